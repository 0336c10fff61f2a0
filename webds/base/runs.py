"""Runs: consecutive samples of one shard that travel between stages as one item.

Read one at a time, a shard of 1-2 KB records costs more in the stages after the reader than in
the reader: each sample is a dict, passed through every stage's generator, decoded field by
field. Where the tar stage reads a chunk of such samples at once (:mod:`webds.tar.bulk`), it can
hand the stages after it a :class:`Run` instead: the samples as columns (one list per field), or,
after ``to_tuple``, as rows. A stage that takes runs (``@stage(runs=True)``) maps a run through
its function's column form (``fn.over_run(run)``, a new run, or None where it cannot) or, where
there is none, takes the run's samples one by one (:meth:`Run.items`), as if they had come so.

The pipeline sends runs only into stages that take them and takes every run apart before the
first stage that does not, and at the end (:func:`expanded`); nothing else ever sees one. A run
records each of its samples in the ledger as it is taken out, as the tar stage records a sample
as it yields it (``ledger.current`` and ``ledger.reading``): a consumer, a checkpoint and a
resume see the samples one by one, in the same order, with the same ids.

Column forms must give what the stage gives sample by sample, and must be pure: a run whose
form fails is taken sample by sample again, and the error met there, where the sample-by-sample
stage would meet it. A column never holds None (the reader's bytes never are; ``decode`` never
makes a field None), so ``to_tuple`` needs no check for it.
"""

from __future__ import annotations

import functools
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
)

from .ledger import LEAF
from .stage import Stage

__all__ = ["Run", "expanded", "mapped", "runs_span"]


class Run:
    """``count`` consecutive samples of one shard: ``columns`` (field -> one value per sample,
    in the samples' field order) or ``rows`` (the items themselves). ``raw``: the columns still
    holding the reader's bytes. :meth:`bind` says where its samples are in the ledger."""

    __slots__ = ("columns", "rows", "raw", "count", "ledger", "first")

    def __init__(
        self,
        columns: Optional[Dict[str, List[Any]]],
        rows: Optional[List[Any]],
        count: int,
        raw: FrozenSet[str] = frozenset(),
    ) -> None:
        self.columns = columns
        self.rows = rows
        self.raw = raw
        self.count = count
        self.ledger: Any = None
        self.first = -1  # the ledger id of the first sample (its shard's id | its number)

    def bind(self, ledger: Any, first: int) -> "Run":
        """Record the samples in ``ledger`` (a :class:`~webds.base.ledger.Ledger`) as they are
        taken out, the first as id ``first``, the rest as the ids after it."""
        self.ledger, self.first = ledger, first
        return self

    def with_columns(self, columns: Dict[str, List[Any]], raw: FrozenSet[str]) -> "Run":
        """The same samples, as other columns."""
        return Run(columns, None, self.count, raw).bind(self.ledger, self.first)

    def with_rows(self, rows: List[Any]) -> "Run":
        """The same samples, as items."""
        return Run(None, rows, self.count).bind(self.ledger, self.first)

    def items(self) -> Iterator[Any]:
        """The samples one by one (dicts, from columns), each recorded in the ledger as it is
        taken, as the tar stage records a sample it yields."""
        rows = self.rows
        if rows is None:
            rows = _dicts(self.columns)  # type: ignore[arg-type]
        ledger, first = self.ledger, self.first
        reading, j = ledger.reading, first & LEAF
        for i, item in enumerate(rows):
            ledger.current = first + i
            reading[1] = j + i
            yield item

    def __repr__(self) -> str:
        shape = f"columns {list(self.columns)}" if self.columns is not None else "rows"
        return f"Run({self.count} samples, {shape})"


def _dicts(columns: Dict[str, List[Any]]) -> List[Dict[str, Any]]:
    """One dict per row of ``columns``, its fields in the columns' order."""
    rows = zip(*columns.values())
    if not 0 < len(columns) <= _WRITTEN_OUT:
        names = list(columns)
        return [dict(zip(names, values)) for values in rows]
    return _rows_of(len(columns))(*columns, rows)


#: The most fields a sample of a run is built for by a dict display written out for its count.
_WRITTEN_OUT = 16


@functools.cache
def _rows_of(n: int) -> Callable[..., List[Dict[str, Any]]]:
    """``f(name_0, ..., name_n-1, rows)``: a dict per row, built by a dict display written out
    for ``n`` fields (``{k0: v0, k1: v1, ...}``), 2.5x faster than ``dict(zip(names, row))``
    for the 4-6 fields of a small sample (the reader's ``__key__`` and ``__url__`` among them).
    The code depends on ``n`` alone: the names are arguments, never part of it."""
    ks = "".join(f"k{i}, " for i in range(n))
    vs = "".join(f"v{i}, " for i in range(n))
    pairs = ", ".join(f"k{i}: v{i}" for i in range(n))
    code = f"def rows_of({ks}rows):\n    return [{{{pairs}}} for {vs}in rows]\n"
    made: Dict[str, Any] = {}
    exec(code, made)  # (no name is part of the code: see above)
    return made["rows_of"]  # type: ignore[no-any-return]


def mapped(run: Run, fn: Callable[[Any], Any]) -> Optional[Run]:
    """``fn`` applied to every sample of ``run`` by its column form (``fn.over_run``), or None
    where it has none, declines, or fails: the caller then applies ``fn`` sample by sample."""
    over = getattr(fn, "over_run", None)
    if over is None:
        return None
    try:
        return over(run)
    except Exception:
        return None  # met again sample by sample, where the stage meets its errors


def expanded(src: Iterable[Any]) -> Iterator[Any]:
    """``src`` with every run taken apart into its samples (see :meth:`Run.items`)."""
    for item in src:
        if type(item) is Run:
            yield from item.items()
        else:
            yield item


def runs_span(stages: Sequence[Any]) -> Tuple[int, int]:
    """Where runs go in a pipeline of ``stages``: the position of the stage that may yield them
    (the first that reads samples out of source items, where the stage after it takes runs),
    and of the first stage after it that does not take them, before which they are taken
    apart (``len(stages)``: after the last); (-1, -1) for none."""
    for i in range(1, len(stages) - 1):
        if isinstance(stages[i], Stage) and stages[i].factory.expands:
            until = i + 1
            while until < len(stages) and _takes_runs(stages[until]):
                until += 1
            return (i, until) if until > i + 1 else (-1, -1)
    return -1, -1


def _takes_runs(s: Any) -> bool:
    return isinstance(s, Stage) and s.factory.takes_runs
