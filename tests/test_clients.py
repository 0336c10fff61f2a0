"""Real webdataset clients run unchanged: open_clip's, timm's and clip_benchmark's own loader code
and img2dataset's own writer (vendored with their licences in tests/clients/), each run once over
webdataset 1.0.2 and once over webds, on whole and damaged shards, with 0 and 2 DataLoader
workers, over 2 epochs.

The shards: 6 x 20 samples (jpg, txt, json, cls) written by webdataset's TarWriter. Sample ``i``
has the key ``sample{i:04d}``, that text as its caption and ``i`` as its class, so whatever a
client yields (images and captions, or images and classes) names its sample. Two damaged copies:
shard 2 cut inside the jpg of its sample 10 (a killed copy), and shard 4 ending after its last
sample without the end-of-archive marker (a killed writer).

What webds must give: where nothing shuffles, the very rows webdataset gives (sample, image
shape, pixel sum), in the same order. Where a client shuffles under ``with_epoch``, the rows are
compared as multisets over both epochs, not epoch by epoch: webds carries the stream across
epochs where webdataset restarts it (docs/migrating.md), and that epoch behaviour is being
changed now; over damaged shards, whose streams wrap inside an epoch, webds must see at least as
many distinct samples as webdataset. Documented differences: a shard without its end-of-archive
marker raises ``EndWithoutMarker`` under a re-raising handler, and under a skipping one webds
withholds its last sample (it cannot tell it from a cut one) unless ``accept_unterminated=True``
or ``WDS_ACCEPT_UNTERMINATED=1`` says the shard is whole, as webdataset assumes.
"""

from __future__ import annotations

import functools
import io
import json
import tarfile
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from clients import clip_benchmark_builder, img2dataset_writer, open_clip_data, timm_reader_wds
from PIL import Image

import webds

wd = pytest.importorskip("webdataset")

# (20 a shard, a multiple of the clients' batch of 10, as 50 was: what the cut and the unmarked
# end leave pending in a batch is the same; fewer samples only make each run shorter)
N_SHARDS, PER_SHARD = 6, 20
N = N_SHARDS * PER_SHARD
CUT = 2 * PER_SHARD + 10  # shard 2 is cut inside this sample's jpg (a multiple of 10)
OPEN_SHARD = 4  # this shard ends without its end-of-archive marker
LAST_OF_OPEN = OPEN_SHARD * PER_SHARD + PER_SHARD - 1  # the sample webds withholds from it
SHAPE = (12, 16, 3)
VALID = {
    "whole": set(range(N)),
    "cut": set(range(N)) - set(range(CUT, 3 * PER_SHARD)),
    "unterminated": set(range(N)),
}
LIBS = {"webdataset": wd, "webds": webds}
Row = Tuple[int, Tuple[int, ...], int]  # (sample, image shape, pixel sum)


