"""The user-facing stages that work on whole samples: shuffle, select, rsample, slice, map, info,
log_keys (the stages on a sample's fields, to_tuple, rename, map_dict, ..., are in
:mod:`webds.stages.fields`; batching is in :mod:`webds.stages.batching`).

Each stage is written once, as a generator function (or, for the stages that turn each sample into
one result, a function returning :func:`webds.base.handlers.apply_each`'s loop) turned into a
curried, picklable factory by :func:`webds.pipeline.stage`; the fluent methods
(``dataset.shuffle(1000)``) are derived from these same factories, so the signatures here are the
public API (webdataset 1.x's, with its bugs fixed).

Samples are dicts (``{"__key__": ..., "jpg": ..., "cls": ...}``) until
:func:`~webds.stages.fields.to_tuple` or :func:`~webds.stages.fields.extract_keys` turns them into
tuples. A malformed sample raises :class:`~webds.errors.SampleError` naming its ``__key__`` and
``__url__``; stages that take a ``handler`` pass such errors to it, and count and log what the
handler skipped. The checks shared by the stage modules (``_where``, ``_check_int``,
``_check_callable``, ``_annotate``) live here.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import numbers
import os
import random
import sys
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    TextIO,
    Tuple,
)

from ..base.handlers import Handler, reraise_exception
from ..base.ledger import ids_of
from ..base.redact import redact
from ..base.stage import REORDER, SAME, Stage, StageFactory, stage
from ..base.workers import derive_seed, worker_info
from ..errors import ArgumentError, WebdsError
from .threads import apply_maybe_threaded, check_threads

__all__ = [
    "derive_seed",
    "shuffle",
    "detshuffle",
    "select",
    "rsample",
    "slice",
    "map",
    "info",
    "log_keys",
    "pick",
    "identity",
]

log = logging.getLogger("webds")

Sample = Any


# -- helpers ---------------------------------------------------------------------------------------


def identity(x: Any) -> Any:
    """Return ``x`` unchanged."""
    return x


def _where(sample: Any) -> Dict[str, Any]:
    """The ``key=``/``url=`` context of a sample for a webds error (empty for non-dicts)."""
    if not isinstance(sample, Mapping):
        return {}
    key, url = sample.get("__key__"), sample.get("__url__")
    return {
        "key": None if key is None else str(key),
        "url": None if url is None else str(url),
    }


def pick(buf: List[Any], rng: random.Random) -> Any:
    """Remove and return a random element of ``buf`` in O(1) (the order of the rest changes)."""
    k = rng.randrange(len(buf))
    buf[k], buf[-1] = buf[-1], buf[k]
    return buf.pop()


def _check_int(name: str, value: Any) -> int:
    try:
        return int(value.__index__())
    except (AttributeError, TypeError):
        raise ArgumentError(f"{name} must be an integer, got {value!r}") from None


def _check_callable(stage_name: str, what: str, f: Any) -> None:
    if not callable(f):
        raise ArgumentError(f"{stage_name}: {what} must be callable, got {f!r}")


def _check_seed(seed: Any) -> Any:
    """Accept an int seed, or a str holding one (as a ``WDS_SEED`` value would be)."""
    if seed is None:
        return None
    if isinstance(seed, str):
        try:
            return int(seed.strip())
        except ValueError:
            raise ArgumentError(f"seed must be an integer, got the string {seed!r}") from None
    return _check_int("seed", seed)


def _annotate(exn: BaseException, stage_name: str, sample: Any) -> None:
    """Add where a user function failed to its exception, keeping the exception's type."""
    where = _where(sample)
    # webds errors already carry the key and url; add_note is Python 3.11+.
    if where and not isinstance(exn, WebdsError) and hasattr(exn, "add_note"):
        url = redact(where["url"])
        exn.add_note(f"webds: in {stage_name} on sample {where['key']!r} of {url!r}")


# -- shuffling and sampling ------------------------------------------------------------------------


def _worker_rng(tag: str, seed: Any, epoch: int) -> random.Random:
    """A Random for this (seed, epoch, rank, worker), or one from fresh entropy if no seed."""
    if seed is None:
        return random.Random(os.urandom(16))
    where = worker_info()
    return random.Random(derive_seed(tag, seed, epoch, where.rank, where.worker))


def _randbelow(rng: random.Random, n: int) -> Tuple[int, int]:
    """``rng.randrange(n)`` as CPython draws it (``_randbelow_with_getrandbits``), and how many
    32-bit words of the generator it took (for ``n`` below 2**32)."""
    k = n.bit_length()
    r = rng.getrandbits(k)
    words = 1
    while r >= n:
        r = rng.getrandbits(k)
        words += 1
    return r, words


