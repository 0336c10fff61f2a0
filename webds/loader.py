"""WebLoader: a PyTorch ``DataLoader`` followed by chainable stages that run in the main process.

``WebLoader(dataset, batch_size=None, num_workers=4).unbatched().shuffle(1000).batched(64)``
mixes samples across workers and rebatches them; ``.with_epoch(n)`` fixes the number of batches
per epoch, ``.with_length(n)`` declares ``len()``.

With a balanced :class:`~webds.fluent.WebDataset` (an index and ``balance=``), ``len(loader)`` is
the exact number of batches this rank yields per epoch (also after ``.unbatched()...batched(n)``
in the main process), and ``state_dict()`` / ``load_state_dict()`` resume mid-epoch with exactly
the samples that were still to come.
"""

from __future__ import annotations

import sys
import weakref
from time import perf_counter
from typing import Any, Dict, Iterator, List, Optional, Tuple

from torch.utils.data import DataLoader

from .counting import check_state, restore_entropy, source_counts, with_topology
from .errors import ArgumentError, LengthError
from .fluent import FluentMixin
from .pipeline import DataPipeline
from .shards.elastic import every_rank, plan_elsewhere, topology_changed
from .shards.shardlists import worker_info
from .stages.batchbuffers import Packed, SlotPool, Unpacker
from .stages.core import Length
from .stages.ledger import PAD, Envelope, Ledger, Restored, ids_of, qualify, unqualify
from .stages.probe import PipelineStats, Probe, merged

__all__ = ["WebLoader"]


