"""Random access into tar shards: ``ShardListDataset(index)[i]`` is sample ``i`` of the dataset.

A map-style dataset over the shards an index lists (see :mod:`webds.shards.index`): sample ``i``
is sample ``j`` of the shard that holds it, counted as the index counts. Its bytes are found by
the shard's sample offsets: the index's (``ShardWriter`` and ``webds index`` record them), or
taken by reading the shard once on its first touch (:mod:`webds.tar.offsets`) and kept in
memory (8 bytes a sample); then each sample is one ``pread``, through a
bounded set of open files that threads and forked DataLoader workers share safely (``pread``
moves no file position). ``ds[i]`` equals the sample the stream yields (``__key__``,
``__url__``, ``__local_path__``, fields as bytes), then goes through ``transform``.

Remote shards (``s3://``, ``gs://``, ``http(s)://``, any fsspec URL) are read one of two ways:
with ``cache_dir``, each shard is downloaded whole into that local cache on its first touch
(:class:`~webds.io.cache.ShardCache`, bounded by ``cache_size``) and then read like a local one;
without it, each sample is one ranged request for exactly its bytes. Shards must be
uncompressed.
"""

from __future__ import annotations

import array
import bisect
import collections
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Union

from ..errors import ArgumentError, OpenError, ShardReadError
from ..io.cache import ShardCache
from ..io.remote import read_range
from ..io.urls import local_path, open_url
from ..tar.cached import complete_tar
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
        cache_dir: Optional[str] = None,
        cache_size: int = -1,
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
        self.storage_options = dict(storage_options or {})
        self.urls = self.index.urls
        #: Each shard's local path; None for a remote shard not (yet) in the cache.
        self.paths: List[Optional[str]] = [local_path(url) for url in self.urls]
        self.cache: Optional[ShardCache] = None
        if cache_dir is not None and cache_size != 0:
            self.cache = ShardCache(os.fspath(cache_dir), cache_size, check=complete_tar)
        # ends[k]: the number of samples in shards 0..k (the index's counts).
        self.ends: List[int] = []
        total = 0
        for shard in self.index.shards:
            total += shard.samples
            self.ends.append(total)
        self._offsets: Dict[int, "array.array[int]"] = {}
        self._files: "collections.OrderedDict[int, int]" = collections.OrderedDict()
        self._open_files = open_files
        self._users: Dict[int, int] = {}  # descriptor -> reads using it now
        self._retired: Set[int] = set()  # out of the open set, closed when its reads end
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
        path = self.paths[k] if self.cache is None else self._cached(k)
        if path is None:
            data = read_range(self.urls[k], start, end, self.storage_options)
        else:
            data = self._pread(k, start, end)
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
        path = self.paths[k] if self.cache is None else self._cached(k)
        try:
            with open(path, "rb") if path is not None else self._stream(k) as f:
                found = sample_offsets(f, url)
        except FileNotFoundError:
            raise OpenError(f"no such file {path!r}; check the index", url=url) from None
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

    def _stream(self, k: int) -> Any:
        return open_url(self.urls[k], "rb", **self.storage_options)

    def _cached(self, k: int) -> Optional[str]:
        """Shard ``k``'s local path, downloading a remote one into the cache on first use; None
        while another process is filling its cache entry (this access reads a range)."""
        path = self.paths[k]
        if path is not None or self.cache is None:
            return path
        url = self.urls[k]
        stream, lpath = self.cache.open(
            url, nbytes=self.index.shards[k].bytes, **self.storage_options
        )
        try:
            if lpath is None:
                while stream.read(1 << 20):  # filled as it is read, kept once whole
                    pass
        finally:
            stream.close()
        done = lpath or self.cache.path_for(url)
        if not os.path.exists(done):
            return None
        self.paths[k] = done
        return done

    def _pread(self, k: int, start: int, end: int) -> bytes:
        fd = self._acquire(k)
        try:
            return os.pread(fd, end - start, start)
        finally:
            self._release(fd)

    def _acquire(self, k: int) -> int:
        """An open descriptor of shard ``k``, counted as in use until :meth:`_release`: one that
        leaves the open set meanwhile (another thread opened more shards) is closed only once
        no read uses it, so a number is never reused under a read."""
        if self._pid != os.getpid():
            # A forked worker: the parent's descriptors work (pread moves no file position), but
            # the lock may have been held by another thread at the fork: this process's own.
            self._lock = threading.Lock()
            self._files = collections.OrderedDict(self._files)
            self._users = {}
            self._retired = set()
            self._pid = os.getpid()
        with self._lock:
            fd = self._files.get(k)
            if fd is not None:
                self._files.move_to_end(k)
            else:
                fd = self._open(k)
                self._files[k] = fd
                while len(self._files) > self._open_files:
                    _, old = self._files.popitem(last=False)
                    if self._users.get(old):
                        self._retired.add(old)  # closed by the last read using it
                    else:
                        os.close(old)
            self._users[fd] = self._users.get(fd, 0) + 1
            return fd

    def _release(self, fd: int) -> None:
        with self._lock:
            n = self._users.get(fd, 1) - 1
            if n > 0:
                self._users[fd] = n
                return
            self._users.pop(fd, None)
            if fd in self._retired:
                self._retired.discard(fd)
                os.close(fd)

    def _open(self, k: int) -> int:
        path = self.paths[k]
        assert path is not None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise OpenError(f"no such file {path!r}; check the index", url=self.urls[k]) from None
        expected = self.index.shards[k].bytes
        size = os.fstat(fd).st_size
        if expected is not None and size != expected:
            os.close(fd)
            raise ShardReadError(
                f"the shard is {size} bytes but the index says {expected}: it was rewritten "
                "after indexing; rebuild the index with `webds index`",
                url=self.urls[k],
            )
        return fd

    def close(self) -> None:
        """Close the shard files held open (they reopen on the next access)."""
        with self._lock:
            while self._files:
                fd = self._files.popitem()[1]
                if self._users.get(fd):
                    self._retired.add(fd)
                else:
                    os.close(fd)

    def __getstate__(self) -> Dict[str, Any]:
        # To a spawned worker: no descriptors, no lock (each process opens its own).
        state = dict(self.__dict__)
        state["_files"] = collections.OrderedDict()
        state["_users"], state["_retired"] = {}, set()
        state["_lock"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()
