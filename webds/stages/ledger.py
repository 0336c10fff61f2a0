"""The ledger: which source items a pipeline has consumed, so a resumed epoch reads each once.

A pipeline's source items are numbered as they are read. Item ``k`` of the source (a shard
descriptor, or any item of a plain iterable) has the id ``k << 32 | LEAF``; sample ``j`` of shard
``k``, as the tar stage reads it, has the id ``k << 32 | j``. Ids are plain ints, cheap to keep,
compare and send between processes.

The ledger records what was *produced* (read from the source: whole items, or a shard's samples up
to the last one read) and what is *held*: read, but sitting in a stage's buffer (a shuffle buffer,
a batch being filled, the rest of a batch being unbatched). What a consumer has seen is everything
produced minus what is held: a sample dropped by ``select``, by ``map`` returning None or by an
error handler is as consumed as one that was yielded, because reading it again would drop it again.
That is why a resume built on the ledger is exact whatever the stages do between the source and
the consumer: it does not predict counts, it records reads.

How an item's id travels: the stage that produces an item sets :attr:`Ledger.current`, and stages
that pass items straight on (map, select, decode, to_tuple, ...) leave it alone, so when a stage
pulls an item, ``ledger.current`` is that item's id. A stage that holds items back records the ids
it holds (:meth:`Ledger.hold`) and, when it yields one, releases it and sets ``current`` back to
that item's id; a stage that combines items (``batched``) sets ``current`` to the list of their
ids, a *bundle*, which ``unbatched`` takes apart again. Stages receive the ledger by declaring a
keyword parameter named ``ledger`` (see :mod:`webds.stages.core`); outside a pipeline it is None.

:meth:`Ledger.state` is the JSON-able record; a ledger made with ``Ledger(resume=state)`` answers
:meth:`Ledger.consumed` so that the source skips what was consumed and reads the holes again. A
DataLoader worker's ledger sends what changed with every item (:meth:`Ledger.take_delta`), and the
main process keeps a copy per worker (:meth:`Ledger.apply`): only items the training loop has
actually received count.

This module does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple

__all__ = [
    "Ledger",
    "LEAF",
    "item_id",
    "shard_of",
    "ids_of",
    "merge_deltas",
    "unconsumed",
    "qualify",
    "unqualify",
    "Envelope",
]

#: The sample number of an id that stands for a whole source item (not a sample inside it).
LEAF = (1 << 32) - 1
_SHIFT = 32


def item_id(k: int, j: int = LEAF) -> int:
    """The id of sample ``j`` of source item ``k`` (``j`` omitted: the whole item)."""
    return (k << _SHIFT) | j


def shard_of(i: int) -> int:
    """The source item (shard) number of id ``i``."""
    return i >> _SHIFT


def ids_of(ids: Any) -> Iterator[int]:
    """The plain ids in an id or a bundle (nested lists of ids)."""
    if isinstance(ids, list):
        for x in ids:
            yield from ids_of(x)
    elif ids is not None:
        yield ids


def _ranges(ks: Iterable[int]) -> List[List[int]]:
    """Sorted ints as ``[first, last + 1]`` runs: ``[0, 1, 2, 5] -> [[0, 3], [5, 6]]``."""
    out: List[List[int]] = []
    for k in sorted(ks):
        if out and out[-1][1] == k:
            out[-1][1] = k + 1
        else:
            out.append([k, k + 1])
    return out


def _unranges(runs: Iterable[Any]) -> Set[int]:
    return {k for a, b in runs for k in range(int(a), int(b))}


class Ledger:
    """What one stream (one process's pipeline pass) has produced and holds; see the module doc.

    ``resume`` is a :meth:`state` saved earlier: the source then skips what it says was consumed.
    ``track=True`` records changes for :meth:`take_delta` (a DataLoader worker's ledger).
    """

    def __init__(self, resume: Optional[Dict[str, Any]] = None, track: bool = False) -> None:
        self.current: Any = None
        self.complete: Set[int] = set()  # source items produced entirely
        self.partial: Dict[int, int] = {}  # shard -> last sample number produced
        self.held: Dict[int, int] = {}  # id -> how many times held (a bundle may repeat one)
        self.problem: Optional[str] = None  # why a resume from here cannot be exact
        self.resuming = resume is not None
        # What was consumed before the resume: all of _old_complete, samples up to _old_partial,
        # except the _holes (held at the checkpoint; read again now).
        self._old_complete: Set[int] = set()
        self._old_partial: Dict[int, int] = {}
        self._holes: Set[int] = set()
        self._hole_shards: Set[int] = set()
        if resume is not None:
            self.complete = _unranges(resume.get("complete", ()))
            self.partial = {int(k): int(j) for k, j in (resume.get("partial") or {}).items()}
            self._old_complete = set(self.complete)
            self._old_partial = dict(self.partial)
            self._holes = {int(i) for i in resume.get("holes", ())}
            self._hole_shards = {shard_of(i) for i in self._holes}
        self._track = track
        self._d_partial: Dict[int, int] = {}
        self._d_complete: List[int] = []
        self._d_held: Dict[int, int] = {}
        self._d_reread: List[int] = []

    # -- the source side -------------------------------------------------------------------------

    def produce(self, i: int) -> None:
        """Record that id ``i`` was read, and make it :attr:`current`."""
        self.current = i
        k, j = i >> _SHIFT, i & LEAF
        if j == LEAF:
            self.complete.add(k)
            if self._track:
                self._d_complete.append(k)
        elif j > self.partial.get(k, -1):
            self.partial[k] = j
            if self._track:
                self._d_partial[k] = j
        if self.resuming and i in self._holes:
            self._holes.discard(i)
            if self._track:
                self._d_reread.append(i)

    def finish(self, k: int) -> None:
        """Record that every sample of source item ``k`` has been read."""
        self.complete.add(k)
        self.partial.pop(k, None)
        if self._track:
            self._d_complete.append(k)
            self._d_partial.pop(k, None)

    def consumed(self, i: int) -> bool:
        """Whether id ``i`` was consumed before the resume (so it must not be read again)."""
        if not self.resuming or i in self._holes:
            return False
        k = i >> _SHIFT
        return k in self._old_complete or (i & LEAF) <= self._old_partial.get(k, -1)

    def skips_item(self, k: int) -> bool:
        """Whether all of source item ``k`` was consumed before the resume: skip it unread."""
        return self.resuming and k in self._old_complete and k not in self._hole_shards

    # -- stages that hold items ------------------------------------------------------------------

    def hold(self, ids: Any) -> None:
        """Record that the item with ``ids`` (an id or a bundle) is held in a buffer."""
        held, track = self.held, self._track
        for i in (ids,) if type(ids) is int else ids_of(ids):
            n = held.get(i, 0)
            if n and i & LEAF == LEAF and self.problem is None:
                self.problem = (
                    "two items held at once came from the same source item: a stage between "
                    "the source and the buffers splits items without numbering them (such as "
                    "tar_file_expander + group_by_keys; tarfile_to_samples numbers them)"
                )
            held[i] = n + 1
            if track:
                self._d_held[i] = self._d_held.get(i, 0) + 1

    def release(self, ids: Any) -> None:
        """Record that the item with ``ids`` left its buffer; it becomes :attr:`current`."""
        held, track = self.held, self._track
        for i in (ids,) if type(ids) is int else ids_of(ids):
            n = held.get(i, 0) - 1
            if n > 0:
                held[i] = n
            else:
                held.pop(i, None)
            if track:
                self._d_held[i] = self._d_held.get(i, 0) - 1
        self.current = ids

    # -- state -----------------------------------------------------------------------------------

    def state(self, extra_holes: Iterable[int] = ()) -> Dict[str, Any]:
        """The JSON-able record of what was consumed (``extra_holes``: held elsewhere)."""
        holes = set(self.held) | self._holes
        holes.update(extra_holes)
        return {
            "complete": _ranges(self.complete),
            "partial": {str(k): j for k, j in sorted(self.partial.items())},
            "holes": sorted(holes),
        }

    # -- between a DataLoader worker and the main process ----------------------------------------

    def take_delta(self) -> Tuple[Any, ...]:
        """What changed since the last call (a worker sends it along with each item)."""
        d = (
            self._d_partial,
            self._d_complete,
            {i: n for i, n in self._d_held.items() if n},
            self._d_reread,
        )
        self._d_partial, self._d_complete, self._d_held, self._d_reread = {}, [], {}, []
        return d

    def envelope(self, item: Any, worker: int, items: int, pass_: int) -> "Envelope":
        """``item`` as worker ``worker`` sends it: with its ids and what changed here since."""
        return Envelope(item, worker, self.current, self.take_delta(), items, pass_, self.problem)

    def apply(self, delta: Tuple[Any, ...]) -> None:
        """Apply a worker's :meth:`take_delta` to this copy of its ledger."""
        partial, complete, held, reread = delta
        for k, j in partial.items():
            if j > self.partial.get(k, -1):
                self.partial[k] = j
        for k in complete:
            self.complete.add(k)
            self.partial.pop(k, None)
        for i, n in held.items():
            m = self.held.get(i, 0) + n
            if m > 0:
                self.held[i] = m
            else:
                self.held.pop(i, None)
        self._holes.difference_update(reread)


def merge_deltas(deltas: List[Tuple[Any, ...]]) -> Tuple[Any, ...]:
    """Several consecutive :meth:`Ledger.take_delta` results, in order, as one."""
    partial: Dict[int, int] = {}
    complete: List[int] = []
    held: Dict[int, int] = {}
    reread: List[int] = []
    for p, c, h, r in deltas:
        for k, j in p.items():
            if j > partial.get(k, -1):
                partial[k] = j
        for k in c:
            partial.pop(k, None)
        complete.extend(c)
        for i, n in h.items():
            held[i] = held.get(i, 0) + n
        reread.extend(r)
    return partial, complete, {i: n for i, n in held.items() if n}, reread


def unconsumed(it: Iterable[Any], ledger: Ledger) -> Iterator[Any]:
    """The items of ``it`` not consumed before the resume (judged by the ledger's current id)."""
    for item in it:
        if not ledger.consumed(ledger.current):
            yield item


# -- DataLoader workers ---------------------------------------------------------------------------

_WORKER_SHIFT = 64
_LOW = (1 << _WORKER_SHIFT) - 1


def qualify(worker: int, ids: Any) -> Any:
    """``ids`` (an id or a bundle) of worker ``worker``'s stream, as ids unique in the main
    process: the worker number above the id's 64 bits."""
    if isinstance(ids, list):
        return [qualify(worker, x) for x in ids]
    if ids is None:
        return None
    return (worker << _WORKER_SHIFT) | ids


def unqualify(qid: int) -> Tuple[int, int]:
    """(worker, id) of a :func:`qualify` id."""
    return qid >> _WORKER_SHIFT, qid & _LOW


class Envelope:
    """An item a DataLoader worker yields, with what its ledger says about it: which worker,
    the item's ids, what changed in the worker's ledger (:meth:`Ledger.take_delta`), the items the
    worker has yielded this epoch, the pass it is in, and a reason resuming can't be exact."""

    __slots__ = ("item", "worker", "ids", "delta", "items", "pass_", "problem")

    def __init__(
        self,
        item: Any,
        worker: int,
        ids: Any,
        delta: Tuple[Any, ...],
        items: int,
        pass_: int,
        problem: Optional[str] = None,
    ) -> None:
        self.item = item
        self.worker = worker
        self.ids = ids
        self.delta = delta
        self.items = items
        self.pass_ = pass_
        self.problem = problem

    def __getstate__(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state: Tuple[Any, ...]) -> None:
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)

    def pin_memory(self, device: Any = None) -> "Envelope":
        """Pin the item (the DataLoader's pin-memory thread calls this)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        self.item = pin_memory(self.item, device)
        return self
