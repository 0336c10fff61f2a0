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
uncompressed stream; memory stays bounded by what the stream really holds.
"""

from __future__ import annotations

import re
import zlib
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import ShardReadError
from .compression import sniffed_chunks
from .fields import (
    _AREG,
    _CONT,
    _EXTENDED_TYPES,
    _NO_DATA_TYPES,
    _PAX_MEMBER,
    _REG,
    _SURROGATE,
    _checksum_ok,
    _nts,
    _number,
    _Pending,
)

__all__ = ["read_members", "EndWithoutMarker", "DEFAULT_MAX_MEMBER_SIZE"]

_ZERO_BLOCK = b"\0" * 512
# No real member is this large; a size beyond it means a corrupt header, not a big file.
_MAX_MEMBER_SIZE = 1 << 46
# Extended headers (pax records, GNU long names) are held whole in memory, so cap them.
_MAX_EXTENDED_SIZE = 1 << 26
_MAX_UNSIGNED_CHKSUM = 512 * 255
#: The largest member read out of a compressed shard (.tar.gz, .tar.bz2, .tar.xz) by default. A
#: plain tar's members are bounded by the file itself; a compressed one can claim (and expand to)
#: any size from a few KB, and every member is held whole in memory.
DEFAULT_MAX_MEMBER_SIZE = 1 << 30
# Zero bytes allowed after the end-of-archive marker: writers pad to their record size (GNU tar
# and tarfile: 10 KiB; tape-style blocking factors up to 1 MiB). More zeros than that is a
# preallocated copy that was never finished, not padding.
_MAX_END_PADDING = 1 << 20


class EndWithoutMarker(ShardReadError):
    """The stream ended at a member boundary without the end-of-archive marker: every member
    read is whole, but whole members may be missing after them (a copy cut at a block
    boundary). A reader that knows the shard's sample count (an index) may accept it, and
    ``accept_unterminated=True`` (``WDS_ACCEPT_UNTERMINATED=1``) reads it as complete."""


def read_members(
    stream: BinaryIO,
    url: Optional[str] = None,
    max_member_size: Optional[int] = None,
    start: int = 0,
) -> Iterator[Tuple[str, bytes, int]]:
    """Yield ``(name, data, header_offset)`` for each regular file in a tar stream, in order.

    ``stream`` only needs ``read(n)``; it is read sequentially and never closed here (the caller
    owns it). Compression (gzip, bzip2, xz) is detected from the first bytes. ``header_offset`` is
    the byte offset of the member's header (its first extended header, if any) in the
    uncompressed stream. Directories, links, devices and fifos are skipped. Any malformed input
    raises :class:`~webds.errors.ShardReadError`::

        with open("shard-000000.tar", "rb") as f:
            for name, data, offset in read_members(f, url="shard-000000.tar"): ...

    The archive must end cleanly: with its end-of-archive marker (zero blocks), followed by
    nothing but zero padding (read to EOF, at most 1 MiB of it). A stream that stops at a member
    boundary without the marker raises :class:`EndWithoutMarker` after its last member; a zero
    block followed by data (a header zeroed by a hole in the file, or concatenated archives)
    raises :class:`~webds.errors.ShardReadError`. ``max_member_size`` bounds the members of a
    compressed stream (default :data:`DEFAULT_MAX_MEMBER_SIZE`; a larger one raises before it is
    read); it applies to plain streams only when given.
    """
    compression, chunks = sniffed_chunks(stream, url)
    if max_member_size is None:
        limit = DEFAULT_MAX_MEMBER_SIZE if compression else _MAX_MEMBER_SIZE
    else:
        limit = max_member_size
    # One generator, not two: a `yield from` layer costs ~10% on small members.
    try:
        nextchunk = chunks.__next__
        adler32 = zlib.adler32
        buf = b""
        pos = 0  # index in buf of the next header; may lie past the end (padding still to skip)
        base = start  # stream offset of buf[0]
        nbuf = 0
        pending = _Pending()
        slow = False  # pending.active(), kept in a local for the fast path
        # The offset of a pax header skipped on the fast path (it holds only times, or other
        # records that change nothing we read), awaiting its member; -1 if none.
        xoff = -1
        # Harmless pax header blocks seen before -> (the start of their only record, b"27
        # mtime=", and their data size): the same block followed by that start is skipped at once.
        pax_known: Dict[bytes, Tuple[bytes, int]] = {}
        pax_tries = 64
        # The last two of them and their records' starts, compared in place first, once a
        # block has been seen twice (paxed).
        paxed = False
        pax1 = pax2 = rec1 = rec2 = b""
        # Where the previous member's data ended, to tell "truncated data" from "truncated padding".
        last_name: Optional[str] = None
        last_data_end = start

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
                    ext = pending.offset if pending.offset >= 0 else xoff
                    _end_of_stream(buf, pos, base, url, last_name, last_data_end, ext)
                    return

            hoff = base + pos
            if (
                paxed
                and pos + 1536 <= nbuf
                and not slow
                and (
                    (buf.startswith(pax1, pos) and buf.startswith(rec1, pos + 512))
                    or (buf.startswith(pax2, pos) and buf.startswith(rec2, pos + 512))
                )
            ):
                # One of the last two pax header blocks seen (below), compared in place: no
                # slice, no hash. Skipped, and its member read in the same turn.
                if xoff < 0:
                    xoff = hoff
                pos += 1024
                hoff += 1024
            hdr = buf[pos : pos + 512]
            if hdr[156] == _PAX_MEMBER and not slow:
                known = pax_known.get(hdr)
                if known is not None and buf.startswith(known[0], pos + 512):
                    # A pax header block seen before, harmless (tarfile and webdataset write the
                    # same few, each of one time record whose length says it is the only one):
                    # already checked, so skipped without a checksum or a parse.
                    if xoff < 0:
                        xoff = hoff
                    if paxed:
                        pax2, rec2, pax1, rec1 = pax1, rec1, hdr, known[0]
                    else:
                        pax2 = pax1 = hdr
                        rec2 = rec1 = known[0]
                        paxed = True
                    if pos + 1536 > nbuf:
                        last_name, last_data_end = None, hoff + 512 + known[1]
                        pos += 1024
                        continue
                    pos += 1024
                    hoff += 1024
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
                    if pending.offset >= 0 or xoff >= 0:
                        raise ShardReadError(
                            "an extended header is not followed by its member (end-of-archive "
                            "marker instead); re-create the shard",
                            url=url,
                            offset=pending.offset if pending.offset >= 0 else xoff,
                        )
                    _check_end(nextchunk, buf, pos, base, url)
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
                if xoff < 0:
                    moff = hoff
                else:
                    moff, xoff = xoff, -1
            elif typ in _EXTENDED_TYPES:
                if typ == _PAX_MEMBER and not slow:
                    # A pax header whose records change nothing we read (tarfile and webdataset
                    # write one with the mtime before every member, GNU tar --format=posix one
                    # with atime and ctime): skipped, its member stays on the fast path.
                    try:
                        size = int(hdr[124:136].rstrip(b" \0"), 8)
                    except ValueError:
                        size = -1
                    dstart = pos + 512
                    dend = dstart + size
                    if 0 < size <= 512 and dend <= nbuf and _harmless_pax(buf, dstart, dend):
                        if xoff < 0:
                            xoff = hoff
                        if pax_tries:
                            # Bounded: GNU tar's blocks (a name per member, two records) never
                            # repeat, so after a few tries it stops looking.
                            pax_tries -= 1
                            record = _only_record_start(buf[dstart:dend], size)
                            if record:
                                pax_known[hdr] = (record, size)
                        last_name, last_data_end = None, hoff + 512 + size
                        pos = dstart + 512
                        continue
                # An extended header: read its data whole (capped), then go on to the next.
                if xoff >= 0:
                    pending.offset, xoff = xoff, -1
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
                if xoff >= 0:
                    pending.offset, xoff = xoff, -1
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

            if size < 0 or size > limit:
                raise _too_large(size, limit, compression, url, name, hoff)
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
        # boundary without them was most likely cut there (a killed copy, a network chunk),
        # taking whole members with it. The caller may know better (an index's sample count).
        raise EndWithoutMarker(
            "shard ends without its end-of-archive marker: it was cut at a block boundary (a "
            "killed copy or writer), and whole samples may be missing. Check it against the "
            "dataset's index (`webds verify INDEX`; reading with index= accepts a complete "
            "count), re-download or re-write the shard, or read it as it is, as webdataset "
            "did: accept_unterminated=True (WebDataset, tarfile_to_samples) or "
            "WDS_ACCEPT_UNTERMINATED=1",
            url=url,
            member=last_name,
            offset=base + pos,
        )


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


def _too_large(
    size: int, limit: int, compression: Optional[str], url: Optional[str], name: str, hoff: int
) -> ShardReadError:
    if size < 0 or size > _MAX_MEMBER_SIZE:
        message = f"corrupt header: member claims {size} bytes, which is impossible; re-create it"
    else:
        where = f"a {compression}-compressed shard" if compression else "this shard"
        message = (
            f"member is {size} bytes, more than the {limit} bytes allowed for a member of "
            f"{where} (each member is held whole in memory; a compressed one may be a "
            "decompression bomb); if it is genuine, raise the limit with "
            "max_member_size= (tarfile_to_samples, WebDataset)"
        )
    return ShardReadError(message, url=url, member=name, offset=hoff)


def _check_end(
    nextchunk: Callable[[], bytes], buf: bytes, pos: int, base: int, url: Optional[str]
) -> None:
    """A zero block at ``buf[pos]`` ends the archive: check that only zero padding follows.

    Reading on to EOF also lets a compressed stream check its own end (a gzip trailer) and a
    ``pipe:`` command finish. Data after zeros is a header zeroed by a hole in the file (a
    sparse or preallocated copy), or archives concatenated with ``cat``: either way members
    would be lost silently, so it is an error, as is more zero padding than any writer adds.
    """
    marker = base + pos
    rest = memoryview(buf)[pos:]
    seen = 0
    while True:
        stripped = bytes(rest).lstrip(b"\0") if rest.nbytes else b""
        if stripped:
            at = marker + seen + rest.nbytes - len(stripped)
            raise ShardReadError(
                f"data at offset {at} follows the zero block at offset {marker} that should end "
                "the archive: a header was zeroed (a hole in a sparse or preallocated copy) or "
                "archives were concatenated; whole samples would be lost, so re-download or "
                "re-create the shard",
                url=url,
                offset=at,
            )
        seen += rest.nbytes
        if seen > _MAX_END_PADDING:
            raise ShardReadError(
                f"the shard ends with more than {_MAX_END_PADDING} zero bytes after offset "
                f"{marker}: an unfinished (preallocated) copy, not end-of-archive padding; "
                "re-download or re-create it",
                url=url,
                offset=marker,
            )
        try:
            rest = memoryview(nextchunk())
        except StopIteration:
            return
