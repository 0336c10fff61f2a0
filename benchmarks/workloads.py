"""The workloads of the suite and the targets of issue 8, each measured in samples/s.

Every workload runs its contestants in the same process, round robin (see harness.measure), and
every ratio compares two numbers of the same run. A :class:`Suite` keeps the measurements
(``results``), what is not a rate (``info``: memory, S3 facts) and ``notes`` on what was
skipped; ``__main__`` prints them, writes them as JSON and plots them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import bench_access as A
from . import bench_media as M
from . import bench_peers as P
from . import loaders as L
from .data import Data
from .harness import (
    ROOT,
    Measurement,
    Target,
    Variant,
    has_module,
    measure,
    ratio,
    round_ratios,
    stderr,
)

#: name -> what it measures. ``--only`` takes these names (or their prefixes).
WORKLOADS: Dict[str, str] = {
    "read-small": "tar -> samples, small records (1-2 KB, no decode)",
    "read-small-wds": "the same small records in shards written by webdataset's TarWriter",
    "read-images": "raw samples, ~100 KB JPEGs (no decode), warm page cache",
    "read-images-cold": "raw samples, ~100 KB JPEGs (no decode), files evicted from the cache",
    "pipeline": "decode + augment + batch in one process (no workers)",
    "crop": "the RandomResizedCrop recipe in one thread: webds's fused crop decoder",
    "loader-0": "WebLoader / DataLoader, decode + augment + batch, 0 workers",
    "loader-1": "WebLoader / DataLoader, decode + augment + batch, 1 worker",
    "loader-2": "WebLoader / DataLoader, decode + augment + batch, 2 workers",
    "write-small": "writing shards, small records (1-2 KB)",
    "write-images": "writing shards, ~100 KB JPEGs (already encoded)",
    "s3": "raw samples streamed from S3 (moto on loopback, no decode)",
    "link": "raw samples over a slow link: 100 ms + 16 MB/s, 20 ms + 100 MB/s per connection",
    "link-depth": "many 1 MB shards over the 100 ms + 16 MB/s link: read-ahead depth auto, 8, 32",
    "memory": "resident memory over 10 epochs, 2 persistent workers",
    "mainproc": "main-process CPU per sample: 2 workers, and threads in one process",
    "random": "random reads, ShardListDataset[i] vs one file per sample, warm and cold",
    "ranged": "random reads over a 20 ms + 100 MB/s link: range requests vs the shard cache",
    "seek": "a read of each shard's last tenth, with and without the index's offsets",
    "index-load": "loading an index of 1,000,000 samples with offsets",
    "recipe": "the JPEG recipe (crop 224 + flip + float, batches of 64, 2 workers or threads) "
    "with webdataset, webds, SPDL and LitData",
    "small-peers": "small records (1-2 KB) in one process: webdataset, webds, LitData, wids",
    "video": "4 clips of 16 frames at stride 2 from each H.264 360p 10 s video: webds's clip "
    "decoder, whole decode + slice, Energon, decord, TorchCodec",
    "audio": "one 5 s clip at 16 kHz mono from each 60 s FLAC / MP3: webds's clip decoder, "
    "full decode + slice, Energon",
}


WEBDS = "webds WebDataset"
#: read-small-wds: webds on the same records in shards webds wrote.
WEBDS_OWN = "webds WebDataset, webds-written shards"
#: The same, measuring where its time goes (stats=True): the probe's overhead.
WEBDS_STATS = "webds WebDataset, stats=True"
#: crop: decode(RandomResizedCropDecoder(224)) + flip + float tensor + batched(32)
FUSED = "webds fused crop decoder"
#: The image pipeline with decode(imagehandler("pil", fast_jpeg=False)), when simplejpeg is
#: installed (without it, "webds WebDataset" decodes with Pillow alone already).
PILLOW_ONLY = "webds WebDataset, Pillow decode"

#: link: a WebLoader that chose its workers (num_workers="auto").
LINK_AUTO = "webds WebLoader num_workers='auto'"
#: link-depth: read-ahead depths set by hand (webds's default is readahead_shards="auto").
DEPTH_8 = "webds WebDataset, readahead_shards=8"
DEPTH_32 = "webds WebDataset, readahead_shards=32"
#: link-depth: one WebDataset read pass after pass ("auto" learned once, by its first pass).
AUTO_LATER = "webds WebDataset, its later passes"
#: read-images: the shards' bytes read into a reused buffer, nothing parsed: the ceiling of any
#: reader that brings the bytes into the process (see loaders.read_shard_bytes).
SHARD_BYTES = "shard bytes only, no samples"
#: loader-1/2: JPEG bytes already in memory, decode + augment in the workers: about the best any
#: loader with that many workers can do on this machine (see loaders.MemoryDataset).
IN_MEMORY = "in-memory DataLoader"

#: (target, threshold for >=, workload, numerator, denominator, what is compared, reference):
#: the reference is (label, contestant), the target's ratio with that contestant as numerator:
#: a contestant that does less than any loader must, so a goal beyond it can't be met here.
RATIO_TARGETS = [
    ("tar->samples small, webds/webdataset", 10, "read-small",
     WEBDS, "webdataset WebDataset", "WebDataset(urls), no decode",
     ("bare loop", "bare reader loop")),
    ("tar->samples small, webdataset-written, webds/webdataset", 10, "read-small-wds",
     WEBDS, "webdataset WebDataset", "shards with a pax header per member",
     None),
    ("webdataset-written/webds-written shards, webds", 0.9, "read-small-wds",
     WEBDS, WEBDS_OWN, "the same records, each writer's shards",
     None),
    ("image pipeline 1 process, webds/webdataset", 1.2, "pipeline",
     WEBDS, "webdataset WebDataset", "decode+augment+batch, no loader",
     ("no loader", "decode+augment alone")),
    ("RandomResizedCrop recipe 1 thread, webds fused/webdataset", 1.5, "crop",
     FUSED, "webdataset WebDataset", "crop+flip+float tensor+batch, no loader",
     None),
    ("WebLoader 2 workers, webds/webdataset", 1.2, "loader-2",
     "webds WebLoader", "webdataset WebLoader", "decode+augment+batch in 2 workers",
     ("no I/O", IN_MEMORY)),
    ("TarWriter small, webds/webdataset", 5, "write-small",
     "webds TarWriter", "webdataset TarWriter", "1-2 KB records",
     ("bare writer", "bare header writer")),
    ("ShardWriter small, webds/webdataset", 5, "write-small",
     "webds ShardWriter", "webdataset ShardWriter", "webds also writes its index + sha256",
     None),
    ("slow link 100 ms + 16 MB/s, 1 process, webds/webdataset", 3, "link-100ms-16MBps",
     WEBDS, "webdataset WebDataset", "raw samples over http", None),
    ("slow link 100 ms + 16 MB/s, WebLoader 2 workers, webds/webdataset", 3,
     "link-100ms-16MBps", "webds WebLoader 2 workers", "webdataset WebLoader 2 workers",
     "raw samples over http", None),
    ("shards/file-per-sample, small records, warm", 3, "read-small",
     WEBDS, "files Dataset", "1-2 KB records, one process",
     ("bare loop", "bare reader loop")),
    ("shards/file-per-sample, warm cache", 3, "read-images",
     WEBDS, "files Dataset", "raw samples, one process",
     ("bytes only", SHARD_BYTES)),
    ("shards/file-per-sample, cold cache", 3, "read-images-cold",
     WEBDS, "files Dataset", "raw samples, files evicted first",
     ("bytes only", SHARD_BYTES)),
    ("random reads, shards/file-per-sample, images, warm", 0.8, "random-images",
     A.SHARDS, A.FILES, "ShardListDataset[i] in a random order", None),
    ("random reads, shards/file-per-sample, small records, warm", 0.8, "random-small",
     A.SHARDS, A.FILES, "ShardListDataset[i] in a random order", None),
    ("JPEG recipe as the README shows it, webds/webdataset", 2.5, "recipe",
     P.RECIPE_AUTO, P.WDS_README, "each README's recipe, batches of 64 (webdataset: 2 workers)",
     None),
    ("small records, webds/webdataset", 40, "small-peers",
     P.SMALL_WEBDS, P.SMALL_WDS, "decode().to_tuple('bin', 'cls'), one process", None),
    ("num_workers='auto' / best by hand, JPEG recipe", 0.9, "recipe",
     P.RECIPE_AUTO, P.FUSED_WORKERS, "the fused recipe; by hand: 2 workers", None),
    ("num_workers='auto' / 1 process, slow link 100 ms + 16 MB/s", 0.9, "link-100ms-16MBps",
     LINK_AUTO, WEBDS, "raw samples over http; by hand: see the link table", None),
    ("num_workers='auto' / 1 process, slow link 20 ms + 100 MB/s", 0.9, "link-20ms-100MBps",
     LINK_AUTO, WEBDS, "raw samples over http; by hand: see the link table", None),
    ("readahead_shards='auto' / best by hand (32), many shards over the 100 ms link", 0.9,
     "link-depth", WEBDS, DEPTH_32, "1 MB shards over http; the old default was 8", None),
    ("num_workers='auto' / best by hand, small records", 0.9, "small-peers",
     P.SMALL_AUTO, P.SMALL_LOADER_0, "WebLoader(batch_size=64); by hand: 0 workers", None),
    ("video clips, webds / whole decode + slice", 5, "video",
     M.WEBDS_VIDEO, M.WHOLE_VIDEO, "H.264 360p, 4 clips x 16 frames, stride 2", None),
    ("video clips, webds / Energon AVDecoder", 1.5, "video",
     M.WEBDS_VIDEO, M.ENERGON_VIDEO, "the same clips, one thread each", None),
    ("audio clips FLAC, webds / full decode + slice", 3, "audio-flac",
     M.WEBDS_AUDIO, M.FULL_AUDIO, "5 s at 16 kHz mono from 60 s", None),
    ("audio clips MP3, webds / full decode + slice", 3, "audio-mp3",
     M.WEBDS_AUDIO, M.FULL_AUDIO, "5 s at 16 kHz mono from 60 s", None),
]  # fmt: skip

#: (label, workload, numerator, denominator): ratios shown for context, without a target.
OTHER_RATIOS = [
    ("link-depth: readahead_shards='auto' / 8 (the default before)", "link-depth", WEBDS,
     DEPTH_8),
    ("link-depth: 'auto', later passes of one dataset / 32 by hand", "link-depth", AUTO_LATER,
     DEPTH_32),
    ("read-small: webds / bare reader loop", "read-small", WEBDS, "bare reader loop"),
    ("read-small: webds stats=True / webds", "read-small", WEBDS_STATS, WEBDS),
    ("pipeline: webds stats=True / webds", "pipeline", WEBDS_STATS, WEBDS),
    ("loader-2: webds stats=True / webds", "loader-2", "webds WebLoader, stats=True",
     "webds WebLoader"),
    ("write-small: webds ShardWriter index=False / webdataset", "write-small",
     "webds ShardWriter index=False", "webdataset ShardWriter"),
    ("read-images: zip / files", "read-images", "zip Dataset", "files Dataset"),
    ("read-images-cold: zip / files", "read-images-cold", "zip Dataset", "files Dataset"),
    ("read-images: webds / shard bytes only", "read-images", WEBDS, SHARD_BYTES),
    ("read-images-cold: webds / shard bytes only", "read-images-cold", WEBDS, SHARD_BYTES),
    ("pipeline: webds / files DataLoader", "pipeline", WEBDS, "files DataLoader"),
    ("pipeline: webds Pillow decode / webdataset", "pipeline", PILLOW_ONLY,
     "webdataset WebDataset"),
    ("crop: webds fused, Pillow resize / webdataset", "crop", FUSED + ", Pillow resize",
     "webdataset WebDataset"),
    ("crop: webds fused / webds decode('pil') + crop in PIL", "crop", FUSED, WEBDS),
    ("loader-0: webds / webdataset", "loader-0", "webds WebLoader", "webdataset WebLoader"),
    ("loader-1: webds / webdataset", "loader-1", "webds WebLoader", "webdataset WebLoader"),
    ("loader-2: webds / files DataLoader", "loader-2", "webds WebLoader", "files DataLoader"),
    ("loader-2: webds / in-memory DataLoader (no I/O)", "loader-2",
     "webds WebLoader", IN_MEMORY),
    ("s3: webds / boto3 + bare reader", "s3",
     "webds WebDataset s3://", "boto3 get_object + bare reader"),
    ("s3: webds / webdataset pipe:curl", "s3",
     "webds WebDataset s3://", "webdataset pipe:curl presigned"),
    ("random-images: shards new each pass / files", "random-images", A.FRESH, A.FILES),
    ("random-small: shards new each pass / files", "random-small", A.FRESH, A.FILES),
    ("random-images-cold: shards / files", "random-images-cold", A.SHARDS_COLD,
     A.FILES_COLD),
    ("random-small-cold: shards / files", "random-small-cold", A.SHARDS_COLD, A.FILES_COLD),
    ("ranged: empty cache / range requests", A.RANGED_TAG, A.CACHE_FIRST, A.RANGED),
    ("ranged: filled cache / range requests", A.RANGED_TAG, A.CACHE_WARM, A.RANGED),
    ("seek-local: with / without offsets", "seek-local", A.WITH_OFFSETS, A.WITHOUT_OFFSETS),
    ("seek over the link: with / without offsets", A.SEEK_TAG, A.WITH_OFFSETS,
     A.WITHOUT_OFFSETS),
    ("recipe: webds with webdataset's pipeline / webdataset README", "recipe", P.WEBDS_PIL,
     P.WDS_README),
    ("recipe: webds fused threads=2 / webdataset README", "recipe", P.FUSED_THREADS,
     P.WDS_README),
    ("recipe: webds fused threads=2, torch 1 thread / webdataset README", "recipe",
     P.FUSED_THREADS_T1, P.WDS_README),
    ("recipe: webds fused threads=2 / 2 workers", "recipe", P.FUSED_THREADS, P.FUSED_WORKERS),
    ("recipe: SPDL 2 threads / webdataset README", "recipe", P.SPDL, P.WDS_README),
    ("recipe: LitData 2 workers / webdataset README", "recipe", P.LITDATA, P.WDS_README),
    ("small-peers: LitData / webdataset", "small-peers", P.SMALL_LITDATA, P.SMALL_WDS),
    ("small-peers: WebLoader 2 workers / 0 workers", "small-peers", P.SMALL_LOADER_2,
     P.SMALL_LOADER_0),
    ("small-peers: wids / webdataset", "small-peers", P.SMALL_WIDS, P.SMALL_WDS),
    ("video: decord / webds", "video", M.DECORD_VIDEO, M.WEBDS_VIDEO),
    ("video: TorchCodec / webds", "video", M.TORCHCODEC_VIDEO, M.WEBDS_VIDEO),
    ("video: Energon / whole decode + slice", "video", M.ENERGON_VIDEO, M.WHOLE_VIDEO),
    ("audio-flac: Energon / webds", "audio-flac", M.ENERGON_AUDIO, M.WEBDS_AUDIO),
    ("audio-mp3: Energon / webds", "audio-mp3", M.ENERGON_AUDIO, M.WEBDS_AUDIO),
]  # fmt: skip


@dataclass
class Config:
    """Sizes of one run; ``--quick`` picks the small ones, ``--smoke`` (the tests') tiny ones."""

    reps: int = 5
    images: int = 2000  # images built (read-images, write-images)
    small: int = 50_000  # small records built (read-small)
    decode: int = 800  # images decoded per pass (pipeline, loader-*, memory); whole shards
    write_small: int = 20_000  # small records per writer run
    s3_images: int = 600  # images (whole shards) streamed from S3
    epochs: int = 10  # memory
    workers: int = 2  # memory
    link_shards: int = 12  # link: shards of link_samples_per_shard x 105 KB (8.4 MB each)
    link_samples_per_shard: int = 80
    link_depth_shards: int = 320  # link-depth: shards of 10 x 105 KB (1 MB each)
    #: A contestant whose warm-up takes less runs several times per rep (harness.measure).
    min_time: float = 0.25

    @classmethod
    def quick(cls) -> "Config":
        return cls(
            reps=3,
            images=400,
            small=20_000,
            decode=200,
            write_small=5_000,
            s3_images=400,
            link_shards=8,
            link_samples_per_shard=40,
            link_depth_shards=160,
        )

    @classmethod
    def smoke(cls) -> "Config":
        """Tiny data for the test suite, which checks that the suite runs end to end: every
        contestant still runs (on one or two whole shards), but its rates mean little."""
        return cls(
            reps=1,
            images=100,
            small=2_000,
            decode=100,
            write_small=1_000,
            s3_images=100,
            epochs=2,
            link_shards=2,
            link_samples_per_shard=10,
            link_depth_shards=20,
            min_time=0.0,
        )


def _webds_default(name: str, default: Any) -> Any:
    """A default of webds.io.readahead (an older webds has none: ``default``)."""
    try:
        from webds.io import readahead
    except ImportError:
        return default
    return getattr(readahead, name, default)


def _evict(paths: Sequence[Any]) -> Callable[[], None]:
    """Drop these files from the page cache (only them: POSIX_FADV_DONTNEED after fsync)."""

    def evict() -> None:
        for p in paths:
            fd = os.open(str(p), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    return evict


class Suite:
    """Runs the selected workloads over one data folder."""

    def __init__(
        self,
        data: Data,
        config: Config,
        only: Optional[Sequence[str]] = None,
        quick: bool = False,
    ) -> None:
        self.data = data
        self.config = config
        self.quick = quick
        self.only = only
        self.wds = has_module("webdataset")
        self.results: Dict[str, Dict[str, Measurement]] = {}
        self.info: Dict[str, Any] = {}
        self.notes: List[str] = []
        if not self.wds:
            self.notes.append(
                "webdataset is not installed: its rows and the targets against it are skipped "
                "(pip install webdataset==1.0.2)"
            )
        if data.meta.get("source_note"):
            self.notes.append(data.meta["source_note"])

    def selected(self, name: str) -> bool:
        # An exact name selects only itself ("read-images" is not "read-images-cold").
        return not self.only or any(
            name == o or (o not in WORKLOADS and name.startswith(o)) for o in self.only
        )

    def run(self) -> None:
        steps: Dict[str, Callable[[], None]] = {
            "read-small": self.read_small,
            "read-small-wds": self.read_small_wds,
            "read-images": lambda: self.read_images(cold=False),
            "read-images-cold": lambda: self.read_images(cold=True),
            "pipeline": self.pipeline,
            "crop": self.crop,
            "loader-0": lambda: self.loader(0),
            "loader-1": lambda: self.loader(1),
            "loader-2": lambda: self.loader(2),
            "write-small": self.write_small,
            "write-images": self.write_images,
            "s3": self.s3,
            "link": self.link,
            "link-depth": self.link_depth,
            "memory": self.memory,
            "mainproc": self.mainproc,
            "random": lambda: A.random_reads(self),
            "ranged": lambda: A.remote_reads(self),
            "seek": lambda: A.mid_shard_starts(self),
            "index-load": lambda: A.index_load(self),
            "recipe": lambda: P.recipe(self),
            "small-peers": lambda: P.small_peers(self),
            "video": lambda: M.video(self),
            "audio": lambda: M.audio(self),
        }
        for name, step in steps.items():
            if self.selected(name):
                stderr(f"[{name}] {WORKLOADS[name]}")
                step()
                gc.collect()

    def _measure(self, name: str, variants: Dict[str, Any]) -> Dict[str, Measurement]:
        res = measure(
            variants, self.config.reps, workload=name, min_time=self.config.min_time, log=stderr
        )
        self.results[name] = res
        return res

    # -- reading --------------------------------------------------------------------------------

    def read_small(self) -> None:
        import webds

        urls = self.data.small_shards()
        files = L.FileDataset(self.data.small_files)
        v: Dict[str, Any] = {
            "bare reader loop": lambda: L.bare_read_samples(urls),
            "files Dataset": lambda: L.iterate_map_style(files),
        }
        ds = L.raw_dataset("webds", urls)
        v[WEBDS] = lambda: L.count(ds)
        pipe = webds.DataPipeline(webds.SimpleShardList(urls), webds.tarfile_to_samples())
        v["webds tarfile_to_samples"] = lambda: L.count(pipe)
        measured = L.raw_dataset("webds", urls, stats=True)
        v[WEBDS_STATS] = lambda: L.count(measured)
        if self.wds:
            wds_ds = L.raw_dataset("webdataset", urls)
            v["webdataset WebDataset"] = lambda: L.count(wds_ds)
        self._measure("read-small", v)

    def read_small_wds(self) -> None:
        urls = self.data.small_shards_wds()
        if not urls:
            self.notes.append("read-small-wds skipped: webdataset was not installed")
            return
        # No bare reader loop here: it knows no pax headers, so it would count each as a sample.
        ds, own_ds = L.raw_dataset("webds", urls), L.raw_dataset("webds", self.data.small_shards())
        v: Dict[str, Any] = {WEBDS: lambda: L.count(ds), WEBDS_OWN: lambda: L.count(own_ds)}
        if self.wds:
            wds_ds = L.raw_dataset("webdataset", urls)
            v["webdataset WebDataset"] = lambda: L.count(wds_ds)
        self._measure("read-small-wds", v)

    def read_images(self, cold: bool) -> None:
        if cold and not hasattr(os, "posix_fadvise"):
            self.notes.append("read-images-cold skipped: no os.posix_fadvise on this system")
            return
        files = L.FileDataset(self.data.files)
        zipped = L.ZipDataset(self.data.zip)
        urls = self.data.image_shards()
        every = [*self.data.image_files(), self.data.zip, *urls]
        before = _evict(every) if cold else None
        v: Dict[str, Any] = {
            "files Dataset": Variant(lambda: L.iterate_map_style(files), before_each=before),
            "zip Dataset": Variant(lambda: L.iterate_map_style(zipped), before_each=before),
            "bare reader loop": Variant(lambda: L.bare_read_samples(urls), before_each=before),
            SHARD_BYTES: Variant(
                lambda: L.read_shard_bytes(urls, self.data.n_images), before_each=before
            ),
        }
        ds = L.raw_dataset("webds", urls)
        v[WEBDS] = Variant(lambda: L.count(ds), before_each=before)
        if self.wds:
            wds_ds = L.raw_dataset("webdataset", urls)
            v["webdataset WebDataset"] = Variant(lambda: L.count(wds_ds), before_each=before)
        self._measure("read-images-cold" if cold else "read-images", v)

    # -- decoding -------------------------------------------------------------------------------

    def pipeline(self) -> None:
        import webds
        from webds.stages import fastjpeg

        n = self.config.decode
        items = [(p.read_bytes(), label) for p, label in self._labelled(n)]
        urls = self.data.image_shards(n)

        def first_batches(loader: Any) -> Callable[[], int]:
            # The warm-up of an expensive pass: imports, page cache, the first batches.
            return lambda: L.count_batches(loader, limit=2)

        files = L.data_loader(L.FileDataset(self.data.files, n, decode=True), 0)
        zipped = L.data_loader(L.ZipDataset(self.data.zip, n, decode=True), 0)
        v: Dict[str, Any] = {
            "decode+augment alone": Variant(
                lambda: L.decode_augment_loop(items),
                warmup=lambda: L.decode_augment_loop(items[: 2 * L.BATCH]),
            ),
            "files DataLoader": Variant(lambda: L.count_batches(files), first_batches(files)),
            "zip DataLoader": Variant(lambda: L.count_batches(zipped), first_batches(zipped)),
        }
        ds = L.image_dataset("webds", urls)
        v[WEBDS] = Variant(lambda: L.count_batches(ds), first_batches(ds))
        measured = L.image_dataset("webds", urls, stats=True)
        v[WEBDS_STATS] = Variant(lambda: L.count_batches(measured), first_batches(measured))
        if fastjpeg.available():
            # The same pipeline decoding with Pillow alone, as the baseline loop does: webds's
            # own overhead is measured on this one (the fast JPEG path would hide it).
            pil = webds.imagehandler("pil", fast_jpeg=False)
            ds_pil = L.image_dataset("webds", urls, decoder=pil)
            v[PILLOW_ONLY] = Variant(lambda: L.count_batches(ds_pil), first_batches(ds_pil))
        if self.wds:
            wds_ds = L.image_dataset("webdataset", urls)
            v["webdataset WebDataset"] = Variant(
                lambda: L.count_batches(wds_ds), first_batches(wds_ds)
            )
        self._measure("pipeline", v)

    def crop(self) -> None:
        """The pipeline workload's recipe (crop, flip, float tensor, batches of 32) with webds's
        fused decoder against decode("pil") + the same crop drawn and applied in PIL. Every
        contestant runs with torch on one thread, as in a DataLoader worker, so the fused
        decoder resizes with torch's kernel (its default where torch has one thread)."""
        import torch

        urls = self.data.image_shards(self.config.decode)

        def first_batches(loader: Any) -> Callable[[], int]:
            return lambda: L.count_batches(loader, limit=2)

        fused = L.crop_dataset(urls)
        fused_pil = L.crop_dataset(urls, resizer="pil")
        plain = L.image_dataset("webds", urls)
        v: Dict[str, Any] = {
            FUSED: Variant(lambda: L.count_batches(fused), first_batches(fused)),
            FUSED + ", Pillow resize": Variant(
                lambda: L.count_batches(fused_pil), first_batches(fused_pil)
            ),
            WEBDS: Variant(lambda: L.count_batches(plain), first_batches(plain)),
        }
        if self.wds:
            wds_ds = L.image_dataset("webdataset", urls)
            v["webdataset WebDataset"] = Variant(
                lambda: L.count_batches(wds_ds), first_batches(wds_ds)
            )
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._measure("crop", v)
        finally:
            torch.set_num_threads(threads)

    def _labelled(self, n: int) -> List[Any]:
        labels = L.FileDataset(self.data.files, n).labels
        return list(zip(self.data.image_files(n), labels))

    def loader(self, workers: int) -> None:
        n = self.config.decode
        urls = self.data.image_shards(n)
        made: Dict[str, Any] = {"webds WebLoader": lambda: L.web_loader("webds", urls, workers)}
        made["webds WebLoader, stats=True"] = lambda: L.web_loader(
            "webds", urls, workers, stats=True
        )
        if self.wds:
            made["webdataset WebLoader"] = lambda: L.web_loader("webdataset", urls, workers)
        if workers:  # with 0 workers they are the "pipeline" workload's DataLoaders
            made["files DataLoader"] = lambda: L.data_loader(
                L.FileDataset(self.data.files, n, decode=True), workers
            )
            made["zip DataLoader"] = lambda: L.data_loader(
                L.ZipDataset(self.data.zip, n, decode=True), workers
            )
            made[IN_MEMORY] = lambda: L.data_loader(L.MemoryDataset(self.data.files, n), workers)
        v: Dict[str, Any] = {}
        for name, make in made.items():
            loader = make()
            v[name] = Variant(
                lambda ld=loader: L.count_batches(ld),
                # A whole epoch: starts the (persistent) workers and reaches every shard.
                warmup=lambda ld=loader: L.count_batches(ld),
                close=lambda ld=loader: L.shutdown(ld),
            )
        self._measure(f"loader-{workers}", v)

    # -- writing --------------------------------------------------------------------------------

    def _writers(self, samples: List[Dict[str, Any]], name: str, maxcount: int) -> None:
        # Every run writes new files into an empty folder (emptied untimed): overwriting a file
        # still being written back costs more than writing a new one, and so would the timed
        # deletion of the old one.
        out = Path(tempfile.mkdtemp(prefix="write-", dir=self.data.root))

        def empty() -> None:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()

        n = len(samples)

        def tar(lib: str) -> Callable[[], int]:
            def run() -> int:
                with L.library(lib).TarWriter(str(out / f"{lib}.tar")) as sink:
                    for s in samples:
                        sink.write(s)
                return n

            return run

        def shards(lib: str, tag: str, **kw: Any) -> Callable[[], int]:
            def run() -> int:
                pattern = str(out / f"{tag}-%06d.tar")
                with L.library(lib).ShardWriter(pattern, maxcount=maxcount, **kw) as sink:
                    for s in samples:
                        sink.write(s)
                return n

            return run

        runs: Dict[str, Callable[[], int]] = {
            "bare header writer": lambda: L.bare_write(str(out / "bare.tar"), samples),
            "webds TarWriter": tar("webds"),
            "webds ShardWriter": shards("webds", "webds"),
            "webds ShardWriter index=False": shards("webds", "webds-noindex", index=False),
        }
        if self.wds:
            runs["webdataset TarWriter"] = tar("webdataset")
            runs["webdataset ShardWriter"] = shards("webdataset", "webdataset", verbose=0)
        v = {k: Variant(run, before_each=empty) for k, run in runs.items()}
        try:
            self._measure(name, v)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def write_small(self) -> None:
        import random

        from .data import small_records

        samples = small_records(self.config.write_small, random.Random(1), os.urandom(1 << 16))
        self._writers(samples, "write-small", maxcount=max(1, self.config.write_small // 2))

    def write_images(self) -> None:
        files = L.FileDataset(self.data.files)
        samples = [
            {"__key__": f"{i:06d}", "jpg": files[i][0], "cls": files.labels[i]}
            for i in range(len(files))
        ]
        self._writers(samples, "write-images", maxcount=100)

    # -- S3 -------------------------------------------------------------------------------------

    def s3(self) -> None:
        missing = [m for m in ("moto", "boto3", "s3fs") if not has_module(m)]
        if missing:
            self.notes.append(
                f"s3 skipped: {', '.join(missing)} not installed (pip install "
                "'moto[server]' s3fs boto3)"
            )
            return
        from .harness import moto_s3

        shards = self.data.image_shards(min(self.config.s3_images, self.data.n_images))
        bucket = "webds-bench"
        with moto_s3() as s3:
            client = s3["client"]
            client.create_bucket(Bucket=bucket)
            keys = [f"images/{Path(p).name}" for p in shards]
            for p, key in zip(shards, keys):
                client.upload_file(p, bucket, key)
            s3_urls = [f"s3://{bucket}/{k}" for k in keys]

            def boto3_bare() -> int:
                n = 0
                for key in keys:
                    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                    n += L.bare_parse(body, key)
                return n

            ds = L.raw_dataset("webds", s3_urls, storage_options=s3["storage_options"])
            v: Dict[str, Any] = {
                "boto3 get_object + bare reader": boto3_bare,
                "webds WebDataset s3://": lambda: L.count(ds),
            }
            if self.wds:
                v.update(self._webdataset_s3(s3, bucket, keys))
            self._measure("s3", v)
        self.info["s3"] = {
            "shards": len(shards),
            "bytes": sum(Path(p).stat().st_size for p in shards),
            "server": "moto ThreadedMotoServer on 127.0.0.1, in this process (shares its GIL)",
        }

    # -- slow links ------------------------------------------------------------------------------

    def link(self) -> None:  # noqa: C901 (one table per link, then S3)
        """Shards over a loopback server that waits ``latency`` before every answer and paces
        each connection (benchmarks/slowlink.py, in its own process): webds with read-ahead
        (its default), without it, and webdataset (curl), in one process and in a WebLoader
        with 2 workers; then s3:// through the same kind of link in front of moto."""
        from .slowlink import SlowLink

        shards = self.data.link_shards(self.config.link_shards, self.config.link_samples_per_shard)
        names = [Path(p).name for p in shards]
        size = sum(Path(p).stat().st_size for p in shards) / len(shards)
        info: Dict[str, Any] = {"shards": len(shards), "shard_bytes": size, "links": {}}
        depth = _webds_default("DEFAULT_READAHEAD_SHARDS", 4)
        grown = ""
        if depth == "auto":  # it starts there, and grows while the reader waits on the link
            depth = _webds_default("AUTO_START_SHARDS", 8)
            most = _webds_default("AUTO_MAX_SHARDS", 0)
            grown = f" (to start with: 'auto' grows it, up to {most})"
        self.notes.append(
            f"link: {len(shards)} shards of {size / 1e6:.1f} MB; webds reads "
            f"{depth} shards ahead of the one it reads{grown}"
        )
        for latency, rate in ((0.1, 16e6), (0.02, 100e6)):
            tag = f"link-{int(latency * 1000)}ms-{int(rate / 1e6)}MBps"
            with SlowLink(Path(shards[0]).parent, latency=latency, rate=rate) as link:
                urls = [f"{link.endpoint}/{n}" for n in names]
                made = time.perf_counter()
                auto = L.raw_loader("webds", urls, "auto")
                self.notes.append(
                    f"{tag}: {LINK_AUTO} made in {time.perf_counter() - made:.2f} s: {auto.choice}"
                )
                v: Dict[str, Any] = {
                    WEBDS: lambda urls=urls: L.count(L.raw_dataset("webds", urls)),
                    WEBDS + ", readahead=False": lambda urls=urls: L.count(
                        L.raw_dataset("webds", urls, readahead=False)
                    ),
                    "webds WebLoader 2 workers": lambda urls=urls: L.count(
                        L.raw_loader("webds", urls, 2)
                    ),
                    "webds WebLoader 2 workers, readahead=False": lambda urls=urls: L.count(
                        L.raw_loader("webds", urls, 2, readahead=False)
                    ),
                    # made once (it measures the dataset first: see the notes for how long)
                    LINK_AUTO: lambda auto=auto: L.count(auto),
                }
                if self.wds:
                    v["webdataset WebDataset"] = lambda urls=urls: L.count(
                        L.raw_dataset("webdataset", urls)
                    )
                    v["webdataset WebLoader 2 workers"] = lambda urls=urls: L.count(
                        L.raw_loader("webdataset", urls, 2)
                    )
                self._measure(tag, v)
                auto.close()  # persistent workers, if it chose any
                peak = L.peak_rss_growth(lambda urls=urls: L.count(L.raw_dataset("webds", urls)))
            one_trip = latency + size / rate
            # What the link allows with that many connections in flight, per process.
            ideal_1 = -(-len(shards) // (depth + 1)) * one_trip
            per_worker = -(-len(shards) // 2)
            ideal_2 = -(-per_worker // (depth + 1)) * one_trip
            n = self.config.link_samples_per_shard * len(shards)
            info["links"][tag] = {
                "latency_s": latency,
                "rate_Bps": rate,
                "connections_in_flight": depth + 1,
                "link_limit_samples_per_s_1_process": n / ideal_1,
                "link_limit_samples_per_s_2_workers": n / ideal_2,
                "peak_rss_growth_bytes_webds_1_process": peak,
            }
        self._link_s3(names, shards)
        self.info["link"] = info
        for tag, facts in info["links"].items():
            res = self.results.get(tag, {})
            for label, name, key in (
                ("1 process", WEBDS, "link_limit_samples_per_s_1_process"),
                ("2 workers", "webds WebLoader 2 workers", "link_limit_samples_per_s_2_workers"),
            ):
                if name in res:
                    share = res[name].median / facts[key]
                    facts[f"share_of_link_limit_{label.replace(' ', '_')}"] = share
                    self.notes.append(
                        f"{tag}, {label}: webds at {share:.0%} of what the link allows with "
                        f"{facts['connections_in_flight']} connections in flight per process "
                        f"({facts[key]:,.0f} samples/s)"
                    )
            self.notes.append(
                f"{tag}: peak RSS growth of a 1-process webds pass "
                f"{facts['peak_rss_growth_bytes_webds_1_process'] / 2**20:.0f} MiB (budget "
                f"{_webds_default('DEFAULT_READAHEAD_BYTES', 0) / 2**20:.0f} MiB)"
            )

    def link_depth(self) -> None:
        """Many small shards over the 100 ms + 16 MB/s link, in one process: the read-ahead
        depth webds grows (its default, ``readahead_shards="auto"``) against depths by hand."""
        from .slowlink import SlowLink

        shards = self.data.link_shards(self.config.link_depth_shards, 10)
        names = [Path(p).name for p in shards]
        with SlowLink(Path(shards[0]).parent, latency=0.1, rate=16e6) as link:
            urls = [f"{link.endpoint}/{n}" for n in names]
            grown = L.raw_dataset("webds", urls, stats=True)
            later = L.raw_dataset("webds", urls)
            self._measure(
                "link-depth",
                {
                    WEBDS: lambda: L.count(L.raw_dataset("webds", urls)),
                    # Its warm-up pass is its first: every measured pass starts deep.
                    AUTO_LATER: lambda: L.count(later),
                    DEPTH_8: lambda: L.count(L.raw_dataset("webds", urls, readahead_shards=8)),
                    DEPTH_32: lambda: L.count(L.raw_dataset("webds", urls, readahead_shards=32)),
                },
            )
            L.count(grown)
            depth = grown.stats().readahead_shards.get("main")
        self.notes.append(
            f"link-depth: {len(shards)} shards of 1.05 MB; readahead_shards='auto' ended a pass "
            f"at {depth} shards in flight"
        )

    def _link_s3(self, names: List[str], shards: List[str]) -> None:
        missing = [m for m in ("moto", "boto3", "s3fs") if not has_module(m)]
        if missing:
            self.notes.append(f"link-s3 skipped: {', '.join(missing)} not installed")
            return
        import boto3

        from .slowlink import SlowLink

        with SlowLink(s3=True, latency=0.1, rate=16e6) as link:
            creds = dict(aws_access_key_id="bench", aws_secret_access_key="bench")
            direct = boto3.client(
                "s3", endpoint_url=link.upstream, region_name="us-east-1", **creds
            )
            direct.create_bucket(Bucket="link")
            for name, path in zip(names, shards):
                direct.upload_file(path, "link", name)
            options = {
                "key": "bench",
                "secret": "bench",
                "client_kwargs": {"endpoint_url": link.endpoint, "region_name": "us-east-1"},
            }
            urls = [f"s3://link/{n}" for n in names]
            v: Dict[str, Any] = {
                WEBDS + " s3://": lambda: L.count(
                    L.raw_dataset("webds", urls, storage_options=options)
                ),
                WEBDS + " s3://, readahead=False": lambda: L.count(
                    L.raw_dataset("webds", urls, storage_options=options, readahead=False)
                ),
            }
            if self.wds and shutil.which("curl"):
                slow = boto3.client(
                    "s3", endpoint_url=link.endpoint, region_name="us-east-1", **creds
                )
                signed = [
                    slow.generate_presigned_url(
                        "get_object", Params={"Bucket": "link", "Key": n}, ExpiresIn=3600
                    )
                    for n in names
                ]
                pipes = [f"pipe:curl -s -f '{u}'" for u in signed]
                v["webdataset pipe:curl presigned"] = lambda: L.count(
                    L.raw_dataset("webdataset", pipes)
                )
            self._measure("link-s3-100ms-16MBps", v)

    def _webdataset_s3(self, s3: Dict[str, Any], bucket: str, keys: List[str]) -> Dict[str, Any]:
        """webdataset has no s3:// opener; its documented ways are ``pipe:`` URLs to a
        downloader. Two of them: curl on a presigned URL (a cheap process per shard), and
        ``aws s3 cp URL -`` (a Python process per shard; our boto3 script stands in when the
        AWS CLI is not installed), the latter in full runs only (a second or so per shard)."""
        import shlex

        v: Dict[str, Any] = {}
        if shutil.which("curl"):
            signed = [
                s3["client"].generate_presigned_url(
                    "get_object", Params={"Bucket": bucket, "Key": k}, ExpiresIn=3600
                )
                for k in keys
            ]
            pipes = [f"pipe:curl -s -f {shlex.quote(u)}" for u in signed]
            ds = L.raw_dataset("webdataset", pipes)
            v["webdataset pipe:curl presigned"] = lambda: L.count(ds)
        if not self.quick:
            creds = f"AWS_ACCESS_KEY_ID={s3['key']} AWS_SECRET_ACCESS_KEY={s3['secret']}"
            if shutil.which("aws"):
                name = "webdataset pipe:aws s3 cp"
                cmd = f"{creds} aws --endpoint-url {s3['endpoint']} s3 cp s3://{bucket}/{{}} -"
            else:
                name = "webdataset pipe:python boto3"
                cat = Path(__file__).with_name("s3cat.py")
                cmd = f"{sys.executable} {cat} {s3['endpoint']} {bucket} {{}}"
            ds2 = L.raw_dataset("webdataset", [f"pipe:{cmd.format(k)}" for k in keys])
            v[name] = lambda: L.count(ds2)
        return v

    # -- memory ---------------------------------------------------------------------------------

    def memory(self) -> None:
        urls = self.data.image_shards(self.config.decode)
        runs = {"webds": self._memory_run("webds", urls)}
        if self.wds:
            runs["webdataset"] = self._memory_run("webdataset", urls)
        # glibc's malloc raises its mmap threshold after large frees, then serves big tensors
        # from a heap it rarely trims: a fixed threshold tells that growth from retained objects.
        fixed = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        runs["webds, MALLOC_MMAP_THRESHOLD_=1MiB"] = self._memory_run("webds", urls, fixed)
        self.info["memory"] = runs

    def _memory_run(
        self, lib: str, urls: List[str], extra_env: Optional[Dict[str, str]] = None
    ) -> Dict[str, Any]:
        # A fresh process: what this one holds by now would dilute the growth.
        cmd = [sys.executable, "-m", "benchmarks.memory", "--lib", lib]
        cmd += ["--epochs", str(self.config.epochs), "--workers", str(self.config.workers)]
        paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            **(extra_env or {}),
        }
        proc = subprocess.run(cmd + urls, stdout=subprocess.PIPE, env=env, cwd=ROOT, check=True)
        return json.loads(proc.stdout.decode().strip().splitlines()[-1])

    def mainproc(self) -> None:
        from . import mainproc

        urls = self.data.image_shards(self.config.decode)
        self.info["mainproc"] = mainproc.run(urls, self.config.reps, self.wds, log=stderr)

    # -- targets --------------------------------------------------------------------------------

    def _ratio(self, workload: str, a: str, b: str) -> Optional[float]:
        res = self.results.get(workload, {})
        return ratio(res[a], res[b]) if a in res and b in res else None

    def _rounds(self, workload: str, a: str, b: str) -> Optional[List[float]]:
        res = self.results.get(workload, {})
        return round_ratios(res[a], res[b]) if a in res and b in res else None

    def targets(self) -> List[Target]:
        """Issue 8's targets, PASS / MISS / SKIP, from this run's measurements."""
        out: List[Target] = []
        for name, threshold, workload, a, b, detail, reference in RATIO_TARGETS:
            value = self._ratio(workload, a, b)
            label, ref = reference or ("", "")
            why = ""
            if value is None:
                why = f"{workload} not run"
                if workload in self.results and b.startswith("webdataset"):
                    why = "webdataset not installed"
            out.append(
                Target(
                    name,
                    threshold,
                    value,
                    detail=f"{workload}: {detail}",
                    skipped=why,
                    rounds=self._rounds(workload, a, b),
                    reference=self._ratio(workload, ref, b) if ref else None,
                    reference_label=label,
                )
            )
        webds_pil = PILLOW_ONLY if PILLOW_ONLY in self.results.get("pipeline", {}) else WEBDS
        base = self._ratio("pipeline", "decode+augment alone", webds_pil)
        base_rounds = self._rounds("pipeline", "decode+augment alone", webds_pil)
        out.append(
            Target(
                "image pipeline, webds overhead over decode+augment",
                0.10,
                None if base is None else base - 1,
                op="<=",
                fmt="{:.1%}",
                detail=f"pipeline: time({webds_pil}) / time(decode+augment alone) - 1",
                skipped="" if base is not None else "pipeline not run",
                rounds=None if base_rounds is None else [r - 1 for r in base_rounds],
            )
        )
        mem = self.info.get("memory", {}).get("webds")
        out.append(
            Target(
                "memory growth after epoch 1 (webds)",
                0.05,
                None if mem is None else mem["growth_after_epoch_1"],
                op="<=",
                fmt="{:.1%}",
                detail=f"memory: RSS main + {self.config.workers} persistent workers, "
                f"epoch {self.config.epochs} vs epoch 1",
                skipped="" if mem else "memory not run",
            )
        )
        return out

    def other_ratios(self) -> Dict[str, Optional[float]]:
        """Ratios without a target, for context (the issue quotes some of them)."""
        return {label: self._ratio(w, a, b) for label, w, a, b in OTHER_RATIOS}

    def config_json(self) -> Dict[str, Any]:
        return asdict(self.config)


@contextlib.contextmanager
def quiet_warnings() -> Any:
    """webdataset warns on every WebDataset without an explicit seed etc.: keep stderr legible."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
