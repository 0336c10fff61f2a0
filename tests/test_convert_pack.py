"""webds.pack / pack_folder / ``webds pack-folder``: real datasets (Fashion-MNIST through
torchvision, image files written by Pillow) into real shards, read back with WebDataset,
tarfile and GNU-style tools; parallel workers, resume, errors, S3 on loopback."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from clitools import cli_env
from PIL import Image
from torchvision_cpu import import_torchvision

import webds
from webds.convert import ImageFolderFiles, pack, pack_folder
from webds.errors import ArgumentError, EncodeError, SampleError
from webds.shards.index import ShardIndex

DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "fashion-mnist"


def read_idx(path: Path) -> np.ndarray:
    """An idx file (images or labels) read directly: the ground truth for the round trip."""
    data = gzip.decompress(path.read_bytes())
    magic, n = struct.unpack(">II", data[:8])
    if magic == 2051:
        rows, cols = struct.unpack(">II", data[8:16])
        return np.frombuffer(data, np.uint8, offset=16).reshape(n, rows, cols)
    assert magic == 2049
    return np.frombuffer(data, np.uint8, offset=8)


@pytest.fixture(scope="module")
def idx() -> Dict[str, np.ndarray]:
    return {
        "images": read_idx(DATA / "t10k-images-idx3-ubyte.gz"),
        "labels": read_idx(DATA / "t10k-labels-idx1-ubyte.gz"),
    }


@pytest.fixture(scope="module")
def fashion(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """torchvision's FashionMNIST (test split) over the committed t10k files."""
    tv = import_torchvision()
    root = tmp_path_factory.mktemp("fmnist")
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (raw / name).write_bytes(gzip.decompress((DATA / f"{name}.gz").read_bytes()))
    # torchvision checks that all four files exist (not their contents, with download=False)
    # before reading the two of the split asked for.
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        (raw / name).touch()
    return tv.datasets.FashionMNIST(str(root), train=False, download=False)


def tar_members(path: Path) -> Dict[str, bytes]:
    """Member name -> bytes, read with Python's tarfile (an independent reader)."""
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}


def shard_files(folder: Path, suffix: str = ".tar") -> List[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(suffix))


# -- Fashion-MNIST through torchvision ------------------------------------------------------


def test_fashion_mnist_round_trip(tmp_path: Path, fashion: Any, idx: Dict[str, np.ndarray]):
    import torch

    subset = torch.utils.data.Subset(fashion, range(2000))
    index = pack(
        subset,
        str(tmp_path / "fm-%06d.tar"),
        maxcount=500,
        workers=2,
        image_format="png",
        progress=True,  # the bar fed by the workers' progress messages
    )
    assert index.counts == [500] * 4 and index.location == str(tmp_path / "fm.index.json")
    assert ShardIndex.load(tmp_path / "fm.index.json").verify() == []
    # Shuffled across shards: the first shard is not simply the first 500 images.
    first = sorted({int(n.split(".")[0]) for n in tar_members(tmp_path / "fm-000000.tar")})
    assert len(first) == 500 and first != list(range(500))

    ds = (
        webds.WebDataset(str(tmp_path / "fm.index.json"))
        .decode("pil")
        .to_tuple("png;jpg", "cls", "__key__")
    )
    seen = set()
    for image, label, key in webds.WebLoader(ds, batch_size=None, num_workers=2):
        i = int(key)
        assert label == idx["labels"][i], key
        assert np.array_equal(np.asarray(image.convert("L")), idx["images"][i]), key
        seen.add(i)
    assert seen == set(range(2000))


def test_default_jpeg_and_quality(tmp_path: Path, fashion: Any, idx: Dict[str, np.ndarray]):
    import torch

    subset = torch.utils.data.Subset(fashion, range(40))
    pack(subset, str(tmp_path / "q-%03d.tar"), workers=0, progress=False, shuffle=False)
    members = tar_members(tmp_path / "q-000.tar")
    assert sorted(members)[:2] == ["00000000.cls", "00000000.jpg"]
    assert len(members) == 80
    for i in range(40):
        image = np.asarray(Image.open(io.BytesIO(members[f"{i:08d}.jpg"])))
        assert image.shape == (28, 28)  # grayscale stays grayscale
        assert np.abs(image.astype(int) - idx["images"][i]).mean() < 8
        assert members[f"{i:08d}.cls"] == str(idx["labels"][i]).encode()


