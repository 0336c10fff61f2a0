"""Our own streaming tar reader and the tar-writing primitives.

Reading: :func:`read_members` parses POSIX tar archives sequentially from any object with a
``read(n)`` method (a file, a pipe, a socket, an fsspec stream; no ``seek`` or ``tell``). It reads
in 1 MiB chunks and slices 512-byte headers out of its own buffer, which makes it several times
faster than ``tarfile`` in streaming mode on shards of small members. It understands ustar (with
the 155-byte prefix), GNU long names/links (``L``/``K``), pax extended headers (``x`` per member and
``g`` global: ``path``, ``size``, ``linkpath``), GNU base-256 numbers and old v7 headers. Gzip
(including concatenated members), bzip2 and xz compression are recognised by their magic bytes.
Every malformed input raises :class:`~webds.errors.ShardReadError` naming the shard, the member and
the byte offset in the uncompressed stream; memory stays bounded by what the stream really holds.

Writing: :func:`encode_header`, :func:`member_bytes`, :func:`write_member` and
:data:`END_OF_ARCHIVE` produce ustar members, with a pax header in front when a name or a number
does not fit ustar. GNU tar and Python's ``tarfile`` read them. :func:`header_encoder` makes the
headers of many members that share their other fields (what the writers use).
"""

from __future__ import annotations

import bz2
import logging
import lzma
import struct
import zlib
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import ArgumentError, ShardReadError, WebdsError

log = logging.getLogger("webds")

__all__ = [
    "read_members",
    "uncompressed_chunks",
    "encode_header",
    "header_encoder",
    "member_bytes",
    "write_member",
    "END_OF_ARCHIVE",
    "BLOCK_SIZE",
]

#: Tar block size; headers and member data are aligned to it.
BLOCK_SIZE = 512
#: Two zero blocks mark the end of an archive.
END_OF_ARCHIVE = b"\0" * 1024

_CHUNK = 1 << 20  # bytes asked of the stream (or produced by a decompressor) per read
_ZERO_BLOCK = b"\0" * 512
# No real member is this large; a size beyond it means a corrupt header, not a big file.
_MAX_MEMBER_SIZE = 1 << 46
# Extended headers (pax records, GNU long names) are held whole in memory, so cap them.
_MAX_EXTENDED_SIZE = 1 << 26
_MAX_UNSIGNED_CHKSUM = 512 * 255
_SIGNED_HEADER = struct.Struct("148b8x356b")

# Type flags (as byte values).
_REG, _AREG, _CONT = 0x30, 0x00, 0x37  # '0', NUL, '7'
_GNU_LONGNAME, _GNU_LONGLINK, _GNU_SPARSE = 0x4C, 0x4B, 0x53  # 'L', 'K', 'S'
_PAX_MEMBER, _PAX_GLOBAL = 0x78, 0x67  # 'x', 'g'
# Link, device, directory and fifo entries carry no data whatever their size field says
# (tarfile and GNU tar agree); other unknown types are skipped over their data.
_NO_DATA_TYPES = frozenset(b"123456")
_EXTENDED_TYPES = frozenset((_PAX_MEMBER, _PAX_GLOBAL, _GNU_LONGNAME, _GNU_LONGLINK))
_SURROGATE = "surrogateescape"


# ---------------------------------------------------------------------------------------------
# Decompression: the stream as an iterator of bounded chunks of uncompressed bytes
# ---------------------------------------------------------------------------------------------


def _raw_reader(stream: BinaryIO, url: Optional[str]) -> Callable[[int], bytes]:
    """Wrap ``stream.read`` so that I/O failures become webds errors and reads return bytes."""
    read = stream.read

    def raw(n: int) -> bytes:
        try:
            data = read(n)
        except WebdsError:
            raise
        except Exception as exn:  # OSError, ValueError on a closed file, network errors...
            raise ShardReadError(
                f"reading the shard failed: {type(exn).__name__}: {exn}; "
                "check that the source is reachable and retry",
                url=url,
            ) from exn
        if data is None:
            raise ShardReadError(
                "the stream returned no data (a non-blocking stream?); pass a blocking stream",
                url=url,
            )
        if type(data) is not bytes:
            data = bytes(data)
        return data

    return raw


