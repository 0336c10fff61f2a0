"""Where a pipeline's time goes: :class:`Probe` times each stage of a pipeline in one process,
and :class:`PipelineStats` is the report that ``WebDataset.stats()`` and ``WebLoader.stats()``
give.

A probe is switched on by ``WebDataset(..., stats=True)`` or ``WebLoader(..., stats=True)``:
then every stage's iterator is wrapped, and the time each ``next()`` takes is added to that
stage. Stages pull from the stage before them inside their own ``next()``, so a stage's own
time is its total less the total of the stage before it. The tar stage's shard streams are
wrapped too: the time spent waiting in their ``read()`` is storage or network time, the rest of
that stage's time is tar parsing. Off, nothing is wrapped and nothing is measured.

In a ``WebLoader`` each DataLoader worker's probe sends a snapshot with every batch (a few
hundred bytes, beside the batch), and the main process adds the time it waited for batches.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

__all__ = ["Probe", "PipelineStats", "StageTime"]

_now = time.perf_counter

#: Stage rows that are not stages of the pipeline: the tar stage's reading, collation.
READING = "reading shards (waiting for storage or network)"
COLLATE = "collate (DataLoader's collate_fn)"
WAITING = "waiting for DataLoader workers"
IDLE = "idle (batches ready, waiting to be taken)"
_WAITS = (WAITING, IDLE)


_FUNCTION = re.compile(r"<(?:function|bound method|built-in function) ([\w.<>]+)[^>]*>")


def label(stage: Any) -> str:
    """A stage's name in a report: ``map(resize)``, ``batched(64)``, ``tarfile_to_samples``."""
    factory = getattr(stage, "factory", None)
    name = getattr(factory, "__name__", None)
    if name in ("tarfile_to_samples", "cached_shards") or (name or "x")[0] == "_":
        return name
    if factory is None:
        return getattr(stage, "__name__", None) or type(stage).__name__
    text = _FUNCTION.sub(lambda m: m.group(1).rpartition(".")[2], str(stage))
    return text if len(text) <= 48 else text[:45] + "..."


class _Timed:
    """``it`` with the time each ``next()`` takes added to ``probe.seconds[index]``."""

    __slots__ = ("it", "probe", "index")

    def __init__(self, it: Iterator[Any], probe: "Probe", index: int) -> None:
        self.it, self.probe, self.index = it, probe, index

    def __iter__(self) -> "_Timed":
        return self

    def __next__(self) -> Any:
        start = _now()
        try:
            item = next(self.it)
        finally:
            self.probe.seconds[self.index] += _now() - start
        self.probe.items[self.index] += 1
        return item

    def close(self) -> None:
        close = getattr(self.it, "close", None)
        if close is not None:
            close()


class _TimedStream:
    """A shard stream whose ``read`` time and bytes are added to the probe's reading."""

    #: Its ``read`` and ``readinto`` are those of ``wrapped``, timed: the tar stage's bulk path
    #: (webds.tar.bulk) reads it with ``readinto`` where it would read ``wrapped`` so.
    passes_through = True

    def __init__(self, stream: Any, probe: "Probe") -> None:
        self._stream, self._probe = stream, probe

    @property
    def wrapped(self) -> Any:
        return self._stream

    def read(self, n: int = -1) -> bytes:
        start = _now()
        data = self._stream.read(n)
        self._probe.read_seconds += _now() - start
        self._probe.read_bytes += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        start = _now()
        n = self._stream.readinto(buf)
        self._probe.read_seconds += _now() - start
        self._probe.read_bytes += n or 0
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Probe:
    """Per-stage times of one pipeline in one process (see the module's docstring)."""

    def __init__(self) -> None:
        self.names: List[str] = []
        self.seconds: List[float] = []
        self.items: List[int] = []
        self.read_seconds = 0.0
        self.read_bytes = 0
        #: The tar stage's read-ahead (a webds.io.readahead.Depth), while it reads.
        self.readahead: Any = None
        self.collate_seconds = 0.0
        self.tar_index: Optional[int] = None
        self.started: Optional[float] = None
        self.wall = 0.0  # seconds of iteration before the current one

    def begin(self, stages: List[Any]) -> None:
        """A pass starts over ``stages`` (the source first): the clock runs."""
        names = [label(s) for s in stages]
        if names != self.names:
            self.names = list(names)
            self.seconds = [0.0] * len(names)
            self.items = [0] * len(names)
            self.tar_index = next(
                (i for i, n in enumerate(names) if n.startswith("tarfile_to_samples")), None
            )
        if self.started is None:
            self.started = _now()

    def end(self) -> None:
        """The pass ended: the clock stops until the next begins."""
        if self.started is not None:
            self.wall += _now() - self.started
            self.started = None

    def wrap(self, it: Iterator[Any], index: int) -> _Timed:
        return _Timed(it, self, index)

    def reads(self, it: Iterator[Any]) -> Iterator[Any]:
        """``it`` (the shards being opened, read ahead) with its ``next()`` time as reading."""
        while True:
            start = _now()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self.read_seconds += _now() - start
            yield item

    def open(self, opened: Any) -> Any:
        """``opened()``, a shard's ``(url, stream, local path)``, timed as reading, with the
        stream's reads timed too."""
        start = _now()
        url, stream, path = opened()
        self.read_seconds += _now() - start
        return url, _TimedStream(stream, self), path

    def elapsed(self) -> float:
        return self.wall + (_now() - self.started if self.started is not None else 0.0)

    def rows(self) -> List["StageTime"]:
        """Each stage's own time (its total less the stage before it), and the reading."""
        rows = []
        before = 0.0
        for i, (name, total, items) in enumerate(zip(self.names, self.seconds, self.items)):
            own = max(0.0, total - before)
            if i == self.tar_index:
                read = min(own, self.read_seconds)
                rows.append(StageTime(READING, read, items, self.read_bytes))
                own -= read
                name = f"{name}: tar parsing"
            rows.append(StageTime(name, own, items))
            before = total
        if self.collate_seconds:
            rows.append(StageTime(COLLATE, self.collate_seconds, 0))
        return rows

    @property
    def samples(self) -> int:
        """The samples out of the tar stage (0 without one)."""
        return self.items[self.tar_index] if self.tar_index is not None else 0

    @property
    def readahead_shards(self) -> Optional[int]:
        """The shards the tar stage fetches ahead now (None: none was fetched ahead)."""
        depth = self.readahead
        return depth.shards if depth is not None and depth.fetched else None

    def snapshot(self) -> Dict[str, Any]:
        """What a worker sends: its rows, elapsed time and the samples out of the tar stage."""
        return {
            "rows": [r.as_tuple() for r in self.rows()],
            "elapsed": self.elapsed(),
            "samples": self.samples,
            "readahead_shards": self.readahead_shards,
            "pid": os.getpid(),  # a new process per epoch unless the workers persist
        }

    def __getstate__(self) -> Dict[str, Any]:
        # A copy sent to a DataLoader worker measures that worker alone, from zero.
        return Probe().__dict__


