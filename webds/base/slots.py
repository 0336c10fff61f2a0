"""Slots: the items a stage holds between its yields, and putting them back after a resume.

A stage that holds items (a shuffle buffer, the rest of a batch being split, items in flight on
threads) keeps their ids in its :class:`Slot`, in the order it keeps them; the ledger
(:mod:`webds.base.ledger`) saves every slot with a checkpoint. A resumed pass reads the held
samples again first, in the order of :class:`RestorePlan` (those held by later stages first), and
:meth:`Slot.restore` hands each back to the stage that held it, so every buffer is as it was and
the same items come out in the same order as if the run had never stopped.

This module imports nothing of webds.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from .ledger import Ledger

__all__ = ["Slot", "RestorePlan", "StageLedger", "BEYOND", "ids_of", "pulled_back"]

log = logging.getLogger("webds")


def ids_of(ids: Any) -> Iterator[int]:
    """The plain ids in an id or a bundle (nested lists of ids)."""
    if isinstance(ids, list):
        for x in ids:
            yield from ids_of(x)
    elif ids is not None:
        yield ids


# Operations on a slot, as a tracking ledger logs them for the main process's copy.
_HOLD, _TAKE, _FIRST, _SET, _PICK = 0, 1, 2, 3, 4  # (_TAKE: take_swapped)

#: The position of a holder after every stage of a pipeline (a WebLoader's main process).
BEYOND = float("inf")
_END = object()


def _key(ids: Any) -> Any:
    """A hashable form of an id or a bundle."""
    return tuple(_key(x) for x in ids) if isinstance(ids, list) else ids


class Slot:
    """The ids of the items one stage holds between its yields, in the order it keeps them.

    ``draws`` counts the stage's random draws (:meth:`take`, :meth:`take_swapped`), so that a
    stage can make the same draws after a resume (``shuffle`` counts the 32-bit words its
    ``random.Random`` gave, and skips as many to resume). ``saved`` is what the slot held at the
    checkpoint resumed from (None when not resuming).
    """

    __slots__ = ("ledger", "position", "ids", "draws", "saved", "captured", "_next", "_ops")

    def __init__(self, ledger: "Ledger", position: int) -> None:
        self.ledger = ledger
        self.position = position
        # Where a tracking ledger logs the operations for the main process; None otherwise.
        self._ops: Optional[List[Any]] = ledger._ops if ledger._track else None
        self.ids: List[Any] = []
        self.draws = 0
        self.saved: Optional[List[Any]] = None
        self.captured: List[Any] = []  # the items restore() took back, in the saved order
        self._next: Any = _END  # the first item restore() pulled that was nobody's

    def hold(self, i: Any) -> None:
        """The item with id ``i`` (an id or a bundle) is kept, after those already held."""
        self.ids.append(i)
        if self._ops is not None:
            self._ops.append((self.position, _HOLD, i))

    def take(self, k: int, draws: int = 1) -> Any:
        """The item at place ``k`` leaves, as ``list.pop(k)`` takes it out: the items after it
        move up one place, in their order. ``draws``: the random draws that chose it (added to
        :attr:`draws`; 1 where nothing random chose it does no harm). Its id becomes the
        ledger's current one and is returned.

        A stage keeps its items in a list in step with this slot: ``slot.take(k)`` with
        ``held.pop(k)``."""
        i = self.ids.pop(k)
        return self._took(i, _PICK, k, draws)

    def take_swapped(self, k: int, draws: int = 1) -> Any:
        """The item at place ``k`` leaves and the last one takes its place (O(1); a list does
        the same with ``held[k], held[-1] = held[-1], held[k]; held.pop()``); otherwise as
        :meth:`take`. ``shuffle`` takes its items so."""
        ids = self.ids
        ids[k], ids[-1] = ids[-1], ids[k]
        return self._took(ids.pop(), _TAKE, k, draws)

    def _took(self, i: Any, op: int, k: int, draws: int) -> Any:
        self.draws += draws
        self.ledger.current = i
        if self._ops is not None:
            self._ops.append((self.position, op, k if draws == 1 else (k, draws)))
        return i

    def take_first(self) -> Any:
        """The oldest item leaves; its id becomes the ledger's current one and is returned."""
        i = self.ids.pop(0)
        self.ledger.current = i
        if self._ops is not None:
            self._ops.append((self.position, _FIRST, None))
        return i

    def forget_saved(self) -> None:
        """For a stage that gets what it held back as ordinary input (``unbatched``): the
        saved ids are not held any more."""
        if self.ids:
            self._set([])

    def _set(self, ids: List[Any]) -> None:
        self.ids[:] = ids
        if self._ops is not None:
            self._ops.append((self.position, _SET, list(ids)))

    def _replay(self, op: int, arg: Any) -> None:
        """Do an operation a worker's slot logged (on the main process's copy)."""
        ids = self.ids
        if op == _HOLD:
            ids.append(arg)
        elif op == _TAKE or op == _PICK:
            k, draws = arg if type(arg) is tuple else (arg, 1)
            if op == _TAKE:
                ids[k], ids[-1] = ids[-1], ids[k]
                k = -1
            ids.pop(k)
            self.draws += draws
        elif op == _FIRST:
            ids.pop(0)
        else:
            ids[:] = arg

    def restore(self, it: Iterator[Any]) -> Iterator[Any]:
        """When resuming: take this stage's saved items back from ``it`` into :attr:`captured`
        (in the saved order; :attr:`ids` then matches), and yield, as they come, the items
        that stages after this one held (each with its id current), which they take back.
        The first item that is neither (read after the checkpoint) is kept for :meth:`rest`.

        The items come back in the order the source reads them again (see
        :meth:`Ledger.restore_order`): those of later stages first, then this stage's."""
        ledger = self.ledger
        self.captured = []
        if not ledger.resuming:
            return
        plan = ledger.restore_plan()
        saved = self.saved or []
        own = plan.capture.get(self.position, {})
        items: List[Any] = [_END] * len(saved)
        missing = len(saved)
        later = plan.leaves_after(self.position)
        while missing or later > 0:
            item = next(it, _END)
            if item is _END:
                break
            i = ledger.current
            places = own.get(_key(i))
            n = next((n for n in places if items[n] is _END), None) if places else None
            if n is not None:
                items[n] = item
                missing -= 1
                continue
            owner = plan.owner(i)
            if owner > self.position:
                later -= sum(1 for _ in ids_of(i))
                yield item
                ledger.current = i  # (the stages after may have changed it)
                continue
            self._next = (item, i)
            break
        if missing:
            kept = [i for i, item in zip(saved, items) if item is not _END]
            self._set(kept)
            if ledger.unordered is None:
                ledger.unordered = (
                    f"{missing} item(s) the stage at position {self.position} held at the "
                    "checkpoint did not come back to it (a stage before it dropped or changed "
                    "them when read again): the rest of the epoch comes in another order"
                )
                log.warning("webds: resuming: %s", ledger.unordered)
        else:
            self.ids[:] = saved
        self.captured = [item for item in items if item is not _END]

    def rest(self, it: Iterator[Any]) -> Iterator[Any]:
        """``it`` after :meth:`restore`: the item it pulled too far first, with its id."""
        pending, self._next = self._next, _END
        if pending is _END:
            return iter(it)
        return pulled_back(pending[0], pending[1], it, self.ledger)


