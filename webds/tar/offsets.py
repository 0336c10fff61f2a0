"""Where each sample of a shard starts: the byte offsets random access reads from.

:func:`sample_offsets` reads a shard once and gives the offset of each sample's first header (its
first extended header, if any), grouped exactly as :func:`~webds.tar.samples.tarfile_to_samples`
groups members (meta members and names without ``key.ext`` belong to no sample), then the
shard's size: sample ``j`` is the bytes ``[offsets[j], offsets[j + 1])``, which
:func:`read_sample` turns back into the sample the stream yields.

Only uncompressed shards have offsets: a compressed stream can't be entered in the middle.
"""

from __future__ import annotations

import io
from typing import Any, BinaryIO, Dict, List, Optional
from zlib import adler32

from ..errors import ArgumentError, ShardReadError
from .compression import compression_of
from .fields import _AREG, _CONT, _PAX_MEMBER, _REG, _SURROGATE, _checksum_ok
from .reader import _harmless_pax
from .samples import tarfile_samples

__all__ = ["sample_offsets", "read_sample", "read_sample_in"]


def sample_offsets(stream: BinaryIO, url: Optional[str] = None) -> List[int]:
    """The offset of every sample's first header in ``stream`` (an uncompressed tar), then its
    size in bytes; raises ArgumentError for a compressed shard, ShardReadError for a damaged one.
    The samples are the stream's own (:func:`tarfile_samples` records where each starts)."""
    counted = _Counted(stream)
    starts: List[int] = []
    shard = {"url": url or "", "stream": counted}
    for _ in tarfile_samples([shard], sample_starts=starts, readahead=False):
        if compression_of(counted.first) is not None:
            break
    kind = compression_of(counted.first)
    if kind is not None:
        raise ArgumentError(
            f"{url or 'the shard'} is {kind}-compressed: random access needs uncompressed tar "
            "shards (decompress it, or stream it)"
        )
    starts.append(counted.total)
    return starts


class _Counted(io.RawIOBase):
    """``stream``'s reads, counted (the shard's size), with its first bytes kept (whether it is
    compressed); closing it leaves ``stream`` to its owner."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self.first = b""
        self.total = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        if len(self.first) < 16:
            self.first += data[:16]
        self.total += len(data)
        return data

    def close(self) -> None:
        pass


def read_sample(data: bytes, url: str, local: Optional[str] = None, at: int = 0) -> Dict[str, Any]:
    """The sample held by ``data``, the bytes of one sample's members cut out of shard ``url``
    at its offsets: the dict the stream yields for it (``__key__``, ``__url__``, fields).
    ``local`` is the shard's local path (``__local_path__``), if it has one; ``at``, where
    ``data`` starts in the shard (for the offsets errors name)."""
    return read_sample_in(data, 0, len(data), url, local, at)


def read_sample_in(
    buf: Any, start: int, end: int, url: str, local: Optional[str] = None, at: int = 0
) -> Dict[str, Any]:
    """:func:`read_sample` of the bytes ``buf[start:end]``, where ``buf`` is anything that
    slices to bytes: each field is cut out of ``buf`` once, without a copy of the whole range
    first. ``at``: where ``buf[start]`` lies in the shard, for the byte offsets errors name."""
    sample = _plain_sample(buf, start, end, url, local)
    if sample is not None:
        return sample
    shard = {"url": url, "stream": io.BytesIO(buf[start:end]), "start": 0, "stop": 1}
    shard["samples"] = 1
    if local is not None:
        shard["local_path"] = local
    # A planned one-sample segment: the range ends at a member boundary without the shard's
    # end-of-archive marker, which the planned count vouches for.
    try:
        samples = list(tarfile_samples([shard]))
    except ShardReadError as exn:
        if exn.offset is not None:
            exn.offset += at  # the reader counts from the range's first byte
        raise
    if len(samples) != 1:
        raise ShardReadError(
            f"expected one sample at this offset, found {len(samples)}: the offsets are out of "
            "date (the shard was rewritten after they were taken); rebuild the index",
            url=url,
        )
    return samples[0]


def _plain_sample(
    buf: Any, first: int, end: int, url: str, local: Optional[str]
) -> Optional[Dict[str, Any]]:
    """The sample in ``buf[first:end]`` when it is the common case, parsed in one loop:
    regular members named ``key.ext`` (one key, no folder, no meta name), each header's
    checksum right, maybe a harmless pax header before each (webdataset's writer), nothing after
    the last member but zeros (the end-of-archive marker, for a shard's last sample). None for
    anything else, which :func:`tarfile_samples` then reads with all its rules and errors: the
    same result, slower."""
    pos = first
    sample: Optional[Dict[str, Any]] = None
    key0 = ""
    while pos + 512 <= end:
        hdr = buf[pos : pos + 512]
        if not _header_ok(hdr):
            break  # zeros (the end), or a header the general path judges
        typ = hdr[156]
        if typ == _PAX_MEMBER:
            size = _octal(hdr)
            if not 0 < size <= 512 or pos + 1024 > end:
                return None
            if not _harmless_pax(buf[pos + 512 : pos + 512 + size]):
                return None
            pos += 1024
            continue
        if typ not in _PLAIN or hdr[345] or hdr[124] & 0x80:
            return None  # a link or folder; a ustar prefix; a base-256 size
        size = _octal(hdr)
        name = hdr[:100].partition(b"\0")[0].decode("utf-8", _SURROGATE)
        key, dot, ext = name.partition(".")
        start = pos + 512
        if size < 0 or start + size > end or not dot or not key or "/" in name:
            return None
        if key[:2] == "__":
            return None  # a meta member
        if sample is None:
            sample = {"__key__": key, "__url__": url}
            if local is not None:
                sample["__local_path__"] = local
            key0 = key
        elif key != key0:
            return None
        ext = ext.lower()
        if ext in sample:
            return None  # a duplicate: the general path says so
        sample[ext] = buf[start : start + size]
        pos = start + ((size + 511) & ~511)
    if sample is None or buf[pos:end].count(0) != end - pos:
        return None
    return sample


_PLAIN = (_REG, _AREG, _CONT)


def _header_ok(hdr: bytes) -> bool:
    """Whether a 512-byte block is a tar header with the right checksum (never all zeros).
    The reader's test: adler32's low half is (1 + sum) mod 65521, computed in C; the exact
    sums only when it fails."""
    try:
        stored = int(hdr[148:154], 8)
    except ValueError:
        return _checksum_ok(hdr)
    if 0 <= stored <= 512 * 255:
        low = (adler32(hdr) & 0xFFFF) - (adler32(hdr[148:156]) & 0xFFFF) + 256 - stored
        if low % 65521 == 0:
            return True
    return _checksum_ok(hdr)


def _octal(hdr: bytes) -> int:
    try:
        return int(hdr[124:136].rstrip(b" \0"), 8)
    except ValueError:
        return -1
