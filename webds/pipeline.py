"""DataPipeline: a source followed by stages, the engine everything else in webds is built from.

Stages (:mod:`webds.base.stage`) are written once, as generator functions taking the upstream
iterator first, and used both ways::

    DataPipeline(source, select(f), ...)  # composable style
    dataset.select(f)                     # fluent style, derived from the same definition

Stages declare what they need and owe (the epoch, the pipeline's seed, the ledger; a count rule
from which ``len()`` follows; what they owe a resume): see :mod:`webds.base.stage`. A pipeline
resumed mid-epoch (:meth:`DataPipeline.load_state_dict`) reads each sample not yet consumed once
(the arithmetic is in :mod:`webds.counting`, the record in :mod:`webds.base.ledger`).
"""

from __future__ import annotations

import copy
import itertools
import secrets
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from torch.utils.data import IterableDataset

from .base.ledger import LEAF, Ledger, Pass, unconsumed
from .base.redact import redact
from .base.runs import expanded, runs_span
from .base.saved import PipelineState, StreamState, read_states

# The stage machinery lives in webds.base.stage (no torch import); its names are served here too.
from .base.stage import (  # noqa: F401
    BATCH,
    LEDGER,
    REORDER,
    SAME,
    STATELESS,
    UNBATCH,
    Count,
    Length,
    Stage,
    StageFactory,
    Stateless,
    pipelinefilter,
    resume_kind,
    stage,
    stateless,
)
from .base.workers import worker_info
from .channel import StreamKeeper, is_worker_dataset, release_free_heap
from .counting import (  # noqa: F401  (source_counts, _exactly: importable from here too)
    _exactly,
    check_state,
    exact_count,
    fit_state,
    forward_counts,
    gather_states,
    own_state,
    random_parts,
    refuse_unresumable,
    repeated,
    resume_elsewhere,
    source_counts,
)
from .counting import stage_name as _stage_name
from .epochs import carries, carry_start, dropping
from .errors import ArgumentError, LengthError
from .io import security
from .shards.elastic import topology_changed
from .stages.probe import Probe

if TYPE_CHECKING:
    from .channel import WorkerChannel, WorkerStart

__all__ = ["stage", "pipelinefilter", "Stage", "StageFactory", "DataPipeline", "Count"]
__all__ += ["Length", "SAME", "REORDER", "BATCH", "UNBATCH", "LEDGER", "STATELESS"]
__all__ += ["Stateless", "stateless", "resume_kind"]


def _as_iterator(source: Any) -> Iterator[Any]:
    """Start the first stage of a pipeline: an iterable is iterated, a callable is called."""
    if hasattr(source, "__iter__"):
        return iter(source)
    if callable(source):
        return iter(source())
    raise ArgumentError(
        f"the first stage of a pipeline must be iterable or callable, got {source!r}"
    )


