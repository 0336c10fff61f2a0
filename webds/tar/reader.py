"""Our own streaming tar reader: :func:`read_members`.

It parses POSIX tar archives sequentially from any object with a ``read(n)`` method (a file, a
pipe, a socket, an fsspec stream; no ``seek`` or ``tell``). It reads in 1 MiB chunks and slices
512-byte headers out of its own buffer, which makes it several times faster than ``tarfile`` in
streaming mode on shards of small members. It understands ustar (with the 155-byte prefix), GNU
long names/links (``L``/``K``), pax extended headers (``x`` per member and ``g`` global: ``path``,
``size``, ``linkpath``), GNU base-256 numbers and old v7 headers (decoded in
:mod:`webds.tar.fields`). Gzip (including concatenated members), bzip2 and xz compression are
recognised by their magic bytes (:mod:`webds.tar.compression`). Every malformed input raises
:class:`~webds.errors.ShardReadError` naming the shard, the member and the byte offset in the
uncompressed stream (how a stream may end, and the errors of one that ends too early, are in
:mod:`webds.tar.ending`); memory stays bounded by what the stream really holds.
"""

from __future__ import annotations

import re
import zlib
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import ShardReadError
from ..io.urls import local_path as url_local_path
from .budget import (
    _MAX_MEMBER_SIZE,
    DEFAULT_MAX_MEMBER_SIZE,
    DEFAULT_MAX_SAMPLE_BYTES,
    MAX_NAME,
    _long_name,
    _member_limit,
    _sample_held,
    _sample_limit,
    _too_large,
)
from .compression import sniffed_chunks
from .ending import EndWithoutMarker, _end_of_stream, _end_or_damage
from .fields import (
    _AREG,
    _CONT,
    _EXTENDED_TYPES,
    _GNU_SPARSE,
    _HARDLINK,
    _NO_DATA_TYPES,
    _PAX_MEMBER,
    _REG,
    _SURROGATE,
    _SYMLINK,
    _checksum_ok,
    _nts,
    _number,
    _Pending,
)
from .links import Earlier, link_target, read_sparse

__all__ = [
    "read_members",
    "EndWithoutMarker",
    "DEFAULT_MAX_MEMBER_SIZE",
    "DEFAULT_MAX_SAMPLE_BYTES",
]

# Extended headers (pax records, GNU long names) are held whole in memory, so cap them.
_MAX_EXTENDED_SIZE = 1 << 26
_MAX_UNSIGNED_CHKSUM = 512 * 255
_SPARSE_TYPES = (_REG, _AREG, _CONT, _GNU_SPARSE)