def uncompressed_chunks(stream: BinaryIO, url: Optional[str]) -> Iterator[bytes]:
    """Yield the uncompressed bytes of ``stream`` (plain, gzip, bzip2 or xz, sniffed from the
    first bytes) as non-empty chunks of at most ~1 MiB; failures raise ShardReadError."""
    raw = _raw_reader(stream, url)
    first = raw(_CHUNK)
    # A raw pipe or socket may return a few bytes at a time; get enough to see the magic.
    while 0 < len(first) < 512:
        more = raw(_CHUNK)
        if not more:
            break
        first += more
    if first[:2] == b"\x1f\x8b":
        yield from _inflate(first, raw, url)
    elif first[:3] == b"BZh" and (first[4:10] in (b"1AY&SY", b"\x17rE8P\x90") or len(first) < 10):
        yield from _decompress_stream(first, raw, url, "bzip2", bz2.BZ2Decompressor)
    elif first[:6] == b"\xfd7zXZ\x00":
        yield from _decompress_stream(
            first, raw, url, "xz", lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ)
        )
    else:
        while first:
            yield first
            first = raw(_CHUNK)


def _inflate(data: bytes, raw: Callable[[int], bytes], url: Optional[str]) -> Iterator[bytes]:
    """Gzip (possibly several concatenated members) with zlib directly: faster than ``gzip``."""
    out_offset = 0
    d = zlib.decompressobj(31)
    while True:
        if not data:
            data = raw(_CHUNK)
            if not data:
                raise ShardReadError(
                    "gzip stream is truncated (it ends inside compressed data); "
                    "re-download or re-create the shard",
                    url=url,
                    offset=out_offset,
                )
        try:
            out = d.decompress(data, _CHUNK)
        except zlib.error as exn:
            raise ShardReadError(
                f"corrupt gzip data ({exn}); re-download or re-create the shard",
                url=url,
                offset=out_offset,
            ) from None
        data = d.unconsumed_tail
        if out:
            out_offset += len(out)
            yield out
        if d.eof:
            # Another gzip member may follow; zero bytes between members are padding.
            data = d.unused_data.lstrip(b"\0")
            while not data:
                data = raw(_CHUNK)
                if not data:
                    return
                data = data.lstrip(b"\0")
            d = zlib.decompressobj(31)


def _decompress_stream(
    data: bytes,
    raw: Callable[[int], bytes],
    url: Optional[str],
    kind: str,
    factory: Callable[[], "bz2.BZ2Decompressor | lzma.LZMADecompressor"],
) -> Iterator[bytes]:
    """bzip2 or xz, including concatenated streams, with bounded output per call."""
    out_offset = 0
    d = factory()
    while True:
        if d.needs_input:
            if not data:
                data = raw(_CHUNK)
                if not data:
                    raise ShardReadError(
                        f"{kind} stream is truncated (it ends inside compressed data); "
                        "re-download or re-create the shard",
                        url=url,
                        offset=out_offset,
                    )
            chunk, data = data, b""
        else:
            chunk = b""
        try:
            out = d.decompress(chunk, _CHUNK)
        except Exception as exn:  # OSError, lzma.LZMAError, EOFError, ValueError
            raise ShardReadError(
                f"corrupt {kind} data ({exn}); re-download or re-create the shard",
                url=url,
                offset=out_offset,
            ) from None
        if out:
            out_offset += len(out)
            yield out
        if d.eof:
            data = (d.unused_data + data).lstrip(b"\0")
            while not data:
                data = raw(_CHUNK)
                if not data:
                    return
                data = data.lstrip(b"\0")
            d = factory()


