"""The saved state of a pipeline: typed records with a version, one reader and one writer.

``state_dict()`` hands out plain dicts of lists, ints and strings (JSON will do, and so will
``torch.save``); inside webds a state is one of these dataclasses. :func:`read_state` is the one
reader: it checks the shape, and says which field of what is wrong. ``to_dict()`` is the one
writer. Nothing else reads or writes a saved state's keys.

- :class:`SlotState`: the ids a stage holds, in its order, and its count of random draws;
- :class:`LedgerState`: what one stream consumed and held (see :mod:`webds.base.ledger`);
- :class:`StreamState`: where one process's stream stands: the epoch, the items yielded in it, the
  pass being read and its ledger;
- :class:`PipelineState`: one rank's state: its stream (or its DataLoader workers' streams, for a
  ``WebLoader``), the configuration it must be loaded into, the seed and the drawn entropy.

This module does not import torch.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import MutableSet
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

from ..errors import ArgumentError, ResumeError
from .slots import ids_of

__all__ = ["VERSION", "READS", "SlotState", "LedgerState", "StreamState", "PipelineState"]
__all__ += ["read_state", "read_states", "Runs"]

#: The version of the format :meth:`PipelineState.to_dict` writes: every field, always (None,
#: [] or {} where there is nothing), so that a missing one is an error.
VERSION = 3
#: The versions :func:`read_state` reads: 2 (which left out the fields with nothing in them, so
#: they may be missing there; its states resume as they always did) and :data:`VERSION`.
READS = (2, 3)

_HEAD = "not a webds pipeline state (from state_dict())"
_NEEDED = object()  # no default: the field must be there


class _Malformed(ArgumentError):
    pass


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _bad(path: str, value: Any, wanted: str) -> _Malformed:
    return _Malformed(f"{_HEAD}: {path} is {_short(value)}, not {wanted}")


def _missing(path: str) -> _Malformed:
    return _Malformed(f"{_HEAD}: {path} is missing (state_dict() writes every field)")


#: The ids of one stream's items are below 2**64 (``shard << 32 | sample``); a WebLoader's main
#: process puts the worker's number above them (:func:`webds.base.ledger.qualify`).
_ID_BITS = 64
#: A sample number (below ``LEAF``, which stands for a whole source item).
_SAMPLES = (1 << 32) - 1
#: The most random words a stage's slot may say it drew in one pass: about 3 billion shuffled
#: samples of one stream. Resuming skips that many words (about 20 s); a larger count is not one
#: a pass drew, and skipping it would not end.
MAX_DRAWS = 1 << 32


def _to_int(value: Any, path: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """``value``, an int (not a bool, not a float) in ``lo <= value < hi`` (None: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(path, value, "an int")
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        wanted = f"an int >= {lo}" if hi is None else f"an int in [{lo or 0}, {hi})"
        raise _bad(path, value, wanted if lo is not None else f"an int below {hi}")
    return int(value)


def _ints(value: Any, path: str, lo: Optional[int] = None, hi: Optional[int] = None) -> List[int]:
    if not isinstance(value, list):
        raise _bad(path, value, "a list of ints")
    return [_to_int(x, f"{path}[{n}]", lo, hi) for n, x in enumerate(value)]


def _ids(value: Any, path: str, bound: int, depth: int = 0) -> Any:
    """An item's ids: an id in ``[0, bound)``, or a bundle (nested lists of them)."""
    if isinstance(value, list) and depth < 32:
        for n, x in enumerate(value):
            _ids(x, f"{path}[{n}]", bound, depth + 1)
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
        raise _bad(
            path,
            value,
            f"an item's ids (ints in [0, 2**{bound.bit_length() - 1}), or lists of them)",
        )
    return value


class _Fields:
    """One record of a saved state being read: each field named by its path in errors
    (``state['ledger']['complete']``). ``complete``: every field must be there (version 3);
    else a field given a default may be missing (version 2 left out the empty ones)."""

    __slots__ = ("d", "path", "complete")

    def __init__(self, d: Any, path: str, complete: bool) -> None:
        if not isinstance(d, dict):
            raise _bad(path, d, "a dict")
        self.d, self.path, self.complete = d, path, complete

    def at(self, key: Any) -> str:
        return f"{self.path}[{key!r}]"

    def raw(self, key: str, default: Any = _NEEDED) -> Any:
        if key in self.d:
            return self.d[key]
        if default is _NEEDED or self.complete:
            raise _missing(self.at(key))
        return default

    def int(
        self, key: str, default: Any = _NEEDED, none: bool = False, lo: Any = None, hi: Any = None
    ) -> Any:
        value = self.raw(key, default)
        return None if value is None and none else _to_int(value, self.at(key), lo, hi)

    def text(self, key: str) -> Optional[str]:
        value = self.raw(key, None)
        if value is not None and not isinstance(value, str):
            raise _bad(self.at(key), value, "a string or None")
        return value

    def map(self, key: str, default: Any = _NEEDED) -> Dict[Any, Any]:
        value = self.raw(key, default)
        if not isinstance(value, dict):
            raise _bad(self.at(key), value, "a dict")
        return value

    def list(self, key: str, default: Any = _NEEDED) -> List[Any]:
        value = self.raw(key, default)
        if not isinstance(value, list):
            raise _bad(self.at(key), value, "a list")
        return value

    def numbered(self, key: str, hi: Optional[int] = None) -> Dict[int, Any]:
        """A dict keyed by numbers ``>= 0`` (below ``hi``) written as strings (``{"3": ...}``)."""
        out = {}
        for k, value in self.map(key).items():
            try:
                n = int(k)
            except (TypeError, ValueError):
                n = -1
            if n < 0 or (hi is not None and n >= hi) or str(n) != k:
                within = "" if hi is None else f" below {hi}"
                raise _bad(f"{self.at(key)}[{k!r}]", k, f"a number's key (>= 0{within})")
            out[n] = value
        return out


class Runs(MutableSet):
    """A set of ints kept as sorted runs ``[first, last + 1)``: the ledger's source items read
    entirely. A saved ``[[0, 10**10]]`` is two numbers here, not ten billion set entries (it
    used to allocate until MemoryError: issue 54)::

        Runs.of([[0, 3], [5, 6]])  # {0, 1, 2, 5}; 4 in it is False
    """

    __slots__ = ("_lo", "_hi")

    def __init__(self, items: Iterable[int] = ()) -> None:
        self._lo: List[int] = []
        self._hi: List[int] = []
        if isinstance(items, Runs):
            self._lo, self._hi = list(items._lo), list(items._hi)
        else:
            for k in items:
                self.add(k)

    @classmethod
    def of(cls, runs: Iterable[Tuple[int, int]]) -> "Runs":
        out = cls()
        for lo, hi in runs:
            out.add_run(lo, hi)
        return out

    def add_run(self, lo: int, hi: int) -> None:
        """Add ``lo, ..., hi - 1``, joining the runs it touches."""
        if lo >= hi:
            return
        i = bisect_left(self._hi, lo)  # the first run ending at or after lo
        j = bisect_right(self._lo, hi)  # past the last run starting at or before hi
        if i < j:
            lo, hi = min(lo, self._lo[i]), max(hi, self._hi[j - 1])
        self._lo[i:j], self._hi[i:j] = [lo], [hi]

    def add(self, k: int) -> None:
        self.add_run(k, k + 1)

    def discard(self, k: int) -> None:
        i = bisect_right(self._lo, k) - 1
        if i < 0 or k >= self._hi[i]:
            return
        lo, hi = self._lo[i], self._hi[i]
        pieces = [(a, b) for a, b in ((lo, k), (k + 1, hi)) if a < b]
        self._lo[i : i + 1] = [a for a, _ in pieces]
        self._hi[i : i + 1] = [b for _, b in pieces]

    def __contains__(self, k: object) -> bool:
        if not isinstance(k, int):
            return False
        i = bisect_right(self._lo, k) - 1
        return i >= 0 and k < self._hi[i]

    def __iter__(self) -> Iterator[int]:
        for lo, hi in zip(self._lo, self._hi):
            yield from range(lo, hi)

    def __len__(self) -> int:
        return sum(hi - lo for lo, hi in zip(self._lo, self._hi))

    def runs(self) -> List[List[int]]:
        return [[lo, hi] for lo, hi in zip(self._lo, self._hi)]

    def __repr__(self) -> str:
        return f"Runs.of({self.runs()!r})"


def _runs(ks: Set[int]) -> List[List[int]]:
    """Sorted ints as ``[first, last + 1]`` runs: ``{0, 1, 2, 5} -> [[0, 3], [5, 6]]``."""
    if isinstance(ks, Runs):
        return ks.runs()
    out: List[List[int]] = []
    for k in sorted(ks):
        if out and out[-1][1] == k:
            out[-1][1] = k + 1
        else:
            out.append([k, k + 1])
    return out


def _read_runs(value: List[Any], path: str, items: int) -> "Runs":
    """The runs, kept as runs (never expanded into one entry per id): sorted, each
    ``[first, last + 1]`` with ``0 <= first < last + 1 <= items``, none overlapping another."""
    out = Runs()
    end = 0
    for n, pair in enumerate(value):
        bounds = _ints(pair, f"{path}[{n}]")
        if len(bounds) != 2 or not end <= bounds[0] < bounds[1] <= items:
            wanted = f"a run [first, last + 1] of source items, after {end - 1} (the last one)"
            raise _bad(f"{path}[{n}]", pair, wanted if n else "a run [first, last + 1], first >= 0")
        out.add_run(bounds[0], bounds[1])
        end = bounds[1]
    return out


@dataclass
class SlotState:
    """What one stage held at the checkpoint: the items' ids (ids or bundles) in its order, and
    how many random numbers it had drawn."""

    ids: List[Any] = field(default_factory=list)
    draws: int = 0


@dataclass
class LedgerState:
    """What one stream had consumed: the source items read entirely, the last sample read of
    each item begun, the ids held by no stage's slot that must be read again (``holes``), each
    stage's slot by its position, the ids of the items held after this stream (by a
    WebLoader's main process), and why the order could not be kept (``unordered``)."""

    complete: Set[int] = field(default_factory=Runs)
    partial: Dict[int, int] = field(default_factory=dict)
    holes: Set[int] = field(default_factory=set)
    slots: Dict[int, SlotState] = field(default_factory=dict)
    held_after: List[Any] = field(default_factory=list)
    unordered: Optional[str] = None
    #: Where it was read from (``state['ledger']``), for errors found when the data is read.
    path: str = field(default="state['ledger']", compare=False, repr=False)

    def reads(self) -> Tuple[Set[int], Dict[int, int], Set[int]]:
        """(the source items read entirely, the last sample read of each item begun, every id
        held at the checkpoint: the holes and what the slots held)."""
        holes = set(self.holes)
        for slot in self.slots.values():
            holes.update(ids_of(slot.ids))
        return Runs(self.complete), dict(self.partial), holes

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "complete": _runs(self.complete),
            "partial": {str(k): j for k, j in sorted(self.partial.items())},
            "holes": sorted(self.holes),
            "slots": {
                str(pos): {"ids": list(s.ids), "draws": s.draws}
                for pos, s in sorted(self.slots.items())
            },
        }
        out["held_after"] = list(self.held_after)
        out["unordered"] = self.unordered
        return out

    @classmethod
    def from_dict(
        cls, d: Any, path: str = "ledger", complete: bool = True, ids: int = 1 << _ID_BITS
    ) -> "LedgerState":
        """The record at ``path`` of a saved state (see :class:`_Fields` for ``complete``);
        ``ids``: the bound of its ids (a WebLoader's main process qualifies them)."""
        f = _Fields(d, path, complete)
        items = ids >> 32  # (the source items: an id is ``item << 32 | sample``)
        partial = {
            k: _to_int(j, f"{f.at('partial')}[{str(k)!r}]", 0, _SAMPLES)
            for k, j in f.numbered("partial", items).items()
        }
        slots = {}
        for pos, s in f.numbered("slots").items():
            slot = _Fields(s, f"{f.at('slots')}[{str(pos)!r}]", True)
            held = _ids(slot.list("ids"), slot.at("ids"), ids)
            slots[pos] = SlotState(held, slot.int("draws", lo=0, hi=MAX_DRAWS + 1))
        return cls(
            _read_runs(f.list("complete"), f.at("complete"), items),
            partial,
            set(_ints(f.list("holes"), f.at("holes"), 0, ids)),
            slots,
            _ids(f.list("held_after", []), f.at("held_after"), ids),
            f.text("unordered"),
            path,
        )