def read_members(
    stream: BinaryIO,
    url: Optional[str] = None,
    max_member_size: Optional[int] = None,
    start: int = 0,
    max_sample_bytes: Optional[int] = None,
    local_path: Optional[str] = None,
) -> Iterator[Tuple[str, bytes, int]]:
    """Yield ``(name, data, header_offset)`` for each regular file in a tar stream, in order.

    ``stream`` only needs ``read(n)``; it is read sequentially and never closed here (the caller
    owns it). Compression (gzip, bzip2, xz) is detected from the first bytes. ``header_offset`` is
    the byte offset of the member's header (its first extended header, if any) in the
    uncompressed stream. Directories, devices and fifos are skipped. A hard link reads as the
    bytes of the member it names, a symbolic link whose name has a dot as those of its target in
    the archive, a GNU sparse member as its real size with the holes as zeros (see
    :mod:`webds.tar.links`; a link is read again from ``local_path``, the shard's file, by
    default the file ``url`` names, and refused where there is none). Any malformed input
    raises :class:`~webds.errors.ShardReadError`::

        with open("shard-000000.tar", "rb") as f:
            for name, data, offset in read_members(f, url="shard-000000.tar"): ...

    The archive must end cleanly: with its end-of-archive marker (zero blocks), followed by
    nothing but zero padding (read to EOF, at most 1 MiB of it). A stream that stops at a member
    boundary without the marker raises :class:`EndWithoutMarker` after its last member; a zero
    block followed by data (a header zeroed by a hole in the file, or concatenated archives)
    raises :class:`~webds.errors.ShardReadError`. ``max_member_size`` bounds the members of a
    compressed stream (default :data:`DEFAULT_MAX_MEMBER_SIZE`; a larger one raises before it is
    read); it applies to plain streams only when given. ``max_sample_bytes`` bounds the members
    of one sample together (consecutive members with one key, as samples are grouped), the same
    way: default :data:`DEFAULT_MAX_SAMPLE_BYTES` for a compressed stream, checked on the header
    of the member that would pass it (:class:`~webds.errors.SampleTooLargeError`), counting its
    extended headers too. A sparse member's real size counts always, in a plain stream without
    ``max_sample_bytes`` too (against the default; the other members of a plain stream then
    count nothing). A member name over :data:`MAX_NAME` characters is refused.
    """
    compression, chunks = sniffed_chunks(stream, url)
    limit = _member_limit(max_member_size, compression)
    budget = _sample_limit(max_sample_bytes, compression)  # (None: sparse members only count)
    # One generator, not two: a `yield from` layer costs ~10% on small members. The members most
    # shards are made of (a plain header; one after a pax header that changes nothing) are read
    # in this loop; headers off that path by a _Scan, which is handed the buffer and gives it back.
    try:
        adler32 = zlib.adler32
        scan = _Scan(chunks.__next__, url, start)
        scan.setup(local_path, compression, limit, max_member_size, budget)
        buf, pos, nbuf, base = b"", 0, 0, start  # pos: the next header in buf, which starts at base
        # slow: scan.pending.active(), kept in a local for the fast path; xoff: the offset of a
        # pax header skipped on the fast path, awaiting its member (-1: none); paxes: see _Scan.
        slow, xoff, paxes = False, -1, scan.paxes
        while True:
            if pos + 512 > nbuf:
                # (The old buffer is let go before new chunks are read: see _Scan.chunk.)
                tail, skip, base, buf = buf[pos:], pos - nbuf, base + min(pos, nbuf), b""
                buf, pos, base = scan.refill(tail, skip, base, xoff)
                nbuf = len(buf)
                if pos + 512 > nbuf:
                    return  # the end of the archive, clean (scan.refill checked it)
            if paxes and not slow and pos + 1536 <= nbuf and buf.startswith(paxes, pos):
                # One of the last two harmless pax headers (_Scan.paxes), block and record start
                # compared in place: no slice, no hash. Skipped; its member read in the same turn.
                xoff = base + pos if xoff < 0 else xoff
                pos += 1024
            hoff = base + pos
            hdr = buf[pos : pos + 512]
            # Checksum: adler32's low half is (1 + sum) mod 65521, computed in C. Replace the stored
            # checksum bytes by 8 spaces and compare modulo 65521; exact sums only on a mismatch.
            # Writers store "%06o\0 ": parse those six digits (another layout just takes the
            # exact path).
            chk = hdr[148:156]
            try:
                stored = int(chk[:6], 8)
            except ValueError:
                stored = -1
            if (
                stored < 0
                or stored > _MAX_UNSIGNED_CHKSUM
                or ((adler32(hdr) & 0xFFFF) - (adler32(chk) & 0xFFFF) + 256 - stored) % 65521
            ) and not _checksum_ok(hdr):
                scan.end_or_damage(hdr, hoff, buf, pos, base, xoff)
                return
            typ = hdr[156]
            if (typ == _REG or typ == _CONT or typ == _AREG) and not slow:
                # Fast path: a plain ustar/GNU/v7 regular file.
                name_b = hdr[:100].partition(b"\0")[0]
                if hdr[345] and hdr[257:263] == b"ustar\0":
                    name_b = _nts(hdr[345:500]) + b"/" + name_b
                if typ == _AREG and name_b.endswith(b"/"):
                    pos += 512  # a v7 directory
                    continue
                name = name_b.decode("utf-8", _SURROGATE)
                try:
                    size = int(hdr[124:136].rstrip(b" \0"), 8)
                except ValueError:
                    size = -1
                if size < 0:  # base-256 (its first byte is not a digit), or not a number
                    size = _number(hdr[124:136], "size", url, hoff, name)
                moff, xoff = (hoff if xoff < 0 else xoff), -1
            elif typ == _PAX_MEMBER and not slow and scan.harmless(hdr, hoff, buf, pos):
                # A pax header whose records change nothing we read (see _Scan): skipped, and its
                # member stays on the fast path.
                xoff, paxes = (hoff if xoff < 0 else xoff), scan.paxes
                pos += 1024
                continue
            else:
                name, size, moff, buf, pos, base, xoff = scan.other(hdr, hoff, buf, pos, base, xoff)
                # (budget: on from a sparse member or a link on, in a plain stream)
                nbuf, slow, paxes, budget = len(buf), scan.pending.active(), scan.paxes, scan.cap
                if name is None:
                    if scan.made is not None:  # a link or a sparse member, read by scan.other
                        made, scan.made = scan.made, None
                        yield made
                    continue  # (else nothing to read: pos is past the entry)
            if size < 0 or size > limit:
                raise _too_large(size, limit, compression, url, name, hoff)
            if budget is not None:  # (plain members count 0 where only sparse ones count)
                scan.charge(name, size if scan.every else 0, hoff)
            dstart = pos + 512
            dend = dstart + size
            if dend <= nbuf:
                data = buf[dstart:dend]
                pos = dstart + ((size + 511) & -512)
            else:
                data, buf, pos, base = scan.read(buf, pos + 512, base, size, name, hoff)
                nbuf = len(buf)
            scan.last_name, scan.last_data_end = name, hoff + 512 + size
            yield name, data, moff
    except MemoryError:
        raise _out_of_memory(url) from None
    finally:
        chunks.close()


