"""Choosing a loader's setting by measurement, as tf.data's AUTOTUNE does: what
``WebLoader(num_workers="auto")`` uses. :func:`measure_dataset` reads a throwaway copy of a
pipeline in this process; :func:`choose_workers`, a pure function of what was measured, picks
worker processes or threads. The same measurements always give the same choice, and no choice
changes the data or its order (workers and threads both keep it)."""

from __future__ import annotations

import contextlib
import os
import random
import stat
import sys
import time
from copy import deepcopy
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

from ..base.stage import Stage
from ..errors import ArgumentError
from ..io.urls import local_path, registered_opener, rewrite_url
from ..shards.datasets import ResampledShards, SimpleShardList
from ..shards.plan import PlannedShards
from ..shards.specs import MultiShardSample

__all__ = [
    "LoaderChoice",
    "Measured",
    "Rate",
    "choose_workers",
    "contested",
    "generators_kept",
    "worker_count",
    "measure_dataset",
    "measure_loader",
    "rereading_effect",
    "settled_by_running",
    "threadable",
]

#: About what one DataLoader item costs to cross from a worker to the main process (pickling
#: its envelope, the queues, the shared-memory batch, both sides): 0.5 ms of the main process's
#: CPU per batch of 32 images on the benchmark machine (``mainproc``), as much again in the
#: worker.
TRANSFER_SECONDS = 0.001
#: Workers pay off when making one item takes at least this many transfers' time: below it, a
#: worker would spend a fifth or more of its time sending, and the main process receiving.
WORTH_WORKERS = 5
#: How long ``num_workers="auto"`` reads the dataset to measure it (after the first item,
#: which pays for opening the first shard and first imports).
MEASURE_SECONDS = 0.5
#: Threads in one process are chosen over none when they make items at least this much faster:
#: the measurement's own spread (two half-second reads on a busy machine) stays below it.
THREADS_GAIN = 1.1


@dataclass(frozen=True)
class Measured:
    """The dataset read in this process (a copy, thrown away): ``items`` after the first, in
    ``seconds`` of wall time and ``cpu_seconds`` of this process's CPU time."""

    items: int
    seconds: float
    cpu_seconds: float

    @property
    def per_item(self) -> float:
        """Wall time per item."""
        return self.seconds / self.items if self.items else 0.0

    @property
    def cpu_per_item(self) -> float:
        """CPU time per item (every thread of this process: read-ahead, decoding pools)."""
        return self.cpu_seconds / self.items if self.items else 0.0


@dataclass(frozen=True)
class LoaderChoice:
    """What ``WebLoader(num_workers="auto")`` chose, from what, and why: ``num_workers``
    worker processes, or ``threads`` for the dataset's stages in this process (0: none)."""

    num_workers: int
    measured: Measured
    items_per_transfer: int
    cores: int
    shards: Optional[int]
    reason: str
    threads: int = 0
    #: The same read with ``threads`` = ``cores`` (None: not measured).
    threaded: Optional[Measured] = None
    #: The loader run for real with each contested setting (:func:`settled_by_running`).
    ran: Tuple["Rate", ...] = ()

    def taken(self, num_workers: int, threads: int = 0) -> "LoaderChoice":
        """This choice overridden by a loaded state's number of workers and threads."""
        why = f"the loaded state's ({self.setting} measured: {self.reason})"
        return replace(self, num_workers=num_workers, reason=why, threads=threads)

    @property
    def setting(self) -> str:
        """``num_workers=N``, and ``threads=T`` when threads were chosen."""
        threads = f", threads={self.threads}" if self.threads else ""
        return f"num_workers={self.num_workers}{threads}"

    def __str__(self) -> str:
        return f"{self.setting}: {self.reason}"


#: How long each contested setting is run for real (after its first items).
RUN_SECONDS = 1.0


