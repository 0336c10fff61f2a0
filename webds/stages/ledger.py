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

from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Set, Tuple

__all__ = [
    "Ledger",
    "LEAF",
    "item_id",
    "shard_of",
    "ids_of",
    "unconsumed",
    "saved_reads",
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


def saved_reads(state: Dict[str, Any]) -> Tuple[Set[int], Dict[int, int], Set[int]]:
    """What a saved :meth:`Ledger.state` says: (the source items read entirely, the last sample
    read of each item begun, the ids held at the checkpoint)."""
    partial = {int(k): int(j) for k, j in (state.get("partial") or {}).items()}
    return _unranges(state.get("complete", ())), partial, {int(i) for i in state.get("holes", ())}


class Ledger:
    """What one stream (one process's pipeline pass) has produced and holds; see the module doc.

    ``resume`` is a :meth:`state` saved earlier: the source then skips what it says was consumed.
    ``track=True`` records changes for :meth:`take_delta` (a DataLoader worker's ledger).
    """

    def __init__(self, resume: Optional[Dict[str, Any]] = None, track: bool = False) -> None:
        self.current: Any = None
        self.probe: Any = None  # the pipeline's Probe, when it measures (stats=True)
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
            self.complete, self.partial, self._holes = saved_reads(resume)
            self._old_complete = set(self.complete)
            self._old_partial = dict(self.partial)
            self._hole_shards = {shard_of(i) for i in self._holes}
        # Tracking (a DataLoader worker's ledger): changes since the last take_delta(); holds and
        # releases go to one log (i held, ~i released) instead of ``held``, which the main
        # process keeps.
        self._track = track
        self._d_partial: Dict[int, int] = {}
        self._d_complete: List[int] = []
        self._log: List[int] = []
        self._d_reread: List[int] = []
        self._holders: List[List[Any]] = []  # lists in which stages keep the ids they hold
        #: [shard, last sample read] of the shard the tar stage is reading (not resuming), which
        #: it updates for each sample instead of calling produce(); read by _fold_reading().
        self.reading: List[int] = [-1, -1]

    @property
    def tracking(self) -> bool:
        """Whether changes are recorded for :meth:`take_delta` (a WebLoader's dataset)."""
        return self._track

    @property
    def log(self) -> List[int]:
        """Where a tracking ledger notes holds (``i``) and releases (``~i``) of plain ids: a
        stage that holds many items may append to it directly instead of calling :meth:`hold`
        and :meth:`release` (it must still set :attr:`current`)."""
        return self._log

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
        if self.reading[0] == k:
            self.reading[0] = self.reading[1] = -1
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

    def first_unconsumed(self, k: int, first: int = 0) -> int:
        """The first sample number ``>= first`` of source item ``k`` not consumed before the
        resume, where a reader that can seek starts (:data:`LEAF` if there is none). Samples
        after it may still be consumed: :meth:`consumed` answers for each."""
        if not self.resuming:
            return first
        after = LEAF if k in self._old_complete else max(first, self._old_partial.get(k, -1) + 1)
        if k in self._hole_shards:
            for i in self._holes:
                j = i & LEAF
                if i >> _SHIFT == k and first <= j < after:
                    after = j
        return after

    def skips_item(self, k: int) -> bool:
        """Whether all of source item ``k`` was consumed before the resume: skip it unread."""
        return self.resuming and k in self._old_complete and k not in self._hole_shards

    # -- stages that hold items ------------------------------------------------------------------

    def holder(self) -> List[Any]:
        """A list for a stage to keep the ids of the items it holds in, which :meth:`state`
        reads: cheaper than :meth:`hold` and :meth:`release` for every item (a shuffle buffer).
        A tracking ledger must still be told with those (see :attr:`tracking`)."""
        ids: List[Any] = []
        self._holders.append(ids)
        return ids

    def hold(self, ids: Any) -> None:
        """Record that the item with ``ids`` (an id or a bundle) is held in a buffer."""
        if type(ids) is not int:
            for i in ids_of(ids):
                self.hold(i)
        elif self._track:
            self._log.append(ids)
        else:
            held = self.held
            held[ids] = held.get(ids, 0) + 1

    def release(self, ids: Any) -> None:
        """Record that the item with ``ids`` left its buffer; it becomes :attr:`current`."""
        if type(ids) is not int:
            for i in ids_of(ids):
                self.release(i)
        elif self._track:
            self._log.append(~ids)
        else:
            held = self.held
            n = held.get(ids, 0) - 1
            if n > 0:
                held[ids] = n
            else:
                held.pop(ids, None)
        self.current = ids

    # -- state -----------------------------------------------------------------------------------

    def start_reading(self, k: int) -> None:
        """The tar stage starts reading shard ``k`` (see :attr:`reading`)."""
        self._fold_reading()
        self.reading[0], self.reading[1] = k, -1

    def _fold_reading(self) -> None:
        """Record the samples the tar stage noted in :attr:`reading` as produced."""
        k, j = self.reading
        if j >= 0 and j > self.partial.get(k, -1):
            self.partial[k] = j
            if self._track:
                self._d_partial[k] = j

    def held_ids(self) -> Dict[int, int]:
        """Every id held now (by :meth:`hold` or in a :meth:`holder` list), and how often."""
        held = dict(self.held)
        for ids in self._holders:
            for i in ids_of(ids):
                held[i] = held.get(i, 0) + 1
        return held

    def state(self, extra_holes: Iterable[int] = ()) -> Dict[str, Any]:
        """The JSON-able record of what was consumed (``extra_holes``: held elsewhere)."""
        self._fold_reading()
        held = self.held_ids()
        self._check_held(held)
        holes = set(held) | self._holes
        holes.update(extra_holes)
        return {
            "complete": _ranges(self.complete),
            "partial": {str(k): j for k, j in sorted(self.partial.items())},
            "holes": sorted(holes),
        }

    def _check_held(self, held: Dict[int, int]) -> None:
        """Two items held at once with the same id of a whole source item: something split it."""
        if self.problem is None and any(n > 1 and i & LEAF == LEAF for i, n in held.items()):
            self.problem = (
                "two items held at once came from the same source item: a stage between the "
                "source and the buffers splits items without numbering them (such as "
                "tar_file_expander + group_by_keys; tarfile_to_samples numbers them)"
            )

    # -- between a DataLoader worker and the main process ----------------------------------------

    def take_delta(self) -> Tuple[Any, ...]:
        """What changed since the last call (a worker sends it along with its items)."""
        self._fold_reading()
        d = (self._d_partial, self._d_complete, self._log[:], self._d_reread)
        self._d_partial, self._d_complete, self._d_reread = {}, [], []
        self._log.clear()  # in place: stages may keep it (see log)
        return d

    def apply(self, delta: Tuple[Any, ...]) -> None:
        """Apply a worker's :meth:`take_delta` to this copy of its ledger."""
        partial, complete, log, reread = delta
        for k, j in partial.items():
            if j > self.partial.get(k, -1):
                self.partial[k] = j
        for k in complete:
            self.complete.add(k)
            self.partial.pop(k, None)
        held = self.held
        for i in log:
            if i >= 0:
                held[i] = held.get(i, 0) + 1
            else:
                i = ~i
                n = held.get(i, 0) - 1
                if n > 0:
                    held[i] = n
                else:
                    held.pop(i, None)
        self._holes.difference_update(reread)


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


class Envelope(NamedTuple):
    """A batch a DataLoader worker sends a WebLoader, with what its ledger says about it: which
    worker, the ids of the items in it, what changed in the worker's ledger
    (:meth:`Ledger.take_delta`), the items the worker has yielded this epoch, the pass it is in,
    a reason resuming can't be exact, and what the worker's probe measured (stats=True). A
    tuple, because it pickles fastest."""

    item: Any
    worker: int
    ids: Any
    delta: Tuple[Any, ...]
    items: int
    pass_: int
    problem: Optional[str] = None
    stats: Any = None  # the worker's Probe snapshot, when the loader measures (stats=True)

    def pin_memory(self, device: Any = None) -> "Envelope":
        """The envelope with its item pinned (the DataLoader's pin-memory thread calls this)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return self._replace(item=pin_memory(self.item, device))