class _Scan:
    """What :func:`read_members` knows off its fast path: the extended headers awaiting their
    member (``pending``), the harmless pax header blocks seen, the last entry read (for the
    errors of a stream that ends too early). Its methods read the headers off the fast path;
    ``read_members`` hands them the buffer (``buf``, the next header's ``pos`` in it, ``base``:
    the stream offset of ``buf[0]``) and takes it back.

    A pax header whose records change nothing we read (tarfile and webdataset write one with the
    mtime before every member, GNU tar --format=posix one with atime and ctime) is skipped, and
    its member stays on the fast path. The few blocks tarfile and webdataset repeat, each of one
    record whose length says it is the only one, are recognised by the block and the record's
    start (``b"27 mtime="``) without a parse; the last two of them, each block followed by its
    record's start (:attr:`paxes`), are compared in place by ``read_members``; see
    :meth:`harmless`.
    """

    __slots__ = (
        "nextchunk",
        "url",
        "pending",
        "known",
        "tries",
        "paxes",
        "last_name",
        "last_data_end",
        "chunk",
        "links",
        "earlier",
        "made",
        "budget",
        "every",
        "held",
        "held_key",
        "tracking",
        "extended",
    )

    def __init__(self, nextchunk: Callable[[], bytes], url: Optional[str], start: int) -> None:
        self.nextchunk = nextchunk
        self.url = url
        self.pending = _Pending()
        self.known: Dict[bytes, Tuple[bytes, int]] = {}  # block -> (record start, data size)
        # Bounded: GNU tar's blocks (a name per member, two records) never repeat, so after a
        # few tries it stops looking.
        self.tries = 64
        self.paxes: Tuple[bytes, ...] = ()
        # Where the last entry's data ended, to tell "truncated data" from "truncated padding".
        self.last_name: Optional[str] = None
        self.last_data_end = start
        # The last chunk refill() read, held until the next refill, as the buffer was before:
        # freed at once, its memory can go back to the system, to be mapped (and faulted in)
        # again for the next chunk: ~8% on small members.
        self.chunk = b""
        # Links and sparse members (webds.tar.links): (the shard's local path, its compression,
        # the member limit, max_member_size); what finds the members links name, made at the
        # first link; the member read in other(), to be yielded.
        self.links: Tuple[Optional[str], Optional[str], int, Optional[int]] = (None, None, 0, None)
        self.earlier: Optional[Earlier] = None
        self.made: Optional[Tuple[str, bytes, int]] = None
        # The sample budget (webds.tar.budget): its bytes, whether every member's bytes count
        # (else only sparse members' and links': a plain stream without max_sample_bytes); the
        # sample in flight's bytes and key; whether keys are tracked (a sparse member or a link
        # seen: the members after it are counted, as 0); the extended header bytes awaiting
        # their member.
        self.budget, self.every = DEFAULT_MAX_SAMPLE_BYTES, False
        self.held, self.held_key, self.tracking, self.extended = 0, "", False, 0

    def setup(
        self,
        path: Optional[str],
        compression: Optional[str],
        limit: int,
        max_member_size: Optional[int],
        budget: Optional[int],
    ) -> None:
        """The stream's links (see ``links``) and its sample budget (None: only sparse members
        and links count, against the default)."""
        self.links = (path, compression, limit, max_member_size)
        self.budget, self.every = (
            DEFAULT_MAX_SAMPLE_BYTES if budget is None else budget,
            bool(budget),
        )

    @property
    def cap(self) -> Optional[int]:
        """The budget every member read is charged to (:meth:`charge`), None where none is."""
        return self.budget if self.every or self.tracking else None

    @property
    def sparse_limit(self) -> int:
        """The largest real size of a sparse member: ``max_member_size``, else that of a member
        of a compressed stream (a sparse member expands as one does)."""
        given = self.links[3]
        return DEFAULT_MAX_MEMBER_SIZE if given is None else given

    def other(
        self, hdr: bytes, hoff: int, buf: bytes, pos: int, base: int, xoff: int
    ) -> Tuple[Optional[str], int, int, bytes, int, int, int]:
        """The header ``hdr`` at ``buf[pos]``, off the fast path: an extended header (its data
        read and kept for its member), a member after extended headers or with global pax values
        in force, or an entry that is not a regular file (skipped). Returns ``(name, size,
        member offset, buf, pos, base, xoff)``: the member to read at ``buf[pos]``, or a name
        None when there is none."""
        pending, typ = self.pending, hdr[156]
        if xoff >= 0:
            pending.offset, xoff = xoff, -1
        if typ in _EXTENDED_TYPES:
            # An extended header: read its data whole (capped), then go on to the next.
            size = _number(hdr[124:136], "size", self.url, hoff, None)
            if size < 0 or size > _MAX_EXTENDED_SIZE:
                raise ShardReadError(
                    f"corrupt header: an extended header claims {size} bytes (more than "
                    f"{_MAX_EXTENDED_SIZE}); re-create the shard",
                    url=self.url,
                    offset=hoff,
                )
            data, buf, pos, base = self.read(buf, pos + 512, base, size, None, hoff)
            self.last_name, self.last_data_end = None, hoff + 512 + size
            pending.add(typ, data, self.url, hoff)
            self.extended += size if self.every else 0
            return None, 0, 0, buf, pos, base, xoff
        name, size, moff = pending.resolve(hdr, self.url, hoff)
        if len(name) > MAX_NAME:
            raise _long_name(name, self.url, moff)
        if self.extended:  # its extended headers count in its sample's budget
            extended, self.extended = self.extended, 0
            self.charge(name, extended, hoff)
        if typ == _AREG and name.endswith("/"):
            typ = 0x35  # a v7 directory
        if typ in _SPARSE_TYPES and pending.sparse(hdr):
            data, buf, pos, base = read_sparse(self, hdr, buf, pos, base, name, size, hoff)
            self.made, self.last_name, self.last_data_end = (name, data, moff), name, base + pos
            return None, 0, 0, buf, pos, base, xoff
        if typ == _REG or typ == _CONT or typ == _AREG:
            return name, size, moff, buf, pos, base, xoff
        if typ == _HARDLINK or (typ == _SYMLINK and "." in name.rpartition("/")[2]):
            self.made = (name, self._linked(typ, name, link_target(hdr, pending), hoff, hdr), moff)
            self.last_name, self.last_data_end = name, hoff + 512
            return None, 0, 0, buf, pos + 512, base, xoff
        if typ in _NO_DATA_TYPES:
            return None, 0, 0, buf, pos + 512, base, xoff
        size = max(size, 0)
        if size > _MAX_MEMBER_SIZE:
            raise ShardReadError(
                f"corrupt header: member claims {size} bytes; re-create the shard",
                url=self.url,
                member=name,
                offset=hoff,
            )
        # Unknown entry type: skip its data.
        self.last_name, self.last_data_end = name, hoff + 512 + size
        return None, 0, 0, buf, pos + 512 + ((size + 511) & -512), base, xoff

    def charge(self, name: str, size: int, hoff: int) -> None:
        """Count ``size`` bytes of member ``name`` in its sample's budget (before they are
        held), or raise SampleTooLargeError."""
        self.held, self.held_key = _sample_held(
            name, size, self.held, self.held_key, self.budget, self.url, hoff
        )

    def charge_expanded(self, name: str, size: int, hoff: int) -> None:
        """:meth:`charge` the real size of a sparse member or the bytes of a link, which count
        always (the bytes on disk say nothing of them); keys are tracked from then on."""
        self.charge(name, size, hoff)
        self.tracking = True

    def _linked(self, typ: int, name: str, target: str, hoff: int, hdr: bytes) -> bytes:
        """The bytes of link ``name`` to ``target`` (:class:`~webds.tar.links.Earlier`)."""
        if self.earlier is None:
            path, compression, limit, _ = self.links
            if path is None and self.url:
                path = url_local_path(self.url)
            self.earlier = Earlier(self.url, path, compression, limit, self.charge_expanded)
        return self.earlier.data(typ, name, target, hoff, hdr)

    def harmless(self, hdr: bytes, hoff: int, buf: bytes, pos: int) -> bool:
        """Whether the pax header ``hdr`` at ``buf[pos]`` (stream offset ``hoff``) has records
        that change nothing we read (its data in ``buf``, at most one block): it is then the
        last entry read, to be skipped."""
        known = self.known.get(hdr)
        if known is not None and buf.startswith(known[0], pos + 512):
            record, size = known
        else:
            try:
                size = int(hdr[124:136].rstrip(b" \0"), 8)
            except ValueError:
                return False
            dstart, dend = pos + 512, pos + 512 + size
            if not (0 < size <= 512 and dend <= len(buf) and _harmless_pax(buf, dstart, dend)):
                return False
            record = b""
            if self.tries:
                self.tries -= 1
                record = _only_record_start(buf[dstart:dend], size)
                if record:
                    self.known[hdr] = (record, size)
        if record and not (self.paxes and self.paxes[0] == hdr + record):
            self.paxes = (hdr + record,) + self.paxes[:1]
        self.last_name, self.last_data_end = None, hoff + 512 + size
        return True

    def read(
        self, buf: bytes, dstart: int, base: int, size: int, name: Optional[str], hoff: int
    ) -> Tuple[bytes, bytes, int, int]:
        """:func:`_read_data` of this stream."""
        return _read_data(self.nextchunk, buf, dstart, base, size, self.url, name, hoff)

    def refill(self, tail: bytes, skip: int, base: int, xoff: int) -> Tuple[bytes, int, int]:
        """A new buffer holding the next header: ``tail`` (the unread end of the old buffer,
        part of a header, at stream offset ``base``) and the chunks after it until there are 512
        bytes or the stream ends; or, where ``skip`` > 0 (padding that lay past the old buffer),
        the chunks after those bytes. Returns ``(buf, pos, base)``, ``pos`` being 0 or the bytes
        still to skip where the stream ended inside them. Where the stream ends before a whole
        header, the end is accepted or the right error raised (:func:`_end_of_stream`)."""
        buf = tail
        while skip > 0:
            try:
                c = self.chunk = self.nextchunk()
            except StopIteration:
                c = b""
            if not c:
                break
            if len(c) <= skip:
                skip -= len(c)
                base += len(c)
            else:
                buf = c[skip:]
                base += skip
                skip = 0
        if skip <= 0:
            parts = [buf]
            have = len(buf)
            while have < 512:
                try:
                    c = self.chunk = self.nextchunk()
                except StopIteration:
                    break
                parts.append(c)
                have += len(c)
            buf, skip = (b"".join(parts) if len(parts) > 1 else parts[0]), 0
        if skip + 512 > len(buf):
            ext = self.pending.offset if self.pending.offset >= 0 else xoff
            _end_of_stream(buf, skip, base, self.url, self.last_name, self.last_data_end, ext)
        return buf, skip, base

    def end_or_damage(
        self, hdr: bytes, hoff: int, buf: bytes, pos: int, base: int, xoff: int
    ) -> None:
        """A block whose checksum is wrong: the end of the archive (return) or damage (raise)."""
        ext = self.pending.offset if self.pending.offset >= 0 else xoff
        _end_or_damage(hdr, hoff, ext, self.nextchunk, buf, pos, base, self.url)


