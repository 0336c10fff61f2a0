"""Mixing several sources into one stream: in turn (:class:`RoundRobin`) or at random
(:class:`RandomMix`).

    RoundRobin([[1, 2, 3], [10]])                          # 1, 10, 2 (stops at the shortest)
    RandomMix([ds_a, ds_b], probs=[0.8, 0.2], seed=0)      # about 80% from ds_a

Unlike webdataset's, :class:`RandomMix` never uses the global ``random``: its choices depend on
(seed, epoch, rank, DataLoader worker), so each worker mixes differently and a seeded run repeats
exactly; without a seed it draws fresh entropy every epoch.
"""

from __future__ import annotations

import itertools
import os
import random
import secrets
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

from torch.utils.data import IterableDataset

from ..base.workers import derive_seed, worker_info
from ..errors import ArgumentError

__all__ = [
    "RoundRobin",
    "RandomMix",
    "round_robin_shortest",
    "round_robin_longest",
    "random_samples",
]

_END = object()


def _round_robin(sources: Sequence[Iterable[Any]], longest: bool) -> Iterator[Any]:
    its: List[Iterator[Any]] = [iter(s) for s in sources]
    while its:
        i = 0
        while i < len(its):
            item = next(its[i], _END)
            if item is _END:
                if not longest:
                    return
                del its[i]
                continue
            yield item
            i += 1


def round_robin_shortest(*sources: Iterable[Any]) -> Iterator[Any]:
    """One item from each source in turn, until any source runs out.

    ``list(round_robin_shortest([1, 2, 3], [10])) == [1, 10, 2]``.
    """
    return _round_robin(sources, longest=False)


def round_robin_longest(*sources: Iterable[Any]) -> Iterator[Any]:
    """One item from each source in turn; exhausted sources drop out until all are done.

    ``list(round_robin_longest([1, 2, 3], [10])) == [1, 10, 2, 3]``.
    """
    return _round_robin(sources, longest=True)


def _normalised(probs: Optional[Sequence[float]], n: int) -> List[float]:
    if n == 0:
        raise ArgumentError("RandomMix needs at least one source")
    if probs is None:
        return [1.0 / n] * n
    ps = [float(p) for p in probs]
    if len(ps) != n:
        raise ArgumentError(f"RandomMix got {len(ps)} probabilities for {n} sources")
    if any(not p >= 0 for p in ps) or sum(ps) <= 0:
        raise ArgumentError(f"RandomMix probabilities must be >= 0 and not all 0, got {ps}")
    total = sum(ps)
    return [p / total for p in ps]


def _mix_rng(seed: Optional[int], epoch: int) -> random.Random:
    if seed is None:
        return random.Random(os.urandom(16))
    where = worker_info()
    return random.Random(derive_seed("randommix", seed, epoch, where.rank, where.worker))


def random_samples(
    sources: Sequence[Iterable[Any]],
    probs: Optional[Sequence[float]] = None,
    longest: bool = False,
    seed: Optional[int] = None,
    *,
    epoch: int = 0,
) -> Iterator[Any]:
    """Yield items from ``sources``, each time from one picked with probability ``probs[i]``.

    ``probs`` are normalised (default: uniform). It stops when the picked source runs out, or with
    ``longest=True`` drops that source and goes on with the rest (probabilities renormalised).
    With ``seed`` the picks depend only on (seed, epoch, rank, worker); without one they are fresh.
    """
    ps = _normalised(probs, len(sources))
    return _mix([iter(s) for s in sources], ps, longest, _mix_rng(seed, epoch))


def _mix(its: List[Iterator[Any]], weights: List[float], longest: bool, rng: Any) -> Iterator[Any]:
    while its:
        if sum(weights) <= 0:
            # Only zero-probability sources are left: they were never meant to be drawn.
            return
        i = rng.choices(range(len(its)), weights=weights)[0]
        item = next(its[i], _END)
        if item is _END:
            if not longest:
                return
            del its[i], weights[i]
            continue
        yield item


