"""The user-facing stages: shuffle, select, map, rename, to_tuple, ... (batching is in
:mod:`webds.stages.batching`).

Each stage is written once, as a generator function (or, for the stages that turn each sample into
one result, a function returning :func:`webds.stages.handlers.apply_each`'s loop) turned into a
curried, picklable factory by :func:`webds.pipeline.stage`; the fluent methods
(``dataset.shuffle(1000)``) are derived from these same factories, so the signatures here are the
public API (webdataset 1.x's, with its bugs fixed).

Samples are dicts (``{"__key__": ..., "jpg": ..., "cls": ...}``) until :func:`to_tuple` or
:func:`extract_keys` turns them into tuples. A malformed sample raises :class:`SampleError` naming
its ``__key__`` and ``__url__``; stages that take a ``handler`` pass such errors to it, and count
and log what the handler skipped.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import numbers
import os
import random
import re
import sys
from fnmatch import fnmatchcase
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    TextIO,
    Union,
)

from ..errors import ArgumentError, SampleError, WebdsError
from ..shards.shardlists import derive_seed, worker_info
from .core import REORDER, SAME, Stage, StageFactory, stage
from .handlers import Handler, apply_each, reraise_exception

__all__ = [
    "derive_seed",
    "shuffle",
    "detshuffle",
    "select",
    "rsample",
    "slice",
    "map",
    "map_dict",
    "map_tuple",
    "rename",
    "to_tuple",
    "extract_keys",
    "rename_keys",
    "associate",
    "info",
    "log_keys",
    "getfirst",
    "transform_with",
    "parse_field_spec",
    "pick",
    "identity",
]

log = logging.getLogger("webds")

Sample = Any
Fields = Union[str, Sequence[str]]


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


def _fields(sample: Mapping[str, Any]) -> str:
    """The payload fields of a sample, for error messages (metadata keys left out)."""
    names = [repr(k) for k in sample if not (isinstance(k, str) and k.startswith("__"))]
    return ", ".join(names) if names else "no fields"


def _alternatives(keys: Fields) -> List[str]:
    if isinstance(keys, str):
        return keys.split(";")
    return list(keys)


def getfirst(
    a: Mapping[str, Any],
    keys: Fields,
    default: Any = None,
    missing_is_error: bool = True,
) -> Any:
    """Return the value of the first of ``keys`` present in ``a``.

    ``keys`` is a list or a ``;``-separated string of alternatives:
    ``getfirst(sample, "jpg;png")``. If none is present, raise :class:`SampleError` (or return
    ``default`` when ``missing_is_error`` is false).
    """
    alternatives = _alternatives(keys)
    for k in alternatives:
        if k in a:
            return a[k]
    if missing_is_error:
        wanted = " or ".join(repr(k) for k in alternatives)
        raise SampleError(
            f"sample has no field {wanted} (it has {_fields(a)}); check the file extensions in "
            "your shards",
            **_where(a),
        )
    return default


def parse_field_spec(fields: Fields) -> List[List[str]]:
    """Parse ``"jpg;png cls"`` (or ``["jpg;png", "cls"]``) into ``[["jpg", "png"], ["cls"]]``."""
    if isinstance(fields, str):
        fields = fields.split()
    return [field.split(";") for field in fields]


def transform_with(sample: Sequence[Any], transformers: Optional[Sequence[Any]]) -> Any:
    """Apply the i-th of ``transformers`` to the i-th element of ``sample`` (``None``: keep it).

    ``transform_with((img, cls), [augment, None])`` returns ``[augment(img), cls]``.
    """
    if not transformers:
        return sample
    if len(transformers) > len(sample):
        raise ArgumentError(
            f"transform_with got {len(transformers)} transformers for a sample of "
            f"{len(sample)} elements"
        )
    result = list(sample)
    for i, f in enumerate(transformers):
        if f is not None:
            result[i] = f(sample[i])
    return result


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
        exn.add_note(f"webds: in {stage_name} on sample {where['key']!r} of {where['url']!r}")


# -- shuffling and sampling ------------------------------------------------------------------------


def _worker_rng(tag: str, seed: Any, epoch: int) -> random.Random:
    """A Random for this (seed, epoch, rank, worker), or one from fresh entropy if no seed."""
    if seed is None:
        return random.Random(os.urandom(16))
    where = worker_info()
    return random.Random(derive_seed(tag, seed, epoch, where.rank, where.worker))


def _buffer_shuffle(
    src: Iterable[Any], bufsize: int, initial: int, rng: random.Random
) -> Iterator[Any]:
    """Shuffle through a buffer of at most ``bufsize`` items (see :func:`shuffle`)."""
    it = iter(src)
    buf: List[Any] = []
    initial = max(1, min(initial, bufsize))
    end = object()
    for item in it:
        buf.append(item)
        if len(buf) >= initial:
            break
    else:
        it = iter(())
    while buf:
        yield pick(buf, rng)
        # Pull two per output while the buffer is below bufsize, so it grows from ``initial``
        # to ``bufsize`` without delaying the first outputs; one per output after that.
        for _ in range(2):
            if len(buf) >= bufsize:
                break
            item = next(it, end)
            if item is end:
                it = iter(())
                break
            buf.append(item)


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
    yield from _buffer_shuffle(src, bufsize, initial, rng or _worker_rng("shuffle", seed, epoch))


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
    yield from _buffer_shuffle(src, bufsize, initial, rng)


detshuffle.count = REORDER


@stage
def rsample(
    src: Iterable[Any], p: float = 0.5, seed: Optional[int] = None, *, epoch: int = 0
) -> Iterator[Any]:
    """Keep each item with probability ``p``.

    Seeded like :func:`shuffle` (by seed, epoch, rank and worker) rather than by the global
    ``random`` that webdataset used.
    """
    if not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise ArgumentError(f"rsample: p must be a probability between 0 and 1, got {p!r}")
    rng = _worker_rng("rsample", _check_seed(seed), epoch)
    for item in src:
        if rng.random() < p:
            yield item


# -- selecting and transforming --------------------------------------------------------------------


@stage
def select(src: Iterable[Any], predicate: Callable[[Any], Any]) -> Iterator[Any]:
    """Keep the items for which ``predicate(item)`` is true."""
    _check_callable("select", "predicate", predicate)
    for item in src:
        if predicate(item):
            yield item


@stage
def slice(src: Iterable[Any], *args: Optional[int]) -> Iterator[Any]:
    """Items ``[start:stop:step]`` of the stream: ``slice(stop)`` or ``slice(start, stop[, step])``.

    Stops pulling from upstream once ``stop`` is reached, as :func:`itertools.islice` does.
    """
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
    src: Iterable[Any], f: Callable[[Any], Any], handler: Handler = reraise_exception
) -> Iterator[Any]:
    """Replace each item by ``f(item)``; an item for which ``f`` returns ``None`` is dropped.

    When both the item and the result are dicts and the result has no ``__key__``, the item's
    ``__key__`` and ``__url__`` are copied over. Exceptions from ``f`` go to ``handler``.
    """
    _check_callable("map", "f", f)
    name = f"map({getattr(f, '__qualname__', f)!s})"

    def apply(sample: Any) -> Any:
        result = f(sample)
        if isinstance(sample, dict) and isinstance(result, dict) and "__key__" not in result:
            for k in ("__key__", "__url__"):
                if k in sample:
                    result[k] = sample[k]
        return result

    return apply_each(src, apply, handler, name, annotate=_annotate, drop_none=True)


@stage(count=SAME)
def map_dict(
    src: Iterable[Any], handler: Handler = reraise_exception, **kw: Callable[[Any], Any]
) -> Iterator[Any]:
    """Apply a function to named fields: ``map_dict(jpg=augment, cls=int)``.

    Returns a new dict per sample (the input is not modified). A missing field is a
    :class:`SampleError`, passed to ``handler`` like the functions' own exceptions.
    """
    for k, f in kw.items():
        _check_callable("map_dict", f"the function for {k!r}", f)

    def apply(sample: Any) -> Dict[str, Any]:
        if not isinstance(sample, Mapping):
            raise SampleError(
                f"map_dict needs dict samples, got a {type(sample).__name__}; "
                "use map_tuple after to_tuple"
            )
        result = dict(sample)
        for k, f in kw.items():
            if k not in result:
                raise SampleError(
                    f"map_dict: sample has no field {k!r} (it has {_fields(sample)})",
                    **_where(sample),
                )
            result[k] = f(result[k])
        return result

    return apply_each(src, apply, handler, "map_dict", annotate=_annotate)


@stage(count=SAME)
def map_tuple(
    src: Iterable[Any], *args: Optional[Callable[[Any], Any]], handler: Handler = reraise_exception
) -> Iterator[Any]:
    """Apply the i-th function to the i-th element of tuple samples: ``map_tuple(augment, None)``.

    ``None`` leaves that element unchanged; elements beyond the functions pass through. Yields
    tuples.
    """
    fns = [identity if f is None else f for f in args]
    for i, f in enumerate(fns):
        _check_callable("map_tuple", f"argument {i}", f)

    def apply(sample: Any) -> tuple:
        if not isinstance(sample, (tuple, list)):
            raise SampleError(
                f"map_tuple needs tuple samples, got a {type(sample).__name__}; "
                "use to_tuple first, or map_dict for dicts",
                **_where(sample),
            )
        result = list(sample)
        for i, f in enumerate(fns[: len(result)]):
            result[i] = f(result[i])
        return tuple(result)

    return apply_each(src, apply, handler, "map_tuple")


def _check_dict_sample(stage_name: str, sample: Any) -> None:
    if not isinstance(sample, Mapping):
        raise SampleError(f"{stage_name} needs dict samples, got a {type(sample).__name__}")


@stage(count=SAME)
def rename(
    src: Iterable[Any], handler: Handler = reraise_exception, keep: bool = True, **kw: Fields
) -> Iterator[Any]:
    """Rename fields: ``rename(image="jpg;png", label="cls")`` takes the first present alternative.

    With ``keep=True`` the other fields stay (the renamed source fields are removed); with
    ``keep=False`` only the new fields are kept. A missing field is a :class:`SampleError`
    passed to ``handler``.
    """
    for new, old in kw.items():
        if not isinstance(old, str) and not (
            isinstance(old, (list, tuple)) and all(isinstance(x, str) for x in old)
        ):
            raise ArgumentError(f"rename: {new}= must be a field name like 'jpg;png', got {old!r}")
    spec = {new: _alternatives(old) for new, old in kw.items()}
    replaced = {old for alternatives in spec.values() for old in alternatives}

    def apply(sample: Any) -> Dict[str, Any]:
        _check_dict_sample("rename", sample)
        renamed = {new: getfirst(sample, old) for new, old in spec.items()}
        if not keep:
            return renamed
        result = {k: v for k, v in sample.items() if k not in replaced}
        result.update(renamed)
        return result

    return apply_each(src, apply, handler, "rename")


@stage(count=SAME)
def to_tuple(
    src: Iterable[Any],
    *args: Fields,
    handler: Handler = reraise_exception,
    missing_is_error: bool = True,
    none_is_error: Optional[bool] = None,
) -> Iterator[Any]:
    """Turn dict samples into tuples of fields: ``to_tuple("jpg;png", "cls")`` or ``"jpg;png cls"``.

    Each field may list ``;``-separated alternatives; the first present is used. A missing field
    (or a ``None`` value) is a :class:`SampleError` passed to ``handler``, unless
    ``missing_is_error`` (``none_is_error``, which defaults to it) is false; a missing field is
    then ``None``.
    """
    if len(args) == 1 and isinstance(args[0], str) and " " in args[0]:
        args = tuple(args[0].split())
    if not args:
        raise ArgumentError("to_tuple needs at least one field, e.g. to_tuple('jpg', 'cls')")
    for field in args:
        if not isinstance(field, str) or not field:
            raise ArgumentError(f"to_tuple fields must be non-empty strings, got {field!r}")
    if none_is_error is None:
        none_is_error = missing_is_error
    spec = [field.split(";") for field in args]

    def apply(sample: Any) -> tuple:
        _check_dict_sample("to_tuple", sample)
        result = []
        for alternatives in spec:
            # getfirst's lookup, inline: this runs for every field of every sample.
            for name in alternatives:
                if name in sample:
                    value = sample[name]
                    break
            else:
                if missing_is_error:
                    raise _missing_error(sample, alternatives, args)
                result.append(None)
                continue
            if value is None and none_is_error:
                raise SampleError(
                    f"to_tuple{args}: field {';'.join(alternatives)!r} is None",
                    **_where(sample),
                )
            result.append(value)
        return tuple(result)

    return apply_each(src, apply, handler, "to_tuple")


def _missing_error(
    sample: Mapping[str, Any], alternatives: List[str], wanted: tuple
) -> SampleError:
    name = " or ".join(repr(a) for a in alternatives)
    return SampleError(
        f"to_tuple{wanted}: sample has no field {name} (it has {_fields(sample)}); check the "
        "extensions in your shards, or pass missing_is_error=False to get None",
        **_where(sample),
    )


def _matches(key: str, patterns: List[str]) -> bool:
    return any(fnmatchcase(key, p) or fnmatchcase("." + key, p) for p in patterns)


@stage(count=SAME)
def extract_keys(
    src: Iterable[Any],
    *patterns: Fields,
    duplicate_is_error: bool = True,
    ignore_missing: bool = False,
) -> Iterator[Any]:
    """Tuples of the fields matching glob patterns: ``extract_keys("*.jpg;*.png", "cls")``.

    A pattern matches a key ``k`` if it matches ``k`` or ``"." + k``. Several keys matching one
    pattern is an error unless ``duplicate_is_error`` is false (the first is then used); with
    ``ignore_missing`` a pattern that matches nothing is left out of the tuple.
    """
    if not patterns:
        raise ArgumentError("extract_keys needs at least one pattern, e.g. extract_keys('*.jpg')")
    spec = [_alternatives(p) for p in patterns]
    for sample in src:
        _check_dict_sample("extract_keys", sample)
        result = []
        for alternatives in spec:
            found = [k for k in sample if isinstance(k, str) and _matches(k, alternatives)]
            if not found:
                if ignore_missing:
                    continue
                raise SampleError(
                    f"extract_keys: no field matches {';'.join(alternatives)!r} (the sample has "
                    f"{_fields(sample)}); pass ignore_missing=True to leave it out",
                    **_where(sample),
                )
            if len(found) > 1 and duplicate_is_error:
                raise SampleError(
                    f"extract_keys: fields {found} all match {';'.join(alternatives)!r}; use a "
                    "narrower pattern or duplicate_is_error=False",
                    **_where(sample),
                )
            result.append(sample[found[0]])
        yield tuple(result)


@stage(count=SAME)
def rename_keys(
    src: Iterable[Any],
    *args: Sequence[str],
    keep_unselected: bool = False,
    must_match: bool = True,
    duplicate_is_error: bool = True,
    **kw: str,
) -> Iterator[Any]:
    """Rename fields by glob pattern: ``rename_keys(("image", "*.jpg"), label="*.cls")``.

    ``args`` are ``(new, pattern)`` pairs and ``kw`` is ``new=pattern``; patterns match the
    lower-cased part of a key after its last ``/``, and later rules win. Unmatched fields are
    dropped unless ``keep_unselected``; with ``must_match`` every rule must match some field.
    """
    rules: List[tuple] = []
    for pair in args:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ArgumentError(
                f"rename_keys: positional rules are (new, pattern) pairs, got {pair!r}"
            )
        rules.append((pair[1], pair[0]))
    rules += [(pattern, new) for new, pattern in kw.items()]
    for pattern, new in rules:
        if not isinstance(pattern, str) or not isinstance(new, str):
            raise ArgumentError(f"rename_keys: rule {new!r}={pattern!r} must be two strings")
    for sample in src:
        _check_dict_sample("rename_keys", sample)
        result: Dict[str, Any] = {}
        matched = [False] * len(rules)
        for path, value in sample.items():
            base = re.sub(r".*/", "", str(path)).lower()
            new_name = None
            for i in range(len(rules) - 1, -1, -1):
                if fnmatchcase(base, rules[i][0]):
                    matched[i] = True
                    new_name = rules[i][1]
                    break
            if new_name is None:
                if keep_unselected:
                    result[path] = value
                continue
            if new_name in result:
                if duplicate_is_error:
                    raise SampleError(
                        f"rename_keys: more than one field is renamed to {new_name!r} (the "
                        f"sample has {_fields(sample)}); pass duplicate_is_error=False to keep "
                        "the first",
                        **_where(sample),
                    )
                continue
            result[new_name] = value
        if must_match and not all(matched):
            unmatched = [rules[i][0] for i in range(len(rules)) if not matched[i]]
            raise SampleError(
                f"rename_keys: patterns {unmatched} match no field (the sample has "
                f"{_fields(sample)}); pass must_match=False to allow this",
                **_where(sample),
            )
        yield result


@stage(count=SAME)
def associate(src: Iterable[Any], associator: Any, **kw: Any) -> Iterator[Any]:
    """Add fields looked up by ``__key__``: from a dict (``associator.get(key, {})``) or a
    function (``associator(key, **kw)``, which may return ``None`` for nothing)."""
    if not callable(associator) and not hasattr(associator, "get"):
        raise ArgumentError(f"associate needs a dict or a function of the key, got {associator!r}")
    for sample in src:
        _check_dict_sample("associate", sample)
        if "__key__" not in sample:
            raise SampleError(f"associate: sample has no __key__ (it has {_fields(sample)})")
        key = sample["__key__"]
        extra = associator(key, **kw) if callable(associator) else associator.get(key, {})
        result = dict(sample)
        if extra:
            result.update(extra)
        yield result


@stage(count=SAME)
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


@stage(count=SAME)
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
