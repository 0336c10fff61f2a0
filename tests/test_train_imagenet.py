"""examples/train_imagenet.py on a miniature ImageNet: one epoch, mid-epoch resume, torchrun DDP.

The data is built here as ImageNet is downloaded: a tar of 5 class tars of 40 JPEGs each and a
validation tar of 25 JPEGs with a LOC_val_solution.csv (32x32 images made from the committed
Fashion-MNIST images), converted to shards (shuffled, with shard indexes and classes.json) by
webds.convert_imagenet, the function behind `webds imagenet`.
The example runs in real subprocesses (and under real torchrun, gloo on the CPU) through
tests/run_example.py, which makes this machine's CPU-only torchvision importable. The
uninterrupted run is a new interpreter; the resume runs and torchrun's launcher are processes
forked by tests/rank_forker.py from one that has imported torch, torchvision and webds once
(each new interpreter spent some 5 s of CPU on those imports); torchrun's ranks are its own new
interpreters. Every run is one torch thread (OMP_NUM_THREADS=1, as torchrun sets for its ranks):
beside the DataLoader worker on 2 cores, two threads spun on each other's cores (ResNet-18's
epoch took 3 s of CPU with one, 20 s with two, on this 2-core machine under load).
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from rank_forker import Forker

import webds

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_imagenet.py"
RUNNER = ROOT / "tests" / "run_example.py"
FASHION = ROOT / "examples" / "data" / "fashion-mnist"
CLASSES, PER_CLASS, VAL_PER_CLASS = 5, 40, 5
BATCH = 16
BATCHES = math.ceil(CLASSES * PER_CLASS / BATCH)  # 13: the last one holds 8
COMMON = [
    "--image-size", "32", "--batch-size", str(BATCH), "--workers", "1",
    "--epochs", "1", "--lr", "0.01", "--print-freq", "5",
]  # fmt: skip
# The uninterrupted run trains a torchvision ResNet-18; the resume and torchrun runs check which
# samples each step and rank read, which no model changes: they train the example's small CNN
# (--arch tiny, with BatchNorm too), a tenth of ResNet-18's CPU time per batch.
RESNET, TINY = ["--arch", "resnet18"], ["--arch", "tiny"]

pytestmark = pytest.mark.slow


def read_idx(path: Path) -> np.ndarray:
    data = gzip.decompress(path.read_bytes())
    ndim = data[3]
    shape = tuple(int(d) for d in np.frombuffer(data[4 : 4 + 4 * ndim], dtype=">u4"))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def jpeg(pixels: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).resize((32, 32)).convert("RGB").save(out, "JPEG", quality=90)
    return out.getvalue()


def tar_bytes(members: list) -> bytes:
    """An uncompressed tar of (name, bytes) members, written with Python's tarfile."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory, forker) -> Path:
    """A miniature ImageNet as it is downloaded (a tar of class tars, a flat validation tar and
    Kaggle's LOC_val_solution.csv), converted with `webds imagenet`'s function into
    root/train/train-00000{0..3}.tar (+ train.index.json, classes.json) and root/val/...
    (``forker``: started first, it makes its imports meanwhile)."""
    root = tmp_path_factory.mktemp("mini-imagenet")
    images = read_idx(FASHION / "t10k-images-idx3-ubyte.gz")
    labels = read_idx(FASHION / "t10k-labels-idx1-ubyte.gz")
    synsets = [f"n0{1000000 + 4321 * c:07d}" for c in range(CLASSES)]
    class_tars, val_members, solution = [], [], ["ImageId,PredictionString"]
    for c, synset in enumerate(synsets):
        where = np.flatnonzero(labels == c)
        train = [(f"{synset}_{i}.JPEG", jpeg(images[i])) for i in where[:PER_CLASS]]
        class_tars.append((f"{synset}.tar", tar_bytes(train)))
        for i in where[PER_CLASS : PER_CLASS + VAL_PER_CLASS]:
            image_id = f"ILSVRC2012_val_{i:08d}"
            val_members.append((f"{image_id}.JPEG", jpeg(images[i])))
            solution.append(f"{image_id},{synset} 1 1 31 31")
    raw = root / "raw"
    raw.mkdir()
    (raw / "train.tar").write_bytes(tar_bytes(class_tars))
    (raw / "val.tar").write_bytes(tar_bytes(sorted(val_members)))
    (raw / "LOC_val_solution.csv").write_text("\n".join(solution) + "\n")
    summary = webds.convert_imagenet(
        str(raw / "train.tar"),
        str(root / "train" / "train-%06d.tar"),
        val_tar=str(raw / "val.tar"),
        val_labels=str(raw / "LOC_val_solution.csv"),
        val_pattern=str(root / "val" / "val-%06d.tar"),
        maxcount=60,
        progress=False,
    )
    assert summary["train"]["samples"] == CLASSES * PER_CLASS
    assert (root / "train" / "train.index.json").is_file()
    assert json.loads((root / "train" / "classes.json").read_text())["classes"] == synsets
    assert json.loads((root / "val" / "val.index.json").read_text())["samples"] == 25
    return root


