"""How a tar stream ends: the end-of-archive marker and the padding after it, and the errors of
a stream that ends too early (:func:`~webds.tar.reader.read_members` calls these when its buffer
runs out or a block is not a header)."""

from __future__ import annotations

from typing import Callable, Optional

from ..errors import ShardReadError

__all__ = ["EndWithoutMarker"]

_ZERO_BLOCK = b"\0" * 512
# Zero bytes allowed after the end-of-archive marker: writers pad to their record size (GNU tar
# and tarfile: 10 KiB; tape-style blocking factors up to 1 MiB). More zeros than that is a
# preallocated copy that was never finished, not padding.
_MAX_END_PADDING = 1 << 20


class EndWithoutMarker(ShardReadError):
    """The stream ended at a member boundary without the end-of-archive marker: every member
    read is whole, but whole members may be missing after them (a copy cut at a block
    boundary). A reader that knows the shard's sample count (an index) may accept it, and
    ``accept_unterminated=True`` (``WDS_ACCEPT_UNTERMINATED=1``) reads it as complete."""


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


def _end_or_damage(
    hdr: bytes,
    hoff: int,
    ext_offset: int,
    nextchunk: Callable[[], bytes],
    buf: bytes,
    pos: int,
    base: int,
    url: Optional[str],
) -> None:
    """A block ``hdr`` at ``buf[pos]`` whose checksum is wrong: the end-of-archive marker (a zero
    block, then nothing but zero padding: return) or damage (raise). ``ext_offset``: the offset
    of extended headers awaiting their member (-1: none)."""
    if hdr == _ZERO_BLOCK:
        if ext_offset >= 0:
            raise ShardReadError(
                "an extended header is not followed by its member (end-of-archive "
                "marker instead); re-create the shard",
                url=url,
                offset=ext_offset,
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
        "corrupt header (checksum mismatch); the shard is damaged, re-download or re-create it",
        url=url,
        offset=hoff,
    )


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
