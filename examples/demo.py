"""Train a small CNN on Fashion-MNIST streamed from tar shards with webds, on CPU, offline.

The demo reads the Fashion-MNIST test set committed in ``examples/data/fashion-mnist``, splits it
into 8,000 training and 2,000 test images, writes both splits as PNG-encoded WebDataset shards
with ``webds.ShardWriter``, streams the training shards through a shuffling, decoding and
augmenting ``webds.WebDataset`` pipeline into a ``webds.WebLoader`` with worker processes,
trains for one epoch and reports throughput and test accuracy::

    python examples/demo.py                      # the full run (make demo)
    python examples/demo.py --limit 1000 --out /tmp/shards --workers 4

Only webds, torch, numpy and tqdm are used: the augmentation is written with torch ops, so
torchvision is not needed.
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import webds

DATA_DIR = Path(__file__).resolve().parent / "data" / "fashion-mnist"
IMAGES = DATA_DIR / "t10k-images-idx3-ubyte.gz"
LABELS = DATA_DIR / "t10k-labels-idx1-ubyte.gz"
CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
TRAIN_FRACTION = 0.8
MAX_SHARD_SAMPLES = 1000
# Pixel statistics of Fashion-MNIST, so the network sees roughly zero-mean, unit-variance input.
MEAN, STD = 0.2860, 0.3530
MAX_SHIFT = 2


def read_idx(path: Path) -> np.ndarray:
    """Read a gzip-compressed IDX file (the MNIST format) of unsigned bytes into an array.

    The header is two zero bytes, a type code (0x08 = uint8), the number of dimensions, then one
    big-endian uint32 per dimension.
    """
    with gzip.open(path, "rb") as stream:
        data = stream.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (header {data[:4].hex()})")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(data[4:header], dtype=">u4"))
    expected = header + math.prod(shape)
    if len(data) != expected:
        raise ValueError(f"{path}: {len(data)} bytes, but the header {shape} says {expected}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def shard_size(nsamples: int, workers: int) -> int:
    """Samples per shard: at most 1000, and small enough that every worker gets a shard."""
    return max(1, min(MAX_SHARD_SAMPLES, math.ceil(nsamples / max(1, workers))))


def write_shards(
    out: Path, prefix: str, images: np.ndarray, labels: np.ndarray, first_key: int, maxcount: int
) -> List[str]:
    """Write images (as PNG) and labels to ``out/{prefix}-000000.tar``, ...; return the paths."""
    for stale in out.glob(f"{prefix}-*.tar"):
        stale.unlink()  # shards of an earlier run with --out would otherwise be read as well
    pattern = str(out / f"{prefix}-%06d.tar")
    with webds.ShardWriter(pattern, maxcount=maxcount, verbose=0) as sink:
        for i, (image, label) in enumerate(zip(images, labels)):
            sink.write({"__key__": f"{first_key + i:06d}", "png": image, "cls": int(label)})
    return sorted(str(p) for p in out.glob(f"{prefix}-*.tar"))


def to_tensor(image: np.ndarray) -> torch.Tensor:
    """A decoded HxW float image in [0, 1] as a normalised 1xHxW tensor."""
    return (torch.tensor(image, dtype=torch.float32).unsqueeze(0) - MEAN) / STD


def augment(image: np.ndarray) -> torch.Tensor:
    """Random horizontal flip and a shift of up to two pixels, filled with background (black)."""
    x = torch.tensor(image, dtype=torch.float32).unsqueeze(0)
    if torch.rand(()) < 0.5:
        x = x.flip(-1)
    dy, dx = (int(v) for v in torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (2,)))
    height, width = x.shape[-2:]
    x = F.pad(x, (MAX_SHIFT, MAX_SHIFT, MAX_SHIFT, MAX_SHIFT))
    x = x[:, MAX_SHIFT + dy : MAX_SHIFT + dy + height, MAX_SHIFT + dx : MAX_SHIFT + dx + width]
    return (x - MEAN) / STD


def identity(x: Any) -> Any:
    """Leave a field unchanged (the label)."""
    return x


def make_model() -> nn.Module:
    """A small CNN: two conv blocks and a two-layer classifier (about 106k parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, len(CLASSES)),
    )