# -- items of every kind ---------------------------------------------------------------------


class Mixed:
    """Items of the shapes pack understands, one kind per index."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        y, x = np.mgrid[0:16, 0:24]
        self.rgb = np.stack([x * 10, y * 15, x * 5 + y * 5], axis=-1).astype(np.uint8)
        self.rgba = rng.integers(0, 256, (4, 4, 4), dtype=np.uint8)
        self.deep = Image.fromarray(rng.integers(0, 60000, (3, 3)).astype(np.uint16))
        self.depth = Image.fromarray(rng.random((3, 2), dtype=np.float32))
        buf = io.BytesIO()
        Image.fromarray(self.rgb).save(buf, format="JPEG")
        self.jpeg = buf.getvalue()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        import torch

        if i == 0:
            return Image.fromarray(self.rgb), 3, {"source": "a"}
        if i == 1:
            return torch.from_numpy(self.rgb).permute(2, 0, 1).float() / 255, torch.tensor(4)
        if i == 2:
            return self.rgba, np.int64(5)
        if i == 3:
            return self.deep, "sixteen bits"
        if i == 4:
            return self.jpeg, None
        if i == 5:
            return {"seg.png": self.rgb, "json": {"k": 1}, "txt": "hi", "_private": "no"}
        if i == 6:
            return np.arange(3, dtype=np.float32), 2.5
        return self.depth, 0


def test_items_of_every_kind(tmp_path: Path):
    ds = Mixed()
    pack(ds, str(tmp_path / "m.tar"), workers=0, shuffle=False, progress=False, quality=90)
    m = tar_members(tmp_path / "m.tar")
    names = sorted(m)
    assert names == [
        "00000000.cls",
        "00000000.jpg",
        "00000000.json",
        "00000001.cls",
        "00000001.jpg",
        "00000002.cls",
        "00000002.png",  # RGBA: JPEG can't hold it
        "00000003.png",  # I;16: neither
        "00000003.txt",
        "00000004.jpg",
        "00000005.json",
        "00000005.seg.png",
        "00000005.txt",
        "00000006.json",
        "00000006.npy",
        "00000007.cls",
        "00000007.tiff",  # float: neither JPEG nor PNG
    ]
    assert m["00000000.cls"] == b"3" and json.loads(m["00000000.json"]) == {"source": "a"}
    assert m["00000001.cls"] == b"4" and m["00000002.cls"] == b"5"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(m["00000002.png"]))), ds.rgba)
    deep = Image.open(io.BytesIO(m["00000003.png"]))
    assert np.array_equal(np.asarray(deep), np.asarray(ds.deep))
    assert m["00000003.txt"] == b"sixteen bits"
    assert m["00000004.jpg"] == ds.jpeg  # bytes are kept as they are
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(m["00000005.seg.png"]))), ds.rgb)
    assert m["00000005.txt"] == b"hi" and json.loads(m["00000005.json"]) == {"k": 1}
    assert np.array_equal(np.load(io.BytesIO(m["00000006.npy"])), np.arange(3, dtype=np.float32))
    assert json.loads(m["00000006.json"]) == 2.5
    depth = Image.open(io.BytesIO(m["00000007.tiff"]))
    assert depth.mode == "F" and np.array_equal(np.asarray(depth), np.asarray(ds.depth))
    for name in ("00000000.jpg", "00000001.jpg"):
        pixels = np.asarray(Image.open(io.BytesIO(m[name])))
        assert np.abs(pixels.astype(int) - ds.rgb).mean() < 5


class Hooked:
    """A dataset with its own raw bytes (``__webds_raw__``) for even items."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return np.full((2, 2), i, dtype=np.uint8), i

    def __webds_raw__(self, i: int) -> Any:
        return {"bin": bytes([i]) * 3, "cls": i} if i % 2 == 0 else None


def raw_from_outside(dataset: Any, i: int) -> Dict[str, Any]:
    return {"txt": f"raw {i}"}


