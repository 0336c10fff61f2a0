"""convert_imagenet and ``webds imagenet`` on a miniature ImageNet built here: 5 synsets x 40
JPEGs (Fashion-MNIST images, upscaled and JPEG-encoded with Pillow) in class tars written by
Python's ``tarfile`` and by GNU ``tar``, inside an outer tar written by GNU ``tar``, plus a
validation tar of 25 JPEGs with a ``LOC_val_solution.csv``-style label file."""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest
from clitools import ROOT, cli_env
from conftest import write_tar

from webds.convert.imagenet import convert_imagenet, default_val_pattern
from webds.errors import ArgumentError, ShardReadError
from webds.shards.index import ShardIndex

PIL = pytest.importorskip("PIL.Image")

FASHION = ROOT / "examples" / "data" / "fashion-mnist" / "t10k-images-idx3-ubyte.gz"
SYNSETS = ["n01440764", "n01443537", "n01484850", "n01491361", "n01494475"]
PER_CLASS = 40
N_TRAIN = len(SYNSETS) * PER_CLASS
N_VAL = 25
# The outer tar lists the class tars out of sorted order: indices must still follow sorted order.
OUTER_ORDER = [3, 0, 4, 1, 2]


@dataclass
class Mini:
    root: Path
    train: Path
    val: Path
    loc_csv: Path
    train_images: Dict[str, Tuple[str, bytes]] = field(default_factory=dict)  # key -> (synset, jpg)
    val_images: List[Tuple[str, str, bytes]] = field(default_factory=list)  # (stem, synset, jpg)


def fashion_jpegs(n: int) -> List[bytes]:
    """``n`` distinct JPEGs: Fashion-MNIST test images upscaled to 64x64."""
    with gzip.open(FASHION, "rb") as f:
        raw = f.read()
    out = []
    for i in range(n):
        pixels = raw[16 + i * 784 : 16 + (i + 1) * 784]
        image = PIL.frombytes("L", (28, 28), pixels).resize((64, 64))
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    assert len(set(out)) == n
    return out


def tar_bytes(members: Sequence[Tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_300_000_000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def gnu_tar(dest: Path, folder: Path, names: Sequence[str]) -> None:
    subprocess.run(["tar", "cf", str(dest), "-C", str(folder), *names], check=True)


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> Mini:
    root = tmp_path_factory.mktemp("mini-imagenet")
    jpegs = fashion_jpegs(N_TRAIN + N_VAL)
    rng = random.Random(1234)
    m = Mini(root, root / "ILSVRC2012_img_train.tar", root / "val.tar", root / "LOC.csv")
    classes = root / "classes"
    classes.mkdir()
    for c, synset in enumerate(SYNSETS):
        numbers = rng.sample(range(1, 20000), PER_CLASS)
        members = []
        for j, number in enumerate(numbers):
            key = f"{synset}_{number}"
            data = jpegs[c * PER_CLASS + j]
            members.append((f"{key}.JPEG", data))
            m.train_images[key] = (synset, data)
        if c % 2 == 0:  # Python's tarfile
            (classes / f"{synset}.tar").write_bytes(tar_bytes(members))
        else:  # GNU tar, from files on disk
            folder = root / f"files-{synset}"
            folder.mkdir()
            for name, data in members:
                (folder / name).write_bytes(data)
            gnu_tar(classes / f"{synset}.tar", folder, [name for name, _ in members])
    gnu_tar(m.train, classes, [f"{SYNSETS[c]}.tar" for c in OUTER_ORDER])
    val_folder = root / "val-files"
    val_folder.mkdir()
    rows = []
    for i in range(N_VAL):
        stem = f"ILSVRC2012_val_{i + 1:08d}"
        synset = rng.choice(SYNSETS)
        data = jpegs[N_TRAIN + i]
        (val_folder / f"{stem}.JPEG").write_bytes(data)
        m.val_images.append((stem, synset, data))
        rows.append(f"{stem},{synset} 10 12 50 60 {synset} 3 4 20 30 ")
    gnu_tar(m.val, val_folder, [f"{stem}.JPEG" for stem, _, _ in m.val_images])
    rng.shuffle(rows)  # Kaggle's file is not in image order either
    m.loc_csv.write_text("ImageId,PredictionString\n" + "\n".join(rows) + "\n")
    return m


def read_shards(paths: Sequence[str]) -> List[Dict[str, bytes]]:
    """Samples of the shards in order, read with Python's tarfile (an independent reader)."""
    samples: List[Dict[str, bytes]] = []
    for path in paths:
        with tarfile.open(path) as tf:
            for member in tf:
                key, _, ext = member.name.partition(".")
                if not samples or samples[-1]["__key__"] != key.encode():
                    samples.append({"__key__": key.encode()})
                samples[-1][ext] = tf.extractfile(member).read()  # type: ignore[union-attr]
    return samples


def shard_files(folder: Path, stem: str = "train") -> Dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob(f"{stem}-*.tar"))}


