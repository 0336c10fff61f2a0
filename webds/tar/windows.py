"""Reading part of an indexed shard without reading what comes before it.

A planned segment (:mod:`webds.shards.plan`) or a resumed shard that starts at sample ``first``
enters the tar stream at that sample's first header, at the byte the index's offsets give: one
seek for a local file (or a shard cache's copy), one range request for a remote object. It stops
at the header of the first sample after the segment, so a worker's share costs the bytes it
yields, not those of the samples before and after it. Without offsets (an index written before
them, a compressed shard) the tar stage reads from the start and drops the samples before
``first``, as it always did.

The shard's size is checked against the index when it is opened: entering a rewritten shard at
an old offset would read garbage, so a different size is reported as an out-of-date index. A
rewrite of the same size is caught by the reader: it enters one sample early and stops one
sample late, and each sample must start at the byte the index says. A server that ignores range
requests is read from the start up to the offset instead.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO, Callable, Dict, NamedTuple, Optional, Tuple

from ..errors import OpenError, ShardReadError, WebdsError
from ..io.ranged import RangeUnsupported
from ..io.streams import ReadStream, abandon_stream
from ..io.urls import deferred_open, local_path, opens_at_offset
from .grouping import _close_quietly

__all__ = ["Window", "window", "window_opener", "stale_index"]

Opened = Tuple[str, Any, Optional[str]]


class Window(NamedTuple):
    """Where a read of a shard enters it and where it stops."""

    first: int  # the sample the read begins with (the one before the first wanted)
    offset: int  # the byte its first header starts at
    end: int  # the byte after the last sample wanted (``size``: the shard's end)
    size: int  # the shard's size, as indexed


def window(shard: Any, first: int) -> Optional[Window]:
    """How to read descriptor ``shard`` (``{"url", "start", "stop", "samples", "offsets"}``)
    from sample ``first`` on by its offsets, or None to read it from its start: no offsets,
    nothing to skip, or a source that can't be entered at an offset (a ``pipe:`` command, a
    stream being copied into the shard cache)."""
    if not isinstance(shard, dict):
        return None
    offsets = shard.get("offsets")
    if offsets is None or "stop" not in shard:
        return None
    samples = int(shard.get("samples", -1))
    if len(offsets) != samples + 1:
        return None
    stop = min(int(shard["stop"]), samples)
    if not 0 <= first < stop or (first == 0 and stop == samples):
        return None
    stream = shard.get("stream")
    if stream is not None:
        # Given open: only a local file (the shard cache's copy) is entered by a seek.
        if shard.get("local_path") is None or not _seekable(stream):
            return None
    elif not opens_at_offset(str(shard.get("url", ""))):
        return None
    # One sample more on each side, read but not yielded, so that the reader finds each
    # boundary of the wanted samples where the index puts it (see tarfile_to_samples): an
    # offset of a rewritten shard that points inside a sample is an out-of-date index, never
    # half a sample.
    enter, past = max(0, first - 1), min(stop + 1, samples)
    return Window(enter, int(offsets[enter]), int(offsets[past]), int(offsets[samples]))


def _seekable(stream: Any) -> bool:
    try:
        return bool(stream.seekable())
    except Exception:
        return False


def window_opener(
    shard: Dict[str, Any], win: Window, storage_options: Dict[str, Any]
) -> Callable[[], Opened]:
    """The function that opens ``shard`` at ``win`` (see :func:`window`), in two steps as
    :func:`~webds.io.urls.deferred_open`: ``(url, stream, local_path)``, the stream holding the
    bytes ``[win.offset, win.end)`` of the shard."""
    url = str(shard["url"])
    given = shard.get("stream")
    if given is not None:

        def open_given() -> BinaryIO:
            given.seek(win.offset)
            return given

        return lambda: _enter(url, open_given, None, win, shard.get("local_path"))
    at = deferred_open(url, "rb", offset=win.offset, **storage_options)
    whole = deferred_open(url, "rb", **storage_options)
    return lambda: _enter(url, at, whole, win, local_path(url))


def _enter(
    url: str,
    open_at: Callable[[], BinaryIO],
    open_whole: Optional[Callable[[], BinaryIO]],
    win: Window,
    lpath: Optional[str],
) -> Opened:
    try:
        try:
            stream = open_at()
        except RangeUnsupported:
            if open_whole is None:
                raise
            # The server can only send the whole object: read up to the offset and drop it.
            stream = open_whole()
            _skip(stream, win, url)
    except WebdsError:
        raise
    except Exception as exn:
        raise OpenError(f"cannot open shard: {type(exn).__name__}: {exn}", url=url) from exn
    size = _size(stream)
    if size is not None and size != win.size:
        _close_quietly(stream)
        raise stale_index(url, f"the shard is {size} bytes but the index says {win.size}")
    return url, _Part(stream, win.end - win.offset), lpath


def _skip(stream: BinaryIO, win: Window, url: str) -> None:
    left = win.offset
    while left:
        data = stream.read(min(left, 1 << 20))
        if not data:
            _close_quietly(stream)
            raise stale_index(url, f"the shard ends before byte {win.offset}")
        left -= len(data)


def _size(stream: Any) -> Optional[int]:
    """The size of the object behind ``stream``, where it is known without a read."""
    size = getattr(stream, "size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    try:
        return os.fstat(stream.fileno()).st_size
    except Exception:
        return None


def stale_index(url: str, what: str) -> ShardReadError:
    """The error for a shard that no longer matches its index's sample offsets."""
    return ShardReadError(
        f"{what}: the index is out of date (the shard was rewritten after indexing); rebuild "
        "it with `webds index`",
        url=url,
    )


class _Part(ReadStream):
    """The first ``n`` bytes of ``stream``: a read that ends where the wanted samples end."""

    def __init__(self, stream: BinaryIO, n: int) -> None:
        self._stream = stream
        self._left = n

    def read(self, n: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        if n < 0 or n > self._left:
            n = self._left
        data = self._stream.read(n)
        self._left -= len(data)
        return data

    def abandon(self) -> None:
        if not self.closed:
            super().close()
            abandon_stream(self._stream)

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._stream.close()