def _skip_words(rng: random.Random, words: int) -> None:
    """Advance ``rng`` by ``words`` 32-bit words, as that many draws would (in C, by chunks)."""
    while words > 0:
        step = min(words, 1 << 20)
        rng.getrandbits(32 * step)
        words -= step


def _buffer_shuffle(
    src: Iterable[Any],
    bufsize: int,
    initial: int,
    rng: random.Random,
    ledger: Any = None,
    seeded: bool = True,
) -> Iterator[Any]:
    """Shuffle through a buffer of at most ``bufsize`` items (see :func:`shuffle`).

    With a ``ledger``, the buffered items' ids are kept in the stage's slot, in the buffer's
    order, with the count of the generator's words drawn; resuming puts the buffer back as it
    was and, when ``rng`` was freshly ``seeded`` for this pass, draws on from where it stood
    (see :meth:`~webds.base.slots.Slot.restore`).
    """
    it = iter(src)
    slot = ledger.slot() if ledger is not None else None
    buf: List[Any] = []
    resumed = slot is not None and ledger.resuming
    if resumed:
        # The items of later stages go by; this stage's buffer comes back, in its order.
        yield from slot.restore(it)
        buf = slot.captured
        it = slot.rest(it)
        if seeded:
            _skip_words(rng, slot.draws)
        elif buf:
            ledger.unordered = ledger.unordered or "shuffle(rng=...) draws afresh after a resume"
    hold = slot.hold if slot is not None else None
    shared = slot.ledger if slot is not None else None  # (ledger.current, without the view)
    initial = max(1, min(initial, bufsize))
    end = object()
    if not resumed:
        for item in it:
            buf.append(item)
            if hold is not None:
                hold(shared.current)
            if len(buf) >= initial:
                break
        else:
            it = iter(())
    while True:
        if resumed:
            # Just after a yield: pull two per output while the buffer is below bufsize, so it
            # grows from ``initial`` to ``bufsize`` without delaying the first outputs; one
            # per output after that.
            for _ in range(2):
                if len(buf) >= bufsize:
                    break
                item = next(it, end)
                if item is end:
                    it = iter(())
                    break
                buf.append(item)
                if hold is not None:
                    hold(shared.current)
        resumed = True
        if not buf:
            return
        k, words = _randbelow(rng, len(buf))
        buf[k], buf[-1] = buf[-1], buf[k]
        item = buf.pop()
        if slot is not None:
            slot.take_swapped(k, words)  # (as buf lost its item)
        yield item


@stage(count=REORDER)
def shuffle(
    src: Iterable[Any],
    bufsize: int = 1000,
    initial: int = 100,
    rng: Optional[random.Random] = None,
    seed: Optional[int] = None,
    handler: Optional[Handler] = None,
    *,
    epoch: int = 0,
    pipeline_seed: Optional[int] = None,
    ledger: Any = None,
) -> Iterator[Any]:
    """Shuffle the stream through a buffer of ``bufsize`` items.

    Fills the buffer to ``initial`` items before the first output, then outputs a random buffered
    item for each one it takes in, growing the buffer up to ``bufsize``; at the end it drains the
    buffer in random order. ``bufsize < 1`` passes the stream through unchanged.

    With ``seed``, the order depends only on (seed, epoch, rank, DataLoader worker), the same on
    every machine and run, and different every epoch; without one it follows the pipeline's seed
    (``WebDataset(..., seed=s)``), and with neither it is fresh every time. ``rng``
    (a ``random.Random``) overrides both. ``handler`` is accepted for webdataset compatibility:
    shuffling itself cannot fail on a sample.

    ``DataPipeline(source, shuffle(1000, seed=0), ...)`` reshuffles on every ``set_epoch``.
    """
    bufsize = _check_int("shuffle bufsize", bufsize)
    initial = _check_int("shuffle initial", initial)
    seed = _check_seed(seed)
    if rng is not None and seed is not None:
        raise ArgumentError("shuffle: pass rng or seed, not both")
    if rng is not None and not hasattr(rng, "randrange"):
        raise ArgumentError(f"shuffle: rng must be a random.Random, got {rng!r}")
    if bufsize < 1:
        yield from src
        return
    if seed is None:
        seed = pipeline_seed
    seeded = rng is None and seed is not None
    rng = rng or _worker_rng("shuffle", seed, epoch)
    yield from _buffer_shuffle(src, bufsize, initial, rng, ledger, seeded)


