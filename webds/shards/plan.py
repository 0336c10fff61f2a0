"""Epoch plans: which samples each rank and DataLoader worker reads, so that every rank yields
exactly the same number of samples, and of batches, in every epoch.

Given every shard's sample count (a :class:`~webds.shards.index.ShardIndex`), an epoch's global
order is the shard list, shuffled by (seed, epoch) when asked, laid end to end: ``N`` positions.
The plan depends only on (counts, seed, epoch, W, r, K, k, balance, granule), so every process
computes its own and they fit together, with no communication:

- rank ``r`` of ``W`` takes positions ``[r*M, (r+1)*M)``: ``balance="pad"`` makes
  ``M = ceil(N/W)``, positions past ``N`` wrapping round to the start (up to ``W-1`` samples
  read twice); ``balance="drop"`` makes ``M = floor(N/W)`` and leaves the last ``N - W*M`` out;
- a rank's positions are cut into chunks of ``granule`` samples (the batch size, so every batch
  but the rank's last is full), and the chunks into ``K`` near-equal contiguous runs, one per
  worker: a rank yields ``ceil(M/granule)`` batches whatever ``K``;
- each run maps back to segments ``{"url", "start", "stop"}`` of shards. A worker enters a shard
  at ``start`` with the index's sample offsets (:mod:`webds.tar.windows`), or else reads and
  skips the samples before it (a warning says how much when there are fewer shards than ranks
  times workers).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import random
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ..base.workers import derive_seed, worker_info
from ..errors import ArgumentError

__all__ = [
    "BALANCE_MODES",
    "Segment",
    "rank_size",
    "worker_spans",
    "epoch_order",
    "plan_worker",
    "plan_rest",
]

log = logging.getLogger("webds")

#: The values of ``WebDataset(balance=...)``.
BALANCE_MODES = ("pad", "drop")


class Segment(NamedTuple):
    """Samples ``start`` to ``stop`` (exclusive) of shard number ``shard`` (``url``)."""

    shard: int
    url: str
    start: int
    stop: int

    def descriptor(self, samples: int, offsets: Optional[Sequence[int]] = None) -> Dict[str, Any]:
        """The shard descriptor the tar stage reads; ``samples`` is the shard's indexed count,
        ``offsets`` where each of its samples starts (the index's, if it has them)."""
        out = {"url": self.url, "start": self.start, "stop": self.stop, "samples": samples}
        if offsets is not None:
            out["offsets"] = offsets
        return out


def check_balance(balance: Optional[str]) -> Optional[str]:
    """Return ``balance`` if it is None or one of :data:`BALANCE_MODES`, else raise."""
    if balance is not None and balance not in BALANCE_MODES:
        raise ArgumentError(
            f"balance must be 'pad' (repeat samples so every rank gets as many) or 'drop' "
            f"(leave out the excess), got {balance!r}"
        )
    return balance


def rank_size(total: int, world_size: int, balance: str) -> int:
    """The number of samples each rank reads per epoch: ``ceil`` (pad) or ``floor`` (drop)."""
    check_balance(balance)
    if balance == "pad":
        return -(-total // world_size)
    return total // world_size


def worker_spans(size: int, num_workers: int, granule: int = 1) -> List[Tuple[int, int]]:
    """Cut ``range(size)`` into ``num_workers`` contiguous runs made of whole ``granule`` chunks.

    ``worker_spans(10, 3, 4) == [(0, 4), (4, 8), (8, 10)]``: three chunks of (up to) 4, one each.
    """
    if num_workers < 1 or granule < 1:
        raise ArgumentError(f"need num_workers >= 1 and granule >= 1, got {num_workers}, {granule}")
    chunks = -(-size // granule)
    per, extra = divmod(chunks, num_workers)
    spans = []
    first = 0
    for k in range(num_workers):
        n = per + (1 if k < extra else 0)
        start = min(first * granule, size)
        spans.append((start, min((first + n) * granule, size)))
        first += n
    return spans


def epoch_order(count: int, seed: Optional[int], epoch: int) -> List[int]:
    """Shard numbers in this epoch's order: as listed, or shuffled by (seed, epoch).

    The same rule as :class:`~webds.shards.datasets.SimpleShardList`, so an index does not change
    the shard order of a dataset.
    """
    order = list(range(count))
    if seed is not None:
        random.Random(derive_seed("shards", seed, epoch)).shuffle(order)
    return order


def _segments(
    counts: Sequence[int], urls: Sequence[str], order: Sequence[int], start: int, stop: int
) -> Iterator[Segment]:
    """Map global positions ``[start, stop)`` of the epoch order to shard segments.

    Positions at or past the total wrap round (modulo the total), which is how padding repeats
    samples from the start of the epoch's order.
    """
    total = sum(counts)
    if total == 0 or start >= stop:
        return
    ordered = [counts[i] for i in order]
    ends = list(itertools.accumulate(ordered))
    pos = start
    while pos < stop:
        k, first = _locate(ends, ordered, pos % total)
        i = order[k]
        n = min(counts[i] - first, stop - pos)
        yield Segment(i, urls[i], first, first + n)
        pos += n


def _locate(ends: Sequence[int], counts: Sequence[int], p: int) -> Tuple[int, int]:
    """(k, sample number in shard k) of position ``p``, given the shards' cumulative ``ends``.

    The first shard ending after ``p`` holds it; empty shards never do.
    """
    k = bisect.bisect_right(ends, p)
    return k, p - (ends[k] - counts[k])


class WorkerPlan(NamedTuple):
    """What one worker of one rank reads in one epoch."""

    segments: List[Segment]
    samples: int  # this worker's samples
    rank_samples: int  # all of this rank's samples (every rank has the same number)
    skipped_reads: int  # samples read only to reach a segment's start


def plan_worker(
    counts: Sequence[int],
    urls: Sequence[str],
    *,
    seed: Optional[int],
    epoch: int,
    world_size: int,
    rank: int,
    num_workers: int,
    worker: int,
    balance: str,
    granule: int = 1,
    skip: int = 0,
) -> WorkerPlan:
    """The segments worker ``worker`` of rank ``rank`` reads in ``epoch`` (see the module doc).

    ``seed`` None keeps the listed shard order; ``skip`` drops that many of the worker's first
    samples (to resume mid-epoch).
    """
    if len(counts) != len(urls):
        raise ArgumentError(f"{len(counts)} sample counts for {len(urls)} shards")
    if not 0 <= rank < world_size:
        raise ArgumentError(f"rank {rank} is not in range for world_size {world_size}")
    if not 0 <= worker < num_workers:
        raise ArgumentError(f"worker {worker} is not in range for num_workers {num_workers}")
    total = sum(counts)
    size = rank_size(total, world_size, balance)
    lo, hi = worker_spans(size, num_workers, granule)[worker]
    lo = min(lo + max(0, skip), hi)
    order = epoch_order(len(counts), seed, epoch)
    base = rank * size
    segments = list(_segments(counts, urls, order, base + lo, base + hi))
    return WorkerPlan(segments, hi - lo, size, sum(s.start for s in segments))


def split_warning(
    counts: Sequence[int],
    world_size: int,
    num_workers: int,
    balance: str,
    granule: int,
    seeks: Sequence[bool] = (),
) -> Optional[str]:
    """A sentence saying why this split is poor, or None if it is fine.

    Poor means: workers that get nothing (fewer batches than workers), or more than a quarter
    of the data read twice because reads start inside shards that have no sample offsets
    (``seeks[i]``: shard ``i`` has them, so a read enters it where it starts).
    """
    total = sum(counts)
    if total == 0:
        return None
    size = rank_size(total, world_size, balance)
    spans = worker_spans(size, num_workers, granule)
    idle = sum(1 for a, b in spans if a == b)
    if idle and size > 0:
        return (
            f"{idle} of {num_workers} DataLoader workers per rank get no samples: each rank has "
            f"{size} samples, {-(-size // granule)} batches of {granule}; use fewer workers"
        )
    # A run that starts inside a shard without offsets reads the samples before its start in
    # vain.
    ends = list(itertools.accumulate(counts))
    cuts = [
        _locate(ends, counts, (r * size + a) % total)
        for r in range(world_size)
        for a, b in spans
        if a < b
    ]
    wasted = sum(j for k, j in cuts if not (k < len(seeks) and seeks[k]))
    if wasted > total // 4:
        readers = world_size * num_workers
        return (
            f"the {readers} readers ({world_size} ranks x {num_workers} workers) start inside "
            f"shards, and reading up to their starting points reads about "
            f"{100 * wasted // total}% of the data twice: the index has no sample offsets for "
            "them, so they can't seek. Rebuild the index with `webds index` (it records the "
            "offsets of uncompressed shards), or write smaller shards, many more than "
            f"{readers}"
        )
    return None


def plan_rest(
    runs: Sequence[Sequence[int]],
    urls: Sequence[str],
    *,
    world_size: int,
    rank: int,
    num_workers: int,
    worker: int,
    balance: str,
    granule: int,
) -> WorkerPlan:
    """What worker ``worker`` of rank ``rank`` reads of ``runs`` ``[shard, start, stop]``, the
    samples an epoch resumed on another topology has left (see :mod:`webds.shards.elastic`):
    shared out like a whole epoch's, run after run instead of shard after shard."""
    lengths = [int(b) - int(a) for _, a, b in runs]
    total = sum(lengths)
    size = rank_size(total, world_size, balance)
    lo, hi = worker_spans(size, num_workers, granule)[worker]
    base = rank * size
    pieces = _segments(
        lengths, [urls[int(s)] for s, _, _ in runs], range(len(runs)), base + lo, base + hi
    )
    segments = [
        Segment(
            int(runs[p.shard][0]),
            p.url,
            int(runs[p.shard][1]) + p.start,
            int(runs[p.shard][1]) + p.stop,
        )
        for p in pieces
    ]
    return WorkerPlan(segments, hi - lo, size, sum(s.start for s in segments))


class PlannedShards:
    """A shard source that reads an epoch plan: this rank's and this worker's shard segments.

    Made by ``WebDataset(index, balance=...)``; it yields ``{"url", "start", "stop",
    "samples"}`` descriptors, which :func:`~webds.tar.samples.tarfile_to_samples` reads as sample
    ranges. ``granule`` is the batch size the plan aligns workers to (set by the pipeline).
    """

    def __init__(
        self,
        urls: Sequence[str],
        counts: Sequence[int],
        *,
        balance: str,
        seed: Optional[int] = None,
        shuffle: bool = False,
        offsets: Optional[Sequence[Optional[Sequence[int]]]] = None,
    ) -> None:
        self.urls = list(urls)
        self.counts = [int(c) for c in counts]
        if len(self.urls) != len(self.counts):
            raise ArgumentError(f"{len(self.counts)} sample counts for {len(self.urls)} shards")
        #: Each shard's sample offsets (None for a shard without): a read that starts inside a
        #: shard seeks to its first sample (see webds.tar.windows).
        self.offsets = list(offsets) if offsets is not None else [None] * len(self.urls)
        if len(self.offsets) != len(self.urls):
            raise ArgumentError(f"{len(self.offsets)} offset arrays for {len(self.urls)} shards")
        self.balance = check_balance(balance) or "pad"
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.granule = 1
        #: An epoch resumed on another topology: ``{"epoch": e, "runs": [[shard, start, stop]]}``,
        #: the samples nobody consumed, which that epoch's plan shares out instead of the index's.
        self.elastic: Optional[Dict[str, Any]] = None
        self._warned = False
        self._where: Optional[Tuple[int, int]] = None

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose plan the next iteration reads."""
        self.epoch = int(epoch)

    def where(self) -> Tuple[int, int, int, int]:
        """(rank, world_size, worker, num_workers) of this process."""
        info = worker_info()
        rank, world = info.rank, info.world_size
        if world == 1 and self._where is not None:
            # A DataLoader worker started by "spawn" has no torch.distributed of its own: use
            # the rank its parent had when it pickled this object.
            rank, world = self._where
        return rank, world, info.worker, info.num_workers

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        info = worker_info()
        if info.world_size > 1:
            state["_where"] = (info.rank, info.world_size)
        return state

    def _rest(self, epoch: int) -> Optional[List[Any]]:
        """The runs an elastic resume left for ``epoch``, if it is the resumed one."""
        elastic = self.elastic
        return elastic["runs"] if elastic is not None and elastic["epoch"] == epoch else None

    def plan(self, epoch: Optional[int] = None, skip: int = 0) -> WorkerPlan:
        """This process's plan for ``epoch`` (default: the current one)."""
        rank, world, worker, workers = self.where()
        epoch = self.epoch if epoch is None else epoch
        rest = self._rest(epoch)
        where = dict(
            world_size=world,
            rank=rank,
            num_workers=workers,
            worker=worker,
            balance=self.balance,
            granule=self.granule,
        )
        if rest is not None:
            return plan_rest(rest, self.urls, **where)
        seed = self.seed if self.shuffle else None
        return plan_worker(self.counts, self.urls, seed=seed, epoch=epoch, skip=skip, **where)

    #: The pipeline must yield exactly the planned count (see DataPipeline._exact_count).
    exact = True

    def stream_lengths(self, num_workers: Optional[int] = None) -> List[int]:
        """Samples per DataLoader worker of this rank (``num_workers`` default: this process's)."""
        rank, world, _, workers = self.where()
        rest = self._rest(self.epoch)
        total = sum(b - a for _, a, b in rest) if rest is not None else sum(self.counts)
        size = rank_size(total, world, self.balance)
        return [b - a for a, b in worker_spans(size, num_workers or workers, self.granule)]

    def warn_split(self, num_workers: int) -> None:
        """Log, once per dataset object and on rank 0, if the split is poor (see split_warning).

        A WebLoader calls this before its workers start, so they inherit the "said it" flag.
        """
        rank, world, _, _ = self.where()
        if self._warned or rank != 0:
            return
        self._warned = True
        seeks = [o is not None for o in self.offsets]
        problem = split_warning(self.counts, world, num_workers, self.balance, self.granule, seeks)
        if problem:
            log.warning("webds: %s", problem)

    def stream_index(self) -> int:
        """This process's DataLoader worker number."""
        return self.where()[2]

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        rank, world, worker, workers = self.where()
        if worker == 0:
            self.warn_split(workers)
        plan = self.plan()
        for seg in plan.segments:
            yield seg.descriptor(self.counts[seg.shard], self.offsets[seg.shard])

    def __len__(self) -> int:
        return len(self.urls)

    def __repr__(self) -> str:
        return (
            f"PlannedShards({len(self.urls)} shards, {sum(self.counts)} samples, "
            f"balance={self.balance!r}, seed={self.seed!r}, shuffle={self.shuffle})"
        )