# ---------------------------------------------------------------------------------------------
# Header fields
# ---------------------------------------------------------------------------------------------


def _nts(field: bytes) -> bytes:
    """A NUL-terminated string field."""
    i = field.find(0)
    return field if i < 0 else field[:i]


def _number(field: bytes, what: str, url: Optional[str], offset: int, member: Optional[str]) -> int:
    """An octal (or GNU base-256) numeric field, as tarfile and GNU tar read them."""
    if field and field[0] in (0x80, 0xFF):
        n = int.from_bytes(field[1:], "big")
        if field[0] == 0xFF:
            n -= 1 << (8 * (len(field) - 1))
        return n
    text = _nts(field).strip()
    if not text:
        return 0
    if text.strip(b"01234567"):
        raise ShardReadError(
            f"corrupt header: the {what} field {bytes(field)!r} is not an octal number; "
            "re-create the shard",
            url=url,
            member=member,
            offset=offset,
        )
    return int(text, 8)


def _checksum_ok(hdr: bytes) -> bool:
    """Exact check against the unsigned and the signed (old tars) header sums."""
    try:
        stored = int(_nts(hdr[148:156]).strip() or b"-1", 8)
    except ValueError:
        return False
    unsigned = sum(hdr) - sum(hdr[148:156]) + 256
    if stored == unsigned:
        return True
    return stored == sum(_SIGNED_HEADER.unpack(hdr)) + 256


def _header_name(hdr: bytes) -> bytes:
    name = _nts(hdr[:100])
    # Only POSIX ustar has a prefix field; GNU and v7 headers use those bytes otherwise.
    if hdr[345] and hdr[257:263] == b"ustar\0":
        name = _nts(hdr[345:500]) + b"/" + name
    return name


def _parse_pax(
    data: bytes, url: Optional[str], offset: int, member: Optional[str]
) -> Dict[str, bytes]:
    """Parse pax records ``"%d %s=%s\\n"`` into a dict of keyword -> raw value."""
    records: Dict[str, bytes] = {}
    i, n = 0, len(data)
    while i < n:
        if data[i] == 0:  # some writers pad the record block with NULs
            break
        sp = data.find(b" ", i, i + 24)
        length_text = data[i:sp] if sp > i else b""
        end = i + int(length_text) if length_text.isdigit() else -1
        if end <= sp + 2 or end > n or data[end - 1] != 0x0A:
            raise ShardReadError(
                f"corrupt pax header: malformed record at byte {i} of {n}; re-create the shard",
                url=url,
                member=member,
                offset=offset,
            )
        keyword, eq, value = data[sp + 1 : end - 1].partition(b"=")
        if not eq or not keyword:
            raise ShardReadError(
                f"corrupt pax header: record without keyword=value at byte {i}; "
                "re-create the shard",
                url=url,
                member=member,
                offset=offset,
            )
        records[keyword.decode("utf-8", _SURROGATE)] = value
        i = end
    return records


def _pax_size(value: bytes, url: Optional[str], offset: int, member: Optional[str]) -> int:
    if not value.isdigit():
        raise ShardReadError(
            f"corrupt pax header: size {value[:40]!r} is not a decimal number; re-create the shard",
            url=url,
            member=member,
            offset=offset,
        )
    return int(value)


