"""The stage machinery: :func:`stage` turns a generator function whose first parameter is the
upstream iterator into a curried, picklable factory (:mod:`webds.pipeline` composes them)::

    @stage
    def select(src, predicate):
        for sample in src:
            if predicate(sample):
                yield sample

    select(lambda s: "jpg" in s)          # -> Stage, a callable iterator -> iterator

Keyword parameters named ``epoch``, ``pipeline_seed`` and ``ledger`` receive the pipeline's
epoch, seed and ledger. ``@stage(count=...)`` says how a stage changes the number of items
(``SAME``, ``REORDER``, ``BATCH``, ``UNBATCH``: ``len()`` and resume follow from it), and
:func:`resume_kind` what it owes a resume: ``STATELESS`` or ``LEDGER``; with a stage that says
neither, ``state_dict()`` refuses mid-pass (docs/architecture.md, "A resumable stage"). No torch
here, so that the command and the writers start fast.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable, Dict, Iterable, Iterator, NamedTuple, Optional

from ..errors import ArgumentError
from .redact import redact

__all__ = [
    "stage",
    "pipelinefilter",
    "Stage",
    "StageFactory",
    "Count",
    "Length",
    "SAME",
    "REORDER",
    "BATCH",
    "UNBATCH",
    "STATELESS",
    "LEDGER",
    "Stateless",
    "stateless",
    "resume_kind",
]

#: What a stage owes a resume: nothing, as it passes each item on (or drops it) before it pulls
#: the next, so that the id of the item it yields is the ledger's current one.
STATELESS = "stateless"
#: What a stage owes a resume: it holds items across its yields and records them in the ledger
#: it declares as a parameter (see :mod:`webds.base.ledger`).
LEDGER = "ledger"


class Length(NamedTuple):
    """Items in one stream; ``inner`` is the count before the last batching (for unbatching)."""

    items: int
    inner: Optional["Length"] = None


class Count:
    """How a stage changes the number of items: ``forward`` for len(), ``backward`` to resume.

    ``forward(n, stage)`` returns the stage's output length for input length ``n``, or None if it
    cannot know. ``backward(c, stage)`` returns how many input items produce the first ``c``
    outputs when those inputs can be skipped instead of replayed, else None.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def forward(self, n: Length, stage: "Stage") -> Optional[Length]:
        return n

    def backward(self, c: int, stage: "Stage") -> Optional[int]:
        return c

    def __repr__(self) -> str:
        return self.name


class _Reorder(Count):
    def backward(self, c: int, stage: "Stage") -> Optional[int]:
        return None  # which inputs made the first c outputs depends on the order: replay