def test_raw_hooks_and_keys(tmp_path: Path):
    pack(Hooked(), str(tmp_path / "h.tar"), workers=0, progress=False, keys=lambda i: f"k{i}")
    m = tar_members(tmp_path / "h.tar")
    assert m["k0.bin"] == b"\0\0\0" and m["k2.bin"] == b"\2\2\2" and m["k2.cls"] == b"2"
    assert "k1.jpg" in m and "k3.cls" in m  # no raw bytes: the item, encoded
    # reencode=True ignores the hook; raw= replaces it.
    pack(Hooked(), str(tmp_path / "r.tar"), workers=0, progress=False, reencode=True)
    assert sorted(tar_members(tmp_path / "r.tar"))[:2] == ["00000000.cls", "00000000.jpg"]
    pack(Hooked(), str(tmp_path / "u.tar"), workers=1, progress=False, raw=raw_from_outside)
    assert tar_members(tmp_path / "u.tar")["00000003.txt"] == b"raw 3"


# -- image folders -------------------------------------------------------------------------


def make_photos(root: Path, idx: Dict[str, np.ndarray]) -> Dict[str, Path]:
    """An ImageFolder tree of real JPEG and PNG files (3 classes, 13 images, mixed case,
    a nested folder), plus files that are not images. Returns stem -> file."""
    files = {}
    layout = {
        "trouser": [("t0", "jpg"), ("t1", "JPEG"), ("t2", "png"), ("sub/t3", "jpg")],
        "bag": [("b0", "PNG"), ("b1", "jpeg"), ("b2", "jpg"), ("b3", "png"), ("b4", "jpg")],
        "coat": [("c0", "jpg"), ("c1", "webp"), ("c2", "png"), ("c3", "jpg")],
    }
    k = 0
    for cls, items in layout.items():
        for name, ext in items:
            path = root / cls / f"{name}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(idx["images"][k]).resize((64, 64))
            if k % 2:
                image = image.convert("RGB")
            fmt = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}[ext.lower()]
            image.save(path, format=fmt, quality=85)
            files[Path(name).name] = path
            k += 1
    (root / "bag" / "notes.txt").write_text("not an image")
    (root / "README").write_text("files beside the class folders are not samples")
    return files


def test_pack_folder_stores_files_unchanged(tmp_path: Path, idx: Dict[str, np.ndarray]):
    files = make_photos(tmp_path / "photos", idx)
    hidden = tmp_path / "photos" / ".ipynb_checkpoints"
    hidden.mkdir()
    shutil.copy(files["t0"], hidden / "x.jpg")
    out = tmp_path / "out"
    index = pack_folder(tmp_path / "photos", str(out / "train-%04d.tar"), maxcount=4, workers=2)
    assert len(index) == 4 and index.total == 13 and sorted(index.counts) == [3, 3, 3, 4]

    classes = json.loads((out / "classes.json").read_text())
    assert classes == {
        "classes": ["bag", "coat", "trouser"],
        "class_to_idx": {"bag": 0, "coat": 1, "trouser": 2},
    }
    assert sorted(p.name for p in out.iterdir()) == [
        "classes.json",
        "train-0000.tar",
        "train-0001.tar",
        "train-0002.tar",
        "train-0003.tar",
        "train.index.json",
    ]
    members: Dict[str, bytes] = {}
    for shard in shard_files(out):
        members.update(tar_members(shard))
    assert len(members) == 26
    ext_of = {"jpg": "jpg", "jpeg": "jpg", "png": "png", "webp": "webp"}
    for stem, path in files.items():
        ext = ext_of[path.suffix.lower().lstrip(".")]
        # The file's own bytes, keyed by its stem, with its class index.
        assert members[f"{stem}.{ext}"] == path.read_bytes(), path
        cls = classes["class_to_idx"][path.relative_to(tmp_path / "photos").parts[0]]
        assert members[f"{stem}.cls"] == str(cls).encode()