@dataclass
class StageTime:
    """One row of :class:`PipelineStats`: a stage, its own seconds, the items it yielded."""

    name: str
    seconds: float
    items: int
    nbytes: int = 0
    where: str = "main"
    share: float = 0.0

    def as_tuple(self) -> tuple:
        return (self.name, self.seconds, self.items, self.nbytes)


@dataclass
class PipelineStats:
    """What ``stats()`` reports: per stage, where it runs (``main`` or ``worker N``) and the
    share of the measured time it took, with the rates of the whole.

    ``print(stats)`` shows a table; :meth:`as_dict` gives plain data (JSON will do);
    :attr:`slowest` names the stage with the largest share.
    """

    stages: List[StageTime]
    elapsed: float
    samples: int
    batches: int
    wait_seconds: Optional[float] = None
    workers: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    #: What ``WebLoader(num_workers="auto")`` chose, and why (None: chosen by hand).
    setting: Optional[str] = None
    #: Shards fetched ahead of the one being read, where the tar stage runs (``main``,
    #: ``worker N``): ``readahead_shards="auto"`` grows it while the reader waits on the link.
    readahead_shards: Dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Shares of the time spent in stages; the main process's wait for workers and the
        # workers' wait for it are symptoms, not stages.
        total = sum(s.seconds for s in self.stages if s.name not in _WAITS) or 1.0
        for s in self.stages:
            s.share = 0.0 if s.name in _WAITS else s.seconds / total

    @property
    def slowest(self) -> Optional[str]:
        """The stage with the most time, summed over workers (None before any is measured)."""
        totals: Dict[str, float] = {}
        for s in self.stages:
            if s.name not in _WAITS:
                totals[s.name] = totals.get(s.name, 0.0) + s.seconds
        return max(totals, key=totals.__getitem__) if totals else None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.elapsed if self.elapsed > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        return {
            "elapsed_s": self.elapsed,
            "samples": self.samples,
            "batches": self.batches,
            "samples_per_s": self.samples_per_s,
            "batches_per_s": self.batches_per_s,
            "wait_s": self.wait_seconds,
            "slowest": self.slowest,
            "verdict": self.verdict,
            "stages": [
                {
                    "name": s.name,
                    "where": s.where,
                    "seconds": s.seconds,
                    "share": s.share,
                    "items": s.items,
                    **({"bytes": s.nbytes} if s.nbytes else {}),
                }
                for s in self.stages
            ],
            "workers": self.workers,
            "setting": self.setting,
            "readahead_shards": self.readahead_shards,
        }

    def summary(self) -> List[StageTime]:
        """The rows with the workers' rows of each stage added up (``where`` = ``workers``)."""
        shown = [s for s in self.stages if s.name != WAITING]
        mains = [s for s in shown if not s.where.startswith("worker")]
        workers = [s for s in shown if s.where.startswith("worker")]
        return mains + list(_totals(workers, "workers").values())

    def __str__(self) -> str:
        lines = [
            f"{self.samples} samples, {self.batches} items in {self.elapsed:.2f} s: "
            f"{self.samples_per_s:,.1f} samples/s, {self.batches_per_s:,.2f} items/s"
        ]
        if self.wait_seconds is not None and self.elapsed > 0:
            lines.append(
                f"the main process waited {self.wait_seconds:.2f} s for batches "
                f"({100 * self.wait_seconds / self.elapsed:.0f}% of the time)"
            )
        rows = self.summary()
        width = max([len(s.name) for s in rows] + [5])
        lines.append(f"{'stage':<{width}}  {'where':<7} {'seconds':>9} {'share':>6} {'items':>9}")
        for s in rows:
            lines.append(
                f"{s.name:<{width}}  {s.where:<7} {s.seconds:9.3f} {100 * s.share:5.1f}% "
                f"{s.items:9d}"
            )
        for w, info in self.workers.items():
            lines.append(
                f"worker {w}: {info['samples']} samples in {info['elapsed_s']:.2f} s "
                f"({info['samples_per_s']:,.1f}/s)"
            )
        if self.slowest is not None:
            lines.append(f"largest share: {self.slowest}")
        if self.readahead_shards:
            where = ", ".join(f"{n} ({w})" for w, n in self.readahead_shards.items())
            lines.append(f"shards fetched ahead: {where}")
        if self.setting is not None:
            lines.append(f"loader: {self.setting}")
        verdict = self.verdict
        if verdict:
            lines.append(verdict)
        return "\n".join(lines)

    @property
    def verdict(self) -> str:
        """For a loader: whether the training loop waits for data, in one sentence."""
        if self.wait_seconds is None or self.elapsed <= 0:
            return ""
        waited = self.wait_seconds / self.elapsed
        if waited < 0.2:
            return (
                f"Data keeps up: the main process waited for batches {100 * waited:.0f}% of the "
                "time; the training step is what bounds the rate."
            )
        return (
            f"The loop is starved: it waited for batches {100 * waited:.0f}% of the time; the "
            f"workers spend the most in {self.slowest}."
        )