class _Pending:
    """Extended headers (pax ``x``/``g``, GNU ``L``/``K``) and the member they apply to."""

    __slots__ = ("gpax", "xpax", "longname", "offset")

    def __init__(self) -> None:
        self.gpax: Dict[str, bytes] = {}  # global pax values in force
        self.xpax: Optional[Dict[str, bytes]] = None  # pax values for the next member only
        self.longname: Optional[bytes] = None
        self.offset = -1  # offset of the first extended header of the next member

    def active(self) -> bool:
        """Whether the next member header needs the slow path."""
        return self.offset >= 0 or bool(self.gpax)

    def add(self, typ: int, data: bytes, url: Optional[str], hoff: int) -> None:
        if typ == _PAX_MEMBER:
            if self.xpax is None:
                self.xpax = {}
            self.xpax.update(_parse_pax(data, url, hoff, None))
        elif typ == _PAX_GLOBAL:
            for k, v in _parse_pax(data, url, hoff, None).items():
                # Keep only what changes how members are read, so that a harmless global
                # header (git archive writes a comment) keeps the fast path.
                if k not in ("path", "size") and not k.startswith("GNU.sparse."):
                    continue
                if v:
                    self.gpax[k] = v
                else:
                    self.gpax.pop(k, None)
            return  # a global header stands alone: it does not start a member
        elif typ == _GNU_LONGNAME:
            self.longname = _nts(data)
        if self.offset < 0:
            self.offset = hoff

    def resolve(self, hdr: bytes, url: Optional[str], hoff: int) -> Tuple[str, int, int]:
        """Apply the pending headers to member header ``hdr``: ``(name, size, offset)``."""
        pax = dict(self.gpax)
        if self.xpax:
            pax.update(self.xpax)
        name_b = _header_name(hdr)
        if self.longname is not None:
            name_b = self.longname
        if pax.get("path"):
            name_b = pax["path"]
        name = name_b.decode("utf-8", _SURROGATE)
        offset = hoff if self.offset < 0 else self.offset
        self.xpax = None
        self.longname = None
        self.offset = -1
        if hdr[156] == _GNU_SPARSE or any(k.startswith("GNU.sparse.") for k in pax):
            if "GNU.sparse.name" in pax:  # pax sparse 1.0 keeps the real name here
                name = pax["GNU.sparse.name"].decode("utf-8", _SURROGATE)
            raise ShardReadError(
                "GNU sparse members are not supported; re-create the shard without "
                "--sparse (or with tar --format=ustar)",
                url=url,
                member=name,
                offset=offset,
            )
        if pax.get("size"):
            size = _pax_size(pax["size"], url, hoff, name)
        else:
            size = _number(hdr[124:136], "size", url, hoff, name)
        return name, size, offset


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_members(stream: BinaryIO, url: Optional[str] = None) -> Iterator[Tuple[str, bytes, int]]:
    """Yield ``(name, data, header_offset)`` for each regular file in a tar stream, in order.

    ``stream`` only needs ``read(n)``; it is read sequentially and never closed here (the caller
    owns it). Compression (gzip, bzip2, xz) is detected from the first bytes. ``header_offset`` is
    the byte offset of the member's header (its first extended header, if any) in the
    uncompressed stream. Directories, links, devices and fifos are skipped. Any malformed input
    raises :class:`~webds.errors.ShardReadError`::

        with open("shard-000000.tar", "rb") as f:
            for name, data, offset in read_members(f, url="shard-000000.tar"): ...
    """
    chunks = uncompressed_chunks(stream, url)
    # One generator, not two: a `yield from` layer costs ~10% on small members.
    try:
        nextchunk = chunks.__next__
        adler32 = zlib.adler32
        buf = b""
        pos = 0  # index in buf of the next header; may lie past the end (padding still to skip)
        base = 0  # stream offset of buf[0]
        nbuf = 0
        pending = _Pending()
        slow = False  # pending.active(), kept in a local for the fast path
        # Where the previous member's data ended, to tell "truncated data" from "truncated padding".
        last_name: Optional[str] = None
        last_data_end = 0

        while True:
            if pos + 512 > nbuf:
                # Refill: keep the unread tail, skip padding that lies past the buffer, read chunks.
                if pos >= nbuf:
                    skip = pos - nbuf
                    base += nbuf
                    buf = b""
                    while skip:
                        try:
                            c = nextchunk()
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
                    pos = skip  # non-zero only when the stream ended inside the skipped bytes
                else:
                    buf = buf[pos:]
                    base += pos
                    pos = 0
                if not pos:
                    parts = [buf]
                    have = len(buf)
                    while have < 512:
                        try:
                            c = nextchunk()
                        except StopIteration:
                            break
                        parts.append(c)
                        have += len(c)
                    buf = b"".join(parts) if len(parts) > 1 else parts[0]
                nbuf = len(buf)
                if pos + 512 > nbuf:
                    _end_of_stream(buf, pos, base, url, last_name, last_data_end, pending.offset)
                    return

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
                if hdr == _ZERO_BLOCK:
                    if pending.offset >= 0:
                        raise ShardReadError(
                            "an extended header is not followed by its member (end-of-archive "
                            "marker instead); re-create the shard",
                            url=url,
                            offset=pending.offset,
                        )
                    return
                if hoff == 0:
                    raise ShardReadError(
                        "not a tar archive (no valid tar header at the start of the stream); "
                        "check that the URL points at a .tar/.tar.gz shard",
                        url=url,
                        offset=0,
                    )
                raise ShardReadError(
                    "corrupt header (checksum mismatch); the shard is damaged, "
                    "re-download or re-create it",
                    url=url,
                    offset=hoff,
                )

            typ = hdr[156]
            if (typ == _REG or typ == _CONT or typ == _AREG) and not slow:
                # Fast path: a plain ustar/GNU/v7 regular file.
                name_b = hdr[:100].partition(b"\0")[0]
                if hdr[345] and hdr[257:263] == b"ustar\0":
                    name_b = _nts(hdr[345:500]) + b"/" + name_b
                if typ == _AREG and name_b.endswith(b"/"):
                    pos += 512  # a v7 directory
                    continue
                if hdr[124] & 0x80:
                    size = -1
                else:
                    try:
                        size = int(hdr[124:136].rstrip(b" \0"), 8)
                    except ValueError:
                        size = -1
                if size < 0:
                    member = name_b.decode("utf-8", _SURROGATE)
                    size = _number(hdr[124:136], "size", url, hoff, member)
                name = name_b.decode("utf-8", _SURROGATE)
                moff = hoff
            elif typ in _EXTENDED_TYPES:
                # An extended header: read its data whole (capped), then go on to the next.
                size = _number(hdr[124:136], "size", url, hoff, None)
                if size < 0 or size > _MAX_EXTENDED_SIZE:
                    raise ShardReadError(
                        f"corrupt header: an extended header claims {size} bytes (more than "
                        f"{_MAX_EXTENDED_SIZE}); re-create the shard",
                        url=url,
                        offset=hoff,
                    )
                data, buf, pos, base = _read_data(
                    nextchunk, buf, pos + 512, base, size, url, None, hoff
                )
                nbuf = len(buf)
                last_name, last_data_end = None, hoff + 512 + size
                pending.add(typ, data, url, hoff)
                slow = pending.active()
                continue
            else:
                # A member header after extended headers, or with global pax values in force,
                # or not a regular file.
                name, size, moff = pending.resolve(hdr, url, hoff)
                slow = pending.active()
                if typ == _AREG and name.endswith("/"):
                    typ = 0x35  # a v7 directory
                if not (typ == _REG or typ == _CONT or typ == _AREG):
                    if typ in _NO_DATA_TYPES:
                        pos += 512
                        continue
                    size = max(size, 0)
                    if size > _MAX_MEMBER_SIZE:
                        raise ShardReadError(
                            f"corrupt header: member claims {size} bytes; re-create the shard",
                            url=url,
                            member=name,
                            offset=hoff,
                        )
                    # Unknown entry type: skip its data.
                    last_name, last_data_end = name, hoff + 512 + size
                    pos += 512 + ((size + 511) & -512)
                    continue

            if size < 0 or size > _MAX_MEMBER_SIZE:
                raise ShardReadError(
                    f"corrupt header: member claims {size} bytes, which is impossible; "
                    "re-create the shard",
                    url=url,
                    member=name,
                    offset=hoff,
                )
            dstart = pos + 512
            dend = dstart + size
            if dend <= nbuf:
                data = buf[dstart:dend]
                pos = dstart + ((size + 511) & -512)
            else:
                data, buf, pos, base = _read_data(
                    nextchunk, buf, dstart, base, size, url, name, hoff
                )
                nbuf = len(buf)
            last_name = name
            last_data_end = hoff + 512 + size
            yield name, data, moff
    except MemoryError:
        raise ShardReadError(
            "out of memory while reading the shard (a member too large for this machine?)",
            url=url,
        ) from None
    finally:
        chunks.close()


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