def pulled_back(item: Any, i: Any, rest: Iterator[Any], ledger: Any) -> Iterator[Any]:
    """``item``, pulled from ``rest`` too far, given back first (its id ``i`` current again),
    then ``rest``."""
    ledger.current = i
    yield item
    yield from rest


class RestorePlan:
    """Who held which item at the checkpoint: each slot's saved ids, by stage position."""

    def __init__(
        self, slots: Dict[int, List[Any]], holes: Iterable[int], after: Sequence[Any] = ()
    ) -> None:
        # Each slot's places by item (a list: a padded epoch may hold one item twice).
        self.capture: Dict[int, Dict[Any, List[int]]] = {}
        for pos, ids in slots.items():
            places = self.capture[pos] = {}
            for n, i in enumerate(ids):
                places.setdefault(_key(i), []).append(n)
        self._order: Dict[int, Tuple[float, int, int]] = {}
        counts: Dict[int, int] = {}
        for pos, ids in slots.items():
            for n, i in enumerate(ids):
                for sub, leaf in enumerate(ids_of(i)):
                    self._order.setdefault(leaf, (pos, n, sub))
                    counts[pos] = counts.get(pos, 0) + 1
        # Held where no slot says (after a DataLoader, in the main process): after every stage,
        # each item as ``after`` says it was made (its ids), else each sample on its own.
        beyond = [i for i in holes if i not in self._order]
        for n, item in enumerate(after):
            for sub, leaf in enumerate(ids_of(item)):
                self._order.setdefault(leaf, (BEYOND, n, sub))
        alone = sorted(i for i in beyond if i not in self._order)
        for n, i in enumerate(alone, len(after)):
            self._order[i] = (BEYOND, n, 0)
        if beyond:
            counts[BEYOND] = len(beyond)
        #: How many of them were held after every stage (by a WebLoader's main process).
        self.beyond = len(beyond)
        self._counts = sorted(counts.items())
        #: Every sample held at the checkpoint: what the source reads again.
        self.holes = frozenset(self._order)

    def owner(self, ids: Any) -> float:
        """The position of the stage that held the item with these ids (-1: none)."""
        where = self.where(ids)
        return where[0] if where is not None else -1

    def where(self, ids: Any) -> Optional[Tuple[float, int, int]]:
        """(position of the stage that held it, its place there, its place in that item) for
        the item with these ids (its first sample's), or None if no stage held it."""
        for leaf in ids_of(ids):
            return self._order.get(leaf)
        return None

    def leaves_after(self, position: int) -> int:
        """How many held samples the stages after ``position`` (and beyond) take back."""
        return sum(n for pos, n in self._counts if pos > position)

    def sort_key(self, i: int) -> Tuple[float, int, int]:
        """Where a sample read again comes: the later stage's first, each stage's in its order."""
        pos, n, sub = self._order.get(i, (-1, 0, 0))
        return (-pos, n, sub)


class StageLedger:
    """The pipeline's :class:`Ledger` as the stage at ``position`` sees it: its own
    :meth:`slot`, everything else shared (``ledger.current`` is the pipeline's). ``runs``: the
    stages after it take runs of samples (:mod:`webds.base.runs`), so it may yield them."""

    __slots__ = ("ledger", "position", "runs")

    def __init__(self, ledger: Ledger, position: int, runs: bool = False) -> None:
        self.ledger = ledger
        self.position = position
        self.runs = runs

    @property
    def current(self) -> Any:
        return self.ledger.current

    @current.setter
    def current(self, value: Any) -> None:
        self.ledger.current = value

    @property
    def problem(self) -> Optional[str]:
        return self.ledger.problem

    @problem.setter
    def problem(self, value: Optional[str]) -> None:
        self.ledger.problem = value

    def slot(self) -> Slot:
        """This stage's slot: where it records the items it holds."""
        return self.ledger.slot(self.position)

    def __getattr__(self, name: str) -> Any:
        if name in StageLedger.__slots__:  # not set yet (while unpickling)
            raise AttributeError(name)
        return getattr(self.ledger, name)
