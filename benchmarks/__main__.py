"""Run the webds benchmark suite: ``python -m benchmarks [--quick] [--reps N] [--out DIR]
[--only NAMES] [--data DIR]``.

Builds the data once (about 100 KB JPEGs made from real photos, stored as files, a zip and
shards, plus a set of small 1-2 KB records as shards), measures every workload with every
loader in the same run (median of ``--reps`` repetitions, min..max), prints one table per
workload and the targets with PASS / MISS, and writes ``DIR/results.json`` and
``DIR/loaders.png``. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # python benchmarks/__main__.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

from .harness import (  # noqa: E402
    ROOT,
    format_table,
    format_targets,
    machine_info,
    plot,
    write_json,
)
from .workloads import WORKLOADS, Config, Suite, quiet_warnings  # noqa: E402

#: The ratio columns of each workload's table.
BASELINES = {
    "read-small": ["webdataset WebDataset", "bare reader loop"],
    "read-small-wds": ["webdataset WebDataset", "webds WebDataset, webds-written shards"],
    "read-images": ["files Dataset", "webdataset WebDataset"],
    "read-images-cold": ["files Dataset", "webdataset WebDataset"],
    "pipeline": ["decode+augment alone", "webdataset WebDataset"],
    "crop": ["webdataset WebDataset", "webds WebDataset"],
    "loader-0": ["webdataset WebLoader", "files DataLoader"],
    "loader-1": ["webdataset WebLoader", "files DataLoader"],
    "loader-2": ["webdataset WebLoader", "files DataLoader"],
    "write-small": ["webdataset TarWriter", "bare header writer"],
    "write-images": ["webdataset TarWriter", "bare header writer"],
    "s3": ["boto3 get_object + bare reader", "webdataset pipe:curl presigned"],
    "video": ["whole decode + slice", "Energon AVDecoder"],
    "audio-flac": ["full decode + slice"],
    "audio-mp3": ["full decode + slice"],
}

PACKAGES = [
    "torch",
    "numpy",
    "pillow",
    "webdataset",
    "scikit-image",
    "matplotlib",
    "fsspec",
    "s3fs",
    "moto",
    "boto3",
    "psutil",
    "av",
    "megatron-energon",
    "decord",
    "torchcodec",
]


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark webds against webdataset, files and a zip, in one run.",
        epilog="workloads: " + ", ".join(WORKLOADS),
    )
    ap.add_argument("--quick", action="store_true", help="small data, 3 reps (under ~2 min)")
    # The test suite's: tiny data (Config.smoke), to check that everything runs, not to measure.
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results"), help="results.json, loaders.png"
    )
    ap.add_argument(
        "--only",
        action="append",
        default=None,
        help="workloads to run (comma-separated names or prefixes, e.g. read,loader-2)",
    )
    ap.add_argument("--data", default=None, help="build the data here and keep it (reused)")
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    args = ap.parse_args(argv)
    if args.only:
        args.only = [o.strip() for chunk in args.only for o in chunk.split(",") if o.strip()]
        unknown = [o for o in args.only if not any(w.startswith(o) for w in WORKLOADS)]
        if unknown:
            ap.error(
                f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}"
            )
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    return args


def report(suite: Suite, meta: Dict[str, Any], machine: Dict[str, Any]) -> str:
    """All the tables, as printed on stdout."""
    pk = machine["packages"]
    parts = [
        f"machine: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['platform']}, "
        f"Python {machine['python']}, torch {pk.get('torch')}, webdataset {pk.get('webdataset')}"
    ]
    img = meta["images"]
    small = meta["small"]
    parts.append(
        f"data: {img['count']} JPEGs from {meta['source']} (mean {img['mean_jpeg_bytes'] / 1e3:.0f}"
        f" kB, median {img['median_jpeg_bytes'] / 1e3:.0f} kB), {img['per_shard']} per shard; "
        f"{small['count']} small records (mean {small['mean_record_bytes']:.0f} B), "
        f"{small['per_shard']} per shard"
    )
    nbytes = {
        "read-small": small["shard_bytes"],
        "read-images": img["shard_bytes"],
        "read-images-cold": img["shard_bytes"],
        "s3": suite.info.get("s3", {}).get("bytes"),
    }
    for name, res in suite.results.items():
        first = next(iter(res.values()))
        things = first.unit[:-2] if first.unit.endswith("/s") else "samples"
        title = (
            f"\n== {name}: {_title(name)} "
            f"({first.per_call} {things} per pass, {len(first.times_s)} reps)"
        )
        nb = nbytes.get(name)
        parts.append(
            format_table(res, BASELINES.get(name, []), title, {k: nb for k in res} if nb else None)
        )
    mem = suite.info.get("memory")
    if mem:
        parts.append(f"\n== memory: {WORKLOADS['memory']}")
        for lib, m in mem.items():
            mb = " ".join(f"{x / 1e6:.0f}" for x in m["rss_bytes_per_epoch"])
            pss = m.get("pss_growth_after_epoch_1")
            parts.append(
                f"{lib}: RSS MB per epoch (main + workers): {mb}\n"
                f"    growth after epoch 1: {m['growth_after_epoch_1']:+.1%} "
                f"(peak {m['peak_growth_after_epoch_1']:+.1%}"
                + (f", PSS {pss:+.1%}" if pss is not None else "")
                + f"); {m['processes']} processes, same workers every epoch: {m['workers_kept']}"
            )
    if suite.info.get("mainproc"):
        from .mainproc import format_report

        parts.append(f"\n== mainproc: {WORKLOADS['mainproc']} (best of {suite.config.reps} epochs)")
        parts.append(format_report(suite.info["mainproc"], machine["cpus"]))
    loaded = suite.info.get("index-load")
    if loaded:
        parts.append(
            f"\n== index-load: {WORKLOADS['index-load']}\n"
            f"{loaded['seconds']:.3f} s (median of {suite.config.reps}), "
            f"{loaded['file_bytes'] / 1e6:.1f} MB file"
        )
    parts.append("\n== targets, ratios of medians measured in this run")
    parts.append(format_targets(suite.targets()))
    others = {k: v for k, v in suite.other_ratios().items() if v is not None}
    if others:
        parts.append("\n== other ratios")
        width = max(len(k) for k in others)
        parts += [f"{k:<{width}}  {v:.2f}x" for k, v in others.items()]
    if suite.notes:
        parts.append("\nnotes:")
        parts += [f"- {n}" for n in suite.notes]
    return "\n".join(parts)


def _title(name: str) -> str:
    """A result table's title: its workload's, or the one it is part of (``link-...``)."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    return WORKLOADS.get(name.partition("-")[0], name)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.list:
        for name, title in WORKLOADS.items():
            print(f"{name:<17} {title}")
        return {}
    config = Config.smoke() if args.smoke else Config.quick() if args.quick else Config()
    if args.reps is not None:
        config.reps = args.reps
    t0 = time.perf_counter()
    with DataFolder(args.data) as root, quiet_warnings():
        from .data import build

        data = build(Path(root), config.images, config.small)
        build_s = time.perf_counter() - t0
        suite = Suite(data, config, args.only, quick=args.quick)
        suite.run()
        machine = machine_info(PACKAGES)
        print(report(suite, data.meta, machine))
        out = Path(args.out)
        result = {
            "machine": machine,
            "config": {**suite.config_json(), "quick": args.quick, "only": args.only},
            "data": {k: v for k, v in data.meta.items() if k != "wanted"},
            "build_s": build_s,
            "workloads": {
                name: {"title": _title(name), "variants": res}
                for name, res in suite.results.items()
            },
            "info": suite.info,
            "targets": suite.targets(),
            "other_ratios": suite.other_ratios(),
            "notes": suite.notes,
            "total_s": time.perf_counter() - t0,
        }
        path = write_json(out / "results.json", result)
        m = result["machine"]
        why = plot(
            suite.results,
            out / "loaders.png",
            title=f"webds benchmarks, median samples/s (min..max), {m['cpus']} CPUs, "
            f"{m['cpu_model']}" + (" (quick)" if args.quick else ""),
        )
        print(f"\nwrote {path}" + (f"; no plot: {why}" if why else f" and {out / 'loaders.png'}"))
        print(f"total {result['total_s']:.0f} s (data {build_s:.0f} s)")
    return result


class DataFolder:
    """``--data DIR`` as is, or a temporary folder removed at the end."""

    def __init__(self, data: Optional[str]) -> None:
        self.data = data
        self._tmp: Optional[tempfile.TemporaryDirectory] = None

    def __enter__(self) -> str:
        if self.data:
            Path(self.data).mkdir(parents=True, exist_ok=True)
            return self.data
        self._tmp = tempfile.TemporaryDirectory(prefix="webds-bench-")
        return self._tmp.name

    def __exit__(self, *exc: Any) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


if __name__ == "__main__":
    main()
