"""The shared benchmark harness: timing, statistics, ratios, targets, tables, JSON and the plot.

Every number a benchmark reports comes from :func:`measure`: the variants of one workload take
turns (round robin, the order rotating each round, so drifting load from other processes falls
on all alike), each after a warm-up, and each keeps the time of every repetition. A
:class:`Measurement` gives the median rate and its spread (min, max, quartiles); :func:`ratio`
compares two measured in the same run, never against a number from elsewhere.

    results = measure({"tarfile": run_tarfile, "webds": run_webds}, reps=5, workload="read")
    print(format_table(results, baselines=["tarfile"]))

Nothing here imports webds, torch or the optional packages, so the scripts can use it alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

ROOT = Path(__file__).resolve().parents[1]


# -- measuring ----------------------------------------------------------------------------------


@dataclass
class Variant:
    """One contestant of a workload: ``run()`` does the work once and returns the item count.

    ``warmup`` (default: ``run``) is called before timing, e.g. to start persistent workers or
    to read only the first batches of an expensive pass; ``close`` is called after the last
    repetition (shut workers down, delete output).
    """

    run: Callable[[], int]
    warmup: Optional[Callable[[], Any]] = None
    close: Optional[Callable[[], Any]] = None
    before_each: Optional[Callable[[], Any]] = None  # untimed, e.g. evict files from the cache
    note: str = ""


VariantLike = Union[Variant, Callable[[], int]]


@dataclass
class Measurement:
    """The repetitions of one variant of one workload."""

    name: str
    workload: str
    count: int
    times_s: List[float]
    unit: str = "samples/s"
    note: str = ""
    loops: int = 1  # calls of run() per repetition; count covers them all
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def per_call(self) -> int:
        """Items one call of run() handles."""
        return self.count // self.loops

    @property
    def rates(self) -> List[float]:
        return [self.count / t for t in self.times_s]

    @property
    def median(self) -> float:
        """The median rate (items per second)."""
        return self.count / statistics.median(self.times_s)

    @property
    def low(self) -> float:
        return min(self.rates)

    @property
    def high(self) -> float:
        return max(self.rates)

    @property
    def quartiles(self) -> List[float]:
        rates = sorted(self.rates)
        if len(rates) < 2:
            return [rates[0], rates[0]]
        q = statistics.quantiles(rates, n=4, method="inclusive")
        return [q[0], q[2]]

    @property
    def spread(self) -> float:
        """(max - min) / median of the rates: how far apart the repetitions were."""
        return (self.high - self.low) / self.median

    def to_json(self) -> Dict[str, Any]:
        q1, q3 = self.quartiles
        out = {
            "unit": self.unit,
            "count": self.count,
            "loops": self.loops,
            "reps": len(self.times_s),
            "median_per_s": self.median,
            "min_per_s": self.low,
            "max_per_s": self.high,
            "q1_per_s": q1,
            "q3_per_s": q3,
            "spread": self.spread,
            "times_s": self.times_s,
        }
        if self.note:
            out["note"] = self.note
        out.update(self.extra)
        return out


def measure(
    variants: Mapping[str, VariantLike],
    reps: int,
    workload: str = "",
    unit: str = "samples/s",
    warmup: bool = True,
    min_time: float = 0.0,
    log: Optional[Callable[[str], Any]] = None,
) -> Dict[str, Measurement]:
    """Time each variant ``reps`` times, round robin, after one warm-up call each.

    Every call must return the same positive item count; the rate is count / seconds. A variant
    whose warm-up took less than ``min_time`` seconds is called as many times in a row per
    repetition as make ``min_time`` (timeit's ``number``; ``before_each`` runs, untimed, before
    every call), so that timer resolution and scheduler hiccups weigh less; not one with its own
    ``warmup``. Each variant's ``close`` runs at the end, also on error.
    """
    vs = {name: v if isinstance(v, Variant) else Variant(v) for name, v in variants.items()}
    times: Dict[str, List[float]] = {name: [] for name in vs}
    counts: Dict[str, int] = {}
    loops = {name: 1 for name in vs}
    names = list(vs)
    try:
        if warmup:
            for name, v in vs.items():
                if v.before_each:
                    v.before_each()
                t0 = time.perf_counter()
                (v.warmup or v.run)()
                elapsed = time.perf_counter() - t0
                if min_time > 0 and v.warmup is None:
                    loops[name] = max(1, min(1000, math.ceil(min_time / max(elapsed, 1e-6))))
        for rep in range(reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                v = vs[name]
                n, elapsed = 0, 0.0
                for _ in range(loops[name]):
                    if v.before_each:
                        v.before_each()
                    t0 = time.perf_counter()
                    n += v.run()
                    elapsed += time.perf_counter() - t0
                if not n or n <= 0:
                    raise RuntimeError(f"{workload}/{name}: run() returned {n!r}, not a count")
                if counts.setdefault(name, n) != n:
                    raise RuntimeError(f"{workload}/{name}: got {n} items, before {counts[name]}")
                times[name].append(elapsed)
            if log:
                log(f"  {workload}: round {rep + 1}/{reps} done")
    finally:
        for v in vs.values():
            if v.close:
                with contextlib.suppress(Exception):
                    v.close()
    return {
        name: Measurement(
            name, workload, counts[name], times[name], unit, vs[name].note, loops=loops[name]
        )
        for name in vs
    }


def ratio(a: Measurement, b: Measurement) -> float:
    """Median rate of ``a`` over median rate of ``b`` (both measured in this run)."""
    return a.median / b.median


def round_ratios(a: Measurement, b: Measurement) -> List[float]:
    """The ratio of rates in each round (a and b ran next to each other there), which drifting
    load from other processes disturbs less than it does the rates themselves."""
    return [ra / rb for ra, rb in zip(a.rates, b.rates)]


# -- targets ------------------------------------------------------------------------------------


@dataclass
class Target:
    """A goal stated as ``value >= threshold`` (or ``<=``), with PASS / MISS / SKIP."""

    name: str
    threshold: float
    value: Optional[float] = None
    op: str = ">="
    fmt: str = "{:.2f}x"
    detail: str = ""
    skipped: str = ""  # why there is no value
    rounds: Optional[List[float]] = None  # the value in each round, where it has one
    # The same ratio for a reference contestant that does less than any loader must (no loader,
    # no I/O, the bytes alone): how far the goal lies from what is possible on this machine.
    reference: Optional[float] = None
    reference_label: str = ""

    @property
    def robust(self) -> Optional[bool]:
        """Whether every round agrees with the status (None without rounds)."""
        if not self.rounds or self.value is None:
            return None
        ok = [r >= self.threshold if self.op == ">=" else r <= self.threshold for r in self.rounds]
        return all(ok) or not any(ok)

    @property
    def status(self) -> str:
        if self.value is None or (isinstance(self.value, float) and math.isnan(self.value)):
            return "SKIP"
        ok = self.value >= self.threshold if self.op == ">=" else self.value <= self.threshold
        return "PASS" if ok else "MISS"

    def to_json(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "op": self.op,
            "threshold": self.threshold,
            "status": self.status,
            "rounds": self.rounds,
            "every_round_agrees": self.robust,
            "detail": self.skipped if self.status == "SKIP" else self.detail,
            "reference": None
            if self.reference is None
            else {"contestant": self.reference_label, "value": self.reference},
        }


def format_targets(targets: Sequence[Target]) -> str:
    """The target table: each goal, the value achieved, PASS / MISS / SKIP, the range of the
    value over the rounds (``*`` marks a status that some round disagrees with), and the
    reference contestant's value where there is one."""
    width = max([len(t.name) for t in targets] + [6])
    refs = [
        "" if t.reference is None else f"{t.reference_label} {t.fmt.format(t.reference)}"
        for t in targets
    ]
    rwidth = max([len(r) for r in refs] + [9])
    head = (
        f"{'target':<{width}}  {'achieved':>9}  {'goal':>9}  status  {'rounds':>15}  "
        f"{'reference':>{rwidth}}  detail"
    )
    lines = [head]
    for t, ref in zip(targets, refs):
        value = "-" if t.value is None else t.fmt.format(t.value)
        goal = f"{t.op} {t.fmt.format(t.threshold)}"
        detail = t.skipped if t.status == "SKIP" else t.detail
        status = t.status + ("*" if t.robust is False else "")
        rounds = ""
        if t.rounds and t.value is not None:
            rounds = f"{t.fmt.format(min(t.rounds))}..{t.fmt.format(max(t.rounds))}"
        lines.append(
            f"{t.name:<{width}}  {value:>9}  {goal:>9}  {status:<6}  {rounds:>15}  "
            f"{ref:>{rwidth}}  {detail}"
        )
    return "\n".join(lines)


