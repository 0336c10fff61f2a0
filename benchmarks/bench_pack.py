"""Benchmark: ``webds.pack`` on the Fashion-MNIST test images against a plain single-process
loop writing the same shards with ``TarWriter``, measured in the same run.

The dataset is map-style and returns ``(PIL image, label)`` as torchvision's FashionMNIST does
(built from the committed idx files, so torchvision is not needed). Both sides encode every
image as JPEG at the same quality (or PNG with ``--format png``) and write shards of
``--maxcount`` samples; ``pack`` also plans the shards (a pilot of 128 samples for maxsize),
hashes them and writes the shard index. The variants take turns, ``--reps`` rounds; the median
and the best time of each are reported (the best is the steadier on a machine shared with other
work).

Usage: ``python benchmarks/bench_pack.py [--reps 3] [--format jpg] [--size 28]
[--out results/pack.json]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import fashion_images, fashion_labels  # noqa: E402
from benchmarks.harness import Variant, machine_info, measure, write_json  # noqa: E402
from webds.convert.packing import pack  # noqa: E402
from webds.stages.encode import imageencoder  # noqa: E402
from webds.writer import TarWriter  # noqa: E402


class FashionMNIST:
    """``dataset[i] == (PIL image, label)``, like torchvision's; ``size`` > 28 upscales the
    images (bicubic), for encoding work closer to photos."""

    def __init__(self, size: int = 28) -> None:
        self.images = fashion_images()
        self.labels = fashion_labels()
        self.size = size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Tuple[Any, int]:
        from PIL import Image

        image = Image.fromarray(self.images[i], mode="L")
        if self.size != 28:
            image = image.resize((self.size, self.size), Image.BICUBIC)
        return image, int(self.labels[i])


def plain_loop(dataset: FashionMNIST, out: Path, maxcount: int, fmt: str) -> None:
    """The baseline: one process, dataset order, TarWriter per shard."""
    pil_format, options = ("JPEG", {"quality": 95}) if fmt == "jpg" else ("PNG", {})
    n = len(dataset)
    for shard, start in enumerate(range(0, n, maxcount)):
        with TarWriter(str(out / f"plain-{shard:06d}.tar")) as sink:
            for i in range(start, min(n, start + maxcount)):
                image, label = dataset[i]
                data = imageencoder(image, pil_format, **options)
                sink.write({"__key__": f"{i:08d}", fmt: data, "cls": label})


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--maxcount", type=int, default=1000)
    ap.add_argument("--format", choices=["jpg", "png"], default="jpg")
    ap.add_argument("--size", type=int, default=28, help="image side in pixels (28: as stored)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pack.json"))
    args = ap.parse_args(argv)

    dataset = FashionMNIST(args.size)
    n = len(dataset)
    cpus = os.cpu_count() or 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-pack-"))

    def clean() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def counted(fn: Callable[[], Any]) -> Callable[[], int]:
        def run() -> int:
            fn()
            return n

        return run

    variants: Dict[str, Any] = {
        "plain TarWriter loop": counted(
            lambda: plain_loop(dataset, tmp, args.maxcount, args.format)
        ),
    }
    for workers in sorted({0, 1, cpus}):
        variants[f"pack workers={workers}"] = counted(
            lambda w=workers: pack(
                dataset,
                str(tmp / "fm-%06d.tar"),
                maxcount=args.maxcount,
                workers=w,
                image_format=args.format,
                progress=False,
            )
        )
    results: Dict[str, Any] = {
        "benchmark": "pack",
        "samples": n,
        "maxcount": args.maxcount,
        "format": args.format,
        "size": args.size,
        "reps": args.reps,
        **machine_info(),
        "variants": {},
    }
    try:
        # Round robin (harness.measure), so that load from other processes falls on every
        # variant alike; no warm-up run, as before.
        runs = measure(
            {k: Variant(v, before_each=clean) for k, v in variants.items()},
            args.reps,
            workload="pack",
            warmup=False,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, m in runs.items():
        results["variants"][name] = {
            "seconds": [round(t, 4) for t in m.times_s],
            "median_s": round(statistics.median(m.times_s), 4),
            "samples_per_s": round(m.median, 1),
            "best_samples_per_s": round(m.high, 1),
        }
    plain = results["variants"]["plain TarWriter loop"]
    what = f"{n} {args.size}x{args.size} {args.format} images"
    print(f"Fashion-MNIST t10k: {what}, shards of {args.maxcount}, {cpus} CPUs")
    for name, row in results["variants"].items():
        row["ratio_vs_plain"] = round(row["samples_per_s"] / plain["samples_per_s"], 2)
        row["best_ratio_vs_plain"] = round(
            row["best_samples_per_s"] / plain["best_samples_per_s"], 2
        )
        print(
            f"  {name:22s} median {row['samples_per_s']:7.0f}/s x{row['ratio_vs_plain']:.2f}"
            f"   best {row['best_samples_per_s']:7.0f}/s x{row['best_ratio_vs_plain']:.2f}"
        )
    out = write_json(args.out, results)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