class DataPipeline(IterableDataset):
    """A source followed by stages, as a PyTorch ``IterableDataset``.

    ``DataPipeline(SimpleShardList(urls), tarfile_to_samples(), shuffle(100), batched(16))``.
    ``None`` arguments are skipped and lists are spliced in, so optional stages are easy to write.

    Every ``iter()`` runs one epoch: the pipeline's epoch number is handed to every stage that
    has ``set_epoch`` and then advances by one; :meth:`set_epoch` chooses it explicitly.
    :meth:`state_dict` says where the epoch in progress stands and :meth:`load_state_dict`
    makes the next ``iter()`` continue from there, in this process or a new one. A source that
    keeps streams of its own (a :class:`~webds.channel.StreamKeeper`) numbers its items and
    saves its streams itself.
    """

    def __init__(self, *stages: Any, **kwargs: Any) -> None:
        super().__init__()
        self.pipeline: List[Any] = []
        for s in stages:
            if s is None:
                continue
            if isinstance(s, list):
                self.pipeline.extend(x for x in s if x is not None)
            else:
                self.pipeline.append(s)
        self.epoch = 0
        self.seed: Optional[int] = None
        self.nsamples: Optional[int] = None
        self.repetitions = 1
        self.length: Optional[int] = None
        self._carry: Optional[Iterator[Any]] = None
        # Drawn once: a resumed unseeded pipeline makes its random choices again (see state).
        self._entropy = secrets.randbits(63)
        # Resuming (see state_dict): [epoch, items yielded] of the epoch in progress; the pass
        # being read and its ledger; a saved stream to continue at the next iter().
        self._position: List[int] = [0, 0]
        self._pass: Optional[Pass] = None
        self._resume: Optional[StreamState] = None
        self._drop = 0
        self._warned_inexact = False
        #: A WebLoader's dataset: how the DataLoader workers' copies report what they read.
        self.channel: Optional["WorkerChannel"] = None
        self.probe: Optional[Probe] = None  # stats=True: where the time goes (stages.probe)
        self.threads = 0  # for the stages that take threads= and were not given it (WebLoader)

    # -- composition -------------------------------------------------------------------------

    def compose(self, *stages: Any) -> "DataPipeline":
        """Return a copy of this pipeline with ``stages`` appended (``self`` is unchanged)."""
        result = copy.copy(self)
        result.pipeline = self.pipeline + [s for s in stages if s is not None]
        result._carry = None
        result._position = list(self._position)
        result._pass = None
        result.channel = None
        return result

    def append(self, stage: Any) -> None:
        """Append a stage in place."""
        self.pipeline.append(stage)

    def stage(self, i: int) -> Any:
        """Return the i-th stage (0 is the source)."""
        return self.pipeline[i]

    # -- epochs and length -------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` (like ``DistributedSampler.set_epoch``).

        Setting the epoch that comes next anyway changes nothing: it keeps the resume position
        :meth:`load_state_dict` chose, and the stream :meth:`with_epoch` carries on; so a loop
        may call ``set_epoch(e)`` at the top of every epoch, resumed or not."""
        keeper = self._keeper()
        if keeper is not None:
            keeper.choose_epoch(int(epoch), changed=int(epoch) != self.epoch)
        if int(epoch) == self.epoch and (self._resume is not None or self._carry is not None):
            return
        self.epoch = int(epoch)
        self._carry = None
        self._resume = None
        self._pass = None
        self._position = [self.epoch, 0]

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> "DataPipeline":
        """Make each epoch exactly ``nsamples`` items long (samples, or batches after
        ``batched``), repeating the data as needed: epoch ``k`` is the items ``k * n`` to
        ``(k + 1) * n`` of the passes one after another, so the stream goes on where the last
        epoch stopped. With an index, a new process at epoch ``k`` (``set_epoch``) starts where
        the uninterrupted run's epoch ``k`` does (:func:`~webds.epochs.carry_start`).
        Changes and returns ``self``, as webdataset did."""
        n = max(nsamples, nbatches)
        if n < 0:
            raise ArgumentError("with_epoch needs a positive nsamples (or nbatches)")
        self.nsamples = n
        self.repetitions = sys.maxsize
        return self

    def repeat(self, nepochs: int = -1, nbatches: int = -1) -> "DataPipeline":
        """Repeat the data ``nepochs`` times per ``iter()`` (-1: forever), at most ``nbatches``."""
        self.repetitions = sys.maxsize if nepochs < 0 else nepochs
        self.nsamples = None if nbatches < 0 else nbatches
        return self

    def with_length(self, n: int, silent: bool = False) -> "DataPipeline":
        """Declare ``len(self) == n`` (for frameworks that need a length). Returns ``self``."""
        self.length = int(n)
        return self

    def _keeper(self) -> Optional[StreamKeeper]:
        """The source, if it keeps streams of its own (see :class:`~webds.channel.StreamKeeper`)."""
        return (
            self.pipeline[0]
            if self.pipeline and isinstance(self.pipeline[0], StreamKeeper)
            else None
        )

    def _counted_source(self) -> Optional[Tuple[int, Any]]:
        """(position, source) of the stage whose output counts are known, if there is one: it has
        ``stream_lengths(num_workers)`` (a stream per DataLoader worker) and ``stream_index()``."""
        src = self.pipeline[0] if self.pipeline else None
        if hasattr(src, "stream_lengths"):
            return 0, src
        return None

    def stream_lengths(self, num_workers: Optional[int] = None) -> List[int]:
        """Items this pipeline yields per stream (per DataLoader worker of ``num_workers``).

        Raises :class:`~webds.errors.LengthError` when a stage or the source cannot know.
        """
        return [n.items for n in self.stream_counts(num_workers)]

    def stream_counts(self, num_workers: Optional[int] = None) -> List[Length]:
        """:meth:`stream_lengths` as :class:`~webds.base.stage.Length` values, which also carry the
        counts before each batching (what a later ``unbatched()`` gets back)."""
        streams = max(1, num_workers or 1)
        if self.nsamples is not None and self.repetitions == sys.maxsize:
            return [Length(self.nsamples)] * streams
        if self.length is not None:
            if streams > 1:
                raise LengthError(
                    f"with_length({self.length}) declares a total, not a count per DataLoader "
                    "worker; use with_epoch(n) for a per-worker epoch length"
                )
            return [Length(self.length)]
        origin = self._counted_source()
        if origin is None:
            src = self.pipeline[0] if self.pipeline else None
            raise LengthError(
                f"the length of this {type(self).__name__} is unknown: its source {src!r} does "
                "not say how many items it yields. Give WebDataset a shard index "
                "(WebDataset('train.index.json') or index=...; see docs/distributed.md), or "
                "declare it with .with_epoch(n) / .with_length(n)"
            )
        at, src = origin
        lengths = source_counts(src, num_workers)
        lengths = forward_counts(self.pipeline[at + 1 :], lengths, type(self).__name__)
        return repeated(lengths, self.repetitions, self.nsamples, type(self).__name__)

    def stream_index(self) -> int:
        """This process's stream: its DataLoader worker number."""
        return worker_info().worker

    def skip(self, n: int) -> None:
        """Make the next ``iter()`` leave out its first ``n`` items (read, then dropped)."""
        self._drop = int(n)

    def _workers_hint(self) -> Optional[int]:
        """How many DataLoader workers will run this pipeline, when something said so."""
        return None

    def __len__(self) -> int:
        if self.length is not None:
            return self.length
        if self.nsamples is not None and self.repetitions == sys.maxsize:
            return self.nsamples  # with_epoch: each stream's epoch
        return sum(self.stream_lengths(self._workers_hint()))

    # -- resuming ----------------------------------------------------------------------------

    def effective_seed(self) -> int:
        """The seed random stages follow: ``seed``, or one drawn for this pipeline if None."""
        return self.seed if self.seed is not None else self._entropy

    def _resume_config(self) -> Dict[str, Any]:
        """What must be the same when a saved position is loaded (see :meth:`load_state_dict`)."""
        config = {"seed": self.seed, "stages": [_stage_name(s) for s in self.pipeline]}
        keeper = self._keeper()
        return config if keeper is None else {**config, **keeper.config()}

    def _state(self) -> PipelineState:
        """Where this pipeline stands, as :meth:`state_dict` saves it."""
        where = worker_info()
        epoch, items = self._position
        state = PipelineState(epoch, items, rank=where.rank, world_size=where.world_size)
        state.seed, state.config = self.effective_seed(), self._resume_config()
        state.entropy = [x._entropy for x in random_parts(self)]
        if self._pass is not None:
            state.pass_, ledger = self._pass
            state.ledger, state.problem = ledger.state(), ledger.problem
            state.last = ledger.current  # what a padded epoch repeats (see _exactly)
        keeper = self._keeper()
        if keeper is not None:
            keeper.save(state, self._pass)
        return state

    def state_dict(self, all_ranks: bool = False, strict: bool = True) -> Any:
        """Where this pipeline stands: the epoch in progress, how many items it has yielded, and
        which source samples it has consumed (a plain dict of lists and ints: JSON will do; its
        fields are :class:`~webds.base.saved.PipelineState`'s). After an epoch has run to
        its end, that is the next epoch with nothing consumed.

        Each rank of a distributed job reads other samples, so each rank's state is its own.
        ``all_ranks=True`` gathers every rank's into one list (a collective: call it on every
        rank at the same step); any rank can load that list, so rank 0 can save it alone.

        Mid-pass, a stage that does not say what it owes a resume (a plain generator, a cache:
        :func:`~webds.base.stage.resume_kind`) raises :class:`~webds.errors.ResumeError`;
        ``strict=False`` saves anyway, and loading that needs ``strict=False`` too.
        """
        state = self._state()
        refuse_unresumable(self, state, strict)
        saved = state.to_dict()
        return gather_states(saved) if all_ranks else saved

    def load_state_dict(self, state: Any, strict: bool = True) -> None:
        """Make the next ``iter()`` continue where :meth:`state_dict` was taken: the rest of that
        epoch, the same items in the same order as if never stopped (the buffers are put back as
        they were), then the epochs after as usual.

        The configuration (seed, shards, stages, world size, workers, batch size) must be the
        same, and the pipeline able to resume exactly, else this raises
        :class:`~webds.errors.ResumeError` saying why; ``strict=False`` resumes anyway, which is
        then only approximately the rest of the epoch. With a shard index, every rank's states
        (``state_dict(all_ranks=True)``) saved by another number of ranks or workers resume too:
        the rest of their epoch is shared out anew (see :mod:`webds.shards.elastic`)."""
        where = worker_info()
        states = read_states(state)
        planned = self._planned()
        if planned is not None and topology_changed(states, where.world_size, planned[2]):
            self.set_epoch(resume_elsewhere(self, states, strict, planned[0], planned[1]))
            self._resume = mine = None
        else:
            mine = own_state(states, where.rank, where.world_size, strict)
            check_state(mine, self._resume_config(), strict)
            fit_state(self, mine, strict)
            self.set_epoch(mine.epoch)
            self._resume = mine
            self._carry = self._pass = None  # the next iter() starts from the resume
            self._position = [self.epoch, mine.items]
        keeper = self._keeper()
        if keeper is not None:
            keeper.load(mine)

    def _planned(self) -> Optional[Tuple[Any, int, int]]:
        """The epoch plan this pipeline reads by (an index's), the batch size the workers'
        shares align to, and the DataLoader workers; None without a plan."""
        keeper = self._keeper()
        return keeper.planned() if keeper is not None else None

    def _take_resume(self, epoch: int) -> Tuple[Optional[StreamState], Optional["WorkerStart"]]:
        """The saved stream this process continues in ``epoch``, if any (taken: used once), and
        for a WebLoader's DataLoader worker, how it begins (see :mod:`webds.channel`)."""
        resume, self._resume = self._resume, None
        if self.channel is not None and self.channel.open:
            start = self.channel.take_start(epoch)
            return (start.stream if start is not None else None), start
        if resume is None or resume.epoch != epoch:
            return None, None
        return resume, None

    # -- running -----------------------------------------------------------------------------

    def _source_items(self, ledger: Ledger) -> Iterator[Any]:
        """The source's items, numbered in the ledger (item ``k`` has the id ``k << 32 | LEAF``)
        and recorded as read, unless a stage reads samples out of each item and records them
        itself (``tarfile_to_samples``)."""
        keeper = self._keeper()
        if keeper is not None:
            keeps = any(isinstance(s, Stage) and s.factory.wants_ledger for s in self.pipeline)
            yield from keeper.numbered(ledger, keeps)
            return
        it = _as_iterator(self.pipeline[0]) if self.pipeline else iter(())
        if any(isinstance(s, Stage) and s.factory.expands for s in self.pipeline):
            for k, item in enumerate(it):
                ledger.current = (k << 32) | LEAF
                yield item
        else:
            for k, item in enumerate(it):
                ledger.produce((k << 32) | LEAF)
                yield item

    def _one_pass(self, epoch: int, ledger: Ledger) -> Iterator[Any]:
        """Run the stages once over the source, closing every stage when done or abandoned.
        Resuming, consumed items are left out before the first stage that keeps the ledger (the
        tar stage skips consumed samples itself), not at the source: stages before may pick
        items by their place in the stream (``split_by_worker``)."""
        seed = self.effective_seed()
        probe = ledger.probe = self.probe
        # Where runs of samples go (webds.base.runs): not while resuming (the tar stage skips
        # consumed samples one by one) nor measuring (stats count items stage by stage).
        runs, until = (-1, -1) if ledger.resuming or probe is not None else runs_span(self.pipeline)
        for i, s in enumerate(self.pipeline):
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
            if isinstance(s, Stage):
                s.set_seed(seed)
                s.set_ledger(ledger.at(i, runs=i == runs))
                s.threads = self.threads
        skip_at = -1
        if ledger.resuming:
            keeps = [isinstance(s, Stage) and s.factory.wants_ledger for s in self.pipeline]
            skip_at = next((i for i in range(1, len(keeps)) if keeps[i]), len(keeps))
        if probe is not None:
            probe.begin(self.pipeline)
        it = self._source_items(ledger)
        its: List[Any] = [it if probe is None else probe.wrap(it, 0)]
        it = its[0]
        for i, s in enumerate(self.pipeline[1:], 1):
            if i == skip_at and not s.factory.expands:
                it = ledger.restore_order(unconsumed(it, ledger))
            if i == until:
                it = expanded(it)
            it = iter(s(it)) if probe is None else probe.wrap(iter(s(it)), i)
            its.append(it)
        if skip_at == len(self.pipeline):
            it = ledger.restore_order(unconsumed(it, ledger))
        if until == len(self.pipeline):
            it = expanded(it)
        try:
            yield from it
        finally:
            if probe is not None:
                probe.end()
            # Close downstream first, so no stage reads from an already closed source.
            for x in reversed(its):
                close = getattr(x, "close", None)
                if close is not None:
                    close()

    def _passes(
        self,
        first_epoch: int,
        resume: Optional[StreamState] = None,
        channel: Optional["WorkerChannel"] = None,
    ) -> Iterator[Any]:
        """Chain up to ``repetitions`` passes; stop at a pass that yields nothing.

        ``resume`` (a saved stream) says which pass to start at and what of it was consumed;
        with a ``channel`` (a WebLoader's dataset), the ledgers record changes for envelopes.
        """
        start = first_epoch if resume is None or resume.pass_ is None else resume.pass_
        saved = resume.ledger if resume is not None else None
        end = first_epoch + self.repetitions if self.repetitions < sys.maxsize else sys.maxsize
        for epoch in range(start, end):
            ledger = Ledger(resume=saved, track=channel is not None)
            saved = None
            self._pass = Pass(epoch, ledger)
            empty = True
            items = self._one_pass(epoch, ledger)
            if channel is not None:
                channel.current_pass = self._pass
                if ledger.resuming:
                    # What a WebLoader's main process held: for this worker's first batch.
                    items = ledger.divert_held_after(items, channel.restored)
            for item in items:
                empty = False
                yield item
            if empty and not ledger.resuming:
                return

    def iterator(self) -> Iterator[Any]:
        """One epoch's items (what ``iter(self)`` returns)."""
        epoch = self.epoch
        self.epoch += 1
        resume, start = self._take_resume(epoch)
        done = resume.items if resume is not None else 0
        channel = self.channel if self.channel is not None and self.channel.open else None
        if self.nsamples is None:
            it: Iterator[Any] = self._passes(epoch, resume, channel)
            exact = exact_count(self, epoch) if self.repetitions == 1 else None
            if exact is not None:
                left = exact - done if resume else exact
                refill = (lambda ledger: self._one_pass(epoch, ledger)) if resume else None
                it = _exactly(it, left, self, refill, resume.last if resume else None)
        elif self.repetitions == sys.maxsize:
            # with_epoch: continue the same endless stream across epochs.
            if self._carry is None:  # resumed, or from where the epoch starts (carry_start)
                if resume is not None and resume.pass_ is not None:
                    self._carry = self._passes(epoch, resume, channel)
                else:
                    first, skip = carry_start(self, epoch) or (epoch, 0)
                    self._carry = dropping(self._passes(first, None, channel), skip)
            it = itertools.islice(self._carry, max(0, self.nsamples - done))
        else:
            it = itertools.islice(
                self._passes(epoch, resume, channel), max(0, self.nsamples - done)
            )
        drop, self._drop = self._drop, 0
        if drop:
            it = itertools.islice(it, drop, None)
        position = self._position = [epoch, done]
        it = self._counted(it, position)
        return it if channel is None else channel.tracked(it, start, done)

    def _counted(self, it: Iterator[Any], position: List[int]) -> Iterator[Any]:
        for item in it:
            position[1] += 1
            yield item
        self._epoch_done(position)

    def _epoch_done(self, position: List[int]) -> None:
        if position is self._position:
            if self._carry is not None and not carries(self):
                self._carry.close()  # type: ignore[attr-defined]
                self._carry = None
            self._position = [position[0] + 1, 0]
            keeper = self._keeper()
            if self._carry is None:  # with_epoch's stream goes on; otherwise the epoch is over
                self._pass = None
                if keeper is not None:
                    keeper.epoch_done()
        if is_worker_dataset(self):
            release_free_heap()  # (a persistent worker idles until the next epoch)

    def __iter__(self) -> Iterator[Any]:
        return self.iterator()

    def close(self) -> None:
        """Close every stage that has a ``close`` method, and any carried stream."""
        if self._carry is not None:
            self._carry.close()  # type: ignore[attr-defined]
            self._carry = None
        for s in self.pipeline:
            if hasattr(s, "close"):
                s.close()

    def __enter__(self) -> "DataPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # A running generator can't cross to a DataLoader worker; the worker starts its own.
        return security.carried(dict(self.__dict__, _carry=None))

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(security.arrived(state))

    def __repr__(self) -> str:
        inner = ",\n  ".join(redact(repr(s)) for s in self.pipeline)  # a source's URLs too
        return f"{type(self).__name__}(\n  {inner}\n)"


def add_length_method(obj: Any) -> Any:
    """webdataset 1.x's helper: make ``len(obj)`` return ``obj.size`` (``obj``'s class becomes
    a subclass that is also an ``IterableDataset``)."""
    cls = type(obj)
    bases = (cls,) if issubclass(cls, IterableDataset) else (cls, IterableDataset)
    obj.__class__ = type(f"{cls.__name__}_Length", bases, {"__len__": lambda self: self.size})
    return obj