# -- tables -------------------------------------------------------------------------------------


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def format_table(
    results: Mapping[str, Measurement],
    baselines: Sequence[str] = (),
    title: str = "",
    nbytes: Optional[Mapping[str, int]] = None,
) -> str:
    """A table of one workload: median rate, min..max, spread and a ratio column per baseline.

    ``nbytes`` (bytes handled by one call of run(), by variant) adds a MB/s column.
    """
    base = [b for b in baselines if b in results]
    width = max([len(n) for n in results] + [8])
    unit = next(iter(results.values())).unit if results else ""
    head = f"{'variant':<{width}}  {unit:>12}  {'min..max':>21}  {'spread':>6}"
    if nbytes:
        head += f"  {'MB/s':>7}"
    for b in base:
        head += f"  {'vs ' + b:>{max(10, len(b) + 3)}}"
    lines = [title] if title else []
    lines.append(head)
    for name, m in results.items():
        line = (
            f"{name:<{width}}  {_rate(m.median):>12}  "
            f"{_rate(m.low) + '..' + _rate(m.high):>21}  {m.spread:>6.0%}"
        )
        if nbytes:
            mb = nbytes.get(name)
            line += f"  {m.median / m.per_call * mb / 1e6:>7.0f}" if mb else " " * 9
        for b in base:
            line += f"  {ratio(m, results[b]):>{max(10, len(b) + 3) - 1}.2f}x"
        lines.append(line)
        if m.note:
            lines.append(f"{'':<{width}}    ({m.note})")
    return "\n".join(lines)