def _read_data(
    nextchunk: Callable[[], bytes],
    buf: bytes,
    dstart: int,
    base: int,
    size: int,
    url: Optional[str],
    name: Optional[str],
    hoff: int,
) -> Tuple[bytes, bytes, int, int]:
    """Read ``size`` bytes starting at ``buf[dstart]``, pulling chunks as needed.

    Returns ``(data, buf, pos, base)`` where ``pos`` indexes the next header in the new ``buf``
    (past the padding). Memory grows only with bytes actually read, so a header that claims a
    huge size on a short stream fails without a huge allocation.
    """
    nbuf = len(buf)
    if dstart + size <= nbuf:
        return buf[dstart : dstart + size], buf, dstart + ((size + 511) & -512), base
    # Views, not slices: the join below is then the only copy of the member's bytes.
    parts: List[Any] = [memoryview(buf)[dstart:]]
    have = nbuf - dstart
    while have < size:
        try:
            c = nextchunk()
        except StopIteration:
            what = f"member {name!r}" if name is not None else "an extended header"
            raise ShardReadError(
                f"shard is truncated: {what} needs {size} bytes, only {have} remain; "
                "re-download or re-create the shard",
                url=url,
                member=name,
                offset=hoff,
            ) from None
        parts.append(c)
        have += len(c)
    extra = have - size
    end = base + dstart + size  # stream offset of the member's end
    pad = ((size + 511) & -512) - size
    if extra:
        # The last chunk becomes the buffer as it is, read from where the member ends: slicing
        # off its rest would copy up to a whole chunk per member that crosses a chunk boundary.
        buf = parts[-1]
        used = len(buf) - extra
        parts[-1] = memoryview(buf)[:used]
        data = b"".join(parts)
        return data, buf, used + pad, end - used
    data = b"".join(parts)
    return data, b"", pad, end


# A pax header's records ("<length> <key>=<value>\n") when none changes how its member is read:
# not its name, size or link, nor a sparse layout. A value holding a newline only makes this
# fail (the general path then parses by lengths), since every record starts a line. Record
# lengths are not checked here: a wrong one in such records changes nothing that is read.
_harmless_pax = re.compile(
    rb"(?:[0-9]+ (?!path=|size=|linkpath=|GNU\.sparse\.)[^=\n]+=[^\n]*\n)+"
).fullmatch


def _only_record_start(data: bytes, size: int) -> bytes:
    """``b"27 mtime="`` if ``data`` (harmless pax records) is one record, whose length field
    then equals ``size``; else b"" (several records can't be recognised by their start)."""
    space = data.find(b" ")
    equals = data.find(b"=")
    if 0 < space < equals and data[:space] == b"%d" % size:
        return data[: equals + 1]
    return b""


def _out_of_memory(url: Optional[str]) -> ShardReadError:
    return ShardReadError(
        "out of memory while reading the shard (a member too large for this machine?)", url=url
    )
