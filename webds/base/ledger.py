"""The ledger: which source items a pipeline has consumed, so a resumed epoch reads each once.

Item ``k`` of the source (a shard descriptor, or any item of a plain iterable) has the id
``k << 32 | LEAF`` (:func:`item_id`); sample ``j`` of shard ``k``, as the tar stage reads it,
``k << 32 | j``. The :class:`Ledger` records what was *produced* (read from the source) and what
is *held* (read, but in a stage's buffer); the rest is consumed, a sample that a stage dropped
included (reading it again would drop it again). So a resume built on it is exact whatever the
stages do: it records reads, it predicts no counts.

``ledger.current`` is the id of the item last pulled: the stage that produces an item sets it,
stages that pass items on leave it, ``batched`` makes it a list (a bundle) that ``unbatched``
takes apart. A stage that holds items takes a ``ledger`` parameter (a :class:`StageLedger`, None
outside a pipeline) and keeps their ids in its :class:`Slot` (:mod:`webds.base.slots`).
:meth:`Ledger.state` is the record; ``Ledger(resume=state)`` answers :meth:`Ledger.consumed` so
the source skips what was consumed. A DataLoader worker's ledger sends its changes with every
item (:meth:`Ledger.take_delta`) and the main process keeps a copy per worker
(:meth:`Ledger.apply`). What a stage owes a resume: docs/architecture.md, "A resumable stage".
This module does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

from ..errors import ArgumentError
from .saved import LedgerState, Runs, SlotState
from .slots import BEYOND, RestorePlan, Slot, StageLedger, ids_of

__all__ = [
    "Ledger",
    "Pass",
    "StageLedger",
    "Slot",
    "RestorePlan",
    "LEAF",
    "item_id",
    "shard_of",
    "ids_of",
    "unconsumed",
    "qualify",
    "unqualify",
    "Envelope",
    "PAD",
    "Restored",
    "NoSamples",
    "BEYOND",
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


class Ledger:
    """What one stream (one process's pipeline pass) has produced and holds; see the module doc.

    ``resume`` is a :meth:`state` saved earlier: the source then skips what it says was consumed.
    ``track=True`` records changes for :meth:`take_delta` (a DataLoader worker's ledger).
    """

    def __init__(self, resume: Optional[LedgerState] = None, track: bool = False) -> None:
        self.current: Any = None
        self.probe: Any = None  # the pipeline's Probe, when it measures (stats=True)
        self.complete: Set[int] = Runs()  # source items produced entirely
        self.partial: Dict[int, int] = {}  # shard -> last sample number produced
        self.problem: Optional[str] = None  # why a resume from here cannot be exact
        #: Why a resumed pass could not put every buffer back as it was (it then goes on with the
        #: same samples, each once, in another order); None while it could.
        self.unordered: Optional[str] = None
        #: Why the pass found no samples at all (set by the empty check in a DataLoader worker,
        #: which cannot know whether the other workers found any: the main process judges).
        self.no_samples: Optional[str] = None
        self._slots: Dict[int, Slot] = {}  # by the position of the stage that holds the items
        # Tracking (a DataLoader worker's ledger): changes since the last take_delta(); the
        # slots' operations go to one log (kept: slots append to it), which the main process
        # replays on its copy.
        self._track = track
        self._d_partial: Dict[int, int] = {}
        self._d_complete: List[int] = []
        self._ops: List[Tuple[int, int, Any]] = []
        self._d_reread: List[int] = []
        self.resuming = resume is not None
        # What was consumed before the resume: all of _old_complete, samples up to _old_partial,
        # except the _holes (held at the checkpoint; read again now).
        self._old_complete: Set[int] = Runs()
        self._old_partial: Dict[int, int] = {}
        self._holes: Set[int] = set()
        self._hole_shards: Set[int] = set()
        # The last sample number the tar stage came to in each shard begun before the resume,
        # to judge the saved sample number against the shard's (see finish()).
        self._seen: Dict[int, int] = {}
        self._path = resume.path if resume is not None else "state['ledger']"
        if resume is not None:
            self.complete, self.partial, self._holes = resume.reads()
            self._old_complete = Runs(self.complete)
            self._old_partial = dict(self.partial)
            self._hole_shards = {shard_of(i) for i in self._holes}
            for pos, saved in resume.slots.items():
                slot = self.slot(pos)
                slot.ids[:] = saved.ids
                slot.draws = saved.draws
                slot.saved = list(slot.ids)
        # Who held what at the checkpoint, made before the source reads anything again.
        self._plan: Optional[RestorePlan] = None
        if resume is not None:
            saved = {pos: slot.saved for pos, slot in self._slots.items() if slot.saved}
            self._plan = RestorePlan(saved, self._holes, resume.held_after)
        #: [shard, last sample read] of the shard the tar stage is reading (not resuming), which
        #: it updates for each sample instead of calling produce(); read by _fold_reading().
        self.reading: List[int] = [-1, -1]

    @property
    def tracking(self) -> bool:
        """Whether changes are recorded for :meth:`take_delta` (a WebLoader's dataset)."""
        return self._track

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
        if self.resuming and self._seen.get(k, LEAF) < self._old_partial.get(k, -1):
            raise ArgumentError(
                f"not a webds pipeline state for this data: {self._path}['partial'][{str(k)!r}] "
                f"is {self._old_partial[k]}, the last sample read of source item {k}, and it "
                f"has {self._seen[k] + 1} (the shards changed, or the state is not theirs)"
            )
        self.complete.add(k)
        self.partial.pop(k, None)
        if self._track:
            self._d_complete.append(k)
            self._d_partial.pop(k, None)

    def consumed(self, i: Any) -> bool:
        """Whether id ``i`` was consumed before the resume (so it must not be read again)."""
        if not self.resuming or type(i) is not int:
            return False
        k = i >> _SHIFT
        if (i & LEAF) > self._seen.get(k, -1) and k in self._old_partial:
            self._seen[k] = i & LEAF
        if i in self._plan.holes:
            return False  # (all held at the checkpoint: produce() forgets those read again)
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

    def slot(self, position: int) -> "Slot":
        """The :class:`Slot` of the stage at ``position`` in the pipeline (made on first use)."""
        slot = self._slots.get(position)
        if slot is None:
            slot = self._slots[position] = Slot(self, position)
        return slot

    def at(self, position: int, runs: bool = False) -> "StageLedger":
        """This ledger as the stage at ``position`` sees it (``runs``: it may yield runs of
        samples, see :mod:`webds.base.runs`)."""
        return StageLedger(self, position, runs)

    def restore_plan(self) -> "RestorePlan":
        """Who held what at the checkpoint resumed from (empty when not resuming)."""
        if self._plan is None:
            self._plan = RestorePlan({}, ())
        return self._plan

    def restore_order(self, items: Iterator[Any]) -> Iterator[Any]:
        """The source's items when resuming (each with its id current), the samples held at
        the checkpoint put in the order the stages take them back (:meth:`Slot.restore`): those
        held by later stages first, each stage's in the order it kept them. They are all read
        before any new sample, so they are gathered until the last is read, or a new one."""
        plan = self.restore_plan()
        holes = set(plan.holes)
        if not holes:
            yield from items
            return
        left = len(holes)
        held: List[Tuple[Any, Any]] = []
        for item in items:
            i = self.current
            if left and type(i) is int and i in holes:
                holes.discard(i)
                held.append((item, i))
                left -= 1
                if left:
                    continue
                yield from self._in_order(held, plan)
                held = []
                continue
            if held:
                yield from self._in_order(held, plan)
                held = []
                self.current = i
            left = 0
            yield item
        yield from self._in_order(held, plan)

    def divert_held_after(self, items: Iterator[Any], into: List[Any]) -> Iterator[Any]:
        """A resumed WebLoader worker's items without those its main process held at the
        checkpoint (which come first): they go to ``into``, as (item, ids), for the worker's
        first batch, and are not this stream's items."""
        left = self.restore_plan().beyond
        if not left:
            yield from items
            return
        plan = self.restore_plan()
        for item in items:
            i = self.current
            if left > 0 and plan.owner(i) == BEYOND:
                into.append((item, i))
                left -= sum(1 for _ in ids_of(i))
                continue
            left = 0
            self.current = i
            yield item

    def _in_order(self, held: List[Tuple[Any, Any]], plan: "RestorePlan") -> Iterator[Any]:
        held.sort(key=lambda pair: plan.sort_key(pair[1]))
        for item, i in held:
            self.current = i
            yield item

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

    def held_items(self) -> List[Any]:
        """The ids of every item held now (ids or bundles), slot by slot."""
        return [i for _, slot in sorted(self._slots.items()) for i in slot.ids]

    def held_ids(self) -> Dict[int, int]:
        """Every id held now in a stage's slot, and how often."""
        held: Dict[int, int] = {}
        for slot in self._slots.values():
            for i in ids_of(slot.ids):
                held[i] = held.get(i, 0) + 1
        return held

    def state(self, held_after: Sequence[Any] = ()) -> LedgerState:
        """The record of what was consumed and is held; ``held_after``: the ids of the items
        that the stages after this stream held (a WebLoader's, of a worker's items)."""
        self._fold_reading()
        held = self.held_ids()
        self._check_held(held)
        holes = self._holes - set(held)  # (what the slots hold is read from them)
        holes.update(ids_of(list(held_after)))
        slots = {
            pos: SlotState(list(slot.ids), slot.draws)
            for pos, slot in sorted(self._slots.items())
            if slot.ids or slot.draws
        }
        return LedgerState(
            Runs(self.complete), dict(self.partial), holes, slots, list(held_after), self.unordered
        )

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
        d = (self._d_partial, self._d_complete, self._ops[:], self._d_reread, self.unordered)
        self._d_partial, self._d_complete, self._d_reread = {}, [], []
        self._ops.clear()  # in place: the slots keep it
        return d

    def apply(self, delta: Tuple[Any, ...]) -> None:
        """Apply a worker's :meth:`take_delta` to this copy of its ledger."""
        partial, complete, ops, reread, unordered = delta
        for k, j in partial.items():
            if j > self.partial.get(k, -1):
                self.partial[k] = j
        for k in complete:
            self.complete.add(k)
            self.partial.pop(k, None)
        for pos, op, arg in ops:
            self.slot(pos)._replay(op, arg)
        self._holes.difference_update(reread)
        if unordered is not None:
            self.unordered = unordered


class Pass(NamedTuple):
    """The pass a stream is reading (an epoch's number; ``with_epoch`` streams run across
    epochs) and its ledger."""

    number: int
    ledger: Ledger


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


class Restored(NamedTuple):
    """What a resumed DataLoader worker yields first: the samples the main process held at the
    checkpoint (in its shuffle buffer, a batch being split), read and made again, each as a
    batch of one, with their ids; the main process takes them back (see
    :meth:`Slot.restore`) without counting them as batches."""

    items: List[Any]
    ids: List[Any]


class NoSamples(NamedTuple):
    """What a DataLoader worker whose epoch found no samples at all yields, alone, at its end
    (the empty check said why: ``message``); when every worker sent one and no item came, the
    main process raises :class:`~webds.errors.NoSamplesError`, as one process would."""

    message: str


class _Pad:
    """What a resumed DataLoader worker yields first when its turn came before the checkpoint's
    next one: an item the main process drops, so that the DataLoader, whose workers take turns
    from worker 0 again, hands the batches over in the uninterrupted run's order."""

    def __reduce__(self) -> str:
        return "PAD"  # the same object in every process

    def __repr__(self) -> str:
        return "webds.base.ledger.PAD"


PAD = _Pad()


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
