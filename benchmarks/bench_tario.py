"""Benchmark: webds's tar reader against Python's tarfile, on small and on image-sized members.

Builds two shards in a temporary folder (random bytes, so nothing compresses or caches
unfairly), then measures in the same run, several times each, and reports the median:

- ``tarfile``: the stdlib in streaming mode (``mode="r|*"``), reading every member (what
  webdataset does);
- ``bare loop``: a minimal 512-byte-header loop over the whole file in memory, with no checks:
  roughly the ceiling for pure Python;
- ``webds.read_members``: our reader, from the open file;
- samples/s: ``tarfile`` plus webdataset's grouping regex, against ``webds.tarfile_to_samples``.

Usage: ``python benchmarks/bench_tario.py [--reps 5] [--out benchmarks/results/tario.json]``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import format_table, machine_info, measure, write_json  # noqa: E402
from webds.fluent import WebDataset  # noqa: E402
from webds.tar.samples import tarfile_to_samples  # noqa: E402
from webds.tar.writing import END_OF_ARCHIVE, write_member  # noqa: E402


def build_shard(path: Path, nmembers: int, min_size: int, max_size: int, exts: List[str]) -> int:
    """Write ``nmembers`` members of random bytes, ``len(exts)`` members per sample."""
    rng = random.Random(0)
    blob = os.urandom(max_size * 4)
    total = 0
    with open(path, "wb") as f:
        for i in range(nmembers):
            size = rng.randint(min_size, max_size)
            start = rng.randint(0, len(blob) - size)
            name = f"{i // len(exts):07d}.{exts[i % len(exts)]}"
            total += write_member(f, name, blob[start : start + size], mtime=1_700_000_000)
        f.write(END_OF_ARCHIVE)
    return total


def run_tarfile(path: Path) -> int:
    n = 0
    with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|*") as tf:
        for m in tf:
            if m.isreg():
                tf.extractfile(m).read()
                n += 1
            tf.members = []  # as webdataset does, so memory stays flat
    return n


def run_bare(path: Path) -> int:
    with open(path, "rb") as f:
        buf = f.read()
    pos, n, end = 0, 0, len(buf) - 512
    while pos <= end:
        hdr = buf[pos : pos + 512]
        if hdr[0] == 0:
            break
        size = int(hdr[124:136].rstrip(b" \0"), 8)
        _name = hdr[:100].partition(b"\0")[0].decode()
        _data = buf[pos + 512 : pos + 512 + size]
        pos += 512 + ((size + 511) & -512)
        n += 1
    return n


def run_read_members(path: Path) -> int:
    from webds.tar.reader import read_members

    n = 0
    with open(path, "rb") as f:
        for _ in read_members(f, str(path)):
            n += 1
    return n


_WDS_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def run_tarfile_samples(path: Path) -> int:
    """tarfile plus webdataset's grouping rule: the baseline for samples/s."""
    n = 0
    cur: Dict[str, object] = {}
    with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|*") as tf:
        for m in tf:
            if m.isreg():
                data = tf.extractfile(m).read()
                match = _WDS_KEY.match(m.name)
                if match:
                    key, ext = match.group(1), match.group(2).lower()
                    if cur.get("__key__") != key:
                        if cur:
                            n += 1
                        cur = {"__key__": key, "__url__": str(path)}
                    cur[ext] = data
            tf.members = []
    return n + (1 if cur else 0)


def run_webds_samples(path: Path) -> int:
    return sum(1 for _ in tarfile_to_samples()(iter([{"url": str(path)}])))


def run_webdataset_facade(path: Path) -> int:
    # The whole fluent pipeline (shard list, splitters, empty check), no decoding.
    return sum(1 for _ in WebDataset(str(path)))


def main(argv: List[str] | None = None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median)")
    ap.add_argument("--small-members", type=int, default=20_000)
    ap.add_argument("--image-members", type=int, default=2_000)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tario.json"))
    args = ap.parse_args(argv)

    shards = {
        "small (1-2 KB)": (args.small_members, 1024, 2048, ["txt", "cls"]),
        "image (~100 KB)": (args.image_members, 90 * 1024, 110 * 1024, ["jpg", "seg.png"]),
    }
    results: Dict[str, object] = {**machine_info(), "reps": args.reps, "shards": {}}
    tables = []
    with tempfile.TemporaryDirectory(prefix="webds-bench-") as tmp:
        for label, (n, lo, hi, exts) in shards.items():
            path = Path(tmp) / f"shard-{n}.tar"
            nbytes = build_shard(path, n, lo, hi, exts)
            member_fns = {
                "tarfile r|*": run_tarfile,
                "bare header loop": run_bare,
                "webds.read_members": run_read_members,
            }
            sample_fns = {
                "tarfile + grouping": run_tarfile_samples,
                "webds.tarfile_to_samples": run_webds_samples,
                "webds.WebDataset": run_webdataset_facade,
            }
            member_runs = measure(
                {k: (lambda f=f, p=path: f(p)) for k, f in member_fns.items()},
                args.reps,
                workload=f"{label} members",
                unit="members/s",
            )
            sample_runs = measure(
                {k: (lambda f=f, p=path: f(p)) for k, f in sample_fns.items()},
                args.reps,
                workload=f"{label} samples",
            )
            base_m = member_runs["tarfile r|*"].median
            base_s = sample_runs["tarfile + grouping"].median
            entry = {"members": n, "bytes": nbytes, "members_per_s": {}, "samples_per_s": {}}
            for key, runs, base in (
                ("members_per_s", member_runs, base_m),
                ("samples_per_s", sample_runs, base_s),
            ):
                for name, m in runs.items():
                    entry[key][name] = {**m.to_json(), "ratio_vs_tarfile": m.median / base}
            results["shards"][label] = entry  # type: ignore[index]
            sizes = {k: nbytes for k in member_fns}
            tables.append(format_table(member_runs, ["tarfile r|*"], f"\n{label}", sizes))
            sizes = {k: nbytes for k in sample_fns}
            tables.append(format_table(sample_runs, ["tarfile + grouping"], "", sizes))

    print("\n".join(tables))
    out = write_json(args.out, results)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