def jpeg(i: int) -> bytes:
    pixels = np.random.default_rng(i).integers(0, 256, SHAPE, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


def pixel_row(i: int, image: Any) -> Row:
    a = np.asarray(image)
    return (i, tuple(a.shape), int(a.sum(dtype=np.int64)))


def _member_end(path: Path, name: Optional[str] = None) -> int:
    """Where the data of member ``name`` ends (padded), or that of the last member."""
    with tarfile.open(path) as tf:
        members = tf.getmembers()
    m = members[-1] if name is None else next(m for m in members if m.name == name)
    return m.offset_data + (m.size + 511) // 512 * 512


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    """{variant: root} for the whole and the two damaged copies, and the expected rows."""
    root = tmp_path_factory.mktemp("clients")
    images = [jpeg(i) for i in range(N)]
    roots = {}
    for variant in VALID:
        test = root / variant / "test"
        test.mkdir(parents=True)
        (test / "nshards.txt").write_text(f"{N_SHARDS}\n")
        (root / variant / "classnames.txt").write_text("".join(f"c{i}\n" for i in range(N)))
        for s in range(N_SHARDS):
            with wd.TarWriter(str(test / f"{s}.tar")) as sink:
                for i in range(s * PER_SHARD, (s + 1) * PER_SHARD):
                    key = f"sample{i:04d}"
                    meta = {"index": i, "key": key}
                    sink.write(
                        {
                            "__key__": key,
                            "jpg": images[i],
                            "txt": key.encode(),
                            "json": json.dumps(meta).encode(),
                            "cls": str(i).encode(),
                        }
                    )
        roots[variant] = root / variant
    cut = roots["cut"] / "test" / "2.tar"
    with tarfile.open(cut) as tf:
        jpg = tf.getmember(f"sample{CUT:04d}.jpg")
    cut.write_bytes(cut.read_bytes()[: jpg.offset_data + jpg.size // 2])
    unterminated = roots["unterminated"] / "test" / f"{OPEN_SHARD}.tar"
    raw = unterminated.read_bytes()
    end = _member_end(unterminated)
    assert raw[end:].strip(b"\0") == b"" and len(raw) > end  # only the marker is cut off
    unterminated.write_bytes(raw[:end])
    expected = {}
    for i in range(N):
        expected[i] = pixel_row(i, Image.open(io.BytesIO(images[i])).convert("RGB"))
    return SimpleNamespace(roots=roots, expected=expected)


def as_array(image: Image.Image) -> torch.Tensor:
    """The clients' preprocessing stand-in: the decoded RGB pixels as they are."""
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())


def drain(
    loader: Any,
    rows: Callable[[Any], List[Row]],
    epochs: int = 2,
    before_epoch: Optional[Callable[[int], None]] = None,
) -> Tuple[List[List[Row]], Optional[BaseException]]:
    """Rows per epoch until the end or the first error (the rows before it are kept)."""
    out: List[List[Row]] = []
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch(epoch)
        got: List[Row] = []
        out.append(got)
        batches = iter(loader)
        try:
            for batch in batches:
                got.extend(rows(batch))
        except Exception as exn:
            # torch's DataLoader waits 5 s for each worker to exit after one raised: end them now
            # (a persistent one is the DataLoader's _iterator; a WebLoader holds the DataLoader)
            held = [loader, getattr(loader, "loader", None)] + getattr(loader, "pipeline", [])[:1]
            for it in [batches] + [getattr(x, "_iterator", None) for x in held]:
                for worker in getattr(it, "_workers", []):
                    worker.terminate()
            return out, exn
    return out, None


def image_rows(batch: Any) -> List[Row]:
    """(images, ids) batches: ids are classes (ints) or captions ``sampleNNNN``."""
    images, ids = batch
    ids = [int(i[6:]) if isinstance(i, str) else int(i) for i in ids]
    return [pixel_row(i, image) for i, image in zip(ids, images)]


def check_rows(data: SimpleNamespace, variant: str, epochs: List[List[Row]]) -> None:
    """Every row is a valid sample, with the shape and pixels that were written."""
    for rows in epochs:
        for row in rows:
            assert row[0] in VALID[variant], row[0]
            assert row == data.expected[row[0]], row


def raised(err: Optional[BaseException], cls: type) -> bool:
    """``err`` is a ``cls``, or (raised again by a DataLoader worker) names one."""
    return isinstance(err, cls) or (err is not None and cls.__name__ in str(err))


class Proxy:
    """A module as a client sees it, with some names replaced (``functools.partial``s of the
    originals): the clients' code is unchanged, only what its ``wds`` names differs."""

    def __init__(self, module: Any, **replaced: Any) -> None:
        self._module, self._replaced = module, replaced

    def __getattr__(self, name: str) -> Any:
        if name in self._replaced:
            return self._replaced[name]
        return getattr(self._module, name)


def pinned(lib: Any) -> Proxy:
    """``lib`` as open_clip's code expects webdataset (open-clip-torch 3.3.0 pins
    ``webdataset<=0.2.86``): ``tar_file_expander`` yields members only, with no end-of-shard
    marker after each shard, which 1.x spells ``eof_value=None``."""
    expander = functools.partial(lib.tariterators.tar_file_expander, eof_value=None)
    return Proxy(lib, tariterators=Proxy(lib.tariterators, tar_file_expander=expander))


# -- open_clip ---------------------------------------------------------------------------------


def open_clip_loader(lib: Any, root: Path, workers: int, is_train: bool, resampled: bool = False):
    oc = open_clip_data.make(lib)
    args = SimpleNamespace(
        train_data=str(root / "test" / "{0..5}.tar"),
        val_data=str(root / "test" / "{0..5}.tar"),
        dataset_resampled=resampled,
        train_num_samples=N,
        val_num_samples=None,
        train_data_upsampling_factors=None,
        seed=0,
        batch_size=10,
        workers=workers,
        world_size=1,
    )
    torch.manual_seed(0)
    info = oc.get_wds_dataset(args, as_array, is_train, epoch=0, tokenizer=lambda text: [text])
    return info


def run_open_clip(lib, root, workers, is_train, resampled=False):
    info = open_clip_loader(lib, root, workers, is_train, resampled)
    # open_clip's train loop: data["train"].set_epoch(epoch) before each epoch
    return drain(info.dataloader, image_rows, before_epoch=info.set_epoch)


def same_rows_but_the_unmarked_last(run, data, variant, workers, monkeypatch) -> None:
    """An eval loader (``run``: its runner) gives webdataset's rows in its order over both
    libraries, but for the last sample of the shard without its marker, which webds withholds
    unless WDS_ACCEPT_UNTERMINATED=1 (then it gives webdataset's rows exactly)."""
    monkeypatch.delenv("WDS_ACCEPT_UNTERMINATED", raising=False)
    got = {name: run(lib, data.roots[variant], workers, False) for name, lib in LIBS.items()}
    (wd_epochs, wd_err), (ds_epochs, ds_err) = got["webdataset"], got["webds"]
    assert wd_err is None and ds_err is None
    check_rows(data, variant, wd_epochs)
    check_rows(data, variant, ds_epochs)
    want = [
        [r for r in rows if variant != "unterminated" or r[0] != LAST_OF_OPEN] for rows in wd_epochs
    ]
    assert ds_epochs == want
    assert [len(rows) for rows in ds_epochs] == [
        len(VALID[variant]) - (variant == "unterminated")
    ] * 2
    if variant == "unterminated":  # read as complete, as webdataset does
        monkeypatch.setenv("WDS_ACCEPT_UNTERMINATED", "1")
        assert run(webds, data.roots[variant], workers, False) == (wd_epochs, None)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("variant", ["whole", "cut", "unterminated"])
def test_open_clip_eval_loader(data, variant, workers, monkeypatch):
    """get_wds_dataset(is_train=False): split_by_worker, tarfile_to_samples(handler=
    log_and_continue), select, decode("pilrgb"), rename, map_dict, to_tuple, batched(partial):
    nothing shuffles, so webds gives webdataset's rows in its order, save the last sample of the
    shard without its marker, which webds withholds."""
    same_rows_but_the_unmarked_last(run_open_clip, data, variant, workers, monkeypatch)


@pytest.mark.parametrize("workers", [0, 2])
def test_open_clip_train_loader_as_published_fails_alike(data, workers):
    """open_clip 3.3.0's training pipeline groups members with its own group_by_keys_nothrow,
    which reads "fname" from every item; webdataset 1.x's tar_file_expander ends each shard with
    an empty dict (since 0.2.96: webdataset issue #384, open_clip issue #935), so with webdataset
    1.0.2 it dies with KeyError 'fname' before its first batch (open_clip pins
    webdataset<=0.2.86). webds keeps webdataset 1.x's contract, so it fails
    alike, at the same point."""
    for lib in LIBS.values():
        epochs, err = run_open_clip(lib, data.roots["whole"], workers, True)
        assert epochs == [[]] and raised(err, KeyError) and "fname" in str(err)


def two_epochs_of_training(data, variant, run):
    """``run(lib)`` -> (epochs of rows, error) with each library: no error, valid rows, N rows an
    epoch, and on whole shards every sample twice with either; each library's sample counts."""
    got = {}
    for name, lib in LIBS.items():
        epochs, err = run(lib)
        assert err is None, name
        check_rows(data, variant, epochs)
        assert [len(rows) for rows in epochs] == [N, N], name
        got[name] = Counter(r[0] for rows in epochs for r in rows)
    if variant == "whole":
        assert got["webds"] == got["webdataset"] == Counter({i: 2 for i in range(N)})
    return got


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("variant", ["whole", "cut", "unterminated"])
def test_open_clip_train_loader(data, variant, workers):
    """get_wds_dataset(is_train=True) as open_clip runs it on the webdataset it pins (see
    :func:`pinned`): detshuffle2 and SharedEpoch, split_by_node/worker, tarfile_to_samples_nothrow,
    shuffle, batched, with_epoch(batches per worker), WebLoader with persistent workers. Per epoch
    N / 10 batches of 10; over both epochs whole shards give every sample twice with either library;
    damaged ones only valid samples, webds seeing at least as many distinct ones. (With open_clip's
    own grouper the last sample of the shard without its marker is yielded: nothing marks it.)"""
    got = two_epochs_of_training(
        data, variant, lambda lib: run_open_clip(pinned(lib), data.roots[variant], workers, True)
    )
    assert len(got["webds"]) >= len(got["webdataset"])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_open_clip_resampled_train_loader(data, workers):
    """--dataset-resampled: ResampledShards2 (deterministic, SharedEpoch) draws shards with
    replacement; what it draws differs between the libraries once webds carries the stream into
    the next epoch, so only counts, shapes and pixels are compared."""
    for name, lib in LIBS.items():
        epochs, err = run_open_clip(pinned(lib), data.roots["whole"], workers, True, True)
        assert err is None, name
        check_rows(data, "whole", epochs)
        assert [len(rows) for rows in epochs] == [N, N], name


# -- timm --------------------------------------------------------------------------------------


def run_timm(lib, root: Path, workers: int, is_training: bool):
    tm = timm_reader_wds.make(lib)
    reader = tm.ReaderWds(
        str(root / "test"),
        split=f"{{0..{N_SHARDS - 1}}}.tar|{N}",
        is_training=is_training,
        batch_size=10,
        sample_shuffle_size=64,
        sample_initial_size=16,
    )
    dataset = timm_reader_wds.IterableImageDataset(
        str(root), reader=reader, transform=as_array, is_training=is_training, batch_size=10
    )
    # timm's create_loader: the reader learns the worker count before the loader forks
    dataset.set_loader_cfg(num_workers=workers)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=10,
        num_workers=workers,
        drop_last=is_training,
        persistent_workers=workers > 0,
    )
    # timm's train.py: dataset.set_epoch(epoch) before each epoch
    return drain(loader, image_rows, before_epoch=dataset.set_epoch)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("variant", ["whole", "cut", "unterminated"])
def test_timm_eval_reader(data, variant, workers, monkeypatch):
    """ReaderWds(is_training=False): tarfile_to_samples(handler=log_and_continue), its own
    _decode (getfirst, Image.open) under map(handler=...), rename: webdataset's rows in its
    order. The half sample of the cut shard, which webdataset yields and timm's _decode drops
    (no jpg), webds never yields; the last sample of the shard without its marker webds
    withholds."""
    same_rows_but_the_unmarked_last(run_timm, data, variant, workers, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("variant", ["whole", "cut", "unterminated"])
def test_timm_train_reader(data, variant, workers):
    """ReaderWds(is_training=True): detshuffle2 over SharedCount, its own split by node and
    worker, shuffle, with_epoch(samples per worker) called on every __iter__: N samples per
    epoch; whole shards give every sample twice over both epochs with either library; damaged
    ones only valid samples, webds seeing at least as many distinct ones (less the one it
    withholds)."""
    got = two_epochs_of_training(
        data, variant, lambda lib: run_timm(lib, data.roots[variant], workers, True)
    )
    withheld = {LAST_OF_OPEN} if variant == "unterminated" else set()
    assert LAST_OF_OPEN not in got["webds"] or not withheld
    assert len(got["webds"]) >= len(set(got["webdataset"]) - withheld)


# -- clip_benchmark ----------------------------------------------------------------------------


def run_clip_benchmark(lib, root: Path, workers: int):
    cb = clip_benchmark_builder.make(lib)
    with warnings.catch_warnings():  # their WebDataset call leaves shardshuffle out
        warnings.simplefilter("ignore")
        dataset = cb.build_wds_dataset("wds/test", transform=as_array, data_dir=str(root))
    assert dataset.classes == [f"c{i}" for i in range(N)]
    loader = cb.wds_dataloader(dataset, batch_size=10, num_workers=workers)
    return drain(loader, image_rows)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("variant", ["whole", "cut", "unterminated"])
def test_clip_benchmark_loader(data, variant, workers, monkeypatch):
    """build_wds_dataset: WebDataset(pattern, cache_dir=None, nodesplitter=lambda src: src),
    decode(ImageHandler("pil", extensions=[...])), to_tuple(["webp", "png", "jpg", "jpeg"],
    "cls"), map_tuple, and cli.py's DataLoader over .batched(10). The default handler re-raises:
    a cut shard stops both libraries, webds after every whole sample before the cut (webdataset
    one batch earlier); a shard without its marker stops webds
    (EndWithoutMarker, after its whole samples) where webdataset reads it to the end, and reads
    as in webdataset with WDS_ACCEPT_UNTERMINATED=1 (the only knob their code lets a user turn)."""
    monkeypatch.delenv("WDS_ACCEPT_UNTERMINATED", raising=False)
    root = data.roots[variant]
    (wd_epochs, wd_err), (ds_epochs, ds_err) = (
        run_clip_benchmark(lib, root, workers) for lib in LIBS.values()
    )
    check_rows(data, variant, wd_epochs)
    check_rows(data, variant, ds_epochs)
    if variant == "whole":
        assert wd_err is None and ds_err is None
        assert ds_epochs == wd_epochs and [len(r) for r in ds_epochs] == [N, N]
    elif variant == "cut":
        # webdataset's tarfile reads ahead and fails before the last whole sample is grouped:
        # it loses the batch of samples CUT - 10 to CUT - 1, which webds yields before it raises.
        assert wd_err is not None and raised(ds_err, webds.ShardReadError)
        assert len(ds_epochs) == len(wd_epochs) == 1
        assert ds_epochs[0][: len(wd_epochs[0])] == wd_epochs[0]
        # (with 2 workers, one batch of the other worker's too: the error comes 2 batches later)
        assert len(ds_epochs[0]) == len(wd_epochs[0]) + 10 * max(1, workers)
        assert set(range(CUT - 10, CUT)) <= {r[0] for r in ds_epochs[0]}
        if workers == 0:
            assert [r[0] for r in ds_epochs[0]] == list(range(CUT))
    else:
        assert wd_err is None and [len(r) for r in wd_epochs] == [N, N]
        assert raised(ds_err, webds.tar.reader.EndWithoutMarker)
        assert len(ds_epochs) == 1 and ds_epochs[0] == wd_epochs[0][: len(ds_epochs[0])]
        assert len(ds_epochs[0]) >= 4 * PER_SHARD  # the shards read before shard 4 (whole batches)
        monkeypatch.setenv("WDS_ACCEPT_UNTERMINATED", "1")
        assert run_clip_benchmark(webds, root, workers) == (wd_epochs, None)


@pytest.mark.parametrize("workers", [0, 2])
def test_clip_benchmark_accept_unterminated(data, workers, monkeypatch):
    """The same call with ``accept_unterminated=True`` added to their WebDataset(...) reads the
    shard without its marker as webdataset does; ``=False`` keeps webds strict even where the
    environment says otherwise."""
    monkeypatch.setenv("WDS_ACCEPT_UNTERMINATED", "1")
    root = data.roots["unterminated"]
    want, err = run_clip_benchmark(wd, root, workers)
    assert err is None
    for accept in (True, False):
        lib = Proxy(
            webds, WebDataset=functools.partial(webds.WebDataset, accept_unterminated=accept)
        )
        epochs, err = run_clip_benchmark(lib, root, workers)
        if accept:
            assert (epochs, err) == (want, None)
        else:
            assert raised(err, webds.tar.reader.EndWithoutMarker)
            assert epochs[0] == want[0][: len(epochs[0])]


# -- img2dataset -------------------------------------------------------------------------------


class ParquetRows:
    """Stand-in for img2dataset's BufferedParquetWriter (pyarrow): keeps the rows."""

    written: Dict[str, List[dict]] = {}

    def __init__(self, output_file: str, schema: Any, buffer_size: int = 100) -> None:
        self.rows = self.written.setdefault(output_file, [])

    def write(self, sample: dict) -> None:
        self.rows.append(dict(sample))

    def close(self) -> None:
        pass


def img2dataset_samples() -> List[tuple]:
    """(img_str, key, caption, meta) as img2dataset's downloader hands them to its writer;
    sample 3 failed to download (img_str None): only its metadata is kept."""
    out = []
    for i in range(8):
        key = f"{5:05d}{i:04d}"
        meta = {
            "key": key,
            "status": "success",
            "width": 16,
            "height": 12,
            "hash": np.array([i, 7]),
        }
        img = None if i == 3 else jpeg(i)
        if img is None:
            meta["status"] = "failed_to_download"
        out.append((img, key, f"caption {i}" if i != 5 else None, meta))
    return out


def test_img2dataset_writer_shards_read_alike(tmp_path):
    """WebDatasetSampleWriter (fsspec file + wds.TarWriter) writes a shard through webdataset's
    TarWriter and one through webds's; each reads back the same with webdataset and with webds:
    the samples as written, in order, with the caption ("" for none) and the metadata JSON
    (numpy arrays as lists, indent=4)."""
    want = []
    for img, key, caption, meta in img2dataset_samples():
        if img is not None:
            meta = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in meta.items()}
            text = "" if caption is None else caption
            want.append((key, img, text.encode(), json.dumps(meta, indent=4).encode()))
    shards = {}
    for name, lib in LIBS.items():
        ns = img2dataset_writer.make(lib, ParquetRows)
        folder = tmp_path / name
        folder.mkdir()
        writer = ns.WebDatasetSampleWriter(5, str(folder), True, 5, None, "jpg")
        for img, key, caption, meta in img2dataset_samples():
            writer.write(img, key, caption, meta)
        writer.close()
        shards[name] = folder / "00005.tar"
        rows = ParquetRows.written[f"{folder}/00005.parquet"]
        assert [r["key"] for r in rows] == [s[1] for s in img2dataset_samples()]
    for writer_name, shard in shards.items():
        for reader_name, lib in LIBS.items():
            ds = lib.WebDataset(str(shard), shardshuffle=False)
            got = [(s["__key__"], s["jpg"], s["txt"], s["json"]) for s in ds]
            assert got == want, (writer_name, reader_name)
            fields = {"__key__", "jpg", "txt", "json"}
            ds = lib.WebDataset(str(shard), shardshuffle=False)
            assert all(set(s) - {"__url__", "__local_path__"} == fields for s in ds)
