"""The main process's CPU time per sample: what bounds a loader however many workers it has.

DataLoader workers decode and augment in parallel, but every batch they make is received,
unpickled and rebuilt by the one main process, which also runs the training loop. Its CPU time
per sample ``us`` caps the loader at ``1e6 / us`` samples/s on a machine with any number of
cores (webdataset users report 2,500 img/s from 96 workers while storage delivered 15,000).

Measured here over whole epochs of the image pipeline (decode + augment + ``batched(32)``),
persistent workers started beforehand:

- ``torch DataLoader``: a plain ``torch.utils.data.DataLoader`` over the same webds
  ``WebDataset`` (the baseline: what torch itself costs per sample);
- ``webds WebLoader``: ``webds.WebLoader`` (batches come in Envelopes carrying what the
  workers' ledgers recorded, for exact resume, their tensors in reused shared buffers, see
  :mod:`webds.stages.batchbuffers`), and the same with ``batch_buffers=False`` (torch's transfer: a
  fresh shared-memory segment per tensor of every batch, as before issue 17);
- ``webdataset WebLoader`` when webdataset is installed;
- ``webds threads``: no worker processes; ``.map(decode_augment, threads=N)`` in the main
  process. Its process CPU per sample is all the work (decode included), so the figure that bounds
  it is the consuming thread's own CPU time (``time.thread_time``): the reading, the stages and
  the batching done by one thread. The pool threads' Python parts also hold the GIL, so the
  real ceiling of the thread mode is below ``1e6 / us`` of that thread. ``stack in a thread``:
  the same with the batches stacked in a pool thread too (``batched(32, collation_fn=None)
  .map(collate, threads=1)``), which takes the biggest part of that thread's work off it.

CPU time of the main process is ``resource.getrusage(RUSAGE_SELF)`` (user + system, every thread
of this process, not the workers). Each figure is the best (lowest) of ``reps`` epochs; the rates
are the best epoch's. Usage: ``python -m benchmarks.mainproc [--quick] [--reps N] [--data DIR]``
(also the ``mainproc`` workload of ``python -m benchmarks``).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # python benchmarks/mainproc.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

from . import loaders as L  # noqa: E402

WORKERS = 2
THREADS = 2


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class DecodeAugment:
    """One sample -> (augmented tensor, label), as ``image_dataset`` does it in three stages:
    webds's ``decode("pil")`` decoder, then the suite's augment (a class: picklable)."""

    def __init__(self) -> None:
        import webds

        self.decoder = webds.stages.decode.make_decoder("pil")

    def __call__(self, sample: Dict[str, Any]) -> Any:
        d = self.decoder(sample)
        return L.augment(d["jpg"]), d["cls"]


def thread_dataset(
    urls: Sequence[str], threads: int = THREADS, collate_in_pool: bool = False
) -> Any:
    """The image pipeline with decode and augment in ``threads`` threads of this process; with
    ``collate_in_pool``, batches are also stacked in a thread (``batched(collation_fn=None)``
    then ``map(collate, threads=1)``), not by the iterating thread."""
    import webds
    from webds.stages.batching import default_collation_fn

    ds = webds.WebDataset(list(urls), shardshuffle=False).map(DecodeAugment(), threads=threads)
    if not collate_in_pool:
        return ds.batched(L.BATCH)
    return ds.batched(L.BATCH, collation_fn=None).map(default_collation_fn, threads=1)


def contestants(urls: Sequence[str], wds: bool) -> Dict[str, Callable[[], Any]]:
    """name -> a function making the loader (built lazily: workers start at the warm-up)."""
    from torch.utils.data import DataLoader

    made: Dict[str, Callable[[], Any]] = {
        f"torch DataLoader, {WORKERS} workers": lambda: DataLoader(
            L.image_dataset("webds", urls),
            batch_size=None,
            num_workers=WORKERS,
            persistent_workers=True,
        ),
        f"webds WebLoader, {WORKERS} workers": lambda: L.web_loader("webds", urls, WORKERS),
        # Before issue 17: torch's fresh shared-memory segment per tensor of every batch.
        f"webds WebLoader, {WORKERS} w, no buffers": lambda: L.web_loader(
            "webds", urls, WORKERS, batch_buffers=False
        ),
    }
    if wds:
        made[f"webdataset WebLoader, {WORKERS} workers"] = lambda: L.web_loader(
            "webdataset", urls, WORKERS
        )
    made[f"webds threads={THREADS}, no workers"] = lambda: thread_dataset(urls)
    made[f"webds threads={THREADS}, stack in a thread"] = lambda: thread_dataset(
        urls, collate_in_pool=True
    )
    return made


def one_epoch(loader: Any) -> Dict[str, float]:
    """Samples, wall seconds, main-process CPU seconds and this thread's CPU seconds."""
    c0, t0, w0 = _cpu(), time.thread_time(), time.perf_counter()
    n = L.count_batches(loader)
    wall = time.perf_counter() - w0
    return {
        "samples": n,
        "wall_s": wall,
        "cpu_s": _cpu() - c0,
        "thread_cpu_s": time.thread_time() - t0,
    }


