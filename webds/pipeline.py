"""Stages and DataPipeline: the engine everything else in webds is built from.

A *stage* is a callable ``stage(src: Iterator) -> Iterator``. Stages are written once, as
generator functions whose first parameter is the upstream iterator, and turned into curried,
picklable factories by :func:`stage`::

    @stage
    def select(src, predicate):
        for sample in src:
            if predicate(sample):
                yield sample

    select(lambda s: "jpg" in s)          # -> Stage, a callable iterator -> iterator
    DataPipeline(source, select(f), ...)  # composable style
    dataset.select(f)                     # fluent style, derived from the same definition

A stage function that declares a keyword parameter named ``epoch`` receives the pipeline's current
epoch (see :meth:`DataPipeline.set_epoch`); that is how shuffles reshuffle every epoch without any
global state.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import itertools
import sys
from typing import Any, Callable, Iterable, Iterator, List, Optional

from torch.utils.data import IterableDataset

from .errors import ArgumentError

__all__ = ["stage", "pipelinefilter", "Stage", "StageFactory", "DataPipeline"]


class StageFactory:
    """What :func:`stage` returns: call it with the stage's parameters to get a :class:`Stage`."""

    def __init__(self, fn: Callable[..., Iterator[Any]]) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        if not params:
            raise ArgumentError(
                f"stage function {fn.__qualname__} must take the source iterator first"
            )
        self.wants_epoch = "epoch" in sig.parameters
        # The public signature is the function's without the source and the injected epoch.
        self.__signature__ = sig.replace(parameters=[p for p in params[1:] if p.name != "epoch"])

    def __call__(self, *args: Any, **kwargs: Any) -> "Stage":
        try:
            self.__signature__.bind(*args, **kwargs)
        except TypeError as exn:
            raise TypeError(f"{self.__name__}{self.__signature__}: {exn}") from None
        return Stage(self, args, kwargs)

    def __reduce__(self) -> Any:
        # Pickle by reference to the module attribute, so DataLoader workers can load stages.
        return (_import_object, (self.fn.__module__, self.fn.__qualname__))

    def __repr__(self) -> str:
        return f"<stage {self.__name__}{self.__signature__}>"


def _import_object(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class Stage:
    """A stage function with its parameters bound; call it on an iterator to run it."""

    def __init__(self, factory: StageFactory, args: tuple, kwargs: dict) -> None:
        self.factory = factory
        self.args = args
        self.kwargs = kwargs
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch passed to stage functions that take an ``epoch`` parameter."""
        self.epoch = epoch

    def __call__(self, src: Iterable[Any]) -> Iterator[Any]:
        if self.factory.wants_epoch:
            return self.factory.fn(src, *self.args, epoch=self.epoch, **self.kwargs)
        return self.factory.fn(src, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.factory.__name__}({', '.join(parts)})"


def stage(fn: Callable[..., Iterator[Any]]) -> StageFactory:
    """Turn a generator function ``fn(src, *params)`` into a curried stage factory."""
    return StageFactory(fn)


#: webdataset's name for :func:`stage`.
pipelinefilter = stage


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
        self.nsamples: Optional[int] = None
        self.repetitions = 1
        self.length: Optional[int] = None
        self._carry: Optional[Iterator[Any]] = None

    # -- composition -------------------------------------------------------------------------

    def compose(self, *stages: Any) -> "DataPipeline":
        """Return a copy of this pipeline with ``stages`` appended (``self`` is unchanged)."""
        result = copy.copy(self)
        result.pipeline = self.pipeline + [s for s in stages if s is not None]
        result._carry = None
        return result

    def append(self, stage: Any) -> None:
        """Append a stage in place."""
        self.pipeline.append(stage)

    def stage(self, i: int) -> Any:
        """Return the i-th stage (0 is the source)."""
        return self.pipeline[i]

    # -- epochs and length -------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` (like ``DistributedSampler.set_epoch``)."""
        self.epoch = int(epoch)
        self._carry = None

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

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError(
                f"{type(self).__name__} has no known length; declare one with .with_length(n)"
            )
        return self.length

    # -- running -----------------------------------------------------------------------------

    def _one_pass(self, epoch: int) -> Iterator[Any]:
        """Run the stages once over the source, closing every stage when done or abandoned."""
        for s in self.pipeline:
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
        its: List[Any] = []
        it = _as_iterator(self.pipeline[0]) if self.pipeline else iter(())
        its.append(it)
        for s in self.pipeline[1:]:
            it = iter(s(it))
            its.append(it)
        try:
            yield from it
        finally:
            # Close downstream first, so no stage reads from an already closed source.
            for x in reversed(its):
                close = getattr(x, "close", None)
                if close is not None:
                    close()

    def _passes(self, first_epoch: int) -> Iterator[Any]:
        """Chain up to ``repetitions`` passes; stop at a pass that yields nothing."""
        for i in range(self.repetitions):
            empty = True
            for item in self._one_pass(first_epoch + i):
                empty = False
                yield item
            if empty:
                return

    def iterator(self) -> Iterator[Any]:
        """One epoch's items (what ``iter(self)`` returns)."""
        epoch = self.epoch
        self.epoch += 1
        if self.nsamples is None:
            return self._passes(epoch)
        if self.repetitions == sys.maxsize:
            # with_epoch: continue the same endless stream across epochs.
            if self._carry is None:
                self._carry = self._passes(epoch)
            return itertools.islice(self._carry, self.nsamples)
        return itertools.islice(self._passes(epoch), self.nsamples)

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
