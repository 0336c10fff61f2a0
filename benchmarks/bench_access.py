"""Random access (issue 18): ``ShardListDataset[i]`` in a random order against one file per
sample, warm and cold; remote shards by one range request per sample against the shard cache;
and what a read that starts inside a shard costs with and without the index's sample offsets.

Each function takes the :class:`~benchmarks.workloads.Suite` and adds its tables.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence

from . import loaders as L
from .harness import Variant

if TYPE_CHECKING:
    from .workloads import Suite

#: The row names the targets and ratios refer to.
FILES = "files Dataset"
SHARDS = "webds ShardListDataset"
FRESH = "webds ShardListDataset, new each pass"
FILES_COLD = "files Dataset, cold"
SHARDS_COLD = "webds ShardListDataset, cold"
RANGED = "ShardListDataset, a range request per sample"
CACHE_FIRST = "ShardListDataset cache_dir, empty cache"
CACHE_WARM = "ShardListDataset cache_dir, filled cache"
WITH_OFFSETS = "planned read, index with offsets"
WITHOUT_OFFSETS = "planned read, index without offsets"

#: The link the remote tables go through (benchmarks/slowlink.py): a nearby object store.
LINK = (0.02, 100e6)
_LINK_TAG = f"{int(LINK[0] * 1000)}ms-{int(LINK[1] / 1e6)}MBps"
RANGED_TAG = f"ranged-{_LINK_TAG}"
SEEK_TAG = f"seek-remote-{_LINK_TAG}"


def _index(urls: Sequence[str]) -> Any:
    """The shards' index, with sample offsets (built now, untimed: data from an older build
    may have an index written before offsets existed)."""
    from webds.shards.index import ShardIndex

    return ShardIndex.build(list(urls))


def _reader(ds: Any, order: List[int]) -> Callable[[], int]:
    def run() -> int:
        for i in order:
            ds[i]
        return len(order)

    return run


def random_reads(suite: "Suite") -> None:
    """Random reads per second: images (~100 KB) and small records (1-2 KB), each read once in
    a random order, from shards through ShardListDataset and from one file per sample; warm,
    and with every file evicted from the page cache before each pass."""
    import webds

    from .workloads import _evict

    data = suite.data
    cases = [
        ("random-images", data.image_shards(), L.FileDataset(data.files), data.image_files()),
        (
            "random-small",
            data.small_shards(),
            L.FileDataset(data.small_files),
            [Path(p) for p in L.FileDataset(data.small_files).paths],
        ),
    ]
    for name, urls, files, paths in cases:
        index = _index(urls)
        shards = webds.ShardListDataset(index)
        assert len(shards) == len(files), (len(shards), len(files))
        order = list(range(len(files)))
        random.Random(0).shuffle(order)

        def read_files(order: List[int] = order, files: Any = files) -> int:
            for i in order:
                files[i]
            return len(order)

        def fresh(order: List[int] = order, index: Any = index) -> int:
            # A new dataset: every page of a shard mapped anew, as in a new worker process.
            ds = webds.ShardListDataset(index)
            try:
                return _reader(ds, order)()
            finally:
                ds.close()

        # Warm and cold in tables of their own: the round robin of one table would run a
        # "warm" pass right after another variant's eviction.
        suite._measure(name, {FILES: read_files, SHARDS: _reader(shards, order), FRESH: fresh})
        shards.close()  # pages a process has mapped can't be evicted
        if hasattr(os, "posix_fadvise"):
            evict = _evict([*paths, *urls])
            suite._measure(
                f"{name}-cold",
                {
                    FILES_COLD: Variant(read_files, before_each=evict),
                    # A new dataset: pages of a file still mapped can't be evicted.
                    SHARDS_COLD: Variant(fresh, before_each=evict),
                },
            )


def remote_reads(suite: "Suite") -> None:
    """Random reads of image shards over a link of 20 ms + 100 MB/s per connection: one range
    request per sample, against the shard cache (whole shard on first touch), empty and filled."""
    import webds

    from .slowlink import SlowLink

    urls = suite.data.image_shards()
    names = [Path(p).name for p in urls]
    n = min(suite.data.n_images, 100 if suite.quick else 400)
    order = random.Random(1).sample(range(suite.data.n_images), n)
    latency, rate = LINK
    tag = RANGED_TAG
    cache = Path(tempfile.mkdtemp(prefix="random-cache-", dir=suite.data.root))
    try:
        with SlowLink(Path(urls[0]).parent, latency=latency, rate=rate) as link:
            remote = [f"{link.endpoint}/{name}" for name in names]
            index = _index(remote)
            ranged = webds.ShardListDataset(index)

            def cached() -> int:
                # A new dataset per pass, as a new job would: one that stays open keeps its
                # files open, deleted or not.
                ds = webds.ShardListDataset(index, cache_dir=str(cache))
                try:
                    return _reader(ds, order)()
                finally:
                    ds.close()

            def empty() -> None:
                shutil.rmtree(cache, ignore_errors=True)
                cache.mkdir()

            v: Dict[str, Any] = {
                RANGED: _reader(ranged, order),
                CACHE_FIRST: Variant(cached, before_each=empty),
                CACHE_WARM: Variant(cached, warmup=cached, before_each=cached),
            }
            suite._measure(tag, v)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    suite.notes.append(
        f"{tag}: {n} random reads of {suite.data.n_images} images in {len(urls)} shards"
    )


def mid_shard_starts(suite: "Suite") -> None:
    """A planned read that starts inside a shard: the last tenth of every image shard, as the
    tar stage reads a segment, with the index's offsets (it seeks) and without (it reads and
    drops what comes before); local (warm) and over the 20 ms + 100 MB/s link."""
    from webds.tar.samples import tarfile_samples

    from .slowlink import SlowLink

    urls = suite.data.image_shards()

    def segments(index: Any, offsets: bool) -> Callable[[], int]:
        def run() -> int:
            descriptors = []
            for s in index.shards:
                d = {"url": s.url, "start": s.samples - s.samples // 10, "stop": s.samples}
                d["samples"] = s.samples
                if offsets:
                    d["offsets"] = s.offsets
                descriptors.append(d)
            return sum(1 for _ in tarfile_samples(descriptors))

        return run

    index = _index(urls)
    suite._measure(
        "seek-local",
        {WITH_OFFSETS: segments(index, True), WITHOUT_OFFSETS: segments(index, False)},
    )
    latency, rate = LINK
    with SlowLink(Path(urls[0]).parent, latency=latency, rate=rate) as link:
        remote = _index([f"{link.endpoint}/{Path(p).name}" for p in urls])
        suite._measure(
            SEEK_TAG,
            {WITH_OFFSETS: segments(remote, True), WITHOUT_OFFSETS: segments(remote, False)},
        )


def index_load(suite: "Suite") -> None:
    """Seconds to load an index of 1,000,000 samples with offsets (1,000 shards of 1,000)."""
    from webds.shards.index import ShardIndex, ShardInfo

    folder = Path(tempfile.mkdtemp(prefix="index-", dir=suite.data.root))
    try:
        rng = random.Random(2)
        shards = []
        for k in range(1000):
            offsets = [0]
            for _ in range(1000):
                offsets.append(offsets[-1] + 512 * rng.randint(2, 400))
            offsets[-1] += 1024  # the end-of-archive marker
            info = ShardInfo(f"s-{k:06d}.tar", 1000, offsets[-1], "0" * 64, offsets=offsets)
            shards.append(info)
        path = folder / "index.json"
        ShardIndex(shards).save(str(path))
        times = []
        for _ in range(suite.config.reps):
            t0 = time.perf_counter()
            loaded = ShardIndex.load(str(path))
            times.append(time.perf_counter() - t0)
            assert loaded.total == 1_000_000
        suite.info["index-load"] = {
            "samples": 1_000_000,
            "file_bytes": path.stat().st_size,
            "seconds": sorted(times)[len(times) // 2],
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