def _end_of_stream(
    buf: bytes,
    pos: int,
    base: int,
    url: Optional[str],
    last_name: Optional[str],
    last_data_end: int,
    ext_offset: int,
) -> None:
    """The stream ended where a header should start: accept it or raise the right error."""
    nbuf = len(buf)
    if pos > nbuf:
        end = base + nbuf
        where = "data" if end < last_data_end else "padding"
        what = f"member {last_name!r}" if last_name is not None else "an extended header"
        raise ShardReadError(
            f"shard is truncated in the {where} of {what}; re-download or re-create the shard",
            url=url,
            member=last_name,
            offset=end,
        )
    if base + nbuf == 0:
        raise ShardReadError(
            "empty shard (0 bytes); re-download or re-create it", url=url, offset=0
        )
    rest = buf[pos:]
    if base + pos == 0:
        raise ShardReadError(
            f"not a tar archive (only {len(rest)} bytes, less than one tar header); "
            "check that the URL points at a tar shard",
            url=url,
            offset=0,
        )
    # A partial block of zeros is a cut end-of-archive marker: no member is lost.
    if rest and rest.count(0) != len(rest):
        raise ShardReadError(
            f"shard is truncated inside a header ({len(rest)} of 512 bytes); "
            "re-download or re-create the shard",
            url=url,
            offset=base + pos,
        )
    if ext_offset >= 0:
        raise ShardReadError(
            "shard is truncated: an extended header is not followed by its member; "
            "re-download or re-create the shard",
            url=url,
            offset=ext_offset,
        )
    if not rest:
        # Every writer ends an archive with zero blocks; a stream that stops exactly at a header
        # boundary without them was most likely cut there, taking whole members with it. Its
        # members are all intact, so read on, but say so: only a size or sample-count check
        # (`webds verify`, a shard index) can tell what is missing.
        log.warning(
            "shard %s ends without an end-of-archive marker: it may be truncated at a member "
            "boundary (check it with `webds verify` against a shard index, or re-create it)",
            url if url is not None else "<stream>",
        )


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _octal(value: int, width: int) -> bytes:
    """``width`` bytes: zero-padded octal digits and a NUL."""
    return b"%0*o\0" % (width - 1, value)


