"""webdataset 1.x helpers that have no better home (its ``utils`` and ``extradatasets``).

They work as webdataset documented them, with its bugs fixed: :class:`with_epoch` and
:class:`with_length` can be instantiated and pickled, :func:`repeatedly` honours ``batchsize``,
:func:`make_seed` gives the same seed in every process, and :func:`safe_eval` never calls
``eval``. New code rarely needs them: ``DataPipeline.with_epoch``/``with_length`` and
:func:`webds.base.workers.worker_info` cover the same ground.
"""

from __future__ import annotations

import ast
import functools
import importlib
import itertools
import os
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Tuple, Union

from torch.utils.data import IterableDataset

from ..base.workers import WorkerInfo, derive_seed, worker_info
from ..errors import ArgumentError, WebdsError
from ..stages.filters import identity

__all__ = [
    "PipelineStage",
    "repeatedly",
    "repeatedly0",
    "make_seed",
    "pytorch_worker_info",
    "pytorch_worker_seed",
    "is_iterable",
    "identity",
    "safe_eval",
    "lookup_sym",
    "guess_batchsize",
    "deprecated",
    "obsolete",
    "ObsoleteException",
    "compute_sample_weights",
    "MockDataset",
    "with_epoch",
    "with_length",
]


class PipelineStage:
    """Base class for webdataset-style stage objects: subclasses define ``run(src)`` (or
    ``invoke(src)``), and an instance is a stage ``stage(src) -> iterator`` in a DataPipeline.

    As the first stage of a pipeline it is called with no arguments.
    """

    def run(self, *args: Any, **kw: Any) -> Iterator[Any]:
        """Run the stage (override this or :meth:`invoke`; each calls the other)."""
        if type(self).invoke is PipelineStage.invoke:
            raise self._undefined()
        return self.invoke(*args, **kw)

    def invoke(self, *args: Any, **kw: Any) -> Iterator[Any]:
        """Run the stage (override this or :meth:`run`; each calls the other)."""
        if type(self).run is PipelineStage.run:
            raise self._undefined()
        return self.run(*args, **kw)

    def _undefined(self) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} is a PipelineStage but defines neither run() nor invoke()"
        )

    def __call__(self, *args: Any, **kw: Any) -> Iterator[Any]:
        return self.run(*args, **kw)


def make_seed(*args: Any) -> int:
    """A 31-bit seed combined from ``args``, the same in every process and on every machine.

    (webdataset combined ``hash()`` values, which differ per process for strings.)
    """
    return derive_seed("make_seed", *args) & 0x7FFFFFFF


def pytorch_worker_info(group: Any = None) -> WorkerInfo:
    """``(rank, world_size, worker, num_workers)`` for this process (see ``worker_info``)."""
    return worker_info(group)


def pytorch_worker_seed(group: Any = None) -> int:
    """A seed distinct per (rank, worker): ``rank * 1000 + worker``, as in webdataset.

    With more than 1000 workers the multiplier grows, so two processes never share a seed.
    """
    info = worker_info(group)
    return info.rank * max(1000, info.num_workers) + info.worker


def is_iterable(obj: Any) -> bool:
    """True for iterables other than ``str`` and ``bytes``."""
    if isinstance(obj, (str, bytes)):
        return False
    try:
        iter(obj)
    except TypeError:
        return False
    return True


def safe_eval(s: str, expr: str = "{}") -> Any:
    """Parse the literal ``expr.format(s)`` (numbers, strings, tuples, lists, dicts, booleans).

    ``safe_eval("3") == 3``, ``safe_eval("2", "[{}, 4]") == [2, 4]``. Anything that is not a
    literal (names, calls, operators) is refused with ArgumentError: nothing is ever evaluated.
    """
    if not isinstance(s, str) or not isinstance(expr, str):
        raise ArgumentError(f"safe_eval needs strings, got {s!r} and {expr!r}")
    text = expr.format(s)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exn:
        raise ArgumentError(
            f"safe_eval: {text!r} is not a Python literal ({type(exn).__name__}); only numbers, "
            "strings, bytes, tuples, lists, dicts, sets, booleans and None are accepted"
        ) from None


def lookup_sym(sym: str, modules: Sequence[str]) -> Any:
    """Return attribute ``sym`` of the first of ``modules`` that has it (relative names are
    relative to ``webds``), or None."""
    for name in modules:
        module = importlib.import_module(name, package="webds")
        result = getattr(module, sym, None)
        if result is not None:
            return result
    return None


def _sized(x: Any) -> bool:
    return hasattr(x, "__len__") and not isinstance(x, (str, bytes, Mapping))


def guess_batchsize(batch: Any) -> int:
    """The number of samples in a batch: the length of its first column.

    Works for tuple/list batches (``(images, labels)``), dict batches (from collating dicts) and
    a plain list of samples (from ``listed``).
    """
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            if _sized(value) and not str(key).startswith("__"):
                return len(value)
        raise ArgumentError(f"guess_batchsize: no column with a length in {list(batch)}")
    if isinstance(batch, (list, tuple)):
        if batch and _sized(batch[0]) and hasattr(batch[0], "__getitem__"):
            return len(batch[0])
        return len(batch)
    if hasattr(batch, "shape"):
        return int(batch.shape[0])
    return len(batch)


