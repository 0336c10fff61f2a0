"""The demo (examples/demo.py) and the Fashion-MNIST data it ships with."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "demo.py"


def load_demo():
    spec = importlib.util.spec_from_file_location("webds_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_data_is_the_fashion_mnist_test_set():
    demo = load_demo()
    images, labels = demo.read_idx(demo.IMAGES), demo.read_idx(demo.LABELS)
    assert images.shape == (10000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10000,)
    # The test split has exactly 1000 images of each of the 10 classes.
    assert np.bincount(labels, minlength=10).tolist() == [1000] * 10


def test_read_idx_rejects_a_truncated_file(tmp_path):
    import gzip

    demo = load_demo()
    with gzip.open(demo.LABELS, "rb") as f:
        data = f.read()
    bad = tmp_path / "cut.gz"
    bad.write_bytes(gzip.compress(data[:-1]))
    with pytest.raises(ValueError, match="header"):
        demo.read_idx(bad)


def test_augment_flips_and_shifts_within_the_frame():
    import torch

    demo = load_demo()
    image = np.zeros((28, 28), dtype=np.float32)
    image[10:18, 3:9] = 1.0  # an off-centre block, so flips and shifts change the picture
    torch.manual_seed(0)
    outputs = [demo.augment(image) for _ in range(50)]
    background = (0.0 - demo.MEAN) / demo.STD
    for x in outputs:
        assert x.shape == (1, 28, 28) and x.dtype == torch.float32
        # A shift of at most 2 pixels keeps the whole 8x6 block inside the frame.
        assert int((x > background + 1e-3).sum()) == 48
    distinct = {tuple(x.flatten().tolist()) for x in outputs}
    assert len(distinct) > 5


@pytest.mark.slow
def test_demo_trains_on_streamed_shards(tmp_path):
    out = tmp_path / "shards"
    # The checkout's webds, whether or not it is installed in this interpreter.
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--limit", "2000", "--workers", "2", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"^accuracy: (\d+\.\d)%", proc.stdout, re.MULTILINE)
    assert match, proc.stdout
    # Images and labels that stayed together through writing, shuffling and batching train a
    # network well above the 10% of chance; a mix-up between them would not.
    assert float(match.group(1)) > 30.0, proc.stdout

    train = sorted(out.glob("train-*.tar"))
    test = sorted(out.glob("test-*.tar"))
    assert len(train) >= 2 and len(test) >= 2  # at least one shard per worker
    # Read the shards back with Python's tarfile, independently of webds.
    names = []
    for shard in train + test:
        with tarfile.open(shard) as tar:
            names += tar.getnames()
    keys = sorted({name.split(".", 1)[0] for name in names})
    assert keys == [f"{i:06d}" for i in range(2000)]
    assert sorted(names) == sorted([f"{k}.png" for k in keys] + [f"{k}.cls" for k in keys])
    with tarfile.open(train[0]) as tar:
        first = tar.getnames()[0].split(".", 1)[0]
        assert tar.extractfile(f"{first}.png").read(8) == b"\x89PNG\r\n\x1a\n"
        label = int(tar.extractfile(f"{first}.cls").read())
    demo = load_demo()
    assert label == int(demo.read_idx(demo.LABELS)[int(first)])


@pytest.mark.slow
def test_demo_trains_with_threads_in_one_process(tmp_path, capsys):
    # --threads: the decode and augment stages in 2 threads of the training process.
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--limit", "2000", "--workers", "0", "--threads", "2"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"^accuracy: (\d+\.\d)%", proc.stdout, re.MULTILINE)
    assert match and float(match.group(1)) > 30.0, proc.stdout
    # A bad --threads is refused by the demo's argument parser, as the run above used it (in
    # this process: the usual exit status 2 of argparse, without starting Python again).
    with pytest.raises(SystemExit) as bad:
        load_demo().main(["--threads", "-1"])
    assert bad.value.code == 2 and "--threads at least 0" in capsys.readouterr().err