def _fits(value: int, width: int) -> bool:
    return 0 <= value < 8 ** (width - 1)


def _pax_records(records: Dict[str, bytes]) -> bytes:
    out = []
    for keyword, value in records.items():
        body = b" " + keyword.encode("utf-8") + b"=" + value + b"\n"
        n = len(body) + 1
        while len(str(n)) + len(body) != n:
            n = len(str(n)) + len(body)
        out.append(str(n).encode("ascii") + body)
    return b"".join(out)


def _split_ustar_name(raw: bytes) -> Optional[Tuple[bytes, bytes]]:
    """``(prefix, name)`` if ``raw`` fits the ustar name and prefix fields, else None."""
    if len(raw) <= 100:
        return b"", raw
    if len(raw) > 256:
        return None
    # Split at a slash so that the name part is <= 100 and the prefix part <= 155.
    i = raw.find(b"/", len(raw) - 101)
    while 0 < i <= 155:
        if len(raw) - i - 1 <= 100 and i + 1 < len(raw):
            return raw[:i], raw[i + 1 :]
        i = raw.find(b"/", i + 1)
    return None


def _field_number(v: int, width: int) -> bytes:
    """A ustar numeric field: octal when it fits, else GNU base-256."""
    if _fits(v, width):
        return _octal(v, width)
    # GNU base-256 (two's complement, first byte 0x80 or 0xff) for values octal can't hold;
    # a pax record carries them too, for readers that prefer pax.
    limit = 1 << (8 * (width - 1))
    if not -limit <= v < limit:
        raise ArgumentError(f"value {v} does not fit a tar header field")
    if v >= 0:
        return b"\x80" + v.to_bytes(width - 1, "big")
    return b"\xff" + (limit + v).to_bytes(width - 1, "big")