class WebLoader(DataPipeline, FluentMixin):
    """``DataLoader(*args, **kwargs)`` as the source of a pipeline.

    Each ``iter()`` hands the loader's epoch to its dataset (``dataset.set_epoch``) before the
    workers start, so shard and sample shuffles change every epoch even though non-persistent
    workers get a fresh copy of the dataset each time. ``set_epoch(e)`` chooses the epoch, as
    ``DistributedSampler.set_epoch`` does.

    With a webds dataset, every item a worker yields comes with what the worker's ledger
    recorded (see :mod:`webds.stages.ledger`), so :meth:`state_dict` knows exactly which samples
    the training loop has received, whatever sits in the DataLoader's queues.
    """

    def __init__(
        self, *args: Any, batch_buffers: bool = True, stats: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(DataLoader(*args, **kwargs))
        dataset = self.loader.dataset
        if stats:
            # Each worker's copy of the dataset's probe measures that worker (see stats()).
            self.probe = Probe()
            if isinstance(dataset, DataPipeline):
                dataset.probe = Probe()
        # The latest probe snapshot of each worker process: {(worker id, pid): snapshot}.
        self._worker_stats: Dict[Tuple[int, Any], Dict[str, Any]] = {}
        if hasattr(dataset, "loader_hint"):
            # Lets a balanced dataset align its workers' shares to the loader's batches.
            dataset.loader_hint = (max(1, self.loader.num_workers), self.loader.batch_size)
        self.seed = getattr(dataset, "seed", None)
        if isinstance(dataset, DataPipeline):
            single = self.loader.batch_size is None and self.loader.batch_sampler is None
            # Reused shared buffers (webds.stages.batchbuffers) save the main process most of its
            # work per batch; a pinned copy is made from torch's own transfer instead.
            pack = batch_buffers and self.loader.num_workers > 0 and not self.loader.pin_memory
            self.loader.collate_fn = _EnvelopeCollate(self.loader.collate_fn, dataset, single, pack)
        # Per DataLoader iterator (one for persistent workers; two live iterators, two).
        self._unpackers: "weakref.WeakKeyDictionary[Any, Unpacker]" = weakref.WeakKeyDictionary()
        self._worker_resume: Optional[Dict[str, Any]] = None
        # Per DataLoader worker: the copy of its ledger, its pass and the items it has yielded.
        self._mirrors: Dict[int, Dict[str, Any]] = {}
        # The worker whose batch came last: the DataLoader's turn order goes on after it.
        self._last_worker: Optional[int] = None
        # Resuming: the workers' Restored batches still to come (see _source_items).
        self._restoring = 0

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # a WebLoader pickled by webds 0.1 lacks these
        self.__dict__.setdefault("_worker_resume", None)
        self.__dict__.setdefault("_mirrors", {})
        if self.__dict__.get("_unpackers") is None:
            self._unpackers = weakref.WeakKeyDictionary()
        self.__dict__.setdefault("_worker_stats", {})
        self.__dict__.setdefault("_last_worker", None)
        self.__dict__.setdefault("_restoring", 0)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_unpackers": None}  # (mapped memory: not sent)

    @property
    def loader(self) -> DataLoader:
        """The underlying ``DataLoader``."""
        return self.pipeline[0]

    def stats(self) -> PipelineStats:
        """Where the time went since the loader was made (``WebLoader(..., stats=True)``): the
        time the main process waited for batches, the main process's stages, and each worker's
        stages (tar parsing, reading shards, decoding, your maps, batching, collation), with
        samples/s and batches/s. ``print(loader.stats())`` shows a table. A worker reports
        with each batch it sends, so what it read after its last batch (samples a stage
        dropped at the end of its share) is not counted."""
        if self.probe is None:
            raise ArgumentError("stats() needs a loader made with WebLoader(..., stats=True)")
        return merged(self.probe, self._worker_stats)

    def _origin(self) -> Optional[Any]:
        return 0, _LoaderOrigin(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` (persistent workers are restarted if
        they would otherwise run another one)."""
        if int(epoch) != self.epoch:
            self._restart_workers()
            self._worker_resume = None
        super().set_epoch(epoch)
        dataset = self.loader.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)  # so that len() is this epoch's

    def load_state_dict(self, state: Any, strict: bool = True) -> None:
        """Continue where :meth:`state_dict` was taken: the rest of that epoch's samples.

        Works across processes: build the same loader (same dataset, seed, index, world size,
        ``num_workers``, batch size), then load this rank's state (or the list of every rank's).
        Persistent workers are restarted.
        """
        plan = getattr(self.loader.dataset, "plan", None)
        world = worker_info().world_size
        if plan is not None and topology_changed(state, world, self.loader.num_workers):
            self._resume_elsewhere(state, strict)
            return
        super().load_state_dict(state, strict)
        state = self._resume or {}
        workers = state.get("workers")
        self._worker_resume = (
            {
                "pass": int(state.get("stream", state.get("epoch", 0))),
                "workers": workers,
                "next_worker": int(state.get("next_worker", 0)),
            }
            if workers
            else None
        )
        self._restart_workers()

    def _resume_elsewhere(self, state: Any, strict: bool) -> None:
        """Resume every rank's ``state`` on this topology: the rest of its epoch, planned anew
        (see :mod:`webds.shards.elastic`)."""
        dataset = self.loader.dataset
        states = every_rank(state)
        mine = self._resume_config()
        for saved in states:
            check_state(saved, with_topology(mine, saved.get("config") or {}), strict)
        epoch = plan_elsewhere(dataset.plan, states, dataset._granule())
        restore_entropy(self, states[0])
        self._worker_resume, self._mirrors = None, {}
        self.set_epoch(epoch)
        self._resume = None
        self._restart_workers()

    def _restart_workers(self) -> None:
        # Persistent workers keep their own copy of the dataset, with its own epoch; they must
        # be started afresh to take a new epoch or resume position.
        it = getattr(self.loader, "_iterator", None)
        if it is not None:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self.loader._iterator = None

    def _resume_config(self) -> Dict[str, Any]:
        config = super()._resume_config()
        dataset = self.loader.dataset
        if hasattr(dataset, "_resume_config"):
            config["dataset"] = dataset._resume_config()
        config["num_workers"] = self.loader.num_workers
        config["batch_size"] = self.loader.batch_size
        return config

    def _carries(self) -> bool:
        """Whether the dataset's stream goes on from one loader epoch to the next (with_epoch,
        in this process or in persistent workers), rather than starting afresh."""
        dataset, loader = self.loader.dataset, self.loader
        carried = getattr(dataset, "nsamples", None) is not None and (
            getattr(dataset, "repetitions", 1) == sys.maxsize
        )
        return carried and (loader.num_workers == 0 or loader.persistent_workers)

    def _stream_state(self) -> Dict[str, Any]:
        state = super()._stream_state()
        if not isinstance(self.loader.dataset, DataPipeline):
            return state
        # The main process's own ledger only holds workers' samples (in its shuffle buffers
        # and batches): they are holes in those workers' records.
        held: Dict[int, List[Any]] = {}
        if self._stream is not None:
            for ids in self._stream["ledger"].held_items():
                for w, part in _by_worker(ids).items():
                    held.setdefault(w, []).append(part)
        # Kept for its slots: the main process's stages put their buffers back from it.
        pass_ = self._stream["pass"] if self._stream is not None else state["epoch"]
        if self._last_worker is not None and self._mirrors:
            state["next_worker"] = (self._last_worker + 1) % max(1, self.loader.num_workers)
        state["workers"] = {
            str(w): {
                "epoch": pass_,
                "items": m["items"],
                "stream": m["pass"],
                "ledger": m["ledger"].state(held.get(w, ())),
                "problem": m["problem"],
                "last": m.get("last"),
            }
            for w, m in sorted(self._mirrors.items())
        }
        return state

    def _epoch_done(self, position: List[int], keep_stream: bool = False) -> None:
        ended = position is self._position  # not an abandoned iterator run out later
        super()._epoch_done(position, keep_stream)
        if ended and self._carry is None:  # (with_epoch here: the DataLoader's pass goes on)
            if self._carries():
                for m in self._mirrors.values():
                    m["items"] = 0  # the workers' streams go on into the next epoch
            else:
                self._mirrors = {}

    def _one_pass(self, epoch: int, ledger: Ledger) -> Any:
        dataset = self.loader.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        plan = dataset.aligned_plan() if hasattr(dataset, "aligned_plan") else None
        if plan is not None:
            plan.warn_split(max(1, self.loader.num_workers))
        resume, self._worker_resume = self._worker_resume, None
        if not self._carries():
            self._mirrors = {}
        mirrors = self._mirrors
        if resume is not None and resume["pass"] == epoch:
            mirrors.clear()
            for w, saved in resume["workers"].items():
                mirrors[int(w)] = {
                    "pass": int(saved.get("stream", epoch)),
                    "ledger": Ledger(resume=saved.get("ledger")),
                    "items": int(saved.get("items", 0)),
                    "problem": saved.get("problem"),
                }
            # Each worker's first batch brings back what this process held (Restored); then
            # those whose turn came before the next one's pad once, as the DataLoader starts
            # its turns at worker 0 again (see webds.stages.ledger.PAD).
            batch = self.loader.batch_size or 1
            first = resume.get("next_worker", 0)
            for_workers = {
                str(w): dict(
                    resume["workers"].get(str(w), {}),
                    restore=batch,
                    pad=batch if w < first else 0,
                )
                for w in range(max(1, self.loader.num_workers))
            }
            dataset._resume = {"epoch": epoch, "for_workers": for_workers}
            self._restoring = len(for_workers)
        return super()._one_pass(epoch, ledger)

    def _source_items(self, ledger: Ledger) -> Iterator[Any]:
        """The DataLoader's items; a webds dataset's come in Envelopes, whose ledger records are
        kept per worker (``mirrors``) as the items arrive."""
        dataset = self.loader.dataset
        if not isinstance(dataset, DataPipeline):
            # Not a webds pipeline: each item is one id, and resuming reads them again.
            yield from super()._source_items(ledger)
            return
        mirrors = self._mirrors
        keeps = any(
            getattr(getattr(s, "factory", None), "wants_ledger", False) for s in self.pipeline
        )
        # Only while the DataLoader starts (its workers copy the dataset; without workers it
        # calls iter(dataset) now): the same dataset used elsewhere yields plain items.
        dataset._envelopes = True
        self._last_worker = None  # the DataLoader's turns start at worker 0
        try:
            it = iter(self.loader)
        finally:
            dataset._envelopes = False
            dataset._resume = None  # the workers (or this process's iterator) have their copy
        restored: List[Tuple[Any, Any]] = []
        for x in it:
            if type(x) is not Envelope:  # not tracked (see _EnvelopeCollate): nothing to note
                yield x
                continue
            if x.item is PAD:
                continue  # only keeps the DataLoader's turn order
            if self._restoring and type(x.item) is not Restored:
                self._restoring = 0  # a worker sent none: go on with what came
                yield from self._take_back(restored, ledger, keeps)
            if x.pass_ is None:  # a Restored of a worker that read nothing: no ledger change
                yield from self._restored_from(x, restored, ledger, keeps)
                continue
            m = mirrors.get(x.worker)
            if m is None or m["pass"] != x.pass_:
                m = mirrors[x.worker] = {
                    "pass": x.pass_,
                    "ledger": Ledger(),
                    "items": 0,
                    "problem": None,
                }
            m["ledger"].apply(x.delta)
            if x.stats is not None:
                self._worker_stats[(x.worker, x.stats.get("pid"))] = x.stats
            m["items"] = x.items
            if x.problem is not None:
                m["problem"] = x.problem
            if type(x.item) is Restored:
                yield from self._restored_from(x, restored, ledger, keeps)
                continue
            self._last_worker = x.worker
            if x.ids is not None:  # what its epoch's padding repeats (see counting._exactly)
                m["last"] = x.ids if self.loader.batch_size is None else x.ids[-1]
            if keeps:  # a stage here holds or batches items: it needs their ids
                ledger.current = qualify(x.worker, x.ids)
            item = x.item
            if type(item) is Packed:
                unpacker = self._unpackers.get(it)
                if unpacker is None:
                    unpacker = self._unpackers[it] = Unpacker()
                item = unpacker.unpack(x.worker, item)
            yield item

    def _restored_from(
        self, x: Envelope, restored: List[Tuple[Any, Any]], ledger: Ledger, keeps: bool
    ) -> Any:
        """Note a worker's Restored batch; once every worker's has come, take them back."""
        restored += [(item, qualify(x.worker, i)) for item, i in zip(*x.item)]
        self._restoring -= 1
        if not self._restoring:
            yield from self._take_back(restored, ledger, keeps)

    def _take_back(self, restored: List[Tuple[Any, Any]], ledger: Ledger, keeps: bool) -> Any:
        """The samples this process held at the checkpoint, made again by the workers, in the
        order its stages take them back (see webds.stages.ledger.Slot.restore)."""
        plan = ledger.restore_plan()
        restored.sort(key=lambda pair: plan.sort_key(next(ids_of(pair[1]), -1)))
        for item, qids in restored:
            if keeps:
                ledger.current = qids
            yield item
        restored.clear()


class _EnvelopeCollate:
    """The DataLoader's ``collate_fn`` for a webds dataset: collates as usual, then wraps the
    batch in an :class:`~webds.stages.ledger.Envelope` with what the dataset's ledger recorded
    since the last batch (it runs where the dataset does: in the worker, or in this process)."""

    def __init__(
        self, collate: Any, dataset: DataPipeline, single: bool, pack: bool = False
    ) -> None:
        self.collate = collate
        self.dataset = dataset
        self.single = single
        self.pack = pack
        self.pool: Optional[SlotPool] = None  # made in the worker, by its first batch

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("pack", False)
        self.__dict__.setdefault("pool", None)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "pool": None}  # each worker makes its own

    def __call__(self, data: Any) -> Any:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        dataset = info.dataset if info is not None else self.dataset
        first = data[0] if isinstance(data, list) and data else data
        if first is PAD:
            return Envelope(PAD, info.id if info is not None else 0, None, _NO_DELTA, 0, 0)
        if type(first) is Restored:
            # Each sample the main process held, collated as a batch of one, as it was split.
            items = [self.collate(x if self.single else [x]) for x in first.items]
            ids = [i if self.single else [i] for i in first.ids]
            worker, stream = info.id if info is not None else 0, dataset._stream
            if stream is None:  # nothing read: this worker's stream had ended
                return Envelope(Restored(items, ids), worker, None, _NO_DELTA, 0, None)
            ledger, pass_ = stream["ledger"], stream["pass"]
            delta, problem, sent = ledger.take_delta(), ledger.problem, dataset._sent
            return Envelope(Restored(items, ids), worker, None, delta, sent, pass_, problem)
        probe = getattr(dataset, "probe", None)
        if probe is None:
            batch = self.collate(data)
        else:
            start = perf_counter()
            batch = self.collate(data)
            probe.collate_seconds += perf_counter() - start
        stream = getattr(dataset, "_stream", None)
        if stream is None or not stream["ledger"].tracking:
            return batch  # iterated outside a WebLoader's iter()
        # The ids of the items collated (noted by DataPipeline._tracked), and what the ledger
        # recorded meanwhile.
        ids: Any = list(dataset._pending)  # the ids of the items collated
        dataset._pending.clear()  # in place: DataPipeline._tracked appends to this list
        items = dataset._sent = dataset._sent + len(ids)
        if self.single:
            ids = ids[0] if ids else None
        ledger = stream["ledger"]
        worker = info.id if info is not None else 0
        delta = ledger.take_delta()
        if self.pack and info is not None:
            if self.pool is None:
                self.pool = SlotPool()
            batch = self.pool.pack(batch)
        snapshot = None if probe is None else probe.snapshot()
        return Envelope(batch, worker, ids, delta, items, stream["pass"], ledger.problem, snapshot)


def _by_worker(ids: Any) -> Dict[int, Any]:
    """An item's qualified ids (an id or a bundle) split by worker, as that worker's ids."""
    if not isinstance(ids, list):
        w, i = unqualify(ids)
        return {w: i}
    out: Dict[int, List[Any]] = {}
    for x in ids:
        for w, part in _by_worker(x).items():
            out.setdefault(w, []).append(part)
    return out


#: The ledger change a PAD envelope carries: none.
_NO_DELTA = ({}, [], [], [], None)


class _LoaderOrigin:
    """The DataLoader as a counted source: one stream, made of its workers' streams in turn."""

    exact = False  # the datasets in the workers keep their own counts exact

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

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
        counts = source_counts(dataset, workers)
        size = loader.batch_size
        if size is None:
            return counts
        if loader.drop_last:
            return [Length(c.items // size, Length(c.items // size * size)) for c in counts]
        return [Length(-(-c.items // size), c) for c in counts]

    def _worker_items(self) -> List[int]:
        return [c.items for c in self._worker_counts()]

    def stream_lengths(self, num_workers: Optional[int] = None) -> List[int]:
        return [n.items for n in self.stream_counts(num_workers)]

    def stream_counts(self, num_workers: Optional[int] = None) -> List[Length]:
        # The workers' streams arrive interleaved as one; what each batched, summed, is what
        # an unbatched() after the loader gets back.
        return [_total(self._worker_counts())]

    def stream_index(self) -> int:
        return 0


def _total(counts: List[Length]) -> Length:
    """The sum of several streams' counts, level by level while every stream knows the level."""
    inner = [c.inner for c in counts if c.inner is not None]
    below = _total(inner) if inner and len(inner) == len(counts) else None
    return Length(sum(c.items for c in counts), below)
