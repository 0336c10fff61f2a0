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

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from ..errors import ArgumentError, ResumeError
from .slots import ids_of

__all__ = ["VERSION", "SlotState", "LedgerState", "StreamState", "PipelineState"]
__all__ += ["read_state", "read_states"]

#: The version of the format :meth:`PipelineState.to_dict` writes, the only one :func:`read_state`
#: reads.
VERSION = 2


class _Malformed(ArgumentError):
    pass


def _fail(what: str, value: Any, whole: Any) -> _Malformed:
    return _Malformed(
        f"not a webds pipeline state (from state_dict()): {what} is {value!r} in {whole!r}"
    )


def _int(d: Dict[str, Any], key: str, default: Any, whole: Any) -> Any:
    value = d.get(key, default)
    if value is None or value is default:
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _fail(repr(key), value, whole) from None


def _runs(ks: Set[int]) -> List[List[int]]:
    """Sorted ints as ``[first, last + 1]`` runs: ``{0, 1, 2, 5} -> [[0, 3], [5, 6]]``."""
    out: List[List[int]] = []
    for k in sorted(ks):
        if out and out[-1][1] == k:
            out[-1][1] = k + 1
        else:
            out.append([k, k + 1])
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

    complete: Set[int] = field(default_factory=set)
    partial: Dict[int, int] = field(default_factory=dict)
    holes: Set[int] = field(default_factory=set)
    slots: Dict[int, SlotState] = field(default_factory=dict)
    held_after: List[Any] = field(default_factory=list)
    unordered: Optional[str] = None

    def reads(self) -> Tuple[Set[int], Dict[int, int], Set[int]]:
        """(the source items read entirely, the last sample read of each item begun, every id
        held at the checkpoint: the holes and what the slots held)."""
        holes = set(self.holes)
        for slot in self.slots.values():
            holes.update(ids_of(slot.ids))
        return set(self.complete), dict(self.partial), holes

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
        if self.held_after:
            out["held_after"] = list(self.held_after)
        if self.unordered is not None:
            out["unordered"] = self.unordered
        return out

    @classmethod
    def from_dict(cls, d: Any, whole: Any = None) -> "LedgerState":
        whole = d if whole is None else whole
        if not isinstance(d, dict):
            raise _fail("the ledger", d, whole)
        try:
            complete = {k for a, b in d.get("complete") or () for k in range(int(a), int(b))}
            partial = {int(k): int(j) for k, j in (d.get("partial") or {}).items()}
            holes = {int(i) for i in d.get("holes") or ()}
            slots = {
                int(pos): SlotState(list(s.get("ids") or []), int(s.get("draws", 0)))
                for pos, s in (d.get("slots") or {}).items()
            }
        except (TypeError, ValueError, AttributeError):
            raise _fail("the ledger", d, whole) from None
        return cls(
            complete, partial, holes, slots, list(d.get("held_after") or []), d.get("unordered")
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
        out: Dict[str, Any] = {"epoch": self.epoch, "items": self.items}
        if self.pass_ is not None:
            out["stream"] = self.pass_
            out["ledger"] = None if self.ledger is None else self.ledger.to_dict()
            out["problem"] = self.problem
            out["last"] = self.last
        elif self.problem is not None:
            out["problem"] = self.problem
        return out

    def to_dict(self) -> Dict[str, Any]:
        return self._fields()

    @classmethod
    def from_dict(cls, d: Any, whole: Any = None) -> "StreamState":
        whole = d if whole is None else whole
        if not isinstance(d, dict):
            raise _fail("a stream", d, whole)
        ledger = d.get("ledger")
        return cls(
            epoch=_int(d, "epoch", 0, whole),
            items=_int(d, "items", 0, whole),
            pass_=_int(d, "stream", None, whole),
            ledger=None if ledger is None else LedgerState.from_dict(ledger, whole),
            problem=d.get("problem"),
            last=d.get("last"),
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
        out: Dict[str, Any] = {"version": self.version, "rank": self.rank}
        out.update(world_size=self.world_size, seed=self.seed, config=self.config)
        out["entropy"] = list(self.entropy)
        out.update(self._fields())
        if self.next_worker is not None:
            out["next_worker"] = self.next_worker
        if self.workers is not None:
            out["workers"] = {str(w): s.to_dict() for w, s in sorted(self.workers.items())}
        return out


def _unknown_version(d: Dict[str, Any]) -> str:
    """Why a state of another version than :data:`VERSION` is refused, and what to do."""
    version = d["version"]
    what = f"this state is of version {version!r}, and this webds reads version {VERSION} only"
    if isinstance(version, int) and version > VERSION:
        return f"{what}: it was saved by a newer webds; upgrade webds to resume it"
    if version == 1:
        what += " (version 1 was written by webds 0.1, which was never released)"
    epoch = d.get("epoch")
    again = f"set_epoch({epoch})" if isinstance(epoch, int) else "set_epoch() with its epoch"
    return f"{what}: it cannot be resumed. Start its epoch afresh: {again}, not load_state_dict()"


def read_state(d: Any) -> PipelineState:
    """A :class:`PipelineState` out of what ``state_dict()`` returned (and JSON or torch.save
    gave back); :class:`~webds.errors.ArgumentError` naming what is wrong otherwise, and
    :class:`~webds.errors.ResumeError` for a state of another version."""
    if isinstance(d, PipelineState):
        return d
    if not isinstance(d, dict) or "version" not in d:
        raise ArgumentError(f"not a webds pipeline state (from state_dict()): {d!r}")
    if d["version"] != VERSION:
        raise ResumeError(_unknown_version(d))
    stream = StreamState.from_dict(d)
    workers = d.get("workers")
    if workers is not None:
        if not isinstance(workers, dict):
            raise _fail("'workers'", workers, d)
        try:
            workers = {int(w): StreamState.from_dict(s, d) for w, s in workers.items()}
        except ValueError:
            raise _fail("'workers'", workers, d) from None
    config = d.get("config") or {}
    if not isinstance(config, dict):
        raise _fail("'config'", config, d)
    try:
        entropy = [int(x) for x in d.get("entropy") or ()]
    except (TypeError, ValueError):
        raise _fail("'entropy'", d.get("entropy"), d) from None
    seed = d.get("seed")
    return PipelineState(
        **vars(stream),
        rank=_int(d, "rank", 0, d),
        world_size=_int(d, "world_size", 1, d),
        seed=None if seed is None else _int(d, "seed", None, d),
        config=config,
        entropy=entropy,
        workers=workers,
        next_worker=_int(d, "next_worker", None, d),
    )


def read_states(d: Any) -> Union[PipelineState, List[PipelineState]]:
    """:func:`read_state` of one rank's state, or of each in a list of every rank's
    (``state_dict(all_ranks=True)``)."""
    if isinstance(d, (list, tuple)):
        if not d:
            raise ArgumentError("not a webds pipeline state (from state_dict()): an empty list")
        return [read_state(x) for x in d]
    return read_state(d)