class _DetShuffleFactory(StageFactory):
    """``detshuffle``'s factory: its own ``epoch=`` argument is an offset to the pipeline epoch.

    A plain stage can't have a user argument named ``epoch``, because the pipeline passes its
    epoch under that name; this factory accepts webdataset's spelling and renames it.
    """

    def __init__(self, fn: Callable[..., Iterator[Any]]) -> None:
        super().__init__(fn)
        params = [p for p in self.__signature__.parameters.values() if p.name != "first_epoch"]
        params.append(
            inspect.Parameter(
                "epoch", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=-1, annotation="int"
            )
        )
        self.__signature__ = self.__signature__.replace(parameters=params)

    def __call__(self, *args: Any, **kwargs: Any) -> Stage:
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError as exn:
            raise TypeError(f"{self.__name__}{self.__signature__}: {exn}") from None
        bound.apply_defaults()
        a = bound.arguments
        return Stage(self, (a["bufsize"], a["initial"], a["seed"], a["epoch"]), {})


@_DetShuffleFactory
def detshuffle(
    src: Iterable[Any],
    bufsize: int = 1000,
    initial: int = 100,
    seed: int = 0,
    first_epoch: int = -1,
    *,
    epoch: int = 0,
    ledger: Any = None,
) -> Iterator[Any]:
    """Shuffle like :func:`shuffle`, in the same order in every rank and worker.

    The order depends only on (seed, epoch), so ``detshuffle`` can shuffle a shard list *before*
    ``split_by_node`` / ``split_by_worker`` and every process still agrees on it. Its ``epoch``
    argument is webdataset's starting counter: epoch ``e`` of the pipeline uses ``e + epoch + 1``,
    so the default (-1) follows the pipeline's epochs.
    """
    bufsize = _check_int("detshuffle bufsize", bufsize)
    initial = _check_int("detshuffle initial", initial)
    seed = _check_seed(seed)
    if seed is None:
        raise ArgumentError("detshuffle needs an integer seed (it is deterministic by design)")
    first_epoch = _check_int("detshuffle epoch", first_epoch)
    if bufsize < 1:
        yield from src
        return
    rng = random.Random(derive_seed("detshuffle", seed, epoch + first_epoch + 1))
    yield from _buffer_shuffle(src, bufsize, initial, rng, ledger)


detshuffle.count = REORDER


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit hash of an int, in a few operations."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


@stage
def rsample(
    src: Iterable[Any],
    p: float = 0.5,
    seed: Optional[int] = None,
    *,
    epoch: int = 0,
    pipeline_seed: Optional[int] = None,
    ledger: Any = None,
) -> Iterator[Any]:
    """Keep each item with probability ``p``.

    Seeded like :func:`shuffle` (by seed, epoch, rank and worker; without ``seed``, by the
    pipeline's) rather than by the global ``random`` that webdataset used. In a pipeline the
    choice for each sample depends only on those and on which sample it is, not on what came
    before it, so a resumed epoch keeps exactly the samples the uninterrupted one would.
    """
    if not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ArgumentError(f"rsample: p must be a probability between 0 and 1, got {p!r}")
    seed = _check_seed(seed)
    if seed is None:
        seed = pipeline_seed
    if ledger is None or seed is None:
        rng = _worker_rng("rsample", seed, epoch)
        for item in src:
            if rng.random() < p:
                yield item
        return
    where = worker_info()
    base = derive_seed("rsample", seed, epoch, where.rank, where.worker)
    threshold = int(p * 2.0**64)
    # Resuming, what stages after this one held comes back first: it was kept before.
    plan = ledger.restore_plan() if ledger.resuming else None
    for item in src:
        i = ledger.current
        if plan is not None:
            if plan.owner(i) > ledger.position:
                yield item
                continue
            plan = None
        if not isinstance(i, int):
            i = next(ids_of(i), 0)  # a batch: drawn by its first sample
        if _mix64(base ^ i) < threshold:
            yield item


# -- selecting and transforming --------------------------------------------------------------------


@stage(stateless=True)
def select(src: Iterable[Any], predicate: Callable[[Any], Any]) -> Iterator[Any]:
    """Keep the items for which ``predicate(item)`` is true."""
    _check_callable("select", "predicate", predicate)
    for item in src:
        if predicate(item):
            yield item


