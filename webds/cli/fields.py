"""Field values and ``--where`` expressions over raw samples, for the inspecting commands.

A *field spec* names a field and optionally a path into it: ``cls``, ``seg.png``, ``json.label``,
``json.boxes.0``, ``__key__``. The longest prefix that is a field of the sample wins (so
``seg.png`` is the field ``seg.png``, and ``json.label`` is the key ``label`` of the decoded
``json`` field); the rest is followed through decoded JSON (dict keys, list indices).

Values are decoded by extension, cheaply and without images: ``json`` -> the JSON value;
``cls``-like (``cls cls2 class count index inx id``) -> int; text (``txt text transcript html htm
caption``) and anything else that is UTF-8 -> str, with numbers becoming int or float; other bytes
stay bytes. A ``--where`` expression is Python evaluated per sample with every field as a name
(``cls == 3 and json.label != "cat"``, ``len(jpg) > 50_000``, ``key.startswith("n01")``); a field
whose extension has dots is reached through attributes (``seg.png``) or ``sample["seg.png"]``.
A field the sample lacks evaluates to None, and an expression that fails on a sample lacking one
of its fields (``len(jpg) > 10`` without a ``jpg``) does not match it.
"""

from __future__ import annotations

import ast
import builtins
import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from ..errors import ArgumentError

__all__ = [
    "field_value",
    "field_names",
    "decode_field",
    "compile_where",
    "Where",
    "format_value",
    "nbytes",
    "human_size",
    "MISSING",
]

_INT_EXTS = {"cls", "cls2", "class", "count", "index", "inx", "id"}
_TEXT_EXTS = {"txt", "text", "transcript", "html", "htm", "caption"}


class _Missing:
    """The value of a field a sample does not have: falsy, compares equal only to itself."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def decode_field(ext: str, data: Any) -> Any:
    """A raw field's value for display and comparison (see the module docstring)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return data
    last = ext.rsplit(".", 1)[-1].lower()
    if last in ("json", "jsn"):
        try:
            return json.loads(bytes(data))
        except ValueError:
            return bytes(data)
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return bytes(data)
    if last in _TEXT_EXTS:
        return text
    stripped = text.strip()
    if last in _INT_EXTS or (stripped and len(stripped) < 40):
        number = _number(stripped)
        if number is not None:
            return number
    if "\x00" in text:
        return bytes(data)
    return text


