"""WebLoader: a PyTorch ``DataLoader`` followed by chainable stages that run in the main process.

``WebLoader(dataset, batch_size=None, num_workers=4).unbatched().shuffle(1000).batched(64)``
mixes samples across workers and rebatches them; ``.with_epoch(n)`` fixes the number of batches
per epoch, ``.with_length(n)`` declares ``len()``.

With a balanced :class:`~webds.fluent.WebDataset` (an index and ``balance=``), ``len(loader)`` is
the exact number of batches this rank yields per epoch (also after ``.unbatched()...batched(n)``
in the main process), and ``state_dict()`` / ``load_state_dict()`` resume mid-epoch with exactly
the samples that were still to come. What the workers read reaches this process through the
worker channel (:mod:`webds.channel`).

``num_workers="auto"`` measures the dataset before the loader starts and picks worker processes
or threads (:func:`choose_workers`, a pure function of what was measured).
"""

from __future__ import annotations

import copy
import logging
import os
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader

from .base.ledger import Ledger, Pass, item_id
from .base.redact import redact
from .base.saved import PipelineState, read_states
from .base.stage import Length
from .base.workers import usable_cpus, worker_info
from .channel import EnvelopeCollate, StreamKeeper, WorkerChannel, WorkerMirrors
from .counting import source_counts
from .epochs import carries, count_shards, shard_pass_length
from .errors import ArgumentError, LengthError
from .fluent import FluentMixin, LoaderShape
from .pipeline import DataPipeline
from .shards.datasets import SimpleShardList
from .stages.autotune import (
    LoaderChoice,
    Measured,
    choose_workers,
    contested,
    generators_kept,
    measure_dataset,
    measure_loader,
    rereading_effect,
    settled_by_running,
    threadable,
    worker_count,
)
from .stages.mix import RandomMix, RoundRobin
from .stages.probe import PipelineStats, Probe, merged
from .stages.threads import check_threads

__all__ = ["WebLoader", "LoaderSource", "LoaderChoice", "Measured", "choose_workers"]

log = logging.getLogger("webds")

#: ``WebLoader(num_workers="auto")``.
AUTO = "auto"


