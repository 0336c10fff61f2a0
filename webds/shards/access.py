"""Random access into tar shards: ``ShardListDataset(index)[i]`` is sample ``i`` of the dataset.

A map-style dataset over the shards an index lists (see :mod:`webds.shards.index`): sample ``i``
is sample ``j`` of the shard that holds it, counted as the index counts. Its bytes are found by
the shard's sample offsets: the index's (``ShardWriter`` and ``webds index`` record them), or
taken by reading the shard once on its first touch (:mod:`webds.tar.offsets`) and kept in
memory (8 bytes a sample). Local shard files stay open, a bounded set that threads and forked
DataLoader workers share safely, and a sample is one ``pread`` of its bytes, never a mapping (a
file cut shorter under a mapping kills the process). ``ds[i]`` equals the
sample the stream yields (``__key__``, ``__url__``, ``__local_path__``, fields as bytes), then
goes through ``transform``.

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
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from ..errors import ArgumentError, NotFoundError, OpenError, ShardReadError
from ..io.cache import ShardCache
from ..io.remote import read_range
from ..io.urls import check_secure, local_path, open_url, rewrite_url
from ..tar.cached import complete_tar
from ..tar.offsets import read_sample, sample_offsets
from ..tar.windows import stale_index
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
        for url in self.urls:
            check_secure(url)  # local shards are opened here directly, not by open_url
        # What each shard's URL opens: GOPEN_REWRITE's rules applied, as open_url applies them.
        self._opened = [rewrite_url(url) for url in self.urls]
        #: Each shard's local path; None for a remote shard not (yet) in the cache.
        self.paths: List[Optional[str]] = [local_path(url) for url in self._opened]
        #: Each shard's ``__local_path__`` as the stream gives it (local shards only, the URL
        #: as given; paths also gets cached copies).
        self.local_paths = [local_path(url) for url in self.urls]
        self.cache: Optional[ShardCache] = None
        if cache_dir is not None and cache_size != 0:
            self.cache = ShardCache(os.fspath(cache_dir), cache_size, check=complete_tar)
        # ends[k]: the number of samples in shards 0..k (the index's counts).
        self.ends: List[int] = []
        total = 0
        for shard in self.index.shards:
            _check_count(shard.url, shard.samples, shard.bytes)
            total += shard.samples
            self.ends.append(total)
        self._offsets: Dict[int, "array.array[int]"] = {}
        self._files: "collections.OrderedDict[int, _OpenShard]" = collections.OrderedDict()
        self._open_files = open_files
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, i: int) -> Any:
        if type(i) is not int:
            if isinstance(i, bool) or not hasattr(i, "__index__"):
                raise TypeError(f"indices must be integers, not {type(i).__name__}")
            i = i.__index__()  # numpy and torch integers
        ends = self.ends
        n = ends[-1] if ends else 0
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index out of range (the dataset has {n} samples)")
        k = bisect.bisect_right(ends, i)
        j = i - (ends[k - 1] if k else 0)
        offsets = self._offsets.get(k) or self._shard_offsets(k)
        start, end = offsets[j], offsets[j + 1]
        path = self.paths[k] if self.cache is None else self._cached(k)
        if path is not None:
            # The shard held by this frame: one another thread drops meanwhile stays open
            # until this read lets go of it.
            files = self._files
            shard = files.get(k)
            if shard is None:
                shard = self._open_shard(k)
            else:
                try:
                    files.move_to_end(k)  # least recently used is dropped first
                except KeyError:
                    pass  # dropped by another thread meanwhile: this read still holds it
            sample = shard.sample(start, end, self.urls[k], self.local_paths[k])
        else:
            data = read_range(self._opened[k], start, end, self.storage_options)
            if len(data) > end - start:
                raise OpenError(
                    f"asked for bytes {start}-{end - 1} of the shard, the server sent "
                    f"{len(data):,} bytes: it ignores range requests. Give "
                    "ShardListDataset(..., cache_dir=DIR) to download each shard once and read "
                    "it locally, or serve the shards from a server that takes ranges",
                    url=self.urls[k],
                )
            if len(data) != end - start:
                raise _shorter(self.urls[k], start, end)
            sample = read_sample(data, self.urls[k], self.local_paths[k], start)
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
            self._offsets[k] = known  # from the index: no scan
            return known
        url = self.urls[k]
        path = self.paths[k] if self.cache is None else self._cached(k)
        if path is not None and os.path.exists(path):
            self._check_size(k, os.path.getsize(path))
        try:
            with open(path, "rb") if path is not None else self._stream(k) as f:
                found = sample_offsets(f, url)
        except FileNotFoundError:
            raise OpenError(f"no such file {path!r}; check the index", url=url) from None
        expected = self.index.shards[k].samples
        if len(found) - 1 != expected:
            raise stale_index(
                url, f"the shard has {len(found) - 1} samples but the index says {expected}"
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

    def _open_shard(self, k: int) -> "_OpenShard":
        """Shard ``k`` opened and put in the open set, the least recently used file dropped
        past ``open_files``. A dropped file is not closed here: a read in another thread may
        hold it, and it closes when the last holder lets go (its own reference count), so no
        read sees a closed or reused descriptor, and no read takes a lock."""
        if self._pid != os.getpid():
            # A forked worker: the parent's open files work (a pread moves no file position),
            # but the lock may have been held by another thread at the fork: this process's own.
            self._lock = threading.Lock()
            self._pid = os.getpid()
        with self._lock:
            shard = self._files.get(k)
            if shard is None:
                shard = self._files[k] = self._open(k)
                while len(self._files) > self._open_files:
                    self._files.popitem(last=False)
            return shard

    def _open(self, k: int) -> "_OpenShard":
        path = self.paths[k]
        assert path is not None
        try:
            file = open(path, "rb", buffering=0)  # close-on-exec, as Python opens files
        except FileNotFoundError:
            raise NotFoundError(
                f"no such file {path!r}; check the index", url=self.urls[k]
            ) from None
        try:
            self._check_size(k, os.fstat(file.fileno()).st_size)
        except BaseException:
            file.close()
            raise
        return _OpenShard(file)

    def _check_size(self, k: int, size: int) -> None:
        """Shard ``k``'s file is ``size`` bytes: the index's size, and enough for its count
        (an index without ``bytes`` is checked here, at the shard's first touch)."""
        shard = self.index.shards[k]
        if shard.bytes is not None and size != shard.bytes:
            raise stale_index(
                self.urls[k], f"the shard is {size} bytes but the index says {shard.bytes}"
            )
        if shard.samples * _MIN_SAMPLE_BYTES > size:
            raise stale_index(
                self.urls[k],
                f"the shard is {size:,} bytes: too small for the {shard.samples} samples the "
                f"index says (a sample takes at least {_MIN_SAMPLE_BYTES} bytes of tar)",
            )

    def close(self) -> None:
        """Close the shard files held open (they reopen on the next access; a read in another
        thread finishes on the file it holds, closed when it lets go)."""
        with self._lock:
            self._files.clear()

    def __getstate__(self) -> Dict[str, Any]:
        # To a spawned worker: no files, no lock (each process opens its own).
        state = dict(self.__dict__)
        state["_files"] = collections.OrderedDict()
        state["_lock"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()


class _OpenShard:
    """A local shard file open for reading at offsets: a sample's bytes in one ``pread`` (no
    shared file position, so threads and forked workers read side by side), its fields cut
    out of them. Not mapped into memory: a mapped file cut shorter under a read (``cp`` over
    it) kills the process (SIGBUS) however recently its size was checked, where a read comes
    back short and is an error. The file object closes its descriptor when it is freed, so a
    read in another thread that holds it never sees the descriptor closed or reused."""

    def __init__(self, file: Any) -> None:
        self.file = file

    def sample(self, start: int, end: int, url: str, local: Optional[str]) -> Dict[str, Any]:
        data = os.pread(self.file.fileno(), end - start, start)
        if len(data) != end - start:
            raise _shorter(url, start, end)
        return read_sample(data, url, local, start)


#: The fewest bytes of tar a sample takes: one member's header. The shards read here are
#: uncompressed, so a count over ``bytes / 512`` is impossible.
_MIN_SAMPLE_BYTES = 512


def _check_count(url: str, samples: int, size: Optional[int]) -> None:
    """Refuse an index entry whose uncompressed shard of ``size`` bytes cannot hold its
    ``samples``, before anything (a sampler's order) is sized by the count."""
    if size is not None and samples * _MIN_SAMPLE_BYTES > size:
        raise ArgumentError(
            f"the index's entry for this shard has 'samples': {samples}, more than its {size:,} "
            f"bytes can hold: ShardListDataset reads uncompressed tars, where a sample takes at "
            f"least {_MIN_SAMPLE_BYTES} bytes; re-create the index with webds index",
            url=url,
        )


def _shorter(url: str, start: int, end: int) -> ShardReadError:
    return ShardReadError(
        f"the shard is shorter than its offsets say (a sample at bytes {start}-{end}); it "
        "changed after it was indexed: rebuild the index (webds index)",
        url=url,
        offset=start,
    )