def _number(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return value if text.lower() not in ("nan", "inf", "-inf", "infinity") else None


def field_names(sample: Mapping[str, Any]) -> List[str]:
    """The sample's fields, in order, without ``__key__``, ``__url__`` and the like."""
    return [name for name in sample if not name.startswith("__")]


def nbytes(value: Any) -> int:
    """The size of a raw field (0 for values that are not bytes)."""
    return memoryview(value).nbytes if isinstance(value, (bytes, bytearray, memoryview)) else 0


def human_size(n: int) -> str:
    """A short size: ``45``, ``67.1k``, ``3.4M``, ``1.2G`` (powers of 1000, as ``--maxsize``)."""
    if n < 1000:
        return str(n)
    value = float(n)
    for unit in "kMGTP":
        value /= 1000.0
        if round(value, 1) < 1000 or unit == "P":
            return f"{value:.1f}{unit}"
    return str(n)  # unreachable: "P" always returns


def _split_spec(sample: Mapping[str, Any], spec: str) -> Tuple[Optional[str], List[str]]:
    """(field, path) for a spec: the longest dotted prefix of ``spec`` that is a field."""
    if spec in sample:
        return spec, []
    parts = spec.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        if name in sample:
            return name, parts[cut:]
    return None, parts


def field_value(sample: Mapping[str, Any], spec: str) -> Any:
    """The value of ``spec`` in ``sample``, decoded; :data:`MISSING` when it is not there.

    ``field_value({"__key__": "a", "json": b'{"label": 3}'}, "json.label") == 3``
    """
    if spec in ("key", "__key__"):
        return sample.get("__key__", MISSING)
    if spec in ("url", "__url__"):
        return sample.get("__url__", MISSING)
    name, path = _split_spec(sample, spec)
    if name is None:
        return MISSING
    value = decode_field(name, sample[name])
    for step in path:
        if isinstance(value, Mapping) and step in value:
            value = value[step]
        elif isinstance(value, list) and _is_index(step, len(value)):
            value = value[int(step)]
        else:
            return MISSING
    return value


def _is_index(step: str, n: int) -> bool:
    try:
        return -n <= int(step) < n
    except ValueError:
        return False


def format_value(value: Any, limit: int = 0) -> str:
    """One-line text for a value: JSON for structures, ``<N bytes>`` for binary, '' if missing;
    newlines and tabs become single spaces, so the text fits a line or a TSV cell.

    ``limit`` > 0 shortens the text to that many characters (ending in ``...``).
    """
    if value is MISSING or value is None:
        text = ""
    elif isinstance(value, (bytes, bytearray)):
        text = f"<{len(value)} bytes>"
    elif isinstance(value, str):
        text = value
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    else:
        text = str(value)
    text = " ".join(text.split()) if ("\n" in text or "\t" in text or "\r" in text) else text
    if limit > 0 and len(text) > limit:
        text = text[: max(limit - 3, 0)] + "..."
    return text


class _Attrs:
    """A decoded JSON object, or the common prefix of dotted field names, reachable with dots."""

    __slots__ = ("_sample", "_prefix", "_value")

    def __init__(self, sample: Mapping[str, Any], prefix: str, value: Any = MISSING) -> None:
        self._sample, self._prefix, self._value = sample, prefix, value

    def __getattr__(self, name: str) -> Any:
        return _wrap(self._sample, f"{self._prefix}.{name}")

    def __getitem__(self, item: Any) -> Any:
        return _wrap(self._sample, f"{self._prefix}.{item}")

    def __eq__(self, other: Any) -> bool:
        return bool(self._value == other)

    def __hash__(self) -> int:
        return hash(self._prefix)

    def __bool__(self) -> bool:
        return bool(self._value)

    def __len__(self) -> int:
        return len(self._value)

    def __contains__(self, item: Any) -> bool:
        return item in self._value

    def __iter__(self) -> Any:
        return iter(self._value)

    def __repr__(self) -> str:
        return repr(self._value)


def _wrap(sample: Mapping[str, Any], spec: str) -> Any:
    value = field_value(sample, spec)
    if isinstance(value, (dict, list)):
        return _Attrs(sample, spec, value)
    if value is MISSING and _has_name(sample, spec):
        return _Attrs(sample, spec)  # "seg" in "seg.png": wait for the next attribute
    return None if value is MISSING else value


class _Names(Dict[str, Any]):
    """The names a ``--where`` expression sees: the sample's fields, then Python's builtins."""

    def __init__(self, sample: Mapping[str, Any], seen: Set[str]) -> None:
        super().__init__()
        self.sample = sample
        self.seen = seen

    def __missing__(self, name: str) -> Any:
        if name == "sample":
            return {k: decode_field(k, v) for k, v in self.sample.items()}
        if name == "key":
            return self.sample.get("__key__")
        if name == "url":
            return self.sample.get("__url__")
        if _has_name(self.sample, name):
            self.seen.add(name)
            return _wrap(self.sample, name)
        if hasattr(builtins, name):
            return getattr(builtins, name)
        return None  # a field this sample does not have


def _has_name(sample: Mapping[str, Any], name: str) -> bool:
    """Whether ``name`` is a field of the sample or the first part of one (``seg`` of
    ``seg.png``)."""
    return name in sample or any(k.startswith(name + ".") for k in sample)


def _absent(sample: Mapping[str, Any], name: str) -> bool:
    return not (_has_name(sample, name) or hasattr(builtins, name))


class Where:
    """A compiled ``--where`` expression: ``Where("cls == 3")(sample) -> bool``.

    ``unseen()`` lists the names the expression uses that were a field of no sample so far,
    to warn about typos (``--where 'clss == 3'`` selects nothing).
    """

    def __init__(self, expression: str) -> None:
        try:
            self.code = compile(expression, "--where", "eval")
        except SyntaxError as exn:
            raise ArgumentError(
                f"--where {expression!r} is not a Python expression: {exn.msg}; example: "
                "--where 'cls == 3 and json.label != \"cat\"'"
            ) from None
        self.expression = expression
        tree = ast.parse(expression, mode="eval")
        loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        self.names = loaded - {"sample", "key", "url"}
        self.seen: Set[str] = set()
        self.globals: Dict[str, Any] = {"__builtins__": {}}

    def __call__(self, sample: Mapping[str, Any]) -> bool:
        try:
            return bool(eval(self.code, self.globals, _Names(sample, self.seen)))
        except Exception as exn:
            if any(_absent(sample, name) for name in self.names):
                return False  # as in SQL: a test on a field the sample lacks does not match
            raise ArgumentError(
                f"--where {self.expression!r} failed on sample {sample.get('__key__')!r} "
                f"({type(exn).__name__}: {exn}); fields there: "
                f"{', '.join(k for k in sample if not k.startswith('__'))}",
                url=sample.get("__url__"),
                key=sample.get("__key__"),
            ) from None

    def unseen(self) -> List[str]:
        """Names in the expression that were never a field (nor a builtin)."""
        return sorted(n for n in self.names - self.seen if not hasattr(builtins, n))


def compile_where(expression: Optional[str]) -> Optional[Callable[[Mapping[str, Any]], bool]]:
    """A predicate for ``--where EXPR`` (None when no expression was given)."""
    return None if expression is None else Where(expression)
