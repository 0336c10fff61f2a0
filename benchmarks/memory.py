"""Resident memory of a ``WebLoader`` with persistent workers over many epochs, in a fresh process.

Run by the suite as a child process, so that what the suite itself holds (data, other loaders,
the S3 server) does not dilute the growth: ``python -m benchmarks.memory --lib webds --epochs 10
--workers 2 SHARD...`` prints one JSON object: the resident memory (RSS, bytes) of this process
plus its workers after each epoch (and PSS, which counts pages shared between the forked
workers once, when psutil is installed), and the growth of the last epoch over the first.

Where Linux lets this process reset its workers' high-water marks (``/proc/PID/clear_refs``),
it also gives the peak RSS reached *during* each epoch (the sum of each process's ``VmHWM``):
memory handed back between epochs (a worker trimming its heap when its epoch ends) lowers the
after-epoch figure but not what the epoch itself needed, and this tells the two apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

from . import loaders as L  # noqa: E402
from .harness import rss_tree  # noqa: E402


def pss_tree() -> Optional[int]:
    """Proportional set size of this process and its descendants (psutil), or None."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.Error, AttributeError):
            return None
    return total


def reset_peaks(pids: List[int]) -> bool:
    """Reset the peak RSS (``VmHWM``) of these processes to their current RSS (Linux only)."""
    try:
        for pid in pids:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
    except OSError:
        return False
    return True


def peak_tree(pids: List[int]) -> Optional[int]:
    """Sum of the peak RSS (``VmHWM``, bytes) of these processes since their last reset."""
    total = 0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/status") as f:
                line = next(x for x in f if x.startswith("VmHWM:"))
            total += int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None
    return total


def run(lib: str, urls: List[str], epochs: int, workers: int) -> Dict[str, Any]:
    """Iterate ``epochs`` epochs of the library's WebLoader; memory after each one."""
    loader = L.web_loader(lib, urls, workers)
    rss: List[int] = []
    pss: List[Optional[int]] = []
    peaks: List[Optional[int]] = []
    pids: List[List[int]] = []
    samples = 0
    before = rss_tree()["total"]
    try:
        for _ in range(epochs):
            # Persistent workers are already there from the second epoch on.
            resettable = reset_peaks([os.getpid(), *rss_tree()["children"]])
            samples = L.count_batches(loader)
            gc.collect()
            tree = rss_tree()
            rss.append(tree["total"])
            pss.append(pss_tree())
            peaks.append(peak_tree([os.getpid(), *tree["children"]]) if resettable else None)
            pids.append(sorted(tree["children"]))
            peak = "" if peaks[-1] is None else f" (peak during the epoch {peaks[-1] / 1e6:.1f} MB)"
            print(
                f"  memory {lib}: epoch {len(rss)}: {rss[-1] / 1e6:.1f} MB{peak}", file=sys.stderr
            )
    finally:
        L.shutdown(loader)
    out: Dict[str, Any] = {
        "lib": lib,
        "samples_per_epoch": samples,
        "rss_before_bytes": before,
        "rss_bytes_per_epoch": rss,
        "growth_after_epoch_1": (rss[-1] - rss[0]) / rss[0],
        "peak_growth_after_epoch_1": (max(rss) - rss[0]) / rss[0],
        "workers_kept": all(p == pids[0] for p in pids),
        "processes": len(pids[0]) + 1,
    }
    if all(p is not None for p in pss):
        out["pss_bytes_per_epoch"] = pss
        out["pss_growth_after_epoch_1"] = (pss[-1] - pss[0]) / pss[0]  # type: ignore[operator]
    if all(p is not None for p in peaks):
        first, last = peaks[0], peaks[-1]
        out["in_epoch_peak_bytes_per_epoch"] = peaks
        out["in_epoch_peak_growth_after_epoch_1"] = (last - first) / first  # type: ignore[operator]
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", choices=["webds", "webdataset"], default="webds")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("urls", nargs="+", help="image shards (jpg + cls)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    result = run(args.lib, args.urls, args.epochs, args.workers)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