@dataclass
class StreamState:
    """Where one process's stream stands: ``epoch`` and the ``items`` yielded in it; the pass
    being read (``pass_``, None when none is) with its ``ledger``; why a resume from here cannot
    be exact (``problem``); the ids of the last item yielded, which a padded epoch repeats."""

    epoch: int = 0
    items: int = 0
    pass_: Optional[int] = None
    ledger: Optional[LedgerState] = None
    problem: Optional[str] = None
    last: Any = None

    def _fields(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"epoch": self.epoch, "items": self.items, "stream": self.pass_}
        out["ledger"] = None if self.ledger is None else self.ledger.to_dict()
        out["problem"] = self.problem
        out["last"] = self.last
        return out

    def to_dict(self) -> Dict[str, Any]:
        return self._fields()

    @classmethod
    def from_dict(
        cls, d: Any, path: str = "state", complete: bool = True, ids: int = 1 << _ID_BITS
    ) -> "StreamState":
        """The record at ``path`` of a saved state (see :class:`_Fields` for ``complete``;
        ``ids``: :meth:`LedgerState.from_dict`'s)."""
        f = _Fields(d, path, complete)
        pass_ = f.int("stream", None, none=True, lo=0)
        reading = _NEEDED if pass_ is not None else None  # (version 2: all four, or none)
        ledger = f.raw("ledger", reading)
        if pass_ is None and ledger is not None:
            raise _missing(f.at("stream"))  # (a ledger is the record of a pass being read)
        if pass_ is not None and ledger is None:
            raise _bad(f.at("ledger"), ledger, f"the ledger of the pass being read ({pass_})")
        f.raw("problem", reading)
        if ledger is not None:
            ledger = LedgerState.from_dict(ledger, f.at("ledger"), complete, ids)
        last = f.raw("last", reading)
        return cls(
            epoch=f.int("epoch", lo=0),
            items=f.int("items", lo=0),
            pass_=pass_,
            ledger=ledger,
            problem=f.text("problem"),
            last=None if last is None else _ids(last, f.at("last"), ids),
        )