def as_batch(images: Any, labels: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """The collated (images, labels) of a batch as tensors."""
    return torch.as_tensor(images), torch.as_tensor(np.asarray(labels), dtype=torch.long)


def train_epoch(
    model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, total: int, desc: str
) -> Tuple[int, float]:
    """One pass over ``loader``; returns (samples seen, mean loss)."""
    model.train()
    seen, loss_sum = 0, 0.0
    # disable=None: a live bar on a terminal, no bar in logs and test captures.
    with tqdm(total=total, desc=desc, unit="img", disable=None, file=sys.stderr) as bar:
        for images, labels in loader:
            x, y = as_batch(images, labels)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(y)
            loss_sum += loss.item() * len(y)
            bar.update(len(y))
            bar.set_postfix(loss=f"{loss.item():.3f}")
    return seen, loss_sum / max(1, seen)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any) -> Tuple[int, int]:
    """Returns (samples seen, correct predictions)."""
    model.eval()
    seen = correct = 0
    for images, labels in loader:
        x, y = as_batch(images, labels)
        correct += int((model(x).argmax(1) == y).sum())
        seen += len(y)
    return seen, correct


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=1, help="training epochs (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument(
        "--threads", type=int, default=0,
        help="threads for the decode and augment stages in each worker, or in this process "
        "with --workers 0 (default 0)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    parser.add_argument(
        "--out", type=Path, default=None,
        help="write the shards into this directory and keep them (default: a temporary directory)",
    )  # fmt: skip
    parser.add_argument(
        "--limit", type=int, default=None,
        help="use only the first N of the 10,000 images (for quick runs; at least 10)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed for shuffles and weights")
    parser.add_argument(
        "--stats", action="store_true",
        help="measure where the training loader's time goes and print it after training",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.workers < 0 or args.threads < 0:
        parser.error(
            "--epochs and --batch-size must be at least 1, --workers and --threads at least 0"
        )
    if args.limit is not None and args.limit < 10:
        parser.error("--limit must be at least 10, so both splits have samples")
    return args


def run(args: argparse.Namespace, out: Path) -> float:
    """Write the shards into ``out``, train, evaluate; returns the test accuracy."""
    torch.manual_seed(args.seed)  # also seeds the DataLoader workers' torch RNGs (augmentation)
    # The workers decode PNGs on their own cores; a training loop that also used every core
    # would fight them for the CPU (on 2 cores with 2 workers that halves the throughput).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - args.workers))
    images, labels = read_idx(IMAGES), read_idx(LABELS)
    if args.limit is not None:
        images, labels = images[: args.limit], labels[: args.limit]
    ntrain = int(len(images) * TRAIN_FRACTION)
    ntest = len(images) - ntrain

    start = time.perf_counter()
    train_urls = write_shards(
        out, "train", images[:ntrain], labels[:ntrain], 0, shard_size(ntrain, args.workers)
    )
    test_urls = write_shards(
        out, "test", images[ntrain:], labels[ntrain:], ntrain, shard_size(ntest, args.workers)
    )
    print(
        f"wrote {ntrain} training samples in {len(train_urls)} shards and {ntest} test samples"
        f" in {len(test_urls)} shards to {out} ({time.perf_counter() - start:.1f} s)"
    )

    train_set = (
        webds.WebDataset(train_urls, shardshuffle=True, seed=args.seed)
        .shuffle(1000)
        .decode("l")
        .to_tuple("png", "cls")
        .map_tuple(augment, identity)
        .batched(args.batch_size)
    )
    # Each iter() of the loader starts the next epoch (it calls train_set.set_epoch), so the
    # shard order and the sample shuffle change from epoch to epoch.
    train_loader = webds.WebLoader(
        train_set,
        batch_size=None,
        num_workers=args.workers,
        threads=args.threads,
        stats=args.stats,
    )
    test_set = (
        webds.WebDataset(test_urls, shardshuffle=False)
        .decode("l")
        .to_tuple("png", "cls")
        .map_tuple(to_tensor, identity)
        .batched(256)
    )
    test_loader = webds.WebLoader(test_set, batch_size=None, num_workers=args.workers)

    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        desc = f"epoch {epoch + 1}/{args.epochs}"
        seen, loss = train_epoch(model, optimizer, train_loader, ntrain, desc)
        elapsed = time.perf_counter() - start
        if seen != ntrain:
            raise SystemExit(f"error: epoch {epoch + 1} streamed {seen} samples, expected {ntrain}")
        print(f"{desc}: {seen} samples, {seen / elapsed:.0f} samples/s, mean loss {loss:.3f}")
    if args.stats:
        print(train_loader.stats())  # where the training loader's time went (every epoch)

    start = time.perf_counter()
    seen, correct = evaluate(model, test_loader)
    elapsed = time.perf_counter() - start
    if seen != ntest:
        raise SystemExit(f"error: the test pass streamed {seen} samples, expected {ntest}")
    accuracy = correct / seen
    print(f"test: {seen} samples, {seen / elapsed:.0f} samples/s")
    print(f"accuracy: {100 * accuracy:.1f}% ({correct}/{seen}; chance is 10%)")
    return accuracy


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        run(args, args.out)
    else:
        with tempfile.TemporaryDirectory(prefix="webds-demo-") as tmp:
            run(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