def test_folder_order_matches_torchvision(tmp_path: Path, idx: Dict[str, np.ndarray]):
    make_photos(tmp_path / "photos", idx)
    tv = import_torchvision()
    theirs = tv.datasets.ImageFolder(str(tmp_path / "photos"))
    ours = ImageFolderFiles(tmp_path / "photos")
    assert ours.classes == theirs.classes and ours.class_to_idx == theirs.class_to_idx
    assert ours.samples == theirs.samples
    image, label = ours[3]
    assert image.mode == "RGB" and label == theirs[3][1]

    # torchvision's own ImageFolder: its files are stored unchanged too...
    pack(theirs, str(tmp_path / "tv.tar"), workers=0, progress=False, shuffle=False)
    m = tar_members(tmp_path / "tv.tar")
    for path, target in theirs.samples:
        stem, ext = os.path.splitext(os.path.basename(path))
        ext = {".jpeg": "jpg", ".png": "png", ".jpg": "jpg", ".webp": "webp"}[ext.lower()]
        assert m[f"{stem}.{ext}"] == Path(path).read_bytes()
        assert m[f"{stem}.cls"] == str(target).encode()
    # ... unless it transforms its images: then the transformed images are stored.
    small = tv.datasets.ImageFolder(
        str(tmp_path / "photos"), transform=lambda im: im.resize((8, 8))
    )
    pack(small, str(tmp_path / "small.tar"), workers=0, progress=False, shuffle=False)
    for name, data in tar_members(tmp_path / "small.tar").items():
        if name.endswith(".jpg"):
            assert Image.open(io.BytesIO(data)).size == (8, 8)


def test_folder_keys_fall_back_to_indices(tmp_path: Path, idx: Dict[str, np.ndarray]):
    for cls in ("a", "b"):
        (tmp_path / "p" / cls).mkdir(parents=True)
        Image.fromarray(idx["images"][0]).save(tmp_path / "p" / cls / "same.png")
    pack_folder(tmp_path / "p", str(tmp_path / "o.tar"), workers=0, progress=False)
    assert sorted(tar_members(tmp_path / "o.tar")) == [
        "00000000.cls",
        "00000000.png",
        "00000001.cls",
        "00000001.png",
    ]
    with pytest.raises(ArgumentError, match="same stem"):
        pack_folder(tmp_path / "p", str(tmp_path / "x.tar"), keys="stem", progress=False)
    with pytest.raises(ArgumentError, match="no class subfolders"):
        pack_folder(tmp_path / "p" / "a", str(tmp_path / "y.tar"))


# -- planning, resuming ------------------------------------------------------------------------