@dataclass
class PipelineState(StreamState):
    """One rank's state (see the module doc). ``workers`` is a WebLoader's: each DataLoader
    worker's stream by worker number ({} before any has sent a batch; None for a pipeline
    that is not a WebLoader), and ``next_worker`` the one whose batch comes next."""

    version: int = VERSION
    rank: int = 0
    world_size: int = 1
    seed: Optional[int] = None
    config: Dict[str, Any] = field(default_factory=dict)
    entropy: List[int] = field(default_factory=list)
    workers: Optional[Dict[int, StreamState]] = None
    next_worker: Optional[int] = None

    @property
    def in_progress(self) -> bool:
        """Whether this state was taken in the middle of a pass (something was being read)."""
        return self.ledger is not None or bool(self.workers)

    def problems(self) -> List[str]:
        """The reasons its streams (its own, its DataLoader workers') can't resume exactly."""
        out = [self.problem] + [w.problem for w in (self.workers or {}).values()]
        return [p for p in dict.fromkeys(out) if p]

    def add_problem(self, why: str) -> None:
        self.problem = "; ".join(p for p in (self.problem, why) if p)

    def streams(self) -> List[Tuple[int, StreamState]]:
        """(worker, stream) of each stream read: a WebLoader's workers', or its own."""
        if self.workers is not None:
            return sorted(self.workers.items())
        return [(0, self)] if self.ledger is not None else []

    def num_workers(self) -> int:
        """The DataLoader workers of the job that saved it (1 without any)."""
        return max(1, int(self.config.get("num_workers") or 0))

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"version": VERSION, "rank": self.rank}
        out.update(world_size=self.world_size, seed=self.seed, config=self.config)
        out["entropy"] = list(self.entropy)
        out.update(self._fields())
        out["next_worker"] = self.next_worker
        out["workers"] = None
        if self.workers is not None:
            # Every worker, those that have sent nothing yet as None: a missing one is an error.
            every = range(max([self.num_workers() - 1, *self.workers]) + 1)
            workers = self.workers
            out["workers"] = {str(w): w in workers and workers[w].to_dict() or None for w in every}
        return out