class WebLoader(DataPipeline, FluentMixin):
    """``DataLoader(*args, **kwargs)`` as the source of a pipeline (a :class:`LoaderSource`).

    Each ``iter()`` hands the loader's epoch to its dataset (``dataset.set_epoch``) before the
    workers start; ``set_epoch(e)`` chooses it, as ``DistributedSampler.set_epoch`` does. With a
    webds dataset, each item a worker yields comes with what its ledger recorded
    (:mod:`webds.channel`), so :meth:`state_dict` knows exactly what the training loop has
    received, whatever sits in the queues. ``close()`` (or a ``with`` block) stops the workers.

    ``threads=N`` runs the dataset's per-sample stages that take ``threads=`` (decode, map,
    map_tuple) and were not given it in N threads, in whichever process runs them; samples,
    order, errors and resume stay as without (:mod:`webds.stages.threads`).
    ``num_workers="auto"`` reads a throwaway copy of the dataset for half a second, and again
    with ``threads`` = cores when it has such stages, and lets :func:`choose_workers` pick the
    worker processes or the threads, running both for real where they contest it
    (``choice``, ``stats()`` and a log line say what and why);
    a loaded state's workers win over a new measurement. docs/api/loading.md has more.
    """

    def __init__(
        self,
        *args: Any,
        batch_buffers: bool = True,
        stats: bool = False,
        threads: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        #: What ``num_workers="auto"`` chose (None: the workers were given).
        self.choice: Optional[LoaderChoice] = None
        given = kwargs  # to make the DataLoader again with a loaded state's workers
        self._threads_chosen = threads is None  # auto's to choose (not given by hand)
        if kwargs.get("num_workers") == AUTO:
            with generators_kept():
                self.choice = _auto(args, kwargs, measure_threads=threads is None)
            kwargs = _with_workers(kwargs, self.choice.num_workers)
            threads = self.choice.threads or threads
        loader = DataLoader(*args, **kwargs)
        if threads is not None:
            threads = check_threads("WebLoader", threads)
            if not isinstance(loader.dataset, DataPipeline):
                raise ArgumentError(
                    f"WebLoader(threads={threads}) runs a webds dataset's stages in threads; "
                    f"{type(loader.dataset).__name__} is not one: give its stages threads= "
                    "yourself"
                )
            loader.dataset.threads = threads
        super().__init__(LoaderSource(loader, batch_buffers=batch_buffers))
        if stats:
            # Each worker's copy of the dataset's probe measures that worker (see stats()).
            self.probe = Probe()
            if isinstance(loader.dataset, DataPipeline):
                loader.dataset.probe = Probe()
        self.seed = getattr(loader.dataset, "seed", None)
        self._made = (args, given, batch_buffers)

    def load_state_dict(self, state: Any, strict: bool = True) -> None:
        """:meth:`DataPipeline.load_state_dict`; a loader that chose its workers
        (``num_workers="auto"``) takes the number the state was saved with, and the threads it
        ran with them (unless ``threads=`` was given), so that it resumes exactly whatever this
        process measured, at the speed the saving loader chose."""
        if self.choice is not None:
            states = read_states(state)
            first = states[0] if isinstance(states, list) else states
            saved = first.config.get("num_workers")
            pipeline = isinstance(self.loader.dataset, DataPipeline)  # (a bare mix has none)
            now = threads = self.loader.dataset.threads if pipeline else 0
            if self._threads_chosen and pipeline and isinstance(saved, int):
                # A state older than the record of threads: none with workers, else as chosen.
                recorded = first.config.get("threads")
                if isinstance(recorded, int):
                    threads = recorded
                elif saved != self.loader.num_workers:
                    threads = 0
            if isinstance(saved, int) and (saved != self.loader.num_workers or threads != now):
                if saved != self.loader.num_workers:
                    args, given, batch_buffers = self._made
                    self.pipeline[0].close()
                    loader = DataLoader(*args, **_with_workers(given, saved))
                    self.pipeline[0] = LoaderSource(loader, batch_buffers)
                if pipeline:
                    self.loader.dataset.threads = threads
                self.choice = self.choice.taken(saved, threads if self._threads_chosen else 0)
                log.info("webds: WebLoader(num_workers='auto') took %s", self.choice)
        super().load_state_dict(state, strict)

    @property
    def loader(self) -> DataLoader:
        """The underlying ``DataLoader``."""
        return self.pipeline[0].loader

    def stats(self) -> PipelineStats:
        """Where the time went since the loader was made (``WebLoader(..., stats=True)``): the
        time the main process waited for batches, the main process's stages, and each worker's
        stages (tar parsing, reading shards, decoding, your maps, batching, collation), with
        samples/s and batches/s. ``print(loader.stats())`` shows a table. A worker reports
        with each batch it sends, so what it read after its last batch (samples a stage
        dropped at the end of its share) is not counted."""
        if self.probe is None:
            raise ArgumentError("stats() needs a loader made with WebLoader(..., stats=True)")
        stats = merged(self.probe, self.pipeline[0].mirrors.worker_stats)
        stats.setting = None if self.choice is None else str(self.choice)
        return stats


def _auto(args: tuple, kwargs: Dict[str, Any], measure_threads: bool) -> LoaderChoice:
    """What ``num_workers="auto"`` chooses for ``DataLoader(*args, **kwargs)`` (threads only
    if ``measure_threads``: not when they were given)."""
    dataset = args[0] if args else kwargs.get("dataset")
    if isinstance(dataset, (RandomMix, RoundRobin)):
        # webds's own mix of datasets (each looked into below): measured as a pipeline's
        # source, the loader still reads it bare, as given.
        dataset = DataPipeline(dataset)
    if not isinstance(dataset, DataPipeline):
        raise ArgumentError(
            "WebLoader(num_workers='auto') measures a webds dataset; "
            f"{type(dataset).__name__} is not one: give num_workers yourself"
        )
    source = dataset.pipeline[0] if dataset.pipeline else None
    effect = rereading_effect(dataset)
    if effect is not None:
        raise ArgumentError(
            "WebLoader(num_workers='auto') measures by reading a copy of the dataset's first "
            f"samples, and reading this dataset twice would act on the world: {effect}. Give "
            "num_workers yourself (0, or a number of worker processes; threads=N for threads)"
        )
    batch = kwargs.get("batch_size", 1) if len(args) < 2 else args[1]
    # Workers share the shards of a plain list (one with an index shares samples; resampled
    # shards are drawn by every worker): more workers than shards would idle.
    urls = getattr(source, "urls", None) if isinstance(source, SimpleShardList) else None
    shards = None
    if isinstance(urls, list) and getattr(dataset, "plan", None) is None:
        shards = max(1, len(urls) // max(1, worker_info().world_size))
    cores = usable_cpus()
    threaded = None
    if measure_threads and cores > 1 and threadable(dataset):
        threaded = measure_dataset(dataset, threads=cores)
    measured = measure_dataset(dataset, as_worker=True)
    choice = choose_workers(measured, batch or 1, cores, shards, threaded)
    if contested(choice):
        # The workers' speed above is an estimate, the threads' a measurement: run both.
        def run(workers: int, threads: Optional[int]) -> "WebLoader":
            # No timeout= of yours: measure_loader bounds the run, and a worker slower to start
            # than your timeout loses the contest instead of failing the constructor.
            kw = _with_workers({**kwargs, "persistent_workers": False, "timeout": 0}, workers)
            kw.pop("dataset", None)
            return WebLoader(copy.deepcopy(dataset), *args[1:], threads=threads, **kw)

        n = choice.num_workers or worker_count(cores, shards)
        ran = measure_loader(lambda: run(n, None), f"num_workers={n}", warm=n + 1)
        threaded_ran = measure_loader(lambda: run(0, cores), f"threads={cores}", warm=1)
        choice = settled_by_running(choice, ran, threaded_ran)
    log.info("webds: WebLoader(num_workers='auto') chose %s", choice)
    return choice


def _with_workers(kwargs: Dict[str, Any], n: int) -> Dict[str, Any]:
    """The DataLoader's keyword arguments with ``n`` workers, persistent unless told not
    (without workers: none of the options DataLoader takes only with workers)."""
    kwargs = dict(kwargs, num_workers=n)
    if n > 0:
        kwargs.setdefault("persistent_workers", True)
    else:
        for name in ("persistent_workers", "prefetch_factor", "multiprocessing_context"):
            kwargs.pop(name, None)
        if kwargs.get("timeout"):
            kwargs["timeout"] = 0  # a worker's batch it waits for: DataLoader refuses it without
    return kwargs


def _pins(loader: DataLoader) -> bool:
    """Whether ``loader`` pins its batches: ``pin_memory=True`` and an accelerator to pin
    them for (as torch's DataLoader decides)."""
    if not loader.pin_memory:
        return False
    accelerator = getattr(torch, "accelerator", None)  # (torch 2.6 and later)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


class LoaderSource(StreamKeeper):
    """A ``DataLoader`` as the source of a pipeline (a :class:`WebLoader`'s).

    It is counted (its workers' streams in turn: see :meth:`stream_counts`), and with a webds
    dataset it keeps each worker's stream (:mod:`webds.channel`): the pipeline's state holds
    them, and a loaded state resumes each worker where it was.
    """

    exact = False  # the datasets in the workers keep their own counts exact

    def __init__(self, loader: DataLoader, batch_buffers: bool = True) -> None:
        self.loader = loader
        dataset = loader.dataset
        if hasattr(dataset, "loader_shape"):
            # Lets a balanced dataset align its workers' shares to the loader's batches.
            dataset.loader_shape = LoaderShape(max(1, loader.num_workers), loader.batch_size)
        if isinstance(dataset, DataPipeline):
            if dataset.channel is None:
                dataset.channel = WorkerChannel()
            single = loader.batch_size is None and loader.batch_sampler is None
            # Reused shared buffers (webds.stages.batchbuffers) save the main process most of its
            # work per batch; a pinned copy is made from torch's own transfer instead (torch
            # pins only where there is an accelerator: pin_memory=True on a CPU does nothing).
            pack = batch_buffers and loader.num_workers > 0 and not _pins(loader)
            dataset.channel.packs = pack
            loader.collate_fn = EnvelopeCollate(loader.collate_fn, dataset, single)
        # This process's copy of each worker's stream, kept from the batches' envelopes.
        self.mirrors = WorkerMirrors(loader.num_workers, loader.batch_size)
        self._loaded: Optional[PipelineState] = None  # a state's workers, for the next pass
        # The workers' with_epoch streams go on in new worker processes (not persistent).
        self._handing_over = False
        self._epoch = 0  # the pass the DataLoader reads next
        self._reading: Any = None  # the DataLoader iterator of the epoch being read
        self._stopper: Optional[weakref.finalize] = None  # see _stoppable

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_reading"] = state["_stopper"] = None  # a running iterator stays here
        if getattr(self.loader, "_iterator", None) is not None:
            # Persistent workers stay here too (torch cannot pickle them): the copy starts its
            # own when it is read, as a loader does before its first epoch.
            state["loader"] = copy.copy(self.loader)
            state["loader"]._iterator = None
        return state

    def __repr__(self) -> str:
        # The dataset says which shards are read (a DataLoader's own repr says nothing).
        loader = self.loader
        dataset = repr(loader.dataset).replace("\n", "\n    ")
        return redact(
            f"LoaderSource(DataLoader({dataset}, batch_size={loader.batch_size}, "
            f"num_workers={loader.num_workers}))"
        )

    # -- the pipeline's questions (see webds.channel.StreamKeeper) --------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Each pass: the dataset reads it (its workers get a fresh copy, or are persistent)."""
        self._epoch = int(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def choose_epoch(self, epoch: int, changed: bool) -> None:
        if changed:
            self.restart_workers()
            self._loaded, self._handing_over = None, False
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)  # so that len() is this epoch's

    def config(self) -> Dict[str, Any]:
        config: Dict[str, Any] = {}
        if hasattr(self.dataset, "_resume_config"):
            config["dataset"] = self.dataset._resume_config()
        config["num_workers"] = self.loader.num_workers
        config["batch_size"] = self.loader.batch_size
        if isinstance(self.dataset, DataPipeline):
            # How fast, not what: not compared on loading (see SPEED_ONLY), read by auto.
            config["threads"] = self.dataset.threads
        return config

    def planned(self) -> Optional[Tuple[Any, int, int]]:
        inner = getattr(self.dataset, "_planned", None)
        planned = inner() if inner is not None else None
        return None if planned is None else (planned[0], planned[1], self.loader.num_workers)

    def save(self, state: PipelineState, stream: Optional[Pass]) -> None:
        if not isinstance(self.dataset, DataPipeline):
            return
        # The pipeline's own ledger only holds workers' samples (in its shuffle buffers and
        # batches): they are holes in those workers' records.
        held = stream.ledger.held_items() if stream is not None else []
        pass_ = stream.number if stream is not None else state.epoch
        state.workers, state.next_worker = self.mirrors.save(held, pass_)

    def load(self, state: Optional[PipelineState]) -> None:
        self.mirrors.clear()
        self._handing_over = False
        self._loaded = state if state is not None and state.workers else None
        self.restart_workers()

    def epoch_done(self) -> None:
        # Workers that are not persistent end with the epoch: a with_epoch stream is handed
        # over to the next epoch's workers (see numbered), from their ledgers' copies here.
        self._handing_over = self._carried() and not self._carries()
        self.mirrors.epoch_done(self._carries() or self._handing_over)

    def numbered(self, ledger: Ledger, keeps: bool) -> Iterator[Any]:
        """The DataLoader's items; a webds dataset's come in envelopes, whose ledger records are
        kept per worker (:class:`~webds.channel.WorkerMirrors`) as the items arrive."""
        dataset = self.dataset
        channel = getattr(dataset, "channel", None)
        if channel is None:
            # Not a webds pipeline: each item is one id, and resuming reads them again.
            for k, item in enumerate(self.loader):
                ledger.produce(item_id(k))
                yield item
            return
        plan = dataset.aligned_plan() if hasattr(dataset, "aligned_plan") else None
        if plan is not None:
            plan.warn_split(max(1, self.loader.num_workers))
        loaded, self._loaded = self._loaded, None
        handing_over, self._handing_over = self._handing_over, False
        if not self._carries() and not handing_over:
            self.mirrors.clear()
        if loaded is not None and (loaded.epoch if loaded.pass_ is None else loaded.pass_) == (
            self._epoch
        ):
            channel.starts = self.mirrors.resume(loaded, self._epoch)
        elif handing_over:
            channel.starts = self.mirrors.hand_over(self._epoch)
        elif self._epoch and self._carried() and self._new_workers():
            count_shards(dataset)  # here, once, not in every worker (see epochs.carry_start)
        # torch's worker loop seeds numpy.random first thing. Imported here, before the workers
        # fork, so that no forked worker imports it while a thread of this process (the last
        # iterator's queue feeders) may hold CPython's import state: a worker died so, 1 run in 8.
        import numpy.random  # noqa: F401

        # Open only while the DataLoader starts (its workers copy the dataset; without workers
        # it calls iter(dataset) now): the same dataset used elsewhere yields plain items.
        channel.open = True
        try:
            it = iter(self.loader)
        finally:
            channel.open = False
            channel.starts = {}  # the workers (or this process's iterator) have their copy
        self._reading = it
        self._stoppable(it)
        try:
            yield from self.mirrors.receive(it, ledger, keeps)
        finally:
            if self._reading is it:
                self._reading = None
            if not self.loader.persistent_workers:
                _shut_down(it)  # closed mid-epoch: its workers stop now, not when collected
                self._stopped(it)

    def close(self) -> None:
        """Stop the workers (``WebLoader.close()``, the end of a ``with`` block), those of an
        epoch still being read included."""
        reading, self._reading = self._reading, None
        if reading is not None:
            _shut_down(reading)
            self._stopped(reading)
        self.restart_workers()

    def restart_workers(self) -> None:
        """Stop persistent workers: they keep their own copy of the dataset, with its own epoch,
        and must start afresh to take a new epoch or resume position."""
        it = getattr(self.loader, "_iterator", None)
        if it is not None:
            _shut_down(it)
            self._stopped(it)
            self.loader._iterator = None

    def _stoppable(self, it: Any) -> None:
        """Have the workers of ``it`` stopped when this source is collected. A dropped loader
        is often collected as a reference cycle (a with_epoch stream's generators hold their
        pipeline), and the iterator with it, after the collector has already closed the
        iterator's queues: each worker then exits only when its 5-second poll sees the stop.
        The finalizer holds the iterator, which keeps it and its queues out of that garbage,
        and stops it first."""
        if getattr(it, "_shutdown_workers", None) is None:
            return  # no workers
        if self._stops(it):
            return  # persistent workers: the same iterator again
        if self._stopper is not None:
            self._stopper.detach()
        self._stopper = weakref.finalize(self, _shut_down_in, os.getpid(), it)

    def _stopped(self, it: Any) -> None:
        """``it``'s workers were stopped: its finalizer lets it go."""
        if self._stops(it):
            self._stopper.detach()
            self._stopper = None

    def _stops(self, it: Any) -> bool:
        """Whether the finalizer holds ``it`` (its arguments: the pid, then the iterator)."""
        stopper = self._stopper
        return stopper is not None and stopper.alive and stopper.peek()[2][1] is it

    def _new_workers(self) -> bool:
        """Whether iterating the DataLoader now starts new worker processes."""
        loader = self.loader
        return loader.num_workers > 0 and (
            not loader.persistent_workers or getattr(loader, "_iterator", None) is None
        )

    def _carried(self) -> bool:
        """Whether the dataset's stream goes on from one loader epoch to the next (with_epoch)."""
        dataset = self.dataset
        return (
            isinstance(dataset, DataPipeline) and dataset.nsamples is not None and carries(dataset)
        )

    def _carries(self) -> bool:
        """Whether the dataset's carried stream goes on in the same iterator: in this process
        or in persistent workers."""
        loader = self.loader
        return self._carried() and (loader.num_workers == 0 or loader.persistent_workers)

    # -- counts -----------------------------------------------------------------------------------

    def _worker_counts(self) -> List[Length]:
        """What each worker yields this epoch (batches, when the DataLoader batches), with the
        samples inside them."""
        loader, dataset = self.loader, self.loader.dataset
        workers = max(1, loader.num_workers)
        if not hasattr(dataset, "stream_lengths"):
            raise LengthError(
                f"the length of this WebLoader is unknown: its dataset {type(dataset).__name__} "
                "does not say how many items each worker yields; use .with_epoch(n) or "
                ".with_length(n)"
            )
        return self._batched(source_counts(dataset, workers))

    def _batched(self, counts: List[Length]) -> List[Length]:
        """Each worker's items (``counts``) as the DataLoader's batches of them, if it batches."""
        loader = self.loader
        size = loader.batch_size
        if size is None:
            return counts
        if loader.drop_last:
            return [Length(c.items // size, Length(c.items // size * size)) for c in counts]
        return [Length(-(-c.items // size), c) for c in counts]

    def counted_counts(self, number: int) -> Optional[List[Length]]:
        """:meth:`stream_counts` of pass ``number`` for a dataset without an index whose local
        shards can be counted (:func:`~webds.epochs.carry_start` needs them), else None."""
        dataset, workers = self.dataset, max(1, self.loader.num_workers)
        if not isinstance(dataset, DataPipeline) or not count_shards(dataset):
            return None
        per = [shard_pass_length(dataset, number, w, workers) for w in range(workers)]
        if any(n is None for n in per):
            return None
        return [_total(self._batched([Length(n) for n in per]))]  # type: ignore[arg-type]

    def stream_lengths(self, num_workers: Optional[int] = None) -> List[int]:
        return [n.items for n in self.stream_counts(num_workers)]

    def stream_counts(self, num_workers: Optional[int] = None) -> List[Length]:
        """One stream: the workers' streams arrive interleaved as one; what each batched, summed,
        is what an unbatched() after the loader gets back."""
        return [_total(self._worker_counts())]

    def stream_index(self) -> int:
        return 0


def _shut_down(it: Any) -> None:
    """Stop a DataLoader iterator's workers, if it has any. Dropped in a reference cycle, it
    would be stopped by the garbage collector after its queues were closed: each worker then
    exits only when its 5-second poll sees the stop, and one forked meanwhile inherits it."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _shut_down_in(pid: int, it: Any) -> None:
    """:func:`_shut_down` in the process ``pid`` only: a forked child holds a copy of the
    finalizer, and of its parent's workers, which are not its own to stop."""
    if os.getpid() == pid:
        _shut_down(it)


def _total(counts: List[Length]) -> Length:
    """The sum of several streams' counts, level by level while every stream knows the level."""
    inner = [c.inner for c in counts if c.inner is not None]
    below = _total(inner) if inner and len(inner) == len(counts) else None
    return Length(sum(c.items for c in counts), below)