class Blobs:
    """Items of incompressible bytes; ``sizes[i]`` bytes each."""

    def __init__(self, sizes: List[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        rng = np.random.default_rng(i)
        return {"bin": rng.bytes(self.sizes[i]), "cls": i}


def test_rerun_rewrites_only_missing_shards(tmp_path: Path):
    pattern = str(tmp_path / "s-%03d.tar")
    first = pack(Blobs([3000] * 50), pattern, maxcount=10, workers=2, progress=False)
    shards = shard_files(tmp_path)
    assert len(shards) == 5
    before = {p.name: p.read_bytes() for p in shards}
    index_text = (tmp_path / "s.index.json").read_text()
    old = 1_000_000_000
    for p in shards:
        os.utime(p, (old, old))
    (tmp_path / "s-002.tar").unlink()

    again = pack(Blobs([3000] * 50), pattern, maxcount=10, workers=2, progress=False)
    mtimes = {p.name: p.stat().st_mtime for p in shard_files(tmp_path)}
    assert [name for name, t in sorted(mtimes.items()) if t != old] == ["s-002.tar"]
    # The plan is the same, so the rewritten shard is byte for byte the one deleted.
    assert {p.name: p.read_bytes() for p in shard_files(tmp_path)} == before
    assert (tmp_path / "s.index.json").read_text() == index_text
    assert [s.sha256 for s in again] == [s.sha256 for s in first]

    # Without the index the shards that are there are hashed, not rewritten.
    (tmp_path / "s.index.json").unlink()
    (tmp_path / "s-004.tar").unlink()
    pack(Blobs([3000] * 50), pattern, maxcount=10, workers=0, progress=False)
    assert (tmp_path / "s.index.json").read_text() == index_text
    assert [p.name for p in shard_files(tmp_path) if p.stat().st_mtime != old] == [
        "s-002.tar",
        "s-004.tar",
    ]

    # Another plan over the same shards is refused, unless overwriting.
    with pytest.raises(ArgumentError, match="overwrite=True"):
        pack(Blobs([3000] * 50), pattern, maxcount=10, seed=1, progress=False)
    pack(Blobs([3000] * 50), pattern, maxcount=10, seed=1, overwrite=True, progress=False)
    assert (tmp_path / "s.index.json").read_text() != index_text


def test_maxsize_lowers_the_count_per_shard(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    index = pack(
        Blobs([10_000] * 100),
        str(tmp_path / "b-%03d.tar"),
        maxsize=100_000,
        workers=2,
        progress=False,
    )
    sizes = [p.stat().st_size for p in shard_files(tmp_path)]
    assert len(sizes) == len(index) > 10 and index.total == 100
    assert max(sizes) <= 100_000 and max(index.counts) - min(index.counts) <= 1

    # One item far bigger than the rest: its shard is not split, but it is reported.
    sizes = [1000] * 10
    sizes[3] = 300_000
    with caplog.at_level(logging.WARNING, logger="webds"):
        index = pack(
            Blobs(sizes), str(tmp_path / "w-%03d.tar"), maxsize=100_000, workers=0, progress=False
        )
    assert index.total == 10 and len(index) > 1
    big = [s.url for s in index if s.bytes > 100_000]
    assert len(big) == 1
    assert f"shard {big[0]} is" in caplog.text and "more than maxsize=100000" in caplog.text


# -- errors ------------------------------------------------------------------------------------


class Failing:
    """Item ``bad`` raises while ``broken`` is set."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad, self.broken = n, bad, True

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.bad and self.broken:
            raise ValueError(f"cannot read record {i}")
        return np.zeros((2, 2), np.uint8), i


@pytest.mark.parametrize("workers", [0, 2])
def test_failing_item_names_index_and_shard(tmp_path: Path, workers: int):
    dataset = Failing(60, bad=37)
    pattern = str(tmp_path / "f-%02d.tar")
    kw: Dict[str, Any] = dict(maxcount=10, shuffle=False, workers=workers, progress=False)
    with pytest.raises(SampleError) as info:
        pack(dataset, pattern, maxsize=None, **kw)  # no pilot: the error comes while writing
    text = str(info.value)
    assert "dataset item 37" in text and "ValueError: cannot read record 37" in text
    assert str(tmp_path / "f-03.tar") in text and "run again" in text
    names = sorted(os.listdir(tmp_path))
    assert "f-03.tar" not in names and not any(n.startswith(".") for n in names)
    assert not (tmp_path / "f.index.json").exists()
    if workers == 0:
        assert names == ["f-00.tar", "f-01.tar", "f-02.tar"]
    # Fixed, the same call completes the missing shards.
    dataset.broken = False
    index = pack(dataset, pattern, maxsize=None, **kw)
    assert index.counts == [10] * 6 and index.verify() == []


def test_failing_item_found_by_the_pilot(tmp_path: Path):
    with pytest.raises(SampleError) as info:
        pack(Failing(60, bad=37), str(tmp_path / "f-%02d.tar"), maxcount=10, shuffle=False)
    text = str(info.value)
    assert "dataset item 37" in text and "before writing any shard" in text
    assert str(tmp_path / "f-03.tar") in text
    assert os.listdir(tmp_path) == []


class BadImage:
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.full((3, 2, 2), 2.0 if i == 1 else 0.5), 0


def test_encode_error_names_item(tmp_path: Path):
    with pytest.raises(EncodeError, match=r"dataset item 1 .*\[0, 1\]") as info:
        pack(BadImage(), str(tmp_path / "e.tar"), workers=0, maxsize=None, progress=False)
    assert info.value.url == str(tmp_path / "e.tar")
    # In the pilot (maxsize set), the same error says when it happened.
    with pytest.raises(EncodeError, match="while measuring sample sizes"):
        pack(BadImage(), str(tmp_path / "e.tar"), workers=0, progress=False)


def test_bad_arguments(tmp_path: Path):
    out = str(tmp_path / "a-%d.tar")
    with pytest.raises(ArgumentError, match="map-style"):
        pack(iter([1, 2]), out)
    with pytest.raises(ArgumentError, match="maxcount"):
        pack(Blobs([1]), out, maxcount=0)
    with pytest.raises(ArgumentError, match="no %-field"):
        pack(Blobs([10] * 5), str(tmp_path / "one.tar"), maxcount=2, progress=False)
    with pytest.raises(ArgumentError, match="image_format"):
        pack(Blobs([1]), out, image_format="gif")
    with pytest.raises(ArgumentError, match="empty"):
        pack(Blobs([]), out)
    with pytest.raises(ArgumentError, match="not a folder"):
        pack_folder(tmp_path / "missing", out)


# -- S3 ----------------------------------------------------------------------------------------


def test_pack_to_s3_and_read_back(s3: Any, fashion: Any, idx: Dict[str, np.ndarray]):
    import torch

    subset = torch.utils.data.Subset(fashion, range(300))
    index = pack(
        subset,
        s3.url("fm/train-%06d.tar"),
        maxcount=100,
        workers=2,
        storage_options=s3.storage_options,
        progress=False,
    )
    assert index.counts == [100, 100, 100]
    assert s3.list("fm/") == [
        "fm/train-000000.tar",
        "fm/train-000001.tar",
        "fm/train-000002.tar",
        "fm/train.index.json",
    ]
    ds = (
        webds.WebDataset(s3.url("fm/train.index.json"), storage_options=s3.storage_options)
        .decode("pil")
        .to_tuple("png;jpg", "cls", "__key__")
    )
    keys = set()
    for image, label, key in ds:
        assert label == idx["labels"][int(key)] and image.size == (28, 28)
        keys.add(int(key))
    assert keys == set(range(300))
    # A rerun writes the deleted shard again, the same bytes as before.
    s3.delete("fm/train-000001.tar")
    pack(
        subset,
        s3.url("fm/train-%06d.tar"),
        maxcount=100,
        workers=0,
        storage_options=s3.storage_options,
        progress=False,
    )
    again = ShardIndex.load(s3.url("fm/train.index.json"), s3.storage_options)
    assert [s.sha256 for s in again] == [s.sha256 for s in index]


def test_pack_folder_to_s3(s3: Any, tmp_path: Path, idx: Dict[str, np.ndarray]):
    files = make_photos(tmp_path / "photos", idx)
    index = pack_folder(
        tmp_path / "photos",
        s3.url("photos/p-%02d.tar"),
        maxcount=7,
        workers=2,
        storage_options=s3.storage_options,
        progress=False,
    )
    assert index.counts == [6, 7]
    assert s3.list("photos/") == [
        "photos/classes.json",
        "photos/p-00.tar",
        "photos/p-01.tar",
        "photos/p.index.json",
    ]
    assert json.loads(s3.get("photos/classes.json"))["class_to_idx"]["coat"] == 1
    members: Dict[str, bytes] = {}
    for shard in ("photos/p-00.tar", "photos/p-01.tar"):
        with tarfile.open(fileobj=io.BytesIO(s3.get(shard))) as tf:
            members.update((m.name, tf.extractfile(m).read()) for m in tf.getmembers())
    assert members["c1.webp"] == files["c1"].read_bytes()


# -- the command -------------------------------------------------------------------------------


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "webds.cli", *args],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_cli_pack_folder(tmp_path: Path, idx: Dict[str, np.ndarray]):
    files = make_photos(tmp_path / "photos", idx)
    proc = run_cli(
        "pack-folder",
        "photos",
        "-o",
        "out/p-%02d.tar",
        "--maxcount",
        "5",
        "--workers",
        "2",
        "--seed",
        "7",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "packed 13 images of 3 classes into 3 shards" in proc.stderr
    out = tmp_path / "out"
    assert json.loads((out / "classes.json").read_text())["classes"] == ["bag", "coat", "trouser"]
    index = ShardIndex.load(out / "p.index.json")
    assert index.counts == [4, 4, 5] and index.extra["pack"]["seed"] == 7
    members: Dict[str, bytes] = {}
    for shard in shard_files(out):
        members.update(tar_members(shard))
    assert members["t1.jpg"] == files["t1"].read_bytes()

    proc = run_cli("pack-folder", "photos", "-o", "o2/p.tar", "--no-shuffle", "-q", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    keys = [n.split(".")[0] for n in tar_members(tmp_path / "o2" / "p.tar")][::2]
    assert keys[:5] == ["b0", "b1", "b2", "b3", "b4"]  # class by class, as the folder

    proc = run_cli("pack-folder", "nowhere", "-o", "x/p-%02d.tar", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "webds pack-folder: error: 'nowhere' is not a folder; give the folder of class subfolders"
    ]