def runs_test(seq: Sequence[int]) -> float:
    """Two-sided p-value of the Wald-Wolfowitz runs test for k categories (normal
    approximation): few runs mean clustered classes."""
    n = len(seq)
    counts = Counter(seq).values()
    s2 = sum(c * c for c in counts)
    s3 = sum(c**3 for c in counts)
    runs = 1 + sum(a != b for a, b in zip(seq, seq[1:]))
    mean = 1 + (n * n - s2) / n
    var = (s2 * (s2 + n * (n + 1)) - 2 * n * s3 - n**3) / (n * n * (n - 1))
    z = (runs - mean) / math.sqrt(var)
    return math.erfc(abs(z) / math.sqrt(2))


def convert(mini: Mini, out: Path, **kw) -> dict:
    kw.setdefault("maxcount", 64)
    kw.setdefault("progress", False)
    return convert_imagenet(str(mini.train), str(out / "train-%06d.tar"), **kw)


# ---------------------------------------------------------------------------------------------
# Training set
# ---------------------------------------------------------------------------------------------


def test_train_round_trip_bytes_labels_classes_index(mini: Mini, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = convert(mini, out)
    shards = [str(out / f"train-{i:06d}.tar") for i in range(4)]
    assert summary["train"]["shards"] == shards
    assert summary["train"]["samples"] == N_TRAIN and summary["classes"] == len(SYNSETS)
    samples = read_shards(shards)
    assert [len(read_shards([s])) for s in shards] == [64, 64, 64, 8]
    keys = [s["__key__"].decode() for s in samples]
    assert sorted(keys) == sorted(mini.train_images)  # every image exactly once
    for sample in samples:
        synset, data = mini.train_images[sample["__key__"].decode()]
        assert set(sample) == {"__key__", "jpg", "cls"}
        assert sample["jpg"] == data  # the original bytes, never re-encoded
        assert int(sample["cls"]) == SYNSETS.index(synset)  # sorted synsets
    doc = json.loads((out / "classes.json").read_text())
    assert doc == {"classes": SYNSETS, "class_to_idx": {s: i for i, s in enumerate(SYNSETS)}}
    assert summary["classes_json"] == str(out / "classes.json")
    index = ShardIndex.load(str(out / "train.index.json"))
    assert summary["train"]["index"] == str(out / "train.index.json")
    assert index.total == N_TRAIN and len(index) == 4
    assert index.verify() == []
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # temp folder removed


def test_class_sequence_is_well_mixed(mini: Mini, tmp_path: Path) -> None:
    summary = convert(mini, tmp_path)
    classes = [int(s["cls"]) for s in read_shards(summary["train"]["shards"])]
    assert runs_test(classes) > 0.01
    # The test can fail: the input order (class by class) and a sorted order are rejected.
    assert runs_test(sorted(classes)) < 1e-9
    input_order = [OUTER_ORDER[i // PER_CLASS] for i in range(N_TRAIN)]
    assert runs_test(input_order) < 1e-9
    # Every shard of 64 mixes all five classes.
    for shard in summary["train"]["shards"][:3]:
        assert len({s["cls"] for s in read_shards([shard])}) == len(SYNSETS)


def test_tiny_memory_many_buckets_same_permutation(mini: Mini, tmp_path: Path) -> None:
    big = convert(mini, tmp_path / "big")
    work = tmp_path / "work"
    tiny = convert(mini, tmp_path / "tiny", memory=20_000, tmpdir=str(work))
    # ~350 kB of images in buckets of 20 kB: many buckets, and oversized ones split again.
    assert tiny["train"]["buckets"] >= 15 and big["train"]["buckets"] == 1
    assert tiny["train"]["splits"] > 0
    keys = [s["__key__"].decode() for s in read_shards(tiny["train"]["shards"])]
    assert sorted(keys) == sorted(mini.train_images)
    # The order depends on the seed only, not on memory or how the buckets were cut.
    assert shard_files(tmp_path / "tiny") == shard_files(tmp_path / "big")
    assert list(work.iterdir()) == []


def test_same_seed_same_shards_other_seed_other_order(mini: Mini, tmp_path: Path) -> None:
    a = convert(mini, tmp_path / "a", seed=7)
    convert(mini, tmp_path / "b", seed=7)
    c = convert(mini, tmp_path / "c", seed=8)
    assert shard_files(tmp_path / "a") == shard_files(tmp_path / "b")
    keys_a = [s["__key__"] for s in read_shards(a["train"]["shards"])]
    keys_c = [s["__key__"] for s in read_shards(c["train"]["shards"])]
    assert keys_a != keys_c and sorted(keys_a) == sorted(keys_c)


def test_read_back_with_webdataset_and_json_field(mini: Mini, tmp_path: Path) -> None:
    from webds import WebDataset

    convert(mini, tmp_path, with_json=True)
    ds = WebDataset(str(tmp_path / "train-{000000..000003}.tar"), shardshuffle=False)
    pairs = list(ds.decode("pil").to_tuple("jpg;png", "cls"))
    assert len(pairs) == N_TRAIN
    assert all(image.size == (64, 64) for image, _ in pairs)
    assert Counter(label for _, label in pairs) == {i: PER_CLASS for i in range(len(SYNSETS))}
    metas = list(WebDataset(str(tmp_path / "train.index.json")).decode().to_tuple("cls", "json"))
    assert all(meta == {"synset": SYNSETS[label]} for label, meta in metas)


def test_gzipped_outer_tar_in_a_folder(mini: Mini, tmp_path: Path) -> None:
    # The outer tar as some mirrors ship it: gzipped, the class tars in a folder (with its
    # directory entry), written by GNU tar.
    folder = tmp_path / "train"
    folder.mkdir()
    with tarfile.open(mini.train) as tf:
        tf.extractall(folder, filter="data")
    outer = tmp_path / "train.tar.gz"
    subprocess.run(["tar", "czf", str(outer), "-C", str(tmp_path), "train"], check=True)
    summary = convert_imagenet(str(outer), str(tmp_path / "o" / "train-%06d.tar"), progress=False)
    got = read_shards(summary["train"]["shards"])
    assert sorted((s["__key__"].decode(), s["jpg"], int(s["cls"])) for s in got) == sorted(
        (key, data, SYNSETS.index(synset)) for key, (synset, data) in mini.train_images.items()
    )


def test_from_and_to_s3(mini: Mini, tmp_path: Path, s3, monkeypatch: pytest.MonkeyPatch) -> None:
    # Remote output: the buckets go to the system temporary folder (here a fresh one).
    temp = tmp_path / "systemp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    train = s3.put("raw/ILSVRC2012_img_train.tar", mini.train.read_bytes())
    summary = convert_imagenet(
        train,
        s3.url("in1k/train-%06d.tar"),
        maxcount=64,
        storage_options=s3.storage_options,
        progress=False,
    )
    assert s3.list("in1k/") == sorted(
        ["in1k/classes.json", "in1k/train.index.json"]
        + [f"in1k/train-{i:06d}.tar" for i in range(4)]
    )
    assert summary["classes_json"] == s3.url("in1k/classes.json")
    assert json.loads(s3.get("in1k/classes.json"))["classes"] == SYNSETS
    convert(mini, tmp_path / "local")  # same seed: the same shards, read from a file
    for name, data in shard_files(tmp_path / "local").items():
        assert s3.get(f"in1k/{name}") == data
    assert list(temp.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Validation set
# ---------------------------------------------------------------------------------------------


def check_val(mini: Mini, shards: Sequence[str], json_field: bool = False) -> None:
    samples = read_shards(shards)
    assert [s["__key__"].decode() for s in samples] == [stem for stem, _, _ in mini.val_images]
    for sample, (_, synset, data) in zip(samples, mini.val_images):
        assert sample["jpg"] == data
        assert int(sample["cls"]) == SYNSETS.index(synset)
        if json_field:
            assert json.loads(sample["json"]) == {"synset": synset}


def test_val_with_kaggle_solution_csv(mini: Mini, tmp_path: Path) -> None:
    summary = convert(
        mini,
        tmp_path,
        val_tar=str(mini.val),
        val_labels=str(mini.loc_csv),  # no val_pattern: beside the training shards
        maxcount=10,
        with_json=True,
    )
    assert summary["val"]["samples"] == N_VAL
    assert summary["val"]["shards"] == [str(tmp_path / f"val-{i:06d}.tar") for i in range(3)]
    check_val(mini, summary["val"]["shards"], json_field=True)
    assert ShardIndex.load(summary["val"]["index"]).total == N_VAL


@pytest.mark.parametrize("form", ["synset-lines", "index-lines", "file-label", "file-index"])
def test_val_other_label_forms_and_val_alone(mini: Mini, tmp_path: Path, form: str) -> None:
    lines = []
    for stem, synset, _ in mini.val_images:
        label = synset if "index" not in form else str(SYNSETS.index(synset))
        lines.append(label if form.endswith("lines") else f"{stem}.JPEG {label}")
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(lines) + "\n")
    classes = tmp_path / "classes.json"
    classes.write_text(json.dumps({"classes": SYNSETS}))
    summary = convert_imagenet(
        None,
        val_tar=str(mini.val),
        val_labels=str(labels),
        val_pattern=str(tmp_path / "v" / "val-%06d.tar"),
        classes=str(classes),
        progress=False,
    )
    assert summary["train"] is None and summary["classes"] == len(SYNSETS)
    check_val(mini, summary["val"]["shards"])


def val_error(mini: Mini, tmp_path: Path, text: str, name: str = "labels.txt") -> str:
    labels = tmp_path / name
    labels.write_text(text)
    with pytest.raises(ArgumentError) as info:
        convert_imagenet(
            None,
            val_tar=str(mini.val),
            val_labels=str(labels),
            val_pattern=str(tmp_path / "val-%06d.tar"),
            classes=SYNSETS,
            progress=False,
        )
    return str(info.value)


def test_bad_label_files(mini: Mini, tmp_path: Path) -> None:
    synsets = [synset for _, synset, _ in mini.val_images]
    unknown = "\n".join(synsets[:3] + ["n99999999"] + synsets[4:])
    message = val_error(mini, tmp_path, unknown)
    assert "line 4" in message and "unknown class 'n99999999'" in message
    message = val_error(mini, tmp_path, "\n".join(["5"] * N_VAL))
    assert "out of range 0..4" in message and "1-based" in message
    message = val_error(
        mini, tmp_path, "1\n" * N_VAL, name="ILSVRC2012_validation_ground_truth.txt"
    )
    assert "meta.mat" in message
    message = val_error(mini, tmp_path, "\n".join(synsets[:-1]))
    assert f"has {N_VAL - 1} labels" in message
    csv = mini.loc_csv.read_text().splitlines()
    missing = "\n".join(line for line in csv if "ILSVRC2012_val_00000007" not in line)
    assert "no label for 'ILSVRC2012_val_00000007'" in val_error(mini, tmp_path, missing)
    assert "expected one label" in val_error(mini, tmp_path, "a b c\n")
    assert "expected 'ImageId,PredictionString'" in val_error(
        mini, tmp_path, "ImageId,PredictionString\nILSVRC2012_val_00000001\n"
    )


def test_bad_val_label_file_fails_before_writing_train_shards(mini: Mini, tmp_path: Path) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("n99999999\n" * N_VAL)
    out = tmp_path / "out"
    with pytest.raises(ArgumentError, match="unknown class"):
        convert(
            mini,
            out,
            val_tar=str(mini.val),
            val_labels=str(labels),
            val_pattern=str(out / "val-%06d.tar"),
        )
    assert list(out.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Damaged or unexpected training tars
# ---------------------------------------------------------------------------------------------


def class_tar(c: int) -> bytes:
    return tar_bytes([(f"{SYNSETS[c]}_{i}.JPEG", b"\xff\xd8 jpeg %d" % i) for i in range(3)])


BAD_TRAINS = {
    "corrupt inner tar": (
        [("n01440764.tar", class_tar(0)), ("n01443537.tar", class_tar(1)[:700])],
        ["class tar 'n01443537.tar' is damaged", "n01443537_0.JPEG"],
    ),
    "garbage inner tar": (
        [("n01440764.tar", b"this is not a tar archive" * 40)],
        ["class tar 'n01440764.tar' is damaged", "not a tar archive"],
    ),
    "non-tar member": (
        [("n01440764.tar", class_tar(0)), ("README.txt", b"hello")],
        ["member 'README.txt' of the training tar is not a class tar"],
    ),
    "empty class": (
        [("n01440764.tar", class_tar(0)), ("n01443537.tar", tar_bytes([]))],
        ["class tar 'n01443537.tar' holds no images"],
    ),
    "JPEG-less class": (
        [("n01440764.tar", tar_bytes([("notes.txt", b"x"), ("labels.csv", b"y")]))],
        ["class tar 'n01440764.tar' holds 'notes.txt', which is not a JPEG"],
    ),
    "duplicate class": (
        [("n01440764.tar", class_tar(0)), ("again/n01440764.tar", class_tar(0))],
        ["class 'n01440764' appears twice"],
    ),
    "not a tar at all": ([], ["not a tar archive"]),
}


@pytest.mark.parametrize("case", sorted(BAD_TRAINS))
def test_bad_training_tars_are_named_and_temp_files_removed(tmp_path: Path, case: str) -> None:
    members, expected = BAD_TRAINS[case]
    train = tmp_path / "train.tar"
    if members:
        write_tar(train, members)
    else:
        train.write_bytes(b"\x89PNG not a tar" * 100)
    work = tmp_path / "work"
    with pytest.raises(ShardReadError) as info:
        convert_imagenet(
            str(train), str(tmp_path / "out" / "t-%06d.tar"), tmpdir=str(work), progress=False
        )
    for text in expected:
        assert text in str(info.value)
    assert info.value.url == str(train)
    assert list(work.iterdir()) == []
    assert not list((tmp_path / "out").glob("*.tar"))


def test_hard_linked_class_tar_is_not_dropped(tmp_path: Path) -> None:
    # GNU tar stores a second name of a hard-linked file as a link member, without data.
    folder = tmp_path / "classes"
    folder.mkdir()
    (folder / "n01440764.tar").write_bytes(class_tar(0))
    os.link(folder / "n01440764.tar", folder / "n01443537.tar")
    train = tmp_path / "train.tar"
    gnu_tar(train, folder, ["n01440764.tar", "n01443537.tar"])
    with pytest.raises(ShardReadError, match="'n01443537.tar' of the training tar is a link"):
        convert_imagenet(str(train), str(tmp_path / "t-%06d.tar"), progress=False)


def test_truncated_outer_tar(mini: Mini, tmp_path: Path) -> None:
    data = mini.train.read_bytes()
    train = tmp_path / "train.tar"
    train.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardReadError, match="truncated") as info:
        convert_imagenet(str(train), str(tmp_path / "t-%06d.tar"), progress=False)
    assert info.value.member is not None and info.value.member.endswith(".tar")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".webds")]


def test_bad_arguments() -> None:
    with pytest.raises(ArgumentError, match="output shard pattern"):
        convert_imagenet("train.tar", None)
    with pytest.raises(ArgumentError, match="label file"):
        convert_imagenet("train.tar", "t-%06d.tar", val_tar="val.tar", val_pattern="v-%06d.tar")
    with pytest.raises(ArgumentError, match="classes="):
        convert_imagenet(None, val_tar="v.tar", val_labels="l.txt", val_pattern="v-%06d.tar")
    with pytest.raises(ArgumentError, match="memory"):
        convert_imagenet("train.tar", "t-%06d.tar", memory=0)
    with pytest.raises(ArgumentError, match="pattern for the validation set"):
        convert_imagenet("train.tar", "t-%06d.tar", val_tar="val.tar", val_labels="l.txt")


def test_default_validation_pattern() -> None:
    assert default_val_pattern("out/train-%06d.tar") == "out/val-%06d.tar"
    assert (
        default_val_pattern("s3://b/train/in1k-train-%06d.tar") == "s3://b/train/in1k-val-%06d.tar"
    )
    assert default_val_pattern("shards-%06d.tar") is None


# ---------------------------------------------------------------------------------------------
# The command line, as a real subprocess
# ---------------------------------------------------------------------------------------------


def webds_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("capture_output", True)
    kw.setdefault("timeout", 120)
    return subprocess.run(
        [sys.executable, "-m", "webds.cli", "imagenet", *args], env=cli_env(), text=False, **kw
    )


def test_cli_file_and_stdin_give_the_library_shards(mini: Mini, tmp_path: Path) -> None:
    reference = convert(mini, tmp_path / "lib", maxcount=50, seed=3)
    proc = webds_cli(
        str(mini.train),
        "-o",
        str(tmp_path / "cli" / "train-%06d.tar"),
        "--maxcount",
        "50",
        "--seed",
        "3",
        "--val",
        str(mini.val),
        "--val-labels",
        str(mini.loc_csv),
        "--val-output",
        str(tmp_path / "cli" / "val-%06d.tar"),
    )
    assert proc.returncode == 0, proc.stderr
    stderr = proc.stderr.decode()
    assert "wrote 200 training images of 5 classes into 4 shards" in stderr
    assert "wrote 25 validation images into 1 shards" in stderr
    assert shard_files(tmp_path / "cli") == shard_files(tmp_path / "lib")
    assert reference["train"]["samples"] == N_TRAIN
    check_val(mini, [str(tmp_path / "cli" / "val-000000.tar")])
    # The training tar piped on stdin: size unknown, so other buckets; the same shards.
    with open(mini.train, "rb") as f:
        proc = webds_cli(
            "-", "-o", str(tmp_path / "pipe" / "train-%06d.tar"), "--maxcount", "50",
            "--seed", "3", "-q", stdin=f,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b""
    assert shard_files(tmp_path / "pipe") == shard_files(tmp_path / "lib")


def test_cli_errors_one_line_and_exit_status(mini: Mini, tmp_path: Path) -> None:
    train = write_tar(
        tmp_path / "bad.tar", [("n01440764.tar", class_tar(0)), ("n01443537.tar", b"x" * 600)]
    )
    proc = webds_cli(str(train), "-o", str(tmp_path / "t-%06d.tar"), "-q")
    assert proc.returncode == 1
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("webds imagenet: error: class tar")
    assert "'n01443537.tar'" in lines[0]
    labels = tmp_path / "labels.txt"
    labels.write_text("n99999999\n")
    proc = webds_cli(
        "--classes", str(tmp_path / "none.json"), "--val", str(mini.val), "--val-labels",
        str(labels), "--val-output", str(tmp_path / "v-%06d.tar"),
    )  # fmt: skip
    assert proc.returncode == 1 and "none.json" in proc.stderr.decode()  # a missing file
    (tmp_path / "classes.json").write_text(json.dumps({"classes": SYNSETS}))
    proc = webds_cli(
        "--classes", str(tmp_path / "classes.json"), "--val", str(mini.val), "--val-labels",
        str(labels), "--val-output", str(tmp_path / "v-%06d.tar"),
    )  # fmt: skip
    assert proc.returncode == 2 and "unknown class 'n99999999'" in proc.stderr.decode()
    proc = webds_cli(str(mini.train))
    assert proc.returncode == 2 and b"-o" in proc.stderr
    proc = webds_cli(str(mini.train), "-o", "x-%06d.tar", "--memory", "lots")
    assert proc.returncode == 2 and b"--memory" in proc.stderr


def test_cli_interrupted_removes_temp_files(mini: Mini, tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [sys.executable, "-m", "webds.cli", "imagenet", "-", "-o", str(tmp_path / "t-%06d.tar")]
        + ["--tmpdir", str(work), "-q"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        # A shell starts a background job (`.ci/run &`) with SIGINT ignored, and children keep
        # that: Python then has no Ctrl-C handler. The command's own Ctrl-C is what is tested.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        data = mini.train.read_bytes()
        assert proc.stdin is not None
        proc.stdin.write(data[: len(data) // 2])
        proc.stdin.flush()
        # Wait until pass 1 has started writing buckets, then Ctrl-C it while it waits for input.
        deadline = time.monotonic() + 60
        while not any(p.is_dir() for p in work.glob(".webds-imagenet-*")):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        # Ctrl-C stops the whole pipeline, so the producer's end of stdin closes too: here once
        # the process has exited, or after 10 s (its clean-up may read on to the end of the
        # input). Closed at once, a busy process could meet the end of its input before it
        # handles the signal and report a truncated tar instead (seen once on a loaded CI run).
        said: List[bytes] = []
        assert proc.stderr is not None
        reader = threading.Thread(target=lambda: said.append(proc.stderr.read()), daemon=True)
        reader.start()
        heard = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < heard:
            time.sleep(0.05)
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
        reader.join(timeout=60)
        stderr = b"".join(said)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert b"interrupted" in stderr
    assert list(work.iterdir()) == []
    assert not list(tmp_path.glob("t-*.tar"))


def test_help_documents_the_bounds() -> None:
    proc = webds_cli("--help")
    text = proc.stdout.decode()
    assert proc.returncode == 0
    for needed in ("--memory", "--tmpdir", "uniform random permutation", "temporary", "example:"):
        assert needed in text
    assert os.path.exists(ROOT / "docs" / "convert-imagenet.md")
