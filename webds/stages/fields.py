"""The stages that pick, rename and transform the fields of a sample: to_tuple, rename, map_dict,
map_tuple, extract_keys, rename_keys, associate, and the helpers behind them (getfirst, ...).

Like :mod:`webds.stages.filters` (whose shared checks this module uses), each stage is written
once and made a curried, picklable factory by :func:`webds.pipeline.stage`; the fluent methods
(``dataset.to_tuple("jpg", "cls")``) are derived from these factories. A malformed sample raises
:class:`SampleError` naming its ``__key__`` and ``__url__``, which a ``handler`` may skip.
"""

from __future__ import annotations

import re
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
    Union,
)

from ..base.handlers import Handler, apply_each, reraise_exception
from ..base.runs import Run
from ..base.stage import SAME, stage
from ..errors import ArgumentError, MissingFieldError, SampleError
from .filters import _annotate, _check_callable, _where, identity
from .threads import apply_maybe_threaded, check_threads

__all__ = [
    "map_dict",
    "map_tuple",
    "rename",
    "to_tuple",
    "extract_keys",
    "rename_keys",
    "associate",
    "getfirst",
    "transform_with",
    "parse_field_spec",
]

Fields = Union[str, Sequence[str]]


# -- helpers ---------------------------------------------------------------------------------------


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


# -- field stages ----------------------------------------------------------------------------------


@stage(count=SAME, stateless=True)
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
                raise MissingFieldError(
                    f"map_dict: sample has no field {k!r} (it has {_fields(sample)})",
                    **_where(sample),
                )
            result[k] = f(result[k])
        return result

    return apply_each(src, apply, handler, "map_dict", annotate=_annotate)


@stage(count=SAME)
def map_tuple(
    src: Iterable[Any],
    *args: Optional[Callable[[Any], Any]],
    handler: Handler = reraise_exception,
    threads: int = 0,
    ledger: Any = None,
) -> Iterator[Any]:
    """Apply the i-th function to the i-th element of tuple samples: ``map_tuple(augment, None)``.

    ``None`` leaves that element unchanged; elements beyond the functions pass through. Yields
    tuples. ``threads=N`` runs the functions in N threads, results in input order (see
    :mod:`webds.stages.threads`).
    """
    threads = check_threads("map_tuple", threads)
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

    return apply_maybe_threaded(src, apply, handler, "map_tuple", threads, ledger=ledger)


def _check_dict_sample(stage_name: str, sample: Any) -> None:
    # (type() first: isinstance against typing's Mapping costs a microsecond a sample)
    if type(sample) is not dict and not isinstance(sample, Mapping):
        raise SampleError(f"{stage_name} needs dict samples, got a {type(sample).__name__}")


@stage(count=SAME, stateless=True)
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


@stage(count=SAME, stateless=True, runs=True)
def to_tuple(
    src: Iterable[Any],
    *args: Fields,
    handler: Handler = reraise_exception,
    missing_is_error: bool = True,
    none_is_error: Optional[bool] = None,
) -> Iterator[Any]:
    """Turn dict samples into tuples of fields: ``to_tuple("jpg;png", "cls")`` or ``"jpg;png cls"``.

    Each field may list alternatives, ``;``-separated or as a list (``to_tuple(["webp", "png"],
    "cls")``, as clip_benchmark writes it); the first present is used. A missing field is a
    :class:`SampleError` passed to ``handler``; ``missing_is_error=False`` makes it ``None``.
    A ``None``, present or missing, is such an error while ``none_is_error`` (which defaults to
    ``missing_is_error``) holds, as in webdataset.
    """
    if len(args) == 1 and isinstance(args[0], str) and " " in args[0]:
        args = tuple(args[0].split())
    if not args:
        raise ArgumentError("to_tuple needs at least one field, e.g. to_tuple('jpg', 'cls')")
    spec = [_field_alternatives(field) for field in args]
    if none_is_error is None:
        none_is_error = missing_is_error

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
                if missing_is_error or none_is_error:
                    # webdataset's rule: a missing field is None, and a None is an error
                    # while none_is_error holds, whatever missing_is_error says.
                    raise _missing_error(sample, alternatives, args, missing_is_error)
                result.append(None)
                continue
            if value is None and none_is_error:
                raise SampleError(
                    f"to_tuple{args}: field {';'.join(alternatives)!r} is None",
                    **_where(sample),
                )
            result.append(value)
        return tuple(result)

    def over_run(run: Run) -> Optional[Run]:
        # Every sample of a run has the same fields, none of them None (webds.base.runs).
        columns = run.columns
        if columns is None:
            return None
        picked = []
        for alternatives in spec:
            for name in alternatives:
                if name in columns:
                    picked.append(columns[name])
                    break
            else:
                return None  # missing: an error or a None, sample by sample
        return run.with_rows(list(zip(*picked)))

    apply.over_run = over_run  # type: ignore[attr-defined]
    return apply_each(src, apply, handler, "to_tuple")


def _field_alternatives(field: Fields) -> List[str]:
    """A to_tuple field's names to try in turn: ``"jpg;png"`` split at ``;``, a list or tuple
    taken as it is (webdataset's ``getfirst``: its items are not split)."""
    if isinstance(field, str):
        alternatives = field.split(";")
    elif isinstance(field, (list, tuple)):
        alternatives = list(field)
    else:
        alternatives = []
    if not alternatives or not all(isinstance(a, str) and a for a in alternatives):
        raise ArgumentError(
            "to_tuple fields must be non-empty strings like 'jpg;png', or lists of them like "
            f"['jpg', 'png'], got {field!r}"
        )
    return alternatives


def _missing_error(
    sample: Mapping[str, Any], alternatives: List[str], wanted: tuple, missing_is_error: bool
) -> SampleError:
    name = " or ".join(repr(a) for a in alternatives)
    fix = "missing_is_error=False" if missing_is_error else "none_is_error=False"
    return SampleError(
        f"to_tuple{wanted}: sample has no field {name} (it has {_fields(sample)}); check the "
        f"extensions in your shards, or pass {fix} to get None",
        **_where(sample),
    )


def _matches(key: str, patterns: List[str]) -> bool:
    return any(fnmatchcase(key, p) or fnmatchcase("." + key, p) for p in patterns)


@stage(count=SAME, stateless=True)
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


@stage(count=SAME, stateless=True)
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


@stage(count=SAME, stateless=True)
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
