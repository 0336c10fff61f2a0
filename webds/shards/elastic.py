"""Elastic resume: finish an epoch on another number of ranks or DataLoader workers.

A checkpoint holds every rank's state (``state_dict(all_ranks=True)``); each records, per
DataLoader worker, which samples of that worker's plan were read and which were still held (see
:mod:`webds.base.ledger`). With the index, each worker's plan can be computed again
(:func:`~webds.shards.plan.plan_worker`), so its records say exactly which samples of the epoch
were consumed, by sample number in each shard, whatever the topology that consumed them.

The samples nobody consumed, in the epoch's order, are the *rest*: runs ``(shard, start, stop)``
of consecutive samples. The resumed epoch shares the rest out among the new ranks and workers
by the usual rules (:func:`~webds.shards.plan.plan_rest`: equal runs per rank, ``pad``/``drop``
for the remainder, batch-aligned runs per worker), so every sample left is read once and every
new rank reads as many. The epochs after it are planned for the new topology as usual.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Sequence, Tuple

import numpy as np

from ..base.ledger import LEAF, shard_of
from ..base.saved import LedgerState, PipelineState
from ..errors import ResumeError
from .plan import Segment, epoch_order, plan_worker

__all__ = [
    "consumed_spans",
    "consumed_samples",
    "rest_runs",
    "topology_changed",
    "every_rank",
    "plan_elsewhere",
]

Run = Tuple[int, int, int]  # shard, first sample, end (exclusive)


def consumed_samples(
    counts: Sequence[int],
    urls: Sequence[str],
    states: Sequence[PipelineState],
    *,
    seed: Any,
    epoch: int,
    balance: str,
    granule: int,
) -> List[np.ndarray]:
    """Per shard, which samples the ranks whose ``states`` these are consumed in ``epoch``."""
    done = [np.zeros(n, dtype=bool) for n in counts]
    for state in states:
        world, rank, workers = state.world_size, state.rank, state.num_workers()
        for worker, stream in state.streams():
            if (stream.epoch if stream.pass_ is None else stream.pass_) != epoch:
                raise ResumeError(
                    f"rank {rank}'s worker {worker} was in another pass ({stream.pass_}) "
                    f"than epoch {epoch}: a with_epoch stream cannot be resumed on another "
                    "topology; resume it with the same world size and workers"
                )
            segments = plan_worker(
                counts,
                urls,
                seed=seed,
                epoch=epoch,
                world_size=world,
                rank=rank,
                num_workers=workers,
                worker=worker,
                balance=balance,
                granule=granule,
            ).segments
            if stream.ledger is not None:
                _mark(done, segments, stream.ledger)
    return done


def consumed_spans(
    segments: Sequence[Segment], saved: LedgerState
) -> Iterator[Tuple[Segment, int, List[int]]]:
    """What a saved ledger state says a worker consumed of its plan's ``segments``: for each
    segment it began, (the segment, the end of what was read, the sample numbers in that read
    part which were held at the checkpoint, to be read again)."""
    complete, partial, holes = saved.reads()
    held: Dict[int, List[int]] = {}
    for i in holes:
        held.setdefault(shard_of(i), []).append(i & LEAF)
    for k, seg in enumerate(segments):
        if k in complete:
            stop = seg.stop
        elif k in partial:
            stop = min(partial[k] + 1, seg.stop)
        else:
            continue
        yield seg, stop, [j for j in held.get(k, ()) if seg.start <= j < stop]


def _mark(done: List[np.ndarray], segments: Sequence[Segment], ledger: LedgerState) -> None:
    """Mark what one saved ledger says was consumed of its worker's ``segments``."""
    for seg, stop, held in consumed_spans(segments, ledger):
        done[seg.shard][seg.start : stop] = True
        done[seg.shard][held] = False  # held at the checkpoint: to be read again


def rest_runs(
    counts: Sequence[int], done: Sequence[np.ndarray], *, seed: Any, epoch: int
) -> List[Run]:
    """The samples not consumed, in the epoch's order, as runs ``[shard, start, stop]``."""
    runs: List[Run] = []
    for shard in epoch_order(len(counts), seed, epoch):
        left = ~done[shard]
        if not left.any():
            continue
        # Starts and ends of the runs of True in ``left``.
        edges = np.flatnonzero(np.diff(np.concatenate(([0], left.view(np.int8), [0]))))
        runs.extend((shard, int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))
    return runs


def topology_changed(state: Any, world_size: int, num_workers: int) -> bool:
    """Whether ``state`` (one rank's, or every rank's list) was saved by another number of
    ranks or of DataLoader workers than ``world_size`` x ``num_workers``."""
    first = state[0] if isinstance(state, list) else state
    return first.world_size != world_size or first.num_workers() != max(1, num_workers)


def every_rank(state: Any) -> List[PipelineState]:
    """The states of every rank of the job that saved ``state`` (one, or a list), in rank
    order, or an error saying why a resume on another topology needs them."""
    states = list(state) if isinstance(state, list) else [state]
    world = states[0].world_size
    ranks = sorted(s.rank for s in states)
    if not world or ranks != list(range(world)):
        raise ResumeError(
            f"resuming on another number of ranks or DataLoader workers needs the state of every "
            f"rank of the job that saved it ({world or '?'} ranks; got ranks {ranks}): each rank "
            "read other samples. Save state_dict(all_ranks=True) (on every rank) and load that "
            "list; see docs/distributed.md"
        )
    epochs = {s.epoch for s in states}
    if len(epochs) != 1:
        raise ResumeError(f"the ranks' states are in different epochs ({sorted(epochs)})")
    return sorted(states, key=lambda s: s.rank)


def plan_elsewhere(plan: Any, state: Any, granule: int) -> int:
    """Make ``plan`` (a :class:`~webds.shards.plan.PlannedShards`) share out the rest of the epoch
    that every rank's ``state`` was saved in; return that epoch."""
    states = every_rank(state)
    epoch = states[0].epoch
    seed = plan.seed if plan.shuffle else None
    done = consumed_samples(
        plan.counts,
        plan.urls,
        states,
        seed=seed,
        epoch=epoch,
        balance=plan.balance,
        granule=granule,
    )
    runs = rest_runs(plan.counts, done, seed=seed, epoch=epoch)
    plan.elastic = {"epoch": epoch, "runs": [list(r) for r in runs]}
    plan.set_epoch(epoch)
    return epoch