def example_env() -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WDS_SEED")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    """One process (rank_forker.py) that imports torch, torchvision (run_example's way), torch's
    launcher and webds while the data is made, then forks each resume run and torchrun's
    launcher: each is a process of its own, without the imports' 5 s of CPU. Yields (it, a
    folder for the runs' output)."""
    forker = Forker(
        example_env(),
        ["run_example", "torchvision_cpu:import_torchvision", "torch.distributed.run"],
        cwd=ROOT,
    )
    forker.start()
    yield forker, tmp_path_factory.mktemp("runs")
    forker.close()


def run_example(args: list, forker=None, torchrun: bool = False) -> subprocess.CompletedProcess:
    """The example with ``args``: in a new interpreter (``forker`` None), or forked by
    ``forker`` (the fixture's) with its imports made (under torchrun: its launcher forked, the
    ranks new interpreters started by it)."""
    argv = [str(EXAMPLE), *map(str, args)]
    if forker is None:
        proc = subprocess.run(
            [sys.executable, str(RUNNER), *argv],
            env=example_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    else:
        forker, folder = forker
        job = "run_example"
        if torchrun:
            job = "torch.distributed.run"
            argv = ["--standalone", "--nproc_per_node", "2", str(RUNNER), *argv]
        run = len(list(folder.glob("*.out")))
        out, err = folder / f"run{run}.out", folder / f"run{run}.err"
        status = forker.run(job, [argv], [str(out)], timeout=300, errs=[str(err)])
        if status is None:
            pytest.fail(f"the example hung\n{out.read_text()}\n{err.read_text()[-12000:]}")
        proc = subprocess.CompletedProcess(argv, status[0], out.read_text(), err.read_text())
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-12000:]}"
    return proc


def data_args(root: Path) -> list:
    # A brace pattern (its index, train.index.json, is found beside it) and a validation index.
    return [
        "--train",
        root / "train" / "train-{000000..000003}.tar",
        "--val",
        root / "val" / "val.index.json",
    ]


def steps(log: dict) -> list:
    return [(s["epoch"], s["batch"], s["step"], s["keys"]) for s in log["steps"]]


@pytest.fixture(scope="module")
def full_run(imagenet, tmp_path_factory):
    """One uninterrupted epoch: (the process, its --log-json, its checkpoint path)."""
    out = tmp_path_factory.mktemp("full")
    proc = run_example(
        [
            *COMMON,
            *RESNET,
            *data_args(imagenet),
            "--log-json",
            out / "log.json",
            "--checkpoint",
            out / "ckpt.pt",
        ]
    )
    return proc, json.loads((out / "log.json").read_text()), out / "ckpt.pt"