@stage
def slice(src: Iterable[Any], *args: Optional[int], ledger: Any = None) -> Iterator[Any]:
    """Items ``[start:stop:step]`` of the stream: ``slice(stop)`` or ``slice(start, stop[, step])``.

    Stops pulling from upstream once ``stop`` is reached, as :func:`itertools.islice` does. It
    counts the items it passes, and a resumed epoch would count from 0 again, so a pipeline with
    a ``slice`` refuses to resume mid-epoch (``with_epoch(n)`` cuts epochs and resumes).
    """
    if ledger is not None and ledger.problem is None:
        ledger.problem = (
            f"slice{args} counts the items it passes and would count from 0 again after "
            "resuming; use with_epoch(n) to cut epochs, or select() to filter"
        )
    if not 1 <= len(args) <= 3:
        raise ArgumentError(
            f"slice takes 1 to 3 arguments (stop, or start, stop[, step]), got {args}"
        )
    try:
        it = itertools.islice(src, *args)
    except (ValueError, TypeError) as exn:
        raise ArgumentError(f"slice{args}: {exn}") from None
    yield from it


@stage(count=SAME)
def map(
    src: Iterable[Any],
    f: Callable[[Any], Any],
    handler: Handler = reraise_exception,
    threads: int = 0,
    *,
    ledger: Any = None,
) -> Iterator[Any]:
    """Replace each item by ``f(item)``; an item for which ``f`` returns ``None`` is dropped.

    When both the item and the result are dicts and the result has no ``__key__``, the item's
    ``__key__`` and ``__url__`` are copied over. Exceptions from ``f`` go to ``handler``.
    ``threads=N`` runs ``f`` in N threads, results in input order (see
    :mod:`webds.stages.threads`): for work that releases the GIL, such as decoding and
    augmenting images.
    """
    _check_callable("map", "f", f)
    threads = check_threads("map", threads)
    name = f"map({getattr(f, '__qualname__', f)!s})"

    def apply(sample: Any) -> Any:
        result = f(sample)
        if isinstance(sample, dict) and isinstance(result, dict) and "__key__" not in result:
            for k in ("__key__", "__url__"):
                if k in sample:
                    result[k] = sample[k]
        return result

    return apply_maybe_threaded(
        src, apply, handler, name, threads, ledger=ledger, annotate=_annotate, drop_none=True
    )


@stage(count=SAME, stateless=True)
def info(
    src: Iterable[Any],
    fmt: Optional[str] = None,
    n: int = 3,
    every: int = -1,
    width: int = 50,
    stream: Optional[TextIO] = None,
    name: str = "",
) -> Iterator[Any]:
    """Print the first ``n`` items (and every ``every``-th after) to ``stream`` (stderr), for
    debugging; items pass through unchanged.

    ``fmt=None`` prints each field's repr cut to ``width``; ``fmt="keys"`` prints the field names;
    any other ``fmt`` is a ``str.format`` template over the fields: ``info("{__key__} {cls}")``.
    """
    out = sys.stderr if stream is None else stream
    for i, sample in enumerate(src):
        if i < n or (every > 0 and (i + 1) % every == 0):
            if isinstance(sample, Mapping):
                items = list(sample.items())
            elif isinstance(sample, (tuple, list)):
                items = list(enumerate(sample))
            else:
                items = [("", sample)]
            if fmt is None:
                print("---", name, file=out)
                for k, v in items:
                    print(k, repr(v)[:width], file=out)
            elif fmt == "keys":
                print(*(k for k, _ in items), file=out)
            elif isinstance(sample, Mapping):
                print(fmt.format(**sample), file=out)
            else:
                print(fmt.format(*(v for _, v in items)), file=out)
            out.flush()
        yield sample


@stage(count=SAME, stateless=True)
def log_keys(src: Iterable[Any], logfile: Optional[str] = None) -> Iterator[Any]:
    """Append ``index, worker, rank, __key__`` per sample to ``logfile`` (tab-separated), to audit
    which process saw which sample; ``None`` does nothing.

    Each line goes out in one ``write`` on a file opened for appending, so lines from several
    processes do not interleave.
    """
    if not logfile:
        yield from src
        return
    where = worker_info()
    fd = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for i, sample in enumerate(src):
            get = sample.get if isinstance(sample, Mapping) else (lambda k, d=None: d)
            line = (
                f"{i}\t{get('__worker__', where.worker)}\t{get('__rank__', where.rank)}"
                f"\t{get('__key__')}\n"
            )
            os.write(fd, line.encode("utf-8"))
            yield sample
    finally:
        os.close(fd)