# -- the machine and JSON -----------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (or platform.processor())."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def has_module(module: str) -> bool:
    """Whether ``module`` can be imported here (an optional contestant's package)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def package_version(name: str) -> Optional[str]:
    """The installed version of a distribution, or None."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine_info(packages: Sequence[str] = ()) -> Dict[str, Any]:
    """Where the numbers were taken: Python, OS, CPUs, CPU model, versions of ``packages``."""
    info: Dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
    }
    with contextlib.suppress(AttributeError, OSError):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gb"] = round(pages * size / 1e9, 1)
    info["packages"] = {name: package_version(name) for name in packages}
    return info


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Measurement):
        return obj.to_json()
    if isinstance(obj, Target):
        return obj.to_json()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")


def write_json(path: Union[str, Path], obj: Any) -> Path:
    """Write ``obj`` (Measurements and Targets included) as indented JSON; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n")
    return path


# -- the plot -----------------------------------------------------------------------------------

#: Bar colours by the first word of a variant's name.
_COLOURS = {
    "webds": "#1f77b4",
    "webdataset": "#ff7f0e",
    "files": "#2ca02c",
    "zip": "#9467bd",
}


def plot(
    workloads: Mapping[str, Mapping[str, Measurement]], path: Union[str, Path], title: str = ""
) -> Optional[str]:
    """Horizontal bars of the median rate per variant (min..max as error bars), one panel per
    workload, log scale. Returns None, or why no plot was written (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    panels = [(name, res) for name, res in workloads.items() if res]
    if not panels:
        return "nothing to plot"
    heights = [0.8 + 0.32 * len(res) for _, res in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, sum(heights) + 0.6), gridspec_kw={"height_ratios": heights}
    )
    if len(panels) == 1:
        axes = [axes]
    for ax, (name, res) in zip(axes, panels):
        names = list(res)[::-1]
        meds = [res[n].median for n in names]
        errs = [
            [res[n].median - res[n].low for n in names],
            [res[n].high - res[n].median for n in names],
        ]
        colours = [_COLOURS.get(n.split()[0], "#7f7f7f") for n in names]
        ax.barh(names, meds, xerr=errs, color=colours, capsize=2)
        highs = [res[n].high for n in names]
        for y, (v, hi) in enumerate(zip(meds, highs)):
            ax.text(hi, y, f"  {_rate(v)}", va="center", fontsize=7)
        if max(highs) / min(meds) > 20:  # a log scale only where the rates span decades
            ax.set_xscale("log")
            ax.set_xlim(min(meds) / 3, max(highs) * 8)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        else:
            ax.set_xlim(0, max(highs) * 1.25)
        ax.set_title(name, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        unit = next(iter(res.values())).unit
        ax.set_xlabel(unit, fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.99 if title else 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -- memory -------------------------------------------------------------------------------------


def _proc_children(pid: int) -> List[int]:
    out: List[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out += [
                    int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                ]
    return out


def _proc_rss(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_tree(pid: Optional[int] = None) -> Dict[str, Any]:
    """Resident memory (bytes) of a process and all its descendants: ``{"total", "main",
    "children": {pid: rss}}``, from psutil if installed, else /proc."""
    pid = os.getpid() if pid is None else pid
    try:
        import psutil

        proc = psutil.Process(pid)
        kids = {}
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                kids[child.pid] = child.memory_info().rss
        main = proc.memory_info().rss
    except ImportError:
        main = _proc_rss(pid)
        kids, todo = {}, _proc_children(pid)
        while todo:
            child = todo.pop()
            kids[child] = _proc_rss(child)
            todo += _proc_children(child)
    return {"total": main + sum(kids.values()), "main": main, "children": kids}


# -- S3 on loopback -----------------------------------------------------------------------------


@contextlib.contextmanager
def moto_s3() -> Iterator[Dict[str, Any]]:
    """moto's S3 server in a thread on 127.0.0.1 (as tests/servers.py starts it).

    Yields ``{"endpoint", "client" (boto3), "storage_options" (for fsspec/s3fs)}``; raises
    ImportError when moto[server] or boto3 is missing.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        key, secret, region = "bench", "bench", "us-east-1"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
        )
        yield {
            "endpoint": endpoint,
            "client": client,
            "key": key,
            "secret": secret,
            "region": region,
            "storage_options": {
                "key": key,
                "secret": secret,
                "client_kwargs": {"endpoint_url": endpoint, "region_name": region},
            },
        }
    finally:
        server.stop()


def stderr(msg: str) -> None:
    """Progress messages go to stderr, so stdout holds only the tables."""
    print(msg, file=sys.stderr, flush=True)