class _Batch(Count):
    def forward(self, n: Length, stage: "Stage") -> Optional[Length]:
        size, partial = stage.argument("batchsize"), stage.argument("partial")
        return Length(-(-n.items // size) if partial else n.items // size, n)

    def backward(self, c: int, stage: "Stage") -> Optional[int]:
        return c * stage.argument("batchsize")


class _Unbatch(Count):
    def forward(self, n: Length, stage: "Stage") -> Optional[Length]:
        return n.inner

    def backward(self, c: int, stage: "Stage") -> Optional[int]:
        return None


#: One output item per input item, in the same order (map, decode, to_tuple, ...).
SAME = Count("SAME")
#: As many outputs as inputs, reordered (shuffle).
REORDER = _Reorder("REORDER")
#: Groups of ``batchsize`` items (a stage with ``batchsize`` and ``partial`` parameters).
BATCH = _Batch("BATCH")
#: Undoes the last BATCH.
UNBATCH = _Unbatch("UNBATCH")


class StageFactory:
    """What :func:`stage` returns: call it with the stage's parameters to get a :class:`Stage`."""

    def __init__(
        self,
        fn: Callable[..., Iterator[Any]],
        count: Optional[Count] = None,
        stateless: bool = False,
        expands: bool = False,
        runs: bool = False,
    ) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.count = count
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        if not params:
            raise ArgumentError(
                f"stage function {fn.__qualname__} must take the source iterator first"
            )
        self.wants_epoch = "epoch" in sig.parameters
        self.wants_seed = "pipeline_seed" in sig.parameters
        self.wants_ledger = "ledger" in sig.parameters
        #: Its per-item work can run in a pool: a pipeline's ``threads`` sets it when not given.
        self.takes_threads = "threads" in sig.parameters
        if stateless and self.wants_ledger:
            raise ArgumentError(
                f"stage function {fn.__qualname__} takes a ledger, so it records what it holds: "
                "it is not stateless (drop one of the two)"
            )
        if expands and not self.wants_ledger:
            raise ArgumentError(
                f"stage function {fn.__qualname__} expands source items into samples, so it "
                "must record them: give it a ledger parameter"
            )
        #: It reads samples out of each source item and records each in the ledger itself.
        self.expands = expands
        #: Its source may hold runs of samples, which it passes on (:mod:`webds.base.runs`).
        self.takes_runs = runs
        #: What the stage owes a resume: LEDGER, STATELESS, or None (undeclared: refused).
        self.resume: Optional[str] = (
            LEDGER if self.wants_ledger else STATELESS if stateless else None
        )
        # The public signature is the function's without the source and the injected values.
        injected = ("epoch", "pipeline_seed", "ledger")
        self.__signature__ = sig.replace(
            parameters=[p for p in params[1:] if p.name not in injected]
        )

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
        self.seed: Optional[int] = None
        self.ledger: Any = None
        #: ``threads=`` when the stage takes it and was not given it (the pipeline's threads).
        self.threads = 0

    @property
    def count(self) -> Optional[Count]:
        """How this stage changes the number of items (None: unknown)."""
        return self.factory.count

    def argument(self, name: str) -> Any:
        """The value of parameter ``name`` in this stage (its default if not given)."""
        bound = self.factory.__signature__.bind(*self.args, **self.kwargs)
        bound.apply_defaults()
        return bound.arguments[name]

    def _given(self, name: str) -> bool:
        """Whether parameter ``name`` was given, by keyword or by position."""
        return name in self.factory.__signature__.bind_partial(*self.args, **self.kwargs).arguments

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch passed to stage functions that take an ``epoch`` parameter."""
        self.epoch = epoch

    def set_seed(self, seed: Optional[int]) -> None:
        """Set the seed passed to stage functions that take a ``pipeline_seed`` parameter."""
        self.seed = seed

    def set_ledger(self, ledger: Any) -> None:
        """Set the ledger passed to stage functions that take a ``ledger`` parameter (see
        :mod:`webds.base.ledger`)."""
        self.ledger = ledger

    def __call__(self, src: Iterable[Any]) -> Iterator[Any]:
        injected: Dict[str, Any] = {}
        if self.factory.wants_epoch:
            injected["epoch"] = self.epoch
        if self.factory.wants_seed:
            injected["pipeline_seed"] = self.seed
        if self.factory.wants_ledger:
            injected["ledger"] = self.ledger
        if self.threads and self.factory.takes_threads and not self._given("threads"):
            injected["threads"] = self.threads
        return self.factory.fn(src, *self.args, **injected, **self.kwargs)

    def __repr__(self) -> str:
        # The arguments may hold a signed URL or storage_options (key=..., secret=...).
        parts = [repr(redact(a)) for a in self.args]
        parts += [f"{k}={v!r}" for k, v in redact(self.kwargs).items()]
        return redact(f"{self.factory.__name__}({', '.join(parts)})")


def stage(
    fn: Optional[Callable[..., Iterator[Any]]] = None,
    *,
    count: Optional[Count] = None,
    stateless: bool = False,
    expands: bool = False,
    runs: bool = False,
) -> Any:
    """Turn a generator function ``fn(src, *params)`` into a curried stage factory.

    Use as ``@stage``, ``@stage(count=SAME)`` (see :class:`Count`) or
    ``@stage(stateless=True)``: the function passes each item on (or drops it) before it pulls
    the next, so a pipeline can save its position mid-pass. A function that holds items across
    its yields declares a ``ledger`` parameter instead and records them (see
    :mod:`webds.base.ledger`); one that does neither is refused by ``state_dict()``.
    ``@stage(expands=True)``: it reads samples out of each source item (a shard) and numbers
    and records each in the ledger itself (``tarfile_to_samples``); the pipeline then only
    says which source item is current, and leaves skipping consumed samples to it.
    ``@stage(runs=True)``: its source may hold runs of samples (:mod:`webds.base.runs`), which
    it passes on, mapped in columns or taken apart (as :func:`~webds.base.handlers.apply_each`
    does); the pipeline sends runs to no other stage.
    """
    if fn is None:
        return lambda f: StageFactory(f, count, stateless, expands, runs)
    return StageFactory(fn, count, stateless, expands, runs)


class Stateless:
    """A plain stage function ``fn(src, ...) -> iterator`` declared stateless (see
    :func:`stateless`); calling it calls ``fn``."""

    resume = STATELESS

    def __init__(self, fn: Callable[..., Iterator[Any]]) -> None:
        if not callable(fn):
            raise ArgumentError(f"stateless() takes a stage function, got {fn!r}")
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> Any:
        # A module-level @stateless function pickles by reference (its name is this object).
        module, name = getattr(self, "__module__", None), getattr(self, "__qualname__", None)
        try:
            if module and name and _import_object(module, name) is self:
                return (_import_object, (module, name))
        except (ImportError, AttributeError):
            pass
        return (Stateless, (self.fn,))

    def __repr__(self) -> str:
        return f"stateless({getattr(self.fn, '__qualname__', self.fn)!r})"


def stateless(fn: Callable[..., Iterator[Any]]) -> Stateless:
    """Declare a plain stage function stateless: it passes each item on, or drops it, before it
    pulls the next (it holds nothing across its yields), so a pipeline that runs it can save
    its position mid-pass.

    >>> ds = webds.WebDataset(url).compose(webds.stateless(my_filter))

    A function that holds items (a buffer, a window, pairs) must not be declared so: make it a
    ``@stage`` with a ``ledger`` parameter that records what it holds (docs/architecture.md).
    """
    if isinstance(fn, Stateless):
        return fn
    if isinstance(fn, (Stage, StageFactory)):
        raise ArgumentError(
            f"{fn!r} is a @stage: declare it with @stage(stateless=True) where it is defined"
        )
    return Stateless(fn)


def resume_kind(s: Any) -> Optional[str]:
    """What stage ``s`` of a pipeline owes a resume: :data:`LEDGER`, :data:`STATELESS`, or
    None when it does not say (a plain function, a generator stage without a declaration, a
    cache stage): a pipeline refuses to save a position mid-pass through such a stage."""
    if isinstance(s, Stage):
        return s.factory.resume
    if isinstance(s, Stateless):
        return STATELESS
    return None


def pipelinefilter(f: Callable[..., Any]) -> "StageFactory":
    """webdataset's name for :func:`stage` (with its parameter name): ``pipelinefilter(f)``
    curries the generator function ``f(src, *params)`` into a stage factory."""
    return stage(f)
