"""A chunk of a tar stream scanned in numpy: :func:`parse`, the member layout
:func:`~webds.tar.bulk.bulk_groups` cuts samples out of.

Every header of the chunk is checked at once, as the member reader checks one (its magic, its
size and sum digits, its sum, its type, its name), the chain of sizes followed from header to
header, and the names read as the grouping rules read them: where every regular file of the
chunk is named alike (``000123.jpg``), in a few operations (:class:`_UniformNames`), else a
byte position at a time (:class:`_Names`).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .fields import _SURROGATE
from .reader import _harmless_pax

__all__ = ["Gathered", "Parsed", "parse"]

_MAGIC = b"ustar\x0000"  # POSIX ustar: magic and version


Parsed = Tuple[List[int], List[int], List[int], List[str], List[bytes], List[int], bool]


def parse(
    np: Any, buf: bytearray, array: Any, size_of_buf: int, limit: int, gathered: "Gathered"
) -> Parsed:
    """The whole members at the start of ``buf[:size_of_buf]`` (``array``: the same bytes, in
    numpy; they start with a header) that the member reader would read as plain
    ``key.extension`` files, each maybe after a pax header whose records change nothing (as
    tarfile and webdataset write them), up to the first that is anything else or does not lie
    whole in ``buf``: ``(where each member starts (its pax header's offset, where it has one),
    where its data starts, where it ends, each sample's key, each member's extension bytes, the
    index of each sample's first member, more)``, the indexes ending with the number of
    members; ``more`` is false where something other than the end of ``buf`` stopped it.
    (``gathered``: where the candidate headers are gathered.)"""
    nblocks = size_of_buf // 512
    if nblocks == 0:
        return [], [], [], [], [], [0], True
    blocks = array[: nblocks * 512].reshape(nblocks, 512)
    # Candidates: blocks with the ustar magic. The chain of sizes from the first header decides
    # which are headers; a block of member data that looks like one breaks the chain.
    cand = np.flatnonzero(_field(np, array, nblocks, 257, "<u8") == _MAGIC_WORD)
    if len(cand) == 0 or cand[0] != 0:
        return [], [], [], [], [], [0], False
    heads = gathered.take(blocks, cand)
    size, whole = _sizes_and_sums(np, heads, limit)
    data_end = cand * 512 + 512 + size
    whole &= data_end <= size_of_buf
    typ = heads[:, 156]
    regular = (typ == 48) | (typ == 0)
    names = _UniformNames.of(np, heads, regular) or _Names(np, heads)
    member = whole & regular & names.keyed  # a regular key.extension file
    # A pax header of one block whose records change nothing, before a member (not another).
    pax = whole & (typ == 120) & (size > 0) & (size <= 512) & (cand + 1 < nblocks)
    headers = np.flatnonzero(pax)
    if len(headers):
        records = blocks[cand[headers] + 1, :99]  # (all _harmless looks at)
        pax[headers] = _harmless(np, buf, records, cand[headers], size[headers])
    pax[:-1] &= typ[1:] != 120
    following = cand + 1 + ((size + 511) >> 9)
    # Entries 0..m-1: each whole and taken, each the one its predecessor's size points to.
    chained = member | pax
    chained[1:] &= following[:-1] == cand[1:]
    m = int(np.argmin(chained)) if not chained.all() else len(cand)
    if m and pax[m - 1]:
        m -= 1  # a pax header goes with its member
    nxt = int(following[m - 1]) if m else 0  # the block of the first entry not taken
    # More of the stream may continue the run: where the next header (or the member after a
    # pax header) is not whole in buf, or its data is not. (One that is, not taken, is
    # something else.)
    more = (nxt + 1) * 512 > size_of_buf or (
        m < len(cand) and int(cand[m]) == nxt and bool(data_end[m] > size_of_buf)
    )
    if not more and m < len(cand) and int(cand[m]) == nxt and pax[m]:
        after = int(following[m])
        more = (after + 1) * 512 > size_of_buf or (
            m + 1 < len(cand) and int(cand[m + 1]) == after and bool(data_end[m + 1] > size_of_buf)
        )
    members: Any = np.flatnonzero(member[:m])
    count = len(members)
    if count == 0:
        return [], [], [], [], [], [0], more
    if members[-1] == count - 1:
        members = slice(count)  # all the entries (no pax header): views, not copies
    begins = cand * 512
    begins[1:] = np.where(pax[:-1], begins[:-1], begins[1:])  # a member after a pax header
    starts = cand[members] * 512 + 512
    keys, exts, firsts = names.grouped(members, count)
    return (
        begins[members].tolist(),
        starts.tolist(),
        (starts + size[members]).tolist(),
        keys,
        exts,
        firsts,
        more,
    )


# Header fields as little-endian words, read across every header at once (a word's first byte
# is its lowest): the numbers' digits checked and summed eight bytes at a time.
_MAGIC_WORD = int.from_bytes(_MAGIC, "little")
_OCTAL8 = 0xF8F8F8F8F8F8F8F8  # of each byte, the bits that are 0x30 for "0".."7"
_ZEROS8 = 0x3030303030303030
_BYTES = 0x00FF00FF00FF00FF


def _field(np: Any, array: Any, rows: int, offset: int, dtype: str) -> Any:
    """The ``dtype`` number at byte ``offset`` of each of the ``rows`` rows at the start of
    ``array`` (512-byte blocks, or the rows of a 2-d ``array``; a view: no copy)."""
    stride = array.strides[0] if array.ndim == 2 else 512
    return np.ndarray((rows,), dtype, array, offset, (stride,))


def _octal(np: Any, words: Any, digits: Any) -> Any:
    """The value of the first ``digits`` (at most 8) octal digits of each of ``words`` (checked
    to be "0".."7" by the caller), the first the highest (``digits``: a column, a count for
    each row of ``words``)."""
    d = (words - np.uint64(_ZEROS8)) << (np.uint64(64) - np.uint64(8) * digits)  # (to the top)
    d = ((d & np.uint64(_BYTES)) << np.uint64(3)) | ((d >> np.uint64(8)) & np.uint64(_BYTES))
    d = ((d & np.uint64(0x0000FFFF0000FFFF)) << np.uint64(6)) | (
        (d >> np.uint64(16)) & np.uint64(0x0000FFFF0000FFFF)
    )
    return (((d & np.uint64(0xFFFFFFFF)) << np.uint64(12)) | (d >> np.uint64(32))).astype(np.int64)


def _byte_sums(np: Any, words: Any) -> Any:
    """The sum of the bytes of each row of ``words`` (uint64; rows of at most 128 words), as
    int64: the bytes added two by two in 16-bit lanes, then the lanes."""
    mask = np.uint64(_BYTES)
    s = (words & mask).sum(axis=-1) + ((words >> np.uint64(8)) & mask).sum(axis=-1)
    s = (s & np.uint64(0x0000FFFF0000FFFF)) + ((s >> np.uint64(16)) & np.uint64(0x0000FFFF0000FFFF))
    return ((s & np.uint64(0xFFFFFFFF)) + (s >> np.uint64(32))).astype(np.int64)


#: Of the words at bytes 124, 132 and 148 of a header (the rows of ``words`` below): the bits
#: that tell its layout, their values there, and how many octal digits it holds.
_LAYOUT = (
    [[_OCTAL8], [0xDFF8F8F8], [0xFFFFF8F8F8F8F8F8]],
    [[_ZEROS8], [0x303030], [0x2000303030303030]],
    [[8], [3], [6]],
)


def _sizes_and_sums(np: Any, heads: Any, limit: int) -> Tuple[Any, Any]:
    """Each header's member size, and whether the header is one the member reader would read
    the same way in its plain loop: sizes and sums in the layout writers use (``%011o`` then NUL
    or space, ``%06o`` then NUL and space), the sum right, no prefix field, a size within
    ``limit``."""
    n = len(heads)
    # The three numbers' words as rows of one array: each step below is one numpy operation.
    words = np.empty((3, n), np.uint64)
    words[0] = _field(np, heads, n, 124, "<u8")  # the size's first 8 digits
    words[1] = _field(np, heads, n, 132, "<u4")  # its last 3, then NUL or space
    words[2] = chk = _field(np, heads, n, 148, "<u8")  # the sum: 6 digits, NUL, space
    bits, values, digits = np.array(_LAYOUT, np.uint64)
    whole = ((words & bits) == values).all(axis=0) & (heads[:, 345] == 0)  # no prefix field
    high, low, stored = _octal(np, words, digits)
    size = (high << 9) + low
    # The sum of the header's bytes, its checksum field counted as spaces (at most 512 * 255).
    halves = np.add.reduce(heads.reshape(n, 2, 256), axis=2, dtype=np.uint16)  # (<= 65280)
    unsigned = halves[:, 0].astype(np.int64) + halves[:, 1] - _byte_sums(np, chk[:, None]) + 256
    whole &= (unsigned == stored) & (size <= limit)
    return size, whole


class Gathered:
    """The array a chunk's candidate headers are gathered into, kept from chunk to chunk: a new
    one each chunk (a megabyte or more) costs its page faults every time."""

    def __init__(self, np: Any) -> None:
        self.np, self.array = np, np.empty((0, 512), np.uint8)

    def take(self, blocks: Any, which: Any) -> Any:
        """``blocks[which]``, in the kept array (grown where it is too small)."""
        if len(self.array) < len(which):
            self.array = self.np.empty((len(which) + len(which) // 4, 512), self.np.uint8)
        out = self.array[: len(which)]
        return self.np.take(blocks, which, axis=0, out=out, mode="clip")


class _UniformNames:
    """The name fields of a chunk's headers where every regular file's name has its first dot at
    the same place and no slash after it, as writers name a shard's members (``000123.jpg``):
    each key is the bytes before that dot, read as :class:`_Names` reads them, in fewer numpy
    operations. The names of other headers, pax headers' among them, are not looked at (they
    are never members): the names are transposed as :class:`_Names` has them, a column per
    regular file (``rows``: which header each is, None where all are)."""

    def __init__(self, np: Any, name: Any, dot: int, keyed: Any, rows: Any) -> None:
        self.np, self.bytes, self.dot, self.keyed, self.rows = np, name, dot, keyed, rows

    @staticmethod
    def of(np: Any, heads: Any, regular: Any) -> Optional["_UniformNames"]:
        """The names of ``heads`` (``regular``: which are regular files), or None where they
        are not uniform."""
        rows = None if regular.all() else np.flatnonzero(regular)
        if rows is not None and not len(rows):
            return None
        first = heads[0 if rows is None else rows[0], :100].tobytes()
        length = first.find(0)
        dot = first.find(46, 0, 100 if length < 0 else length)
        # A look at the middle and last names first: keys of other lengths (``s9.bin``,
        # ``s10.bin``) are told at once, before the work below.
        few = [len(heads) // 2, -1] if rows is None else [rows[len(rows) // 2], rows[-1]]
        if dot <= 0 or (heads[few, dot] != 46).any():
            return None
        # Only the regular files' names: where other headers are among them (a pax header
        # before each member, as webdataset writes), half the bytes to look at.
        files = heads if rows is None else heads[rows, :100]
        width = _width(np, files, 100 if length < 0 else length)
        if dot + 1 >= width:
            return None  # no extension: read by _Names
        name = np.ascontiguousarray(files[:, :width].T)
        key, tail = name[:dot], name[dot + 1 :]
        odd = ((key == 46) | (key == 0)).any(axis=0) | (name[dot] != 46)
        odd |= (tail == 47).any(axis=0)
        if odd.any():
            return None
        named = tail != 0
        keyed = (
            ~(named[1:] & ~named[:-1]).any(axis=0)  # no byte after a NUL
            & (name[dot - 1] != 47)  # a key after the last slash
            & ~((name[0] == 95) & (name[1] == 95))  # maybe metadata ("__meta__")
        )
        if rows is not None:  # (the other headers are not keyed files)
            files_keyed, keyed = keyed, np.zeros(len(heads), bool)
            keyed[rows] = files_keyed
        return _UniformNames(np, name, dot, keyed, rows)

    def grouped(self, members: Any, count: int) -> Tuple[List[str], List[bytes], List[int]]:
        """As :meth:`_Names.grouped`."""
        np, dot = self.np, self.dot
        if self.rows is not None and not isinstance(members, slice):
            # The columns are the regular files': which are the members? Mostly the first.
            first = np.array_equal(self.rows[:count], members)
            members = slice(count) if first else np.searchsorted(self.rows, members)
        name = self.bytes[:, members]
        new = np.ones(count, bool)
        new[1:] = (name[:dot, 1:] != name[:dot, :-1]).any(axis=0)
        firsts = np.flatnonzero(new)
        keys = np.ascontiguousarray(name[:dot, firsts].T).view(f"S{dot}").ravel().tolist()
        ext = np.ascontiguousarray(name[dot + 1 :].T)
        return (
            b"\0".join(keys).decode("utf-8", _SURROGATE).split("\0"),
            ext.view(f"S{len(name) - dot - 1}").ravel().tolist(),
            firsts.tolist() + [count],
        )


def _width(np: Any, heads: Any, least: int) -> int:
    """The length of the longest name of ``heads``, at least ``least`` (the rest of every name
    field is NUL)."""
    rest = heads[:, least:100]
    if not rest.any():
        return least
    return least + int(np.flatnonzero(np.bitwise_or.reduce(rest, axis=0))[-1]) + 1


class _Names:
    """The name fields of a chunk's headers read as the plain grouping rules read them, a byte
    position at a time: the names' bytes transposed (a row per position, a column per header),
    so that each step is one numpy operation along rows as long as the chunk's header count."""

    def __init__(self, np: Any, heads: Any) -> None:
        # The widest name: the rest of every name field is NUL (at least 2: "__" is looked at).
        used = np.bitwise_or.reduce(heads.view(np.uint64)[:, :13], axis=0).view(np.uint8)[:100]
        width = max(int(np.flatnonzero(used)[-1]) + 1 if used.any() else 1, 2)
        self.np, self.width = np, width
        self.bytes = name = np.ascontiguousarray(heads[:, :width].T)
        self.rows = at = np.arange(width)[:, None]
        named = name != 0
        self.length = named.sum(axis=0)
        slash = name == 47
        last_slash = np.where(slash, at, -1).max(axis=0) if slash.any() else -1
        dots = (name == 46) & (at > last_slash)
        self.key_length = np.argmax(dots, axis=0)
        self.keyed = (
            # A name is its bytes up to the first NUL: no byte after a NUL.
            ~(named[1:] & ~named[:-1]).any(axis=0)
            & dots.any(axis=0)
            & (self.key_length > last_slash + 1)  # a file name with a key and an extension
            & ~((name[0] == 95) & (name[1] == 95))  # maybe metadata ("__meta__")
        )

    def grouped(self, members: Any, count: int) -> Tuple[List[str], List[bytes], List[int]]:
        """For the ``count`` headers ``members`` (an index array or slice; keyed names, in
        order): each sample's key, each member's extension bytes, and the index of each
        sample's first member, then the number of members."""
        np, width = self.np, self.width
        name, key_len, name_len = (
            self.bytes[:, members],
            self.key_length[members],
            self.length[members],
        )
        in_key = self.rows < key_len
        new = np.ones(count, bool)
        new[1:] = (key_len[1:] != key_len[:-1]) | (
            (name[:, 1:] != name[:, :-1]) & in_key[:, 1:]
        ).any(axis=0)
        firsts = np.flatnonzero(new)
        nul = np.uint8(0)
        keys = np.ascontiguousarray(np.where(in_key[:, firsts], name[:, firsts], nul).T)
        # (One decode for all: a NUL is in no key, nor in what an undecodable byte becomes.)
        joined = b"\0".join(keys.view(f"S{width}").ravel().tolist())
        ext_width = max(int((name_len - key_len).max()) - 1, 1)
        at = key_len + 1 + np.arange(ext_width)[:, None]
        ext = np.take_along_axis(name, np.minimum(at, width - 1), axis=0)
        ext = np.ascontiguousarray(np.where(at < name_len, ext, nul).T)
        return (
            joined.decode("utf-8", _SURROGATE).split("\0"),
            ext.view(f"S{ext_width}").ravel().tolist(),
            firsts.tolist() + [count],
        )


#: Bytes 1..8 of the record ``"NN mtime=..."``, its second digit masked out.
_SPACE_MTIME = int.from_bytes(b"\0 mtime=", "little")


def _harmless(np: Any, buf: bytearray, data: Any, where: Any, size: Any) -> Any:
    """Whether each pax header's records (``data``: its data block, or at least its first 99
    bytes; ``size`` bytes of records; ``where``: its header's block) change nothing the member
    reader reads, as its
    ``_harmless_pax`` says. The one record tarfile and webdataset write, ``"30 mtime=...\\n"``,
    is recognised at once; other records are matched one header at a time."""
    data = np.ascontiguousarray(data[:, :99])  # (rows of 99 bytes: a word at byte 1 of each)
    width = min(int(size.max()), 99)  # (records of up to 99 bytes are recognised at once)
    length = (size // 10 + 48) | ((size % 10 + 48) << 8)  # its two digits, as the record starts
    one_mtime = (
        (size >= 10)
        & (size <= 99)
        & (_field(np, data, len(data), 0, "<u2") == length)  # one record: all of the data
        & (_field(np, data, len(data), 1, "<u8") & np.uint64(0xFFFFFFFFFFFFFF00) == _SPACE_MTIME)
        # Its first newline at its end (none: argmax is 0, and the end is past 9).
        & ((data[:, :width] == 10).argmax(axis=1) == size - 1)
    )
    for i in np.flatnonzero(~one_mtime).tolist():
        start = int(where[i]) * 512 + 512
        one_mtime[i] = _harmless_pax(buf, start, start + int(size[i])) is not None
    return one_mtime
