"""webds next to its peers: the JPEG training recipe (``recipe``) and small records
(``small-peers``) with webdataset, SPDL and LitData, each written the way its README or docs
write it.

``recipe``: 256-pixel JPEGs (shorter side 256) in webds shards of 100, RandomResizedCrop(224)
+ random horizontal flip + float tensor CHW in [0, 1], batches of 64, 2 workers or 2 threads:

- ``webdataset README``, ``webds, webdataset's pipeline``:
  ``WebDataset(urls).decode("pil").to_tuple("jpg", "cls").map_tuple(augment,
  identity).batched(64)`` in ``WebLoader(batch_size=None, num_workers=2,
  persistent_workers=True)``, the crop drawn and applied in PIL
  (:func:`benchmarks.loaders.augment`);
- ``webds fused, 2 workers``: ``decode(webds.RandomResizedCropDecoder(224,
  output="torch"))`` + flip + ``float() / 255`` in the same WebLoader; ``webds README (fused,
  num_workers='auto')``: the same in ``WebLoader(num_workers="auto")``, as webds's README writes
  it; ``webds fused, threads=2``: the same dataset in ``WebLoader(num_workers=0, threads=2)``,
  its per-sample stages in 2 threads of this process (and again with torch at one intra-op
  thread, as in a worker);
- ``SPDL, 2 threads``: ``spdl.pipeline.PipelineBuilder``: the samples of the same tar shards
  (``spdl.io.iter_tarfile``), a decode + crop + flip + tensor stage with ``concurrency=2``,
  ``aggregate(64)``, ``torch.stack``; a pipeline built per pass, as ``spdl.dataloader.DataLoader``
  builds one per ``__iter__``. It decodes with ``spdl.io.load_image`` where spdl's FFmpeg
  libraries load, else with PIL (said in the contestant's note);
- ``LitData, 2 workers``: the same JPEGs converted once by ``litdata.optimize`` (bytes + int,
  100 samples per chunk like the shards, so the 2 workers share the chunks as they share the
  shards), ``StreamingDataset(transform=PIL decode + the same augment)`` in
  ``StreamingDataLoader(batch_size=64, num_workers=2, persistent_workers=True)``.

``small-peers``: the suite's small records (1-2 KB ``bin`` + ``cls``), 10,000 (``--quick``) or
50,000, in one process: webdataset and webds ``WebDataset(urls).decode().to_tuple("bin",
"cls")``, LitData's ``StreamingDataset`` over the same records converted once, and webdataset's
``wids.ShardListDataset`` where ``wids`` imports.

Everything converted is kept under the data root and reused. Each function takes the
:class:`~benchmarks.workloads.Suite` and adds its table; a peer that is not installed is skipped
with a note.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Sequence, Tuple

import numpy as np

from . import loaders as L
from .harness import Variant, has_module, stderr

if TYPE_CHECKING:
    from .workloads import Suite

BATCH = 64
WORKERS = 2
SHORT_SIDE = 256
PER_SHARD = 100
#: Bump when the way the recipe's JPEGs or a conversion are made changes (rebuilds kept data).
VERSION = 1

#: The row names the ratios refer to.
WDS_README = "webdataset README"
#: webdataset's README pipeline run by webds (what webds's README showed until it took the fused
#: decoder).
WEBDS_PIL = "webds, webdataset's pipeline"
#: The fused crop decoder in 2 persistent workers, by hand.
FUSED_WORKERS = "webds fused, 2 workers"
FUSED_THREADS = "webds fused, threads=2"
#: The same with torch at one intra-op thread in this process, as in a worker: the fused
#: decoder then resizes with torch's kernel, and no intra-op thread spins beside the pool.
FUSED_THREADS_T1 = "webds fused, threads=2, torch 1 thread"
#: webds's README: the fused recipe in ``WebLoader(num_workers="auto")``, against the settings
#: picked by hand above.
RECIPE_AUTO = "webds README (fused, num_workers='auto')"
SPDL = "SPDL, 2 threads"
LITDATA = "LitData, 2 workers"

SMALL_WDS = "webdataset WebDataset"
SMALL_WEBDS = "webds WebDataset"
SMALL_LITDATA = "LitData StreamingDataset"
SMALL_WIDS = "wids ShardListDataset"
#: The same webds records in a WebLoader batching 64 per item: by hand, and chosen.
SMALL_LOADER_0 = "webds WebLoader, 0 workers"
SMALL_LOADER_2 = "webds WebLoader, 2 workers"
SMALL_AUTO = "webds WebLoader, num_workers='auto'"


def _done(folder: Path, facts: Dict[str, Any]) -> bool:
    """Whether ``folder`` holds a finished build of exactly ``facts``."""
    marker = folder / "done.json"
    return marker.exists() and json.loads(marker.read_text()) == facts


def _finish(folder: Path, facts: Dict[str, Any]) -> None:
    (folder / "done.json").write_text(json.dumps(facts) + "\n")


# -- the recipe's data --------------------------------------------------------------------------


def make_recipe_jpeg(photos: List[Any], i: int) -> Tuple[bytes, int]:
    """Image ``i``: a random 50-100% crop (each side) of photo ``i % 16``, resized so that its
    shorter side is 256 pixels, JPEG quality 90; the label is the photo's number."""
    from PIL import Image

    rng = np.random.default_rng([VERSION, i])
    label = i % len(photos)
    photo = photos[label]
    w, h = photo.size
    cw, ch = int(w * rng.uniform(0.5, 1.0)), int(h * rng.uniform(0.5, 1.0))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    scale = SHORT_SIDE / min(cw, ch)
    size = (max(SHORT_SIDE, round(cw * scale)), max(SHORT_SIDE, round(ch * scale)))
    image = photo.resize(size, Image.BICUBIC, box=(x, y, x + cw, y + ch))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue(), label


