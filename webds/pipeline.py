"""DataPipeline: a source followed by stages, the engine everything else in webds is built from.

Stages (:mod:`webds.stages.core`) are written once, as generator functions taking the upstream
iterator first, and used both ways::

    DataPipeline(source, select(f), ...)  # composable style
    dataset.select(f)                     # fluent style, derived from the same definition

A stage function that declares a keyword parameter named ``epoch`` receives the pipeline's current
epoch (see :meth:`DataPipeline.set_epoch`); that is how shuffles reshuffle every epoch without any
global state. One that declares ``pipeline_seed`` receives the pipeline's ``seed`` (for instance
``WebDataset(..., seed=s)``), so a seeded dataset's sample shuffle follows the same seed as its
shard shuffle.

A stage may also say how it changes the number of items (``@stage(count=SAME)``: one out for one
in; ``REORDER``: the same number, reordered; ``BATCH``/``UNBATCH``). From those rules a pipeline
whose source knows its size computes a truthful ``len()``, and a pipeline resumed mid-epoch
(:meth:`DataPipeline.load_state_dict`) skips already consumed items as far upstream as it can.

The stage machinery (:func:`stage`, :class:`Stage`, :class:`Count`, ...) is defined in
:mod:`webds.stages.core`, which does not import torch, and re-exported here. The arithmetic of
lengths and resuming (what the count rules give) is in :mod:`webds.counting`.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import itertools
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

from torch.utils.data import IterableDataset

from .counting import (  # noqa: F401  (source_counts, _exactly: importable from here too)
    _exactly,
    check_resume_config,
    exact_count,
    forward_counts,
    resume_share,
    skip_point,
    source_counts,
)
from .errors import ArgumentError, LengthError

# The stage machinery lives in webds.stages (no torch import); these names stay importable from
# here, where webdataset code and pickles made before the split look for them (a pickled stage
# factory refers to webds.pipeline._import_object).
from .stages.core import (  # noqa: F401
    BATCH,
    REORDER,
    SAME,
    UNBATCH,
    Count,
    Length,
    Stage,
    StageFactory,
    _import_object,
    pipelinefilter,
    stage,
)

__all__ = [
    "stage",
    "pipelinefilter",
    "Stage",
    "StageFactory",
    "DataPipeline",
    "Count",
    "Length",
    "SAME",
    "REORDER",
    "BATCH",
    "UNBATCH",
]


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
    makes the next ``iter()`` continue from there, in this process or a new one.

    In a DataLoader worker, the end of each epoch hands the C heap's free pages back to the
    operating system (glibc's ``malloc_trim``), so persistent workers do not keep growing.
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
        # Resuming: items to skip at the next iter() (an int, or one per DataLoader worker), the
        # [epoch, items consumed] of the epoch in progress, and with_epoch's stream position.
        self._skip: Any = 0
        self._position: List[int] = [0, 0]
        self._carry_position: Optional[List[int]] = None
        self._carry_resume: Optional[Tuple[int, int]] = None
        self._warned_inexact = False

    # -- composition -------------------------------------------------------------------------

    def compose(self, *stages: Any) -> "DataPipeline":
        """Return a copy of this pipeline with ``stages`` appended (``self`` is unchanged)."""
        result = copy.copy(self)
        result.pipeline = self.pipeline + [s for s in stages if s is not None]
        result._carry = None
        result._position = list(self._position)
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
        :meth:`load_state_dict` chose, and the stream :meth:`with_epoch` carries from one epoch
        to the next. So a training loop can call ``set_epoch(e)`` at the top of every epoch,
        resumed or not, with or without ``with_epoch``.
        """
        if int(epoch) == self.epoch and (self._skip or self._carry is not None):
            return
        self.epoch = int(epoch)
        self._carry = None
        self._skip = 0
        self._position = [self.epoch, 0]

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> "DataPipeline":
        """Make each epoch exactly ``nsamples`` items long, repeating the data as needed.

        The underlying stream continues where the previous epoch stopped (it is not restarted),
        within one process. Counts items at this point of the pipeline: samples, or batches
        after ``batched``. Changes and returns ``self``, as webdataset did.
        """
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

    def _origin(self) -> Optional[Tuple[int, Any]]:
        """(position, source) of the stage whose output counts are known, if there is one.

        The source has ``stream_lengths(num_workers)`` (items per stream: one stream per
        DataLoader worker), ``stream_index()`` (this process's stream) and ``skip(n)``.
        """
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
        """:meth:`stream_lengths` as :class:`~webds.stages.core.Length` values, which also carry the
        counts before each batching (what a later ``unbatched()`` gets back)."""
        streams = max(1, num_workers or 1)
        if self.nsamples is not None:
            return [Length(self.nsamples)] * streams
        if self.length is not None:
            if streams > 1:
                raise LengthError(
                    f"with_length({self.length}) declares a total, not a count per DataLoader "
                    "worker; use with_epoch(n) for a per-worker epoch length"
                )
            return [Length(self.length)]
        origin = self._origin()
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
        return forward_counts(self.pipeline[at + 1 :], lengths, type(self).__name__)

    def stream_index(self) -> int:
        """This process's stream: its DataLoader worker number."""
        from .shards.shardlists import worker_info

        return worker_info().worker

    def skip(self, n: int) -> None:
        """Make the next ``iter()`` start ``n`` items in (used when nested in a pipeline)."""
        self._skip = n

    def _workers_hint(self) -> Optional[int]:
        """How many DataLoader workers will run this pipeline, when something said so."""
        return None

    def __len__(self) -> int:
        if self.length is not None:
            return self.length
        if self.nsamples is not None:
            return self.nsamples
        return sum(self.stream_lengths(self._workers_hint()))

    # -- resuming ----------------------------------------------------------------------------

    def _resume_config(self) -> Dict[str, Any]:
        """What must be the same when a saved position is loaded (see :meth:`load_state_dict`)."""
        return {"seed": self.seed, "stages": len(self.pipeline)}

    def state_dict(self) -> Dict[str, Any]:
        """Where this pipeline stands: the epoch in progress and how many items it has yielded.

        After an epoch has run to its end, that is the next epoch with nothing consumed.
        """
        epoch, consumed = self._position
        state: Dict[str, Any] = {
            "version": 1,
            "epoch": epoch,
            "consumed": consumed,
            "config": self._resume_config(),
        }
        if self._carry_position is not None and self.repetitions == sys.maxsize:
            state["stream"] = list(self._carry_position)
        return state

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Make the next ``iter()`` continue where :meth:`state_dict` was taken.

        The configuration that fixes the order (seed, shards, world size, workers, batch size)
        must be the same, else this raises; ``strict=False`` resumes at the same epoch and item
        count anyway, which is then only approximately the rest of the epoch.
        """
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ArgumentError(f"not a webds pipeline state (from state_dict()): {state!r}")
        check_resume_config(state.get("config") or {}, self._resume_config(), strict)
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        self.epoch = epoch
        self._skip = consumed
        self._position = [epoch, consumed]
        self._carry = None
        stream = state.get("stream")
        self._carry_resume = (int(stream[0]), int(stream[1])) if stream else None

    def _take_skip(self) -> int:
        """The items to skip in this iteration (and, in a DataLoader worker, which worker to be)."""
        skip, self._skip = self._skip, 0
        from .shards.shardlists import renumber_worker

        worker = None
        if _is_worker_dataset(self):
            # Only the DataLoader's own dataset renumbers its worker (a WebLoader resuming
            # mid-epoch, see loader._LoaderOrigin.skip), and undoes that in the epochs after.
            worker = renumber_worker(skip["shift"] if isinstance(skip, dict) else 0)
        return resume_share(skip, worker)

    def _skip_point(self, count: int) -> Tuple[int, int, Any]:
        """Where to skip ``count`` output items: (stage position, items there, origin or None).

        Walks back over stages that can say which inputs made their first outputs (map, batched)
        and stops at one that cannot (shuffle), where skipping means replaying and dropping.
        When it reaches the origin, the origin skips without reading.
        """
        return skip_point(self.pipeline, self._origin(), count)

    def _exact_count(self) -> Optional[int]:
        """The items this process must yield this epoch, for sources that promise it."""
        return exact_count(self)

    # -- running -----------------------------------------------------------------------------

    def _one_pass(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        """Run the stages once over the source, closing every stage when done or abandoned."""
        for s in self.pipeline:
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
            if isinstance(s, Stage):
                s.set_seed(self.seed)
        at, n = -1, 0
        if skip:
            at, n, origin = self._skip_point(skip)
            if origin is not None and origin.skip(n) is not False:
                at = -1
        its: List[Any] = []
        it = _as_iterator(self.pipeline[0]) if self.pipeline else iter(())
        its.append(it)
        for i, s in enumerate(self.pipeline):
            if i > 0:
                it = iter(s(it))
                its.append(it)
            if i == at:
                it = itertools.islice(it, n, None)
        try:
            yield from it
        finally:
            # Close downstream first, so no stage reads from an already closed source.
            for x in reversed(its):
                close = getattr(x, "close", None)
                if close is not None:
                    close()

    def _passes(self, first_epoch: int, skip: int = 0, track: bool = False) -> Iterator[Any]:
        """Chain up to ``repetitions`` passes; stop at a pass that yields nothing.

        ``skip`` items of the first pass are skipped; ``track`` records the pass and the items
        yielded in it (with_epoch's stream position).
        """
        for i in range(self.repetitions):
            epoch, n = first_epoch + i, skip if i == 0 else 0
            pos = [epoch, n]
            if track:
                self._carry_position = pos
            empty = True
            for item in self._one_pass(epoch, n):
                empty = False
                pos[1] += 1
                yield item
            if empty and n == 0:
                return

    def iterator(self) -> Iterator[Any]:
        """One epoch's items (what ``iter(self)`` returns)."""
        epoch = self.epoch
        self.epoch += 1
        skip = self._take_skip()
        if self.nsamples is None:
            if self.repetitions == 1:
                it: Iterator[Any] = self._passes(epoch, skip)
                exact = self._exact_count()
                if exact is not None:
                    it = _exactly(it, exact - skip, self)
            else:
                it = itertools.islice(self._passes(epoch), skip, None)
        elif self.repetitions == sys.maxsize:
            # with_epoch: continue the same endless stream across epochs.
            if self._carry is None:
                start, done = self._carry_resume or (epoch, 0)
                self._carry_resume = None
                self._carry = self._passes(start, done, track=True)
            it = itertools.islice(self._carry, max(0, self.nsamples - skip))
        else:
            it = itertools.islice(self._passes(epoch), skip, self.nsamples)
        position = self._position = [epoch, skip]
        return self._counted(it, position)

    def _counted(self, it: Iterator[Any], position: List[int]) -> Iterator[Any]:
        for item in it:
            position[1] += 1
            yield item
        if position is self._position:
            self._position = [position[0] + 1, 0]
        if _is_worker_dataset(self):
            # A persistent worker idles until the next epoch holding all the heap its epoch
            # fragmented (decoded images and tensors of mixed sizes); see _release_free_heap.
            _release_free_heap()

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
        state = self.__dict__.copy()
        state["_carry"] = None
        return state

    def __repr__(self) -> str:
        inner = ",\n  ".join(repr(s) for s in self.pipeline)
        return f"{type(self).__name__}(\n  {inner}\n)"


def _is_worker_dataset(pipeline: "DataPipeline") -> bool:
    """Whether this process is a DataLoader worker and ``pipeline`` is its dataset (not a
    pipeline nested in it, nor one in the main process)."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return info is not None and info.dataset is pipeline


@functools.cache
def _malloc_trim() -> Any:
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # no C library to load by that name (Windows)
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _release_free_heap() -> bool:
    """Hand the free pages of the C heap back to the OS: glibc's ``malloc_trim(0)``.

    Why: glibc raises its mmap threshold to the largest block freed so far, so after the first
    few samples, decoded images and per-sample tensors (0.2-2 MB, of mixed sizes) are carved
    from the heap instead of mapped. Freed, they leave holes that glibc keeps and never returns,
    and the holes grow with the epochs: a persistent 2-worker loader of the image benchmark
    grew 10-13% over 10 epochs with flat Python and malloc in-use figures. Trimming once per
    worker epoch (a few milliseconds) keeps the workers' resident size at its floor between
    epochs. Returns False where there is no glibc (musl, macOS, Windows): nothing is done.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