@dataclass(frozen=True)
class Rate:
    """A loader run for real with ``setting``: ``items`` it yielded in ``seconds`` (after the
    first ones, while its workers started and their queues filled); ``ended``: the loader ran
    out first (what its workers had queued ahead came out at once: too short to tell)."""

    setting: str
    items: int
    seconds: float
    ended: bool = False

    @property
    def per_second(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return f"{self.setting}: {self.per_second:.1f} items/s"


def measure_loader(
    make: Callable[[], Any], setting: str, warm: int, seconds: Optional[float] = None
) -> Rate:
    """Run the loader ``make()`` returns: pass its first ``warm`` items, count the next for
    about ``seconds`` (:data:`RUN_SECONDS`; at most four times that, waiting for a second
    item), and close it."""
    seconds = RUN_SECONDS if seconds is None else seconds
    loader = make()
    try:
        it = iter(loader)
        for _ in range(warm):
            if next(it, _END) is _END:
                return Rate(setting, 0, 0.0, ended=True)
        start, n = time.perf_counter(), 0
        for _ in it:
            n += 1
            elapsed = time.perf_counter() - start
            if (elapsed >= seconds and n >= 2) or elapsed >= 4 * seconds:
                return Rate(setting, n, elapsed)
        return Rate(setting, n, time.perf_counter() - start, ended=True)
    finally:
        loader.close()


def settled_by_running(choice: LoaderChoice, workers: Rate, threads: Rate) -> LoaderChoice:
    """``choice`` (workers, by an estimate) checked against the loader run for real with those
    workers and with a thread per core instead: threads win when they yielded at least
    1 / ``THREADS_GAIN`` as many items a second (a tie goes to them). An estimate of what
    crossing between processes costs is right on one machine and wrong on the next (a float
    batch of 38 MB, a slower shared memory); the run is not. A run that ended before its time,
    or yielded too few items to tell: the estimate stands."""
    ran = replace(choice, ran=(workers, threads))
    if any(r.ended or r.items < 3 for r in (workers, threads)):
        return ran
    why = f"{choice.reason}; run for real: {workers}, {threads}"
    # A tie goes to the threads: no process to start, nothing to send, one copy in memory.
    if threads.per_second * THREADS_GAIN < workers.per_second:
        n = int(workers.setting.rpartition("=")[2])
        return replace(ran, num_workers=n, threads=0, reason=f"{why}: workers")
    if choice.num_workers == 0:  # the estimate's own choice, in this process, stands
        return replace(ran, reason=f"{why}: not workers")
    return replace(ran, num_workers=0, threads=choice.cores, reason=f"{why}: threads")


def contested(choice: LoaderChoice) -> bool:
    """Whether ``choice`` is to be run for real (:func:`settled_by_running`): threads were
    measured, and workers were chosen by estimate, or might pay for an item's wall time where
    its CPU time said they would not (a stage waiting with the GIL held, which threads can't
    overlap)."""
    if choice.threaded is None or choice.cores < 2:
        return False
    wall = choice.measured.per_item * max(1, choice.items_per_transfer)
    return choice.num_workers > 0 or wall >= WORTH_WORKERS * TRANSFER_SECONDS


def worker_count(cores: int, shards: Optional[int]) -> int:
    """One worker per core, at most one per shard (a worker without a shard idles)."""
    return max(1, cores if shards is None else min(cores, shards))


def choose_workers(
    measured: Measured,
    items_per_transfer: int,
    cores: int,
    shards: Optional[int],
    threaded: Optional[Measured] = None,
) -> LoaderChoice:
    """Worker processes or threads for a dataset that made ``measured`` in this process (and
    ``threaded`` with a thread per core in its stages that take ``threads=``, if measured).

    Workers: none when an item the DataLoader sends (``items_per_transfer`` dataset items) takes
    under ``WORTH_WORKERS`` transfers' CPU time to make (workers would spend that long sending
    it), else one per core, at most one per shard (``shards``, when known: a worker without a
    shard idles). Threads (one per core) instead, when they made items at least as fast as
    those workers would, each making an item in the CPU time measured plus its transfer; or,
    where workers don't pay, ``THREADS_GAIN`` times as fast as one thread.

    CPU time, not wall time, for workers: waiting for storage or the network is left to the
    read-ahead of one process (``readahead_shards`` in flight), which keeps a slow link busier
    than workers do (the benchmark's ``link`` workload)."""
    made = measured.cpu_per_item * max(1, items_per_transfer)
    facts = (
        f"{measured.cpu_per_item * 1e3:.3f} ms of CPU ({measured.per_item * 1e3:.3f} ms of wall "
        f"time) per dataset item in one process ({measured.items} measured), "
        f"{made * 1e3:.2f} ms of CPU per item sent"
    )
    choice = partial(
        LoaderChoice,
        measured=measured,
        items_per_transfer=items_per_transfer,
        cores=cores,
        shards=shards,
        threaded=threaded,
    )
    if measured.items == 0:
        return choice(0, reason="nothing to measure: no workers")
    n = worker_count(cores, shards)
    workers = made >= WORTH_WORKERS * TRANSFER_SECONDS
    if threaded is not None and threaded.items and cores > 1:
        rate = threaded.items / threaded.seconds
        facts += f"; {rate:.0f} items/s with {cores} threads"
        if workers:
            bar = n / (measured.cpu_per_item + TRANSFER_SECONDS / max(1, items_per_transfer))
            than = f"{n} workers' {bar:.0f}"
        else:
            one = measured.items / measured.seconds
            bar, than = THREADS_GAIN * one, f"{THREADS_GAIN} times one thread's {one:.0f}"
        if rate >= bar:
            return choice(0, reason=f"{facts}: threads, as fast as {than}", threads=cores)
        facts += f", slower than {than}"
    if not workers:
        return choice(0, reason=f"{facts}: too little work to send between processes")
    why = f"{facts}: one worker per core ({cores})" + (
        f", at most one per shard ({shards})" if shards is not None else ""
    )
    return choice(n, reason=why)


def rereading_effect(dataset: Any) -> Optional[str]:
    """Why reading a copy of ``dataset`` would act on the world, or None when it would not.

    Decided by allow-list, at every depth (a pipeline inside a pipeline, the datasets of a
    mix): a copy may read again only webds's shard lists over stored files (local regular
    files, remote objects) and lists of such shards. Refused: ``-`` (standard input, eaten by
    the first read), ``pipe:`` commands (run again), local files that are not regular files (a
    FIFO, ``/dev/stdin``), schemes with an opener you registered, sources that claim or delete
    the files they read, and any other source (a generator, a dataset or callable of yours):
    webds can't tell what reading them twice does."""
    return _effect(dataset, 0)


def _effect(obj: Any, depth: int) -> Optional[str]:
    if depth > 16:
        return f"{type(obj).__name__} nests sources deeper than webds looks"
    name = type(obj).__name__
    if getattr(obj, "claims_files", False):
        return f"{name} claims (or deletes) the files it reads"
    pipeline = getattr(obj, "pipeline", None)
    if isinstance(pipeline, list) and hasattr(obj, "iterator"):  # a DataPipeline
        for part in pipeline:
            if getattr(part, "claims_files", False):
                return f"{type(part).__name__} claims (or deletes) the files it reads"
        return _effect(pipeline[0], depth + 1) if pipeline else None
    if isinstance(getattr(obj, "datasets", None), list) and hasattr(obj, "set_epoch"):
        return _first(_effect(d, depth + 1) for d in obj.datasets)  # a mix of datasets
    if type(obj) in _SHARD_LISTS:  # exactly these: a subclass may read otherwise
        if isinstance(obj, MultiShardSample):  # the urls of each of its sources
            urls = [u for source in obj.sources for u in source.urls]
        else:
            urls = obj.urls
        return _first(_url_effect(u) for u in urls)
    return (
        f"the source {name} is not a webds shard list, and webds can't tell what reading it "
        "twice does (a generator is used up, a command runs again)"
    )


# webds's own shard sources, which only yield their shards' URLs.
_SHARD_LISTS = (SimpleShardList, ResampledShards, PlannedShards, MultiShardSample)


def _url_effect(url: Any) -> Optional[str]:
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        return f"the source yields {type(url).__name__} items, not shard URLs"
    opened = rewrite_url(url)  # what is opened: GOPEN_REWRITE's rules applied, once
    effect = _opened_effect(opened)
    if effect is not None and opened != url:
        effect += f" (GOPEN_REWRITE rewrote {url!r} to it)"
    return effect


def _opened_effect(url: str) -> Optional[str]:
    if url == "-":
        return "its shard '-' is standard input, which the first read uses up"
    if url.startswith("pipe:"):
        return f"its shard {url!r} is a command, which would run once more"
    if registered_opener(url) is not None:
        return f"its shard {url!r} is opened by an opener you registered"
    path = local_path(url)
    if path is not None:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return None  # missing: the epoch's own read says so
        if not stat.S_ISREG(mode):
            return f"its shard {url!r} is not a regular file (a pipe or device reads once)"
    return None


def _first(effects: Iterable[Optional[str]]) -> Optional[str]:
    return next((e for e in effects if e is not None), None)


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """The process's random generators (``random``'s, numpy's and torch's, CUDA's where it was
    started) as they were before the block: what ``auto`` measures runs your stages, which may
    draw from them (``random.random()``, a flip by ``torch.rand``), and the DataLoaders it runs
    draw their workers' seeds from torch's. Without this, the loader it chose would not yield
    what the same loader given by hand yields after the same ``torch.manual_seed``."""
    numpy = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    torch_state = torch.get_rng_state() if torch is not None else None
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
        if torch is not None:
            torch.set_rng_state(torch_state)
        if cuda:
            torch.cuda.set_rng_state_all(cuda_states)


def measure_dataset(
    dataset: Any, seconds: Optional[float] = None, threads: int = 0, as_worker: bool = False
) -> Measured:
    """Read a copy of ``dataset`` in this process for about ``seconds`` (default
    :data:`MEASURE_SECONDS`) after its first item, its stages that take ``threads=`` (and were
    not given it) on ``threads`` threads, and throw it away: the dataset itself is not touched.
    ``as_worker``: with torch at one intra-op thread meanwhile, as in a DataLoader worker (where
    the main process's torch threads would spin beside the work, and size a worker's share of
    it wrong)."""
    try:
        copy = deepcopy(dataset)  # (lambdas and local functions too, which pickle refuses)
    except Exception as exn:
        raise ArgumentError(
            f"WebLoader(num_workers='auto') measures a copy of the dataset, and it can't be "
            f"copied ({type(exn).__name__}: {exn}): give num_workers yourself"
        ) from exn
    seconds = MEASURE_SECONDS if seconds is None else seconds
    copy.threads, copy.probe = threads, None
    torch = sys.modules.get("torch") if as_worker else None
    before = torch.get_num_threads() if torch is not None else 1
    if torch is not None:
        torch.set_num_threads(1)
    try:
        return _measure(copy, seconds)
    finally:
        if torch is not None:
            torch.set_num_threads(before)


def _measure(copy: Any, seconds: float) -> Measured:
    with copy:
        it = copy.iterator()
        try:
            if next(it, _END) is _END:
                return Measured(0, 0.0, 0.0)
            wall, cpu, n = time.perf_counter(), time.process_time(), 0
            for _ in it:
                n += 1
                if time.perf_counter() - wall >= seconds:
                    break
            return Measured(n, time.perf_counter() - wall, time.process_time() - cpu)
        finally:
            it.close()


_END = object()


def threadable(dataset: Any) -> bool:
    """Whether ``dataset`` has stages that take ``threads=`` and were not given it."""
    return any(
        isinstance(s, Stage) and s.factory.takes_threads and not s._given("threads")
        for s in dataset.pipeline
    )
