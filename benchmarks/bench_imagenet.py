"""Benchmark: ``convert_imagenet`` against plain single-process loops, on a scaled-up mini
ImageNet built in a temporary folder.

The mini ImageNet: ``--classes`` class tars (default 10) of ``--per-class`` JPEGs (default
200), made with Pillow from Fashion-MNIST images (examples/data/fashion-mnist) upscaled to
``--width`` x ``--height`` with a little noise so that the JPEGs are about ImageNet's size
(~110 KB on average), inside one outer tar written by GNU ``tar``. Measured in the same run, each
``--reps`` times (median), all writing shards into the same temporary folder:

- ``convert_imagenet``: the two-pass shuffle (scatter into buckets, gather into shards), with
  ``--memory`` for the buckets (default 64 MB, so that several buckets are used), and with
  2 GB (one bucket);
- ``tarfile + TarWriter``: the plain loop: Python's ``tarfile`` streaming the outer tar and each
  class tar, every image written with ``TarWriter`` to one tar, no shuffle;
- ``read_members + TarWriter``: the same loop with webds's tar reader (each class tar read
  whole into memory).

Also measured once: the peak resident memory of a child process running the conversion with
``--memory`` against a child that only imports webds, to check the documented bound.

Usage: ``python benchmarks/bench_imagenet.py [--reps 3] [--out benchmarks/results/imagenet.json]``.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.data import fashion_images  # noqa: E402
from benchmarks.harness import Variant, machine_info, measure, write_json  # noqa: E402
from webds.convert.imagenet import convert_imagenet  # noqa: E402
from webds.tar.reader import read_members  # noqa: E402
from webds.writer import TarWriter  # noqa: E402


def build(
    folder: Path, classes: int, per_class: int, width: int, height: int, noise: float
) -> Dict:
    """The outer tar ``train.tar`` of class tars; returns its facts."""
    import numpy as np
    from PIL import Image

    pixels = fashion_images()
    rng = np.random.default_rng(0)
    class_dir = folder / "classes"
    class_dir.mkdir()
    names, total, count = [], 0, 0
    for c in range(classes):
        synset = f"n{1440764 + 1000 * c:08d}"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
            for j in range(per_class):
                image = Image.fromarray(pixels[(c * per_class + j) % len(pixels)])
                image = image.resize((width, height), Image.BILINEAR).convert("RGB")
                noise_px = rng.standard_normal((height, width, 3), dtype=np.float32) * noise
                noisy = np.asarray(image, np.float32) + noise_px
                image = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
                jpg = io.BytesIO()
                image.save(jpg, format="JPEG", quality=90)
                data = jpg.getvalue()
                info = tarfile.TarInfo(f"{synset}_{j + 1}.JPEG")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                total += len(data)
                count += 1
        (class_dir / f"{synset}.tar").write_bytes(buf.getvalue())
        names.append(f"{synset}.tar")
    train = folder / "train.tar"
    subprocess.run(["tar", "cf", str(train), "-C", str(class_dir), *names], check=True)
    shutil.rmtree(class_dir)
    return {
        "path": str(train),
        "classes": classes,
        "images": count,
        "image_bytes": total,
        "mean_jpeg_bytes": total / count,
        "tar_bytes": train.stat().st_size,
    }


def run_convert(train: str, out: Path, memory: float) -> int:
    summary = convert_imagenet(
        train, str(out / "train-%06d.tar"), memory=memory, maxcount=1000, progress=False
    )
    return summary["train"]["samples"]


def run_tarfile_loop(train: str, out: Path) -> int:
    n = 0
    with (
        open(train, "rb") as f,
        tarfile.open(fileobj=f, mode="r|") as outer,
        TarWriter(str(out / "plain.tar"), encoder=False) as sink,
    ):
        for c, member in enumerate(outer):
            inner_stream = outer.extractfile(member)
            with tarfile.open(fileobj=inner_stream, mode="r|") as inner:
                for image in inner:
                    data = inner.extractfile(image).read()  # type: ignore[union-attr]
                    key = image.name.rsplit(".", 1)[0]
                    sink.write({"__key__": key, "jpg": data, "cls": str(c).encode()})
                    n += 1
    return n


def run_read_members_loop(train: str, out: Path) -> int:
    n = 0
    with open(train, "rb") as f, TarWriter(str(out / "plain.tar"), encoder=False) as sink:
        for c, (class_name, class_tar, _) in enumerate(read_members(f, train)):
            for name, data, _ in read_members(io.BytesIO(class_tar), class_name):
                sink.write({"__key__": name.rsplit(".", 1)[0], "jpg": data, "cls": b"%d" % c})
                n += 1
    return n


def timed(fn: Callable[[Path], int], folder: Path) -> Variant:
    """``fn(out)`` on a fresh, empty ``folder/out`` each time (made and cleared untimed)."""
    out = folder / "out"

    def fresh() -> None:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()

    return Variant(lambda: fn(out), before_each=fresh, close=lambda: shutil.rmtree(out, True))


# VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across exec, so a child would report
# the parent's size at fork time.
_CHILD = """
import re, sys
sys.path.insert(0, {root!r})
from webds.convert.imagenet import convert_imagenet
if {convert!r}:
    convert_imagenet({train!r}, {out!r}, memory={memory!r}, maxcount=1000, progress=False)