def repeatedly(
    source: Iterable[Any],
    nepochs: Optional[int] = None,
    nbatches: Optional[int] = None,
    nsamples: Optional[int] = None,
    batchsize: Union[int, Callable[[Any], int]] = guess_batchsize,
) -> Iterator[Any]:
    """Iterate ``source`` again and again: ``nepochs`` passes, at most ``nbatches`` items and
    ``nsamples`` samples in all (each item counting ``batchsize(item)`` samples, or ``batchsize``
    if it is an int). Stops at a pass that yields nothing, rather than spinning forever.

    ``for batch in repeatedly(loader, nsamples=10_000): ...``
    """
    count: Callable[[Any], int] = (lambda _: batchsize) if isinstance(batchsize, int) else batchsize
    epoch = batches = total = 0
    while nepochs is None or epoch < nepochs:
        empty = True
        for item in source:
            empty = False
            yield item
            batches += 1
            if nbatches is not None and batches >= nbatches:
                return
            if nsamples is not None:
                total += count(item)
                if total >= nsamples:
                    return
        if empty:
            return
        epoch += 1


def repeatedly0(
    loader: Iterable[Any], nepochs: int = sys.maxsize, nbatches: int = sys.maxsize
) -> Iterator[Any]:
    """``nepochs`` passes over ``loader``, each cut to at most ``nbatches`` items."""
    for _ in range(nepochs):
        empty = True
        for item in itertools.islice(loader, nbatches):
            empty = False
            yield item
        if empty:
            return


def deprecated(arg: Any = None) -> Any:
    """Decorator: calling the function issues a DeprecationWarning (``@deprecated`` or
    ``@deprecated("use X instead")``)."""

    def decorate(func: Callable[..., Any], reason: Optional[str]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kw: Any) -> Any:
            msg = f"{func.__name__} is deprecated"
            warnings.warn(msg + (f": {reason}" if reason else ""), DeprecationWarning, 2)
            return func(*args, **kw)

        return wrapper

    if callable(arg):
        return decorate(arg, None)
    return lambda func: decorate(func, arg)


class ObsoleteException(WebdsError, NotImplementedError):
    """A function marked :func:`obsolete` was called without ``ALLOW_OBSOLETE=1``."""


def obsolete(func: Optional[Callable[..., Any]] = None, *, reason: Optional[str] = None) -> Any:
    """Decorator: calling the function raises :class:`ObsoleteException`, unless the environment
    variable ``ALLOW_OBSOLETE`` is ``1`` (read at call time), when it only warns."""
    if func is None:
        return functools.partial(obsolete, reason=reason)

    @functools.wraps(func)
    def wrapper(*args: Any, **kw: Any) -> Any:
        msg = f"{func.__name__} is obsolete" + (f": {reason}" if reason else "")
        if os.environ.get("ALLOW_OBSOLETE", "0").strip() not in ("", "0"):
            warnings.warn(msg, DeprecationWarning, 2)
            return func(*args, **kw)
        raise ObsoleteException(msg + "; set the environment variable ALLOW_OBSOLETE=1 to use it")

    return wrapper


def compute_sample_weights(n_w_pairs: Sequence[Tuple[float, float]]) -> Any:
    """Relative sampling weights ``n * w``, scaled so the largest is 1 (a numpy array).

    ``compute_sample_weights([(100, 1.0), (50, 1.0)])`` -> ``array([1.0, 0.5])``.
    """
    import numpy as np

    pairs = list(n_w_pairs)
    if not pairs:
        raise ArgumentError("compute_sample_weights needs at least one (n, w) pair")
    weighted = np.array([float(n) * float(w) for n, w in pairs])
    top = weighted.max()
    if not top > 0:
        raise ArgumentError(f"compute_sample_weights: no positive n * w in {pairs}")
    return weighted / top


class MockDataset(IterableDataset):
    """Yields ``sample`` ``length`` times (for tests and benchmarks)."""

    def __init__(self, sample: Any, length: int) -> None:
        super().__init__()
        self.sample = sample
        self.length = int(length)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Any]:
        return itertools.repeat(self.sample, self.length)


class with_epoch(IterableDataset):  # noqa: N801 (webdataset's name)
    """Make every epoch of ``dataset`` exactly ``length`` items long.

    The underlying iterator continues across epochs (and restarts when exhausted), so nothing is
    skipped or seen twice more than needed: ``with_epoch(ds, 1000)`` in a loop over epochs.
    """

    def __init__(self, dataset: Iterable[Any], length: int) -> None:
        super().__init__()
        if int(length) < 0:
            raise ArgumentError(f"with_epoch length must be >= 0, got {length}")
        self.dataset = dataset
        self.length = int(length)
        self._it: Optional[Iterator[Any]] = None
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the dataset, if it takes one."""
        self.epoch = int(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return self.length

    def _next(self) -> Any:
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.dataset)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
        raise ArgumentError(f"with_epoch: the dataset {self.dataset!r} yields nothing")

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.length):
            yield self._next()

    def __getstate__(self) -> dict:
        # A live iterator can't be pickled; a copy in a DataLoader worker starts afresh.
        state = self.__dict__.copy()
        state["_it"] = None
        return state


class with_length(IterableDataset):  # noqa: N801 (webdataset's name)
    """Iterate ``dataset`` unchanged, but declare ``len() == length``."""

    def __init__(self, dataset: Iterable[Any], length: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.length = int(length)

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the dataset, if it takes one."""
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)