def run(urls: Sequence[str], reps: int, wds: bool, log: Any = None) -> Dict[str, Any]:
    """Each contestant ``reps`` epochs, round robin; per contestant the best epoch's figures."""
    made = contestants(urls, wds)
    loaders = {name: make() for name, make in made.items()}
    epochs: Dict[str, List[Dict[str, float]]] = {name: [] for name in loaders}
    try:
        for ld in loaders.values():
            L.count_batches(ld)  # warm-up: starts the persistent workers, reads every shard
        for rep in range(reps):
            names = list(loaders)
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                epochs[name].append(one_epoch(loaders[name]))
            if log:
                log(f"  mainproc: round {rep + 1}/{reps} done")
    finally:
        for ld in loaders.values():
            L.shutdown(ld)
    out: Dict[str, Any] = {}
    for name, es in epochs.items():
        n = es[0]["samples"]
        us = min(e["cpu_s"] for e in es) / n * 1e6
        thread_us = min(e["thread_cpu_s"] for e in es) / n * 1e6
        threaded = "threads=" in name
        bound = thread_us if threaded else us
        out[name] = {
            "samples": n,
            "main_cpu_us_per_sample": us,
            "main_thread_cpu_us_per_sample": thread_us,
            "bounding_us_per_sample": bound,
            "ceiling_per_s": 1e6 / bound if bound > 0 else None,
            "best_per_s": max(n / e["wall_s"] for e in es),
            "epochs": es,
        }
    return out


RATIOS = [
    ("main CPU per sample, webds WebLoader / torch DataLoader", "main_cpu_us_per_sample",
     f"webds WebLoader, {WORKERS} workers", f"torch DataLoader, {WORKERS} workers"),
    ("main CPU per sample, WebLoader with / without buffers", "main_cpu_us_per_sample",
     f"webds WebLoader, {WORKERS} workers", f"webds WebLoader, {WORKERS} w, no buffers"),
    (f"samples/s, threads={THREADS} / webds WebLoader {WORKERS} workers", "best_per_s",
     f"webds threads={THREADS}, no workers", f"webds WebLoader, {WORKERS} workers"),
    (f"samples/s, webds WebLoader / webdataset WebLoader, {WORKERS} workers", "best_per_s",
     f"webds WebLoader, {WORKERS} workers", f"webdataset WebLoader, {WORKERS} workers"),
    (f"samples/s, threads={THREADS} / webdataset WebLoader {WORKERS} workers", "best_per_s",
     f"webds threads={THREADS}, no workers", f"webdataset WebLoader, {WORKERS} workers"),
]  # fmt: skip


def ratios(res: Dict[str, Any]) -> Dict[str, float]:
    """The ratios of :data:`RATIOS` whose contestants ran."""
    return {
        label: res[a][key] / res[b][key]
        for label, key, a, b in RATIOS
        if a in res and b in res and res[b][key]
    }


def format_report(res: Dict[str, Any], cpus: Optional[int] = None) -> str:
    """The table: main-process us/sample, the ceiling it implies, the best rate measured."""
    head = (
        f"{'contestant':<36} {'main CPU':>10} {'main thread':>12} {'ceiling':>12} {'best':>10}\n"
        f"{'':<36} {'us/sample':>10} {'us/sample':>12} {'samples/s':>12} {'samples/s':>10}"
    )
    rows = [head]
    for name, r in res.items():
        ceiling = r["ceiling_per_s"]
        rows.append(
            f"{name:<36} {r['main_cpu_us_per_sample']:>10.1f} "
            f"{r['main_thread_cpu_us_per_sample']:>12.1f} "
            f"{ceiling if ceiling is not None else float('nan'):>12,.0f} "
            f"{r['best_per_s']:>10,.0f}"
        )
    rows.append(
        "ceiling = 1e6 / us: for process workers the main process's CPU (every thread); for the "
        "thread mode the consuming thread's (an upper bound: the pool's Python parts hold the "
        "GIL too)" + (f"; {cpus} CPUs here" if cpus else "")
    )
    rows += [f"{label}: {value:.2f}x" for label, value in ratios(res).items()]
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    import os
    import tempfile
    import warnings

    from .data import build
    from .harness import ROOT, has_module, stderr, write_json
    from .workloads import Config

    ap = argparse.ArgumentParser(prog="python -m benchmarks.mainproc", description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--data", default=None, help="build the data here and keep it (reused)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "mainproc.json"))
    args = ap.parse_args(argv)
    config = Config.quick() if args.quick else Config()
    reps = args.reps or config.reps
    with tempfile.TemporaryDirectory(prefix="webds-bench-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = build(Path(args.data or tmp), config.images, config.small)
        res = run(data.image_shards(config.decode), reps, has_module("webdataset"), log=stderr)
    print(format_report(res, os.cpu_count()))
    path = write_json(Path(args.out), {"reps": reps, "quick": args.quick, "results": res})
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