def recipe_shards(suite: "Suite", n: int) -> List[str]:
    """``n`` recipe JPEGs in webds shards of 100 (``NNNNNN.jpg`` + ``NNNNNN.cls``), made once
    under the data root."""
    import webds

    from .data import load_photos

    source = suite.data.meta["source"]
    folder = suite.data.root / "recipe" / str(n)
    shards = folder / "shards"
    paths = [str(shards / f"rec-{s:06d}.tar") for s in range(-(-n // PER_SHARD))]
    facts = {"version": VERSION, "n": n, "source": source}
    if _done(folder, facts):
        return paths
    stderr(f"  recipe: making {n} JPEGs of {SHORT_SIDE} pixels in {shards} ...")
    shutil.rmtree(folder, ignore_errors=True)
    shards.mkdir(parents=True)
    photos = load_photos(source)
    with webds.ShardWriter(str(shards / "rec-%06d.tar"), maxcount=PER_SHARD) as sink:
        for i in range(n):
            jpg, label = make_recipe_jpeg(photos, i)
            sink.write({"__key__": f"{i:06d}", "jpg": jpg, "cls": label})
    _finish(folder, facts)
    return paths


def recipe_facts(paths: Sequence[str]) -> Dict[str, Any]:
    """The JPEGs' count and sizes, read back from the shards."""
    import webds

    sizes = [len(s["jpg"]) for s in webds.WebDataset(list(paths), shardshuffle=False)]
    return {
        "images": len(sizes),
        "shards": len(paths),
        "mean_jpeg_bytes": sum(sizes) / len(sizes),
        "median_jpeg_bytes": float(np.median(sizes)),
    }


def _shard_samples(path: str, fields: Tuple[str, str]) -> Iterator[Dict[str, Any]]:
    """The samples of one shard as ``{fields[0]: bytes, fields[1]: int}`` (for litdata.optimize:
    a module-level generator, run in its worker process)."""
    import webds

    data, label = fields
    for s in webds.WebDataset([path], shardshuffle=False):
        yield {data: s[data], label: int(s[label])}


def litdata_copy(
    suite: "Suite",
    urls: Sequence[str],
    n: int,
    fields: Tuple[str, str],
    name: str,
    **chunking: Any,
) -> str:
    """The ``n`` samples of ``urls`` converted once by ``litdata.optimize`` into its chunk
    format under the data root (bytes + int); returns the folder."""
    import functools
    import multiprocessing

    import litdata

    folder = suite.data.root / "litdata" / name
    facts = {"version": VERSION, "n": n, "urls": [Path(u).name for u in urls], **chunking}
    if _done(folder, facts):
        return str(folder)
    stderr(f"  litdata.optimize: {len(urls)} shards -> {folder} ...")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # optimize sets the process's start method (force=True; spawn by default, which would
    # re-import our __main__ and then start every later DataLoader's workers by spawn): fork,
    # and the method as it was afterwards.
    method = multiprocessing.get_start_method(allow_none=True)
    try:
        litdata.optimize(
            fn=functools.partial(_shard_samples, fields=fields),
            inputs=list(urls),
            output_dir=str(folder),
            num_workers=1,  # one writer: the chunks keep the shards' order
            mode="overwrite",
            verbose=False,
            start_method="fork",
            **chunking,
        )
    finally:
        multiprocessing.set_start_method(method, force=True)
    index = json.loads((folder / "index.json").read_text())
    got = sum(c["chunk_size"] for c in index["chunks"])
    if got != n:  # optimize logs a failure in its worker and returns
        raise RuntimeError(f"litdata.optimize wrote {got} samples into {folder}, expected {n}")
    _finish(folder, facts)
    return str(folder)


# -- the recipe's contestants -------------------------------------------------------------------


_rng = random.Random(0)


def flip_float(image: Any, rng: random.Random = _rng) -> Any:
    """After ``RandomResizedCropDecoder(224, output="torch")`` (uint8 3xHxW): a random
    horizontal flip, then a float tensor in [0, 1]."""
    if rng.random() < 0.5:
        image = image.flip(-1)
    return image.float().div_(255)


def readme_dataset(lib: str, urls: Sequence[str]) -> Any:
    """The README's pipeline with the PIL crop + flip + tensor augment, batches of 64."""
    return L.image_dataset(lib, urls, batch_size=BATCH)


def readme_loader(lib: str, urls: Sequence[str]) -> Any:
    return L.library(lib).WebLoader(
        readme_dataset(lib, urls),
        batch_size=None,
        num_workers=WORKERS,
        persistent_workers=True,
    )


def fused_dataset(urls: Sequence[str]) -> Any:
    import webds

    return (
        webds.WebDataset(list(urls), shardshuffle=False)
        .decode(webds.RandomResizedCropDecoder(L.SIZE, output="torch"))
        .to_tuple("jpg", "cls")
        .map_tuple(flip_float, L.identity)
        .batched(BATCH)
    )


class TarSamples:
    """SPDL's source: (JPEG bytes, label) of every sample of the shards, in order, the tars
    parsed by ``spdl.io.iter_tarfile`` (its C++ tar parser) from the open files."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)

    def __iter__(self) -> Iterator[Tuple[bytes, int]]:
        import spdl.io

        for url in self.urls:
            key, jpg, label = None, None, None
            with open(url, "rb") as f:
                for name, data in spdl.io.iter_tarfile(f):
                    k, _, ext = name.partition(".")
                    if k != key:
                        if jpg is not None:
                            yield jpg, label  # type: ignore[misc]
                        key, jpg, label = k, None, None
                    if ext == "jpg":
                        jpg = data
                    elif ext == "cls":
                        label = int(data)
            if jpg is not None:
                yield jpg, label  # type: ignore[misc]


def spdl_decoder() -> Tuple[Callable[[bytes], Any], str]:
    """(bytes -> RGB PIL image, note): spdl.io (FFmpeg) when its libraries load, else PIL."""
    try:
        import spdl.io

        probe = io.BytesIO()
        from PIL import Image

        Image.new("RGB", (8, 8)).save(probe, format="JPEG")
        spdl.io.to_numpy(spdl.io.load_image(probe.getvalue()))
    except Exception as e:  # no FFmpeg libraries (spdl_io loads them at run time)
        why = str(e)[:100] or type(e).__name__
        if "libavutil" in why:
            why = "no FFmpeg libraries: libavutil.so.56-61 not found"
        return L.read_jpeg, f"decodes with PIL: spdl.io.load_image does not work here ({why})"

    def decode(data: bytes) -> Any:
        from PIL import Image

        rgb = spdl.io.to_numpy(spdl.io.load_image(data, filter_desc="format=rgb24"))
        return Image.fromarray(np.ascontiguousarray(rgb))

    return decode, "decodes with spdl.io.load_image (FFmpeg)"


def spdl_pass(urls: Sequence[str], decode: Callable[[bytes], Any]) -> Callable[[], Any]:
    """A function that builds the SPDL pipeline of one pass and returns its batches' iterator
    (the pipeline stops when the pass ends)."""
    import torch
    from spdl.pipeline import PipelineBuilder

    source = TarSamples(urls)

    def decode_augment(item: Tuple[bytes, int]) -> Tuple[Any, int]:
        data, label = item
        return L.augment(decode(data)), label

    def collate(items: List[Tuple[Any, int]]) -> Tuple[Any, Any]:
        images, labels = zip(*items)
        return torch.stack(images), torch.tensor(labels)

    def batches() -> Iterator[Any]:
        pipeline = (
            PipelineBuilder()
            .add_source(source)
            .pipe(decode_augment, concurrency=WORKERS)
            .aggregate(BATCH)
            .pipe(collate)
            .add_sink(3)
            .build(num_threads=WORKERS)
        )
        with pipeline.auto_stop():
            yield from pipeline

    return batches


def litdata_loader(suite: "Suite", urls: Sequence[str], n: int) -> Any:
    import litdata

    folder = litdata_copy(suite, urls, n, ("jpg", "cls"), f"recipe-{n}", chunk_size=PER_SHARD)
    # Local chunks are read in place, as LitData's docs show for local data (a cache_dir is for
    # remote data: with one, chunks were copied into it first).
    ds = litdata.StreamingDataset(folder, transform=lit_augment)
    return litdata.StreamingDataLoader(
        ds, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True
    )


def lit_augment(item: Dict[str, Any]) -> Tuple[Any, int]:
    """LitData's transform: PIL decode + the same crop, flip and tensor."""
    return L.augment(L.read_jpeg(item["jpg"])), item["cls"]


def expected_batches(n: int, streams: int) -> int:
    """Batches of 64 from ``n`` samples split evenly over ``streams`` workers (each batches its
    own share, a partial batch at its end)."""
    share = n // streams
    return streams * -(-share // BATCH)


def checked_pass(
    batches: Callable[[], Any], name: str, n: int, n_batches: int
) -> Callable[[], int]:
    """A pass over ``batches()`` that counts samples and batches and asserts both."""

    def run() -> int:
        samples = k = 0
        for batch in batches():
            samples += L.batch_size_of(batch)
            k += 1
        if (samples, k) != (n, n_batches):
            raise AssertionError(
                f"recipe/{name}: {samples} samples in {k} batches, expected {n} in {n_batches}"
            )
        return samples

    return run


def one_torch_thread(batches: Any) -> Iterator[Any]:
    """``batches`` with torch at one intra-op thread in this process, as in a worker."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield from batches
    finally:
        torch.set_num_threads(threads)


def recipe(suite: "Suite") -> None:
    """The JPEG recipe side by side: webdataset and webds as their READMEs write it, webds's
    fused crop decoder in 2 workers and in 2 threads, SPDL, LitData."""
    import torch

    import webds

    n = 400 if suite.quick else 1200
    urls = recipe_shards(suite, n)
    facts = suite.info["recipe"] = recipe_facts(urls)
    suite.notes.append(
        f"recipe: {n} JPEGs, shorter side {SHORT_SIDE}, quality 90 (mean "
        f"{facts['mean_jpeg_bytes'] / 1e3:.0f} kB), {PER_SHARD} per shard; torch at "
        f"{torch.get_num_threads()} threads in this process (the threads contestants), 1 in workers"
    )
    made: Dict[str, Tuple[Callable[[], Any], Any, int, str]] = {}
    # name -> (a pass's batches, the loader to close, expected batches, note)
    if suite.wds:
        ld = readme_loader("webdataset", urls)
        made[WDS_README] = (lambda ld=ld: ld, ld, expected_batches(n, WORKERS), "")
    ld = readme_loader("webds", urls)
    made[WEBDS_PIL] = (lambda ld=ld: ld, ld, expected_batches(n, WORKERS), "")
    ld = webds.WebLoader(
        fused_dataset(urls), batch_size=None, num_workers=WORKERS, persistent_workers=True
    )
    made[FUSED_WORKERS] = (lambda ld=ld: ld, ld, expected_batches(n, WORKERS), "")
    ld = webds.WebLoader(fused_dataset(urls), batch_size=None, num_workers=0, threads=WORKERS)
    made[FUSED_THREADS] = (lambda ld=ld: ld, ld, expected_batches(n, 1), "")
    ld = webds.WebLoader(fused_dataset(urls), batch_size=None, num_workers=0, threads=WORKERS)
    made[FUSED_THREADS_T1] = (lambda ld=ld: one_torch_thread(ld), ld, expected_batches(n, 1), "")
    ld = webds.WebLoader(fused_dataset(urls), batch_size=None, num_workers="auto")
    streams = max(1, ld.loader.num_workers)
    made[RECIPE_AUTO] = (lambda ld=ld: ld, ld, expected_batches(n, streams), str(ld.choice))
    if has_module("spdl.pipeline") and has_module("spdl.io"):
        decode, note = spdl_decoder()
        made[SPDL] = (spdl_pass(urls, decode), None, expected_batches(n, 1), note)
        suite.notes.append(f"recipe: SPDL {note}")
    else:
        suite.notes.append("recipe: SPDL skipped: spdl is not installed (pip install spdl)")
    if has_module("litdata"):
        ld = litdata_loader(suite, urls, n)
        # LitData gives its workers whole batches' worth of samples: one partial batch in all.
        made[LITDATA] = (lambda ld=ld: ld, ld, expected_batches(n, 1), "")
    else:
        suite.notes.append(
            "recipe: LitData skipped: litdata is not installed (pip install litdata)"
        )

    v: Dict[str, Any] = {}
    for name, (batches, loader, n_batches, note) in made.items():
        run = checked_pass(batches, name, n, n_batches)
        v[name] = Variant(
            run,
            warmup=run,  # a whole pass: starts the persistent workers, reaches every shard
            close=(lambda ld=loader: _close(ld)) if loader is not None else None,
            note=note,
        )
    suite._measure("recipe", v)


def _close(loader: Any) -> None:
    if hasattr(loader, "close"):
        loader.close()
    L.shutdown(loader)


# -- small records ------------------------------------------------------------------------------


def small_peers(suite: "Suite") -> None:
    """Small records in one process: webdataset, webds, LitData's StreamingDataset, wids."""
    from .data import SMALL_PER_SHARD

    n = 10_000 if suite.quick else 50_000
    if n > suite.data.n_small:
        n = suite.data.n_small - suite.data.n_small % SMALL_PER_SHARD
    urls = suite.data.small_shards()[: n // SMALL_PER_SHARD]

    def counted(name: str, run: Callable[[], int]) -> Callable[[], int]:
        def checked() -> int:
            got = run()
            if got != n:
                raise AssertionError(f"small-peers/{name}: {got} samples, expected {n}")
            return got

        return checked

    def tuples(lib: str) -> Any:
        return L.raw_dataset(lib, urls).decode().to_tuple("bin", "cls")

    v: Dict[str, Any] = {}
    if suite.wds:
        wds_ds = tuples("webdataset")
        v[SMALL_WDS] = counted(SMALL_WDS, lambda: L.count(wds_ds))
    webds_ds = tuples("webds")
    v[SMALL_WEBDS] = counted(SMALL_WEBDS, lambda: L.count(webds_ds))
    import webds

    def samples(loader: Any) -> int:
        return sum(len(batch[1]) for batch in loader)

    for name, workers in ((SMALL_LOADER_0, 0), (SMALL_LOADER_2, 2), (SMALL_AUTO, "auto")):
        ld = webds.WebLoader(
            tuples("webds"),
            batch_size=BATCH,
            num_workers=workers,
            **({"persistent_workers": True} if workers == 2 else {}),
        )
        note = str(ld.choice) if ld.choice is not None else ""
        run = counted(name, lambda ld=ld: samples(ld))
        v[name] = Variant(run, close=lambda ld=ld: _close(ld), note=note)
    if has_module("litdata"):
        import litdata

        folder = litdata_copy(suite, urls, n, ("bin", "cls"), f"small-{n}", chunk_bytes="64MB")
        lit = litdata.StreamingDataset(folder)  # in place, as its docs show for local data
        v[SMALL_LITDATA] = counted(SMALL_LITDATA, lambda: L.count(lit))
    else:
        suite.notes.append("small-peers: LitData skipped: litdata is not installed")
    if has_module("wids"):
        ds = wids_dataset(suite, urls, n)
        v[SMALL_WIDS] = counted(SMALL_WIDS, lambda: L.iterate_map_style(ds))
    else:
        suite.notes.append(
            "small-peers: wids skipped: the module wids does not import (webdataset 1.0.2's "
            "wheel does not ship it; it is the separate wids package)"
        )
    suite._measure("small-peers", v)


def wids_dataset(suite: "Suite", urls: Sequence[str], n: int) -> Any:
    """``wids.ShardListDataset`` over the shards, from a shard list JSON written next to them."""
    import wids

    per = n // len(urls)
    spec = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": "small",
        "shardlist": [{"url": str(Path(u).resolve()), "nsamples": per} for u in urls],
    }
    path = suite.data.root / "small" / f"wids-{n}.json"
    path.write_text(json.dumps(spec, indent=1) + "\n")
    return wids.ShardListDataset(str(path))