def _ustar_block(
    name: bytes,
    prefix: bytes,
    size: int,
    mtime: int,
    mode: int,
    uid: int,
    gid: int,
    uname: bytes,
    gname: bytes,
    typeflag: bytes,
) -> bytes:
    num = _field_number
    hdr = b"".join(
        (
            name.ljust(100, b"\0"),
            num(mode, 8),
            num(uid, 8),
            num(gid, 8),
            num(size, 12),
            num(mtime, 12),
            b"        ",
            typeflag,
            b"\0" * 100,  # linkname
            b"ustar\x0000",
            uname[:32].ljust(32, b"\0"),
            gname[:32].ljust(32, b"\0"),
            _octal(0, 8),  # devmajor
            _octal(0, 8),  # devminor
            prefix.ljust(155, b"\0"),
            b"\0" * 12,
        )
    )
    chksum = b"%06o\0 " % sum(hdr)
    return hdr[:148] + chksum + hdr[156:]


def encode_header(
    name: str,
    size: int,
    *,
    mtime: int = 0,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    uname: str = "bigdata",
    gname: str = "bigdata",
    typeflag: bytes = b"0",
) -> bytes:
    """Return the tar header(s) for a member: one 512-byte ustar block, preceded by a pax ``x``
    header (and its data blocks) when the name is long or not ASCII, or a number does not fit
    ustar (a size of 8 GiB or more, for instance)::

        hdr = encode_header("000001.jpg", len(data), mtime=1_700_000_000)
        stream.write(hdr + data + b"\\0" * (-len(data) % 512))
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise ArgumentError(f"tar member name must be a non-empty str without NUL, got {name!r}")
    if not isinstance(size, int) or size < 0:
        raise ArgumentError(f"tar member size must be a non-negative int, got {size!r}")
    if not isinstance(typeflag, bytes) or len(typeflag) != 1:
        raise ArgumentError(f"typeflag must be a single byte, got {typeflag!r}")
    for label, v in (("mtime", mtime), ("mode", mode), ("uid", uid), ("gid", gid)):
        if not isinstance(v, int):
            raise ArgumentError(f"{label} must be an int, got {v!r}")
    if not 0 <= mode < 8**7:
        raise ArgumentError(f"mode must be between 0 and 0o7777777, got {mode!r}")
    records: Dict[str, bytes] = {}
    raw_name = name.encode("utf-8", _SURROGATE)
    split = _split_ustar_name(raw_name) if name.isascii() else None
    if split is None:
        records["path"] = raw_name
        # A readable ASCII stand-in for tools that ignore pax headers.
        short = raw_name.decode("ascii", "replace").encode("ascii", "replace")
        split = (b"", short.replace(b"?", b"_")[-100:])
    prefix, ustar_name = split
    if not _fits(size, 12):
        records["size"] = b"%d" % size
    if not _fits(mtime, 12):
        records["mtime"] = b"%d" % mtime
    if not _fits(uid, 8):
        records["uid"] = b"%d" % uid
    if not _fits(gid, 8):
        records["gid"] = b"%d" % gid
    unames = []
    for label, text in (("uname", uname), ("gname", gname)):
        raw = str(text).encode("utf-8", _SURROGATE)
        if not str(text).isascii() or len(raw) > 32:
            records[label] = raw
            raw = b""
        unames.append(raw)
    block = _ustar_block(
        ustar_name, prefix, size, mtime, mode, uid, gid, unames[0], unames[1], typeflag
    )
    if not records:
        return block
    pax_data = _pax_records(records)
    pax_hdr = _ustar_block(
        b"././@PaxHeader",
        b"",
        len(pax_data),
        max(0, min(mtime, 8**11 - 1)),
        0o644,
        0,
        0,
        b"",
        b"",
        b"x",
    )
    return pax_hdr + pax_data + b"\0" * (-len(pax_data) % 512) + block


def header_encoder(
    *,
    mtime: int = 0,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    uname: str = "bigdata",
    gname: str = "bigdata",
    typeflag: bytes = b"0",
) -> Callable[[str, int], bytes]:
    """Return ``header(name, size)``, giving the same bytes as ``encode_header(name, size,
    **fields)`` for these fixed fields, several times faster for a writer of many members::

        header = header_encoder(mtime=1_700_000_000)
        stream.write(header("000001.jpg", len(data)) + data + b"\\0" * (-len(data) % 512))

    The fields are checked now (the same errors as :func:`encode_header`).
    """
    fields = dict(mtime=mtime, mode=mode, uid=uid, gid=gid, uname=uname, gname=gname)
    reference = encode_header("a", 0, typeflag=typeflag, **fields)  # type: ignore[arg-type]

    def slow(name: str, size: int) -> bytes:
        return encode_header(name, size, typeflag=typeflag, **fields)  # type: ignore[arg-type]

    if len(reference) != BLOCK_SIZE:
        return slow  # a fixed field needs a pax record in every header
    # The common member (a short ASCII name, a size under 8 GiB) is a template with the name,
    # size and checksum filled in; the checksum is the template's byte sum plus theirs.
    mid, mtime_field, tail = reference[100:124], reference[136:148], reference[156:]
    base = sum(reference) - sum(reference[148:156]) + 8 * 0x20 - ord("a") - sum(reference[124:136])
    join = b"".join

    def header(name: str, size: int) -> bytes:
        if (
            type(name) is str
            and type(size) is int
            and 0 <= size < 0o100000000000
            and 0 < len(name) <= 100
            and name.isascii()
            and "\0" not in name
        ):
            raw = name.encode("ascii")
            size_field = b"%011o\0" % size
            chksum = b"%06o\0 " % (base + sum(raw) + sum(size_field))
            return join((raw.ljust(100, b"\0"), mid, size_field, mtime_field, chksum, tail))
        return slow(name, size)

    return header


def _nbytes(data: object) -> int:
    if isinstance(data, (bytes, bytearray)):
        return len(data)
    try:
        return memoryview(data).nbytes  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentError(
            f"tar member data must be bytes-like, got {type(data).__name__}; encode it first"
        ) from None


def member_bytes(name: str, data: bytes, **header_kw: object) -> bytes:
    """Return one complete tar member: header(s), ``data`` and zero padding to 512 bytes."""
    n = _nbytes(data)
    return b"".join((encode_header(name, n, **header_kw), data, b"\0" * (-n % 512)))  # type: ignore[arg-type]


def write_member(stream: BinaryIO, name: str, data: bytes, **header_kw: object) -> int:
    """Write one tar member to ``stream`` and return the number of bytes written."""
    n = _nbytes(data)
    hdr = encode_header(name, n, **header_kw)  # type: ignore[arg-type]
    pad = b"\0" * (-n % 512)
    if n < 65536:
        stream.write(b"".join((hdr, data, pad)))
    else:  # don't copy large data just to concatenate it
        stream.write(hdr)
        stream.write(data)
        stream.write(pad)
    return len(hdr) + n + len(pad)