def test_one_epoch_on_cpu_prints_train_loss_and_val_accuracy(full_run):
    import torch

    proc, log, checkpoint = full_run
    assert "classes: 5 (from " in proc.stdout  # counted from classes.json
    train = re.search(r"Epoch \[0\] train loss (\S+)\s+acc@1 (\S+)\s+\(200 samples", proc.stdout)
    assert train and math.isfinite(float(train.group(1))), proc.stdout
    val = re.search(r"\* Epoch \[0\] val acc@1 (\S+)\s+acc@5 (\S+).*\(25 samples", proc.stdout)
    assert val and 0 <= float(val.group(1)) <= float(val.group(2)) <= 100, proc.stdout
    (epoch,) = log["epochs"]
    assert epoch["batches"] == BATCHES and epoch["samples"] == 200
    assert epoch["val"]["samples"] == epoch["val"]["read"] == 25
    assert [s["batch"] for s in log["steps"]] == list(range(BATCHES))
    keys = [k for s in log["steps"] for k in s["keys"]]
    assert len(keys) == len(set(keys)) == 200  # every sample once
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert (state["epoch"], state["step"]) == (1, BATCHES)
    (loader,) = state["loader"]  # every rank's loader state: one rank here
    assert (loader["epoch"], loader["items"]) == (1, 0)  # next: epoch 1
    assert state["arch"] == "resnet18" and state["classes"] == 5
    assert state["model"]["fc.weight"].shape == (5, 512)


def test_resume_mid_epoch_runs_exactly_the_remaining_batches(imagenet, full_run, forker, tmp_path):
    import torch

    _, full, _ = full_run
    k = 5
    checkpoint = tmp_path / "ckpt.pt"
    run_example(
        [
            *COMMON,
            *TINY,
            *data_args(imagenet),
            "--max-steps",
            k,
            "--checkpoint",
            checkpoint,
            "--log-json",
            tmp_path / "head.json",
        ],
        forker,
    )
    head = json.loads((tmp_path / "head.json").read_text())
    assert head["stopped"] == {"epoch": 0, "step": k}
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert (state["loader"][0]["epoch"], state["loader"][0]["items"], state["step"]) == (0, k, k)

    proc = run_example(
        [
            *COMMON,
            *TINY,
            *data_args(imagenet),
            "--resume",
            checkpoint,
            "--log-json",
            tmp_path / "rest.json",
        ],
        forker,
    )
    assert f"resumed from {checkpoint}: epoch 0, batch {k}, step {k}" in proc.stdout
    rest = json.loads((tmp_path / "rest.json").read_text())
    # The rest of the epoch: every sample once, none twice or missed, in as many batches; the
    # first k batches were the same as the uninterrupted run's (same seed).
    assert steps(head) == steps(full)[:k]
    got = sorted(key for s in head["steps"] + rest["steps"] for key in s["keys"])
    assert got == sorted(key for s in full["steps"] for key in s["keys"])
    assert [s["step"] for s in rest["steps"]] == list(range(k + 1, BATCHES + 1))
    assert rest["epochs"][0]["first_batch"] == k and rest["epochs"][0]["batches"] == BATCHES - k
    assert all(math.isfinite(s["loss"]) for s in rest["steps"])
    assert rest["epochs"][0]["val"]["samples"] == 25


def test_torchrun_two_ranks_read_equal_batches_and_count_val_once(imagenet, forker, tmp_path):
    # Folders: each index is found in them (the only *.index.json); classes.json beside.
    proc = run_example(
        [
            *COMMON,
            *TINY,
            "--train",
            f"{imagenet / 'train'}/",
            "--val",
            f"{imagenet / 'val'}/",
            "--log-json",
            tmp_path / "rank{rank}.json",
        ],
        forker,
        torchrun=True,
    )
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [log["rank"] for log in logs] == [0, 1]
    assert all(log["world_size"] == 2 for log in logs)
    per_rank = math.ceil(CLASSES * PER_CLASS / 2 / BATCH)  # 100 samples each: 7 batches
    assert [len(log["steps"]) for log in logs] == [per_rank, per_rank]
    assert [log["epochs"][0]["batches"] for log in logs] == [per_rank, per_rank]
    assert all(log["epochs"][0]["samples"] == 200 for log in logs)  # summed over the ranks
    # 25 validation samples over 2 ranks: 13 each (one read twice), counted once.
    vals = [log["epochs"][0]["val"] for log in logs]
    assert [v["read"] for v in vals] == [13, 13]
    assert [v["samples"] for v in vals] == [25, 25] and vals[0] == {**vals[1], "read": 13}
    assert "(25 samples" in proc.stdout and "2 process(es)" in proc.stdout
