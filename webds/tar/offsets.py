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

from ..errors import ArgumentError, ShardReadError
from .compression import compression_of
from .samples import tarfile_samples

__all__ = ["sample_offsets", "read_sample"]


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


def read_sample(data: bytes, url: str) -> Dict[str, Any]:
    """The sample held by ``data``, the bytes of one sample's members cut out of shard ``url``
    at its offsets: the dict the stream yields for it (``__key__``, ``__url__``, fields)."""
    shard = {"url": url, "stream": io.BytesIO(data), "start": 0, "stop": 1, "samples": 1}
    # A planned one-sample segment: the range ends at a member boundary without the shard's
    # end-of-archive marker, which the planned count vouches for.
    samples = list(tarfile_samples([shard]))
    if len(samples) != 1:
        raise ShardReadError(
            f"expected one sample at this offset, found {len(samples)}: the offsets are out of "
            "date (the shard was rewritten after they were taken); rebuild the index",
            url=url,
        )
    return samples[0]