class _Mixer(IterableDataset):
    """What both mixers share: their sources, the epoch (forwarded to the sources), and
    ``state_dict`` / ``load_state_dict`` (the epoch and the items yielded in it).
    A mixer defines ``_items(skip)``, its items for this epoch after the first ``skip``."""

    def __init__(self, datasets: Sequence[Iterable[Any]]) -> None:
        super().__init__()
        self.datasets = list(datasets)
        self.epoch = 0
        self._skip = 0
        self._position = [0, 0]

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (it changes a random mix's picks) here and on every source that has
        ``set_epoch``."""
        self.epoch = int(epoch)
        for d in self.datasets:
            if hasattr(d, "set_epoch"):
                d.set_epoch(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        return self._run(self._items)

    def _items(self, skip: int) -> Iterator[Any]:
        raise NotImplementedError

    def skip(self, n: int) -> None:
        """Make the next iteration start ``n`` items in."""
        self._skip = int(n)

    def state_dict(self) -> Dict[str, Any]:
        """Where the mix stands: the epoch in progress and how many items it has yielded."""
        epoch, consumed = self._position
        return {"version": 1, "epoch": epoch, "consumed": consumed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Make the next iteration continue where :meth:`state_dict` was taken."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ArgumentError(f"not a webds mixer state (from state_dict()): {state!r}")
        self.set_epoch(int(state["epoch"]))
        self._skip = int(state["consumed"])
        self._position = [self.epoch, self._skip]

    def _run(self, make: Callable[[int], Iterator[Any]]) -> Iterator[Any]:
        """Run ``make(skip)`` for this epoch, counting items; the epoch advances at the end."""
        skip, self._skip = self._skip, 0
        position = self._position = [self.epoch, skip]
        for item in make(skip):
            position[1] += 1
            yield item
        if position is self._position:
            # The sources advance their own epochs; the mix's picks change with its own.
            self.epoch += 1
            self._position = [self.epoch, 0]


class RoundRobin(_Mixer):
    """Alternate between ``datasets``, one item each; stop at the first that runs out, or with
    ``longest=True`` go on with the others until all are done."""

    def __init__(self, datasets: Sequence[Iterable[Any]], longest: bool = False) -> None:
        super().__init__(datasets)
        if not self.datasets:
            raise ArgumentError("RoundRobin needs at least one dataset")
        self.longest = bool(longest)

    def _items(self, skip: int) -> Iterator[Any]:
        # Which items each source yields, and when one runs dry, is only known by reading: the
        # items already yielded are read again and dropped, which is exact whatever the sources'
        # stages drop or reorder, as long as each source repeats its epoch.
        return itertools.islice(_round_robin(self.datasets, self.longest), skip, None)

    def __repr__(self) -> str:
        return f"RoundRobin({len(self.datasets)} datasets, longest={self.longest})"


class RandomMix(_Mixer):
    """Mix ``datasets`` at random, picking each item's source with probability ``probs[i]``.

    ``RandomMix([a, b], probs=[3, 1], seed=0)`` takes about 75% of its items from ``a``. The
    picks depend on (seed, epoch, rank, DataLoader worker): every worker mixes differently, and a
    seeded run is reproducible; ``seed=None`` uses fresh entropy. See :func:`random_samples`.
    """

    def __init__(
        self,
        datasets: Sequence[Iterable[Any]],
        probs: Optional[Sequence[float]] = None,
        longest: bool = False,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__(datasets)
        self.probs = _normalised(probs, len(self.datasets))
        self.longest = bool(longest)
        if seed is not None and not isinstance(seed, int):
            raise ArgumentError(f"RandomMix seed must be an int or None, got {seed!r}")
        self.seed = seed
        # Without a seed, one drawn now: fresh for every mix, yet kept in state_dict() so that
        # a resumed epoch makes the same picks.
        self._entropy = secrets.randbits(63)

    def effective_seed(self) -> int:
        """The seed the picks follow: ``seed``, or the one drawn for this mix."""
        return self.seed if self.seed is not None else self._entropy

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["seed"] = self.effective_seed()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.seed is None and "seed" in state:
            self._entropy = int(state["seed"])

    def _items(self, skip: int) -> Iterator[Any]:
        # The picks are replayed (same seed, epoch, rank and worker) and the items already
        # yielded read again and dropped: exact whatever the sources' own stages do.
        rng = _mix_rng(self.effective_seed(), self.epoch)
        its = [iter(s) for s in self.datasets]
        return itertools.islice(_mix(its, list(self.probs), self.longest, rng), skip, None)

    def __repr__(self) -> str:
        return f"RandomMix({len(self.datasets)} datasets, probs={self.probs}, seed={self.seed})"