def _unknown_version(d: Dict[str, Any]) -> str:
    """Why a state of a version not in :data:`READS` is refused, and what to do."""
    version = d["version"]
    what = f"this state is of version {version!r}, and this webds reads versions 2 and {VERSION}"
    if isinstance(version, int) and version > VERSION:
        return f"{what}: it was saved by a newer webds; upgrade webds to resume it"
    if version == 1:
        what += " (version 1 was written by webds 0.1, which was never released)"
    epoch = d.get("epoch")
    again = f"set_epoch({epoch})" if isinstance(epoch, int) else "set_epoch() with its epoch"
    return f"{what}: it cannot be resumed. Start its epoch afresh: {again}, not load_state_dict()"


def read_state(d: Any) -> PipelineState:
    """A :class:`PipelineState` out of what ``state_dict()`` returned (and JSON or torch.save
    gave back); :class:`~webds.errors.ArgumentError` naming the field that is missing or of the
    wrong type by its path (``state['ledger']['complete']``), and
    :class:`~webds.errors.ResumeError` for a state of another version."""
    if isinstance(d, PipelineState):
        return d
    if not isinstance(d, dict):
        raise _bad("state", d, "a dict")
    if "version" not in d:
        raise _missing("state['version']")
    version = d["version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise _bad("state['version']", version, "an int")
    if version not in READS:
        raise ResumeError(_unknown_version(d))
    complete = version >= 3
    f = _Fields(d, "state", complete)
    config = f.map("config")
    given = config.get("num_workers")
    n = given if isinstance(given, int) and not isinstance(given, bool) and given > 1 else 1
    # A WebLoader's main process holds its workers' items, their number above each id.
    stream = StreamState.from_dict(d, "state", complete, n << _ID_BITS)
    workers = f.raw("workers", None)
    if workers is not None:
        workers = _read_workers(f, config)
    world_size = f.int("world_size", lo=1)
    return PipelineState(
        **vars(stream),
        rank=f.int("rank", lo=0, hi=world_size),
        world_size=world_size,
        seed=f.int("seed", none=True),
        config=config,
        entropy=_ints(f.list("entropy"), f.at("entropy")),
        workers=workers,
        next_worker=f.int("next_worker", None, none=True, lo=0, hi=n),
    )


def _read_workers(f: _Fields, config: Dict[str, Any]) -> Dict[int, StreamState]:
    """A WebLoader state's workers: in version 3, one for each of its DataLoader workers
    (None: it had sent nothing yet)."""
    given = f.numbered("workers")
    path = f.at("workers")
    if f.complete:
        if "num_workers" not in config:
            raise _missing(f"{f.at('config')}['num_workers']")
        n = max(1, _to_int(config["num_workers"] or 0, f"{f.at('config')}['num_workers']"))
        for w in range(n):
            if w not in given:
                raise _missing(f"{path}[{str(w)!r}]")
        for w in given:
            if not 0 <= w < n:
                raise _bad(f"{path}[{str(w)!r}]", w, f"a worker number below {n}")
    return {
        w: StreamState.from_dict(s, f"{path}[{str(w)!r}]", f.complete)
        for w, s in sorted(given.items())
        if s is not None or not f.complete
    }


def read_states(d: Any) -> Union[PipelineState, List[PipelineState]]:
    """:func:`read_state` of one rank's state, or of each in a list of every rank's
    (``state_dict(all_ranks=True)``)."""
    if isinstance(d, (list, tuple)):
        if not d:
            raise ArgumentError("not a webds pipeline state (from state_dict()): an empty list")
        return [read_state(x) for x in d]
    return read_state(d)
