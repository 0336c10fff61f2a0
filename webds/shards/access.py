"""Random access into tar shards: ``ShardListDataset(index)[i]`` is sample ``i`` of the dataset.

A map-style dataset over the shards an index lists (see :mod:`webds.shards.index`): sample ``i``
is sample ``j`` of the shard that holds it, counted as the index counts. Its bytes are found by
the shard's sample offsets: the index's (``ShardWriter`` and ``webds index`` record them), or
taken by reading the shard once on its first touch (:mod:`webds.tar.offsets`) and kept in
memory (8 bytes a sample); then each sample is one ``pread``, through a
bounded set of open files that threads and forked DataLoader workers share safely (``pread``
moves no file position). ``ds[i]`` equals the sample the stream yields (``__key__``,
``__url__``, ``__local_path__``, fields as bytes), then goes through ``transform``.

This version reads local, uncompressed shards.
"""

from __future__ import annotations

import array
import bisect
import collections
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from ..errors import ArgumentError, OpenError, ShardReadError
from ..io.urls import local_path
from ..tar.offsets import read_sample, sample_offsets
from .index import ShardIndex

__all__ = ["ShardListDataset", "DEFAULT_OPEN_FILES"]

#: Shard files kept open at once by one dataset (least recently used closed first).
DEFAULT_OPEN_FILES = 64


class ShardListDataset:
    """Sample ``i`` of the shards an index lists, by ``ds[i]`` (a ``torch`` map-style dataset).

    ``index``: the index file's path (or a :class:`~webds.shards.index.ShardIndex`).
    ``transform``: applied to each sample dict before it is returned. ``open_files``: how many
    shard files stay open at once::

        ds = webds.ShardListDataset("data/train.index.json")
        sample = ds[12345]  # {"__key__": ..., "__url__": ..., "jpg": b"...", "cls": b"3"}
        loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=True, num_workers=4)
    """

    def __init__(
        self,
        index: Union[str, "os.PathLike[str]", ShardIndex],
        transform: Optional[Callable[[Dict[str, Any]], Any]] = None,
        open_files: int = DEFAULT_OPEN_FILES,
        storage_options: Optional[Mapping[str, Any]] = None,
    ) -> None:
        if isinstance(index, ShardIndex):
            self.index = index
        else:
            self.index = ShardIndex.load(index, storage_options=storage_options)
        if transform is not None and not callable(transform):
            raise ArgumentError(f"transform must be callable, got {transform!r}")
        if isinstance(open_files, bool) or not isinstance(open_files, int) or open_files < 1:
            raise ArgumentError(f"open_files must be an int >= 1, got {open_files!r}")
        self.transform = transform
        self.urls = self.index.urls
        self.paths: List[str] = []
        for url in self.urls:
            path = local_path(url)
            if path is None:
                raise ArgumentError(
                    f"ShardListDataset reads local shards in this version; {url!r} is remote: "
                    "copy the shards to local disk, or stream them with WebDataset"
                )
            self.paths.append(path)
        # ends[k]: the number of samples in shards 0..k (the index's counts).
        self.ends: List[int] = []
        total = 0
        for shard in self.index.shards:
            total += shard.samples
            self.ends.append(total)
        self._offsets: Dict[int, "array.array[int]"] = {}
        self._files: "collections.OrderedDict[int, int]" = collections.OrderedDict()
        self._open_files = open_files
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, i: int) -> Any:
        if isinstance(i, bool) or not isinstance(i, int):
            try:
                i = i.__index__()  # numpy and torch integers
            except AttributeError:
                raise TypeError(f"indices must be integers, not {type(i).__name__}") from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index out of range (the dataset has {n} samples)")
        k = bisect.bisect_right(self.ends, i)
        j = i - (self.ends[k - 1] if k else 0)
        offsets = self._shard_offsets(k)
        start, end = offsets[j], offsets[j + 1]
        data = os.pread(self._fd(k), end - start, start)
        if len(data) != end - start:
            raise ShardReadError(
                f"the shard is shorter than its offsets say (sample {j} at bytes {start}-{end}); "
                "it changed after it was indexed: rebuild the index (webds index)",
                url=self.urls[k],
                offset=start,
            )
        sample = read_sample(data, self.urls[k])
        return sample if self.transform is None else self.transform(sample)

    def __repr__(self) -> str:
        return f"ShardListDataset({len(self.urls)} shards, {len(self)} samples)"

    # -- offsets and files ------------------------------------------------------------------

    def _shard_offsets(self, k: int) -> "array.array[int]":
        offsets = self._offsets.get(k)
        if offsets is not None:
            return offsets
        known = self.index.shards[k].offsets
        if known is not None:
            return known  # from the index: no scan
        url = self.urls[k]
        try:
            with open(self.paths[k], "rb") as f:
                found = sample_offsets(f, url)
        except FileNotFoundError:
            raise OpenError(f"no such file {self.paths[k]!r}; check the index", url=url) from None
        expected = self.index.shards[k].samples
        if len(found) - 1 != expected:
            raise ShardReadError(
                f"the shard has {len(found) - 1} samples but the index says {expected}: the index "
                "is out of date (the shard was rewritten after indexing); rebuild it with "
                "`webds index`",
                url=url,
            )
        offsets = array.array("q", found)
        self._offsets[k] = offsets
        return offsets

    def _fd(self, k: int) -> int:
        if self._pid != os.getpid():
            # A forked worker: the parent's descriptors work (pread moves no file position), but
            # the lock may have been held by another thread at the fork: this process's own.
            self._lock = threading.Lock()
            self._files = collections.OrderedDict(self._files)
            self._pid = os.getpid()
        with self._lock:
            fd = self._files.get(k)
            if fd is not None:
                self._files.move_to_end(k)
                return fd
            try:
                fd = os.open(self.paths[k], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise OpenError(
                    f"no such file {self.paths[k]!r}; check the index", url=self.urls[k]
                ) from None
            expected = self.index.shards[k].bytes
            size = os.fstat(fd).st_size
            if expected is not None and size != expected:
                os.close(fd)
                raise ShardReadError(
                    f"the shard is {size} bytes but the index says {expected}: it was rewritten "
                    "after indexing; rebuild the index with `webds index`",
                    url=self.urls[k],
                )
            self._files[k] = fd
            while len(self._files) > self._open_files:
                _, old = self._files.popitem(last=False)
                os.close(old)
            return fd

    def close(self) -> None:
        """Close the shard files held open (they reopen on the next access)."""
        with self._lock:
            while self._files:
                os.close(self._files.popitem()[1])

    def __getstate__(self) -> Dict[str, Any]:
        # To a spawned worker: no descriptors, no lock (each process opens its own).
        state = dict(self.__dict__)
        state["_files"] = collections.OrderedDict()
        state["_lock"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()