with open("/proc/self/status") as f:
    print(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1))
"""


def peak_rss(train: str, out: Path, memory: float, convert: bool) -> int:
    """Peak resident memory (bytes) of a child that converts (or only imports)."""
    code = _CHILD.format(
        root=str(ROOT), train=train, out=str(out / "train-%06d.tar"), memory=memory, convert=convert
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    shutil.rmtree(out, ignore_errors=True)
    return int(proc.stdout.split()[-1]) * 1024


def main(argv: List[str] | None = None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--per-class", type=int, default=200)
    ap.add_argument("--width", type=int, default=500)
    ap.add_argument("--height", type=int, default=375)
    ap.add_argument("--noise", type=float, default=32.0, help="pixel noise (JPEG size)")
    ap.add_argument("--memory", type=float, default=64e6, help="convert_imagenet's memory")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per measurement (median)")
    ap.add_argument("--tmpdir", default=None, help="where to build and write (default $TMPDIR)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "imagenet.json"))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="webds-bench-imagenet-", dir=args.tmpdir) as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        data = build(folder, args.classes, args.per_class, args.width, args.height, args.noise)
        build_s = time.perf_counter() - t0
        train = data.pop("path")
        # The warm-up run fills the page cache and does the imports.
        runs = measure(
            {
                f"convert_imagenet {args.memory / 1e6:g} MB": timed(
                    lambda out: run_convert(train, out, args.memory), folder
                ),
                "convert_imagenet 2 GB": timed(lambda out: run_convert(train, out, 2e9), folder),
                "tarfile + TarWriter": timed(lambda out: run_tarfile_loop(train, out), folder),
                "read_members + TarWriter": timed(
                    lambda out: run_read_members_loop(train, out), folder
                ),
            },
            args.reps,
            workload="imagenet",
        )
        rss_import = peak_rss(train, folder / "rss-import", args.memory, convert=False)
        rss_convert = peak_rss(train, folder / "rss-convert", args.memory, convert=True)

    base = runs["tarfile + TarWriter"].median
    results: Dict[str, object] = {
        **machine_info(),
        "reps": args.reps,
        "dataset": data,
        "build_s": build_s,
        "memory": args.memory,
        "runs": {
            name: {
                **r.to_json(),
                "mb_per_s": r.median * data["image_bytes"] / r.count / 1e6,
                "ratio_vs_tarfile_loop": r.median / base,
            }
            for name, r in runs.items()
        },
        "peak_rss_bytes": {"import_only": rss_import, "convert": rss_convert},
    }
    print(
        f"mini ImageNet: {data['classes']} classes x {args.per_class} JPEGs, "
        f"{data['image_bytes'] / 1e6:.0f} MB of images (mean {data['mean_jpeg_bytes'] / 1e3:.0f}"
        f" kB); built in {build_s:.1f} s"
    )
    print(f"{'loop':<26} {'samples/s':>10} {'MB/s':>8} {'vs tarfile loop':>16}")
    for name, r in results["runs"].items():  # type: ignore[union-attr]
        print(
            f"{name:<26} {r['median_per_s']:>10,.0f} {r['mb_per_s']:>8.0f} "
            f"{r['ratio_vs_tarfile_loop']:>15.2f}x"
        )
    print(
        f"peak RSS with memory={args.memory:.3g}: {rss_convert / 1e6:.0f} MB "
        f"(a child that only imports webds: {rss_import / 1e6:.0f} MB)"
    )
    out = write_json(args.out, results)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