def _totals(rows: Iterable[StageTime], where: str) -> Dict[str, StageTime]:
    """``rows`` added up by stage name, in the order of first appearance, placed ``where``."""
    totals: Dict[str, StageTime] = {}
    for r in rows:
        total = totals.get(r.name)
        if total is None:
            total = totals[r.name] = StageTime(r.name, 0.0, 0, 0, where)
        total.seconds += r.seconds
        total.items += r.items
        total.nbytes += r.nbytes
        total.share += r.share
    return totals


def stats_of(probe: Probe, where: str = "main") -> PipelineStats:
    """One process's report: its probe's rows."""
    rows = probe.rows()
    for r in rows:
        r.where = where
    items = probe.items[-1] if probe.items else 0
    stats = PipelineStats(rows, probe.elapsed(), probe.samples or items, items)
    if probe.readahead_shards is not None:
        stats.readahead_shards[where] = probe.readahead_shards
    return stats


def merged(main: Probe, workers: Dict[Tuple[int, Any], Dict[str, Any]]) -> PipelineStats:
    """A WebLoader's report: the main process's stages (the DataLoader, its source, is the wait
    for workers) and the workers' snapshots, keyed ``(worker id, pid)``: the latest of each
    process, added up per worker id (non-persistent workers are new processes every epoch)."""
    rows: List[StageTime] = []
    wait = None
    for i, r in enumerate(main.rows()):
        if i == 0:
            wait = r.seconds
            r.name = WAITING
        r.where = "main"
        rows.append(r)
    by_worker: Dict[int, List[Dict[str, Any]]] = {}
    for (worker, _pid), snap in workers.items():
        by_worker.setdefault(worker, []).append(snap)
    samples = 0
    per_worker: Dict[str, Dict[str, Any]] = {}
    depths = {} if main.readahead_shards is None else {"main": main.readahead_shards}
    for w, snaps in sorted(by_worker.items()):
        where = f"worker {w}"
        own = _totals((StageTime(*row) for snap in snaps for row in snap["rows"]), where)
        rows.extend(own.values())
        elapsed = sum(snap["elapsed"] for snap in snaps)
        done = sum(snap["samples"] for snap in snaps)
        # The rest of a worker's time: its batches queued, waiting for the main process (or
        # pickled on their way there).
        busy = sum(row.seconds for row in own.values())
        rows.append(StageTime(IDLE, max(0.0, elapsed - busy), 0, where=where))
        samples += done
        depth = snaps[-1].get("readahead_shards")
        if depth is not None:
            depths[where] = depth
        per_worker[str(w)] = {
            "samples": done,
            "elapsed_s": elapsed,
            "samples_per_s": done / elapsed if elapsed else 0.0,
        }
    batches = main.items[-1] if main.items else 0
    stats = PipelineStats(rows, main.elapsed(), samples, batches, wait, per_worker)
    stats.readahead_shards = depths
    return stats
