"""Elastic resume: finish an epoch on another number of ranks or DataLoader workers.

A checkpoint holds every rank's state (``state_dict(all_ranks=True)``); each records, per
DataLoader worker, which samples of that worker's plan were read and which were still held (see
:mod:`webds.stages.ledger`). With the index, each worker's plan can be computed again
(:func:`~webds.shards.plan.plan_worker`), so its records say exactly which samples of the epoch
were consumed, by sample number in each shard, whatever the topology that consumed them.

The samples nobody consumed, in the epoch's order, are the *rest*: runs ``(shard, start, stop)``
of consecutive samples. The resumed epoch shares the rest out among the new ranks and workers
by the usual rules (:func:`~webds.shards.plan.plan_rest`: equal runs per rank, ``pad``/``drop``
for the remainder, batch-aligned runs per worker), so every sample left is read once and every
new rank reads as many. The epochs after it are planned for the new topology as usual.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Sequence, Tuple

import numpy as np

from ..errors import ResumeError
from ..stages.ledger import LEAF, saved_reads, shard_of
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


def _streams(state: Dict[str, Any]) -> Iterable[Tuple[int, Dict[str, Any]]]:
    """(worker, saved stream) of one rank's state: a WebLoader's workers, or a dataset's own."""
    workers = state.get("workers")
    if workers is not None:
        for w, stream in workers.items():
            yield int(w), stream
    elif state.get("ledger") is not None:
        yield 0, state


def consumed_samples(
    counts: Sequence[int],
    urls: Sequence[str],
    states: Sequence[Dict[str, Any]],
    *,
    seed: Any,
    epoch: int,
    balance: str,
    granule: int,
) -> List[np.ndarray]:
    """Per shard, which samples the ranks whose ``states`` these are consumed in ``epoch``."""
    done = [np.zeros(n, dtype=bool) for n in counts]
    for state in states:
        world, rank = int(state.get("world_size", 1)), int(state.get("rank", 0))
        workers = int((state.get("config") or {}).get("num_workers") or 0) or 1
        for worker, stream in _streams(state):
            if int(stream.get("stream", stream.get("epoch", epoch))) != epoch:
                raise ResumeError(
                    f"rank {rank}'s worker {worker} was in another pass ({stream.get('stream')}) "
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
            _mark(done, segments, stream["ledger"])
    return done


def consumed_spans(
    segments: Sequence[Segment], saved: Dict[str, Any]
) -> Iterator[Tuple[Segment, int, List[int]]]:
    """What a saved ledger state says a worker consumed of its plan's ``segments``: for each
    segment it began, (the segment, the end of what was read, the sample numbers in that read
    part which were held at the checkpoint, to be read again)."""
    complete, partial, holes = saved_reads(saved)
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


def _mark(done: List[np.ndarray], segments: Sequence[Segment], ledger: Dict[str, Any]) -> None:
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
    first = state[0] if isinstance(state, (list, tuple)) and state else state
    if not isinstance(first, dict) or first.get("version") != 2:
        return False
    saved_workers = max(1, int((first.get("config") or {}).get("num_workers") or 0))
    return int(first.get("world_size", 1)) != world_size or saved_workers != max(1, num_workers)


def every_rank(state: Any) -> List[Dict[str, Any]]:
    """The states of every rank of the job that saved ``state``, in rank order, or an error
    saying why a resume on another topology needs them."""
    states = list(state) if isinstance(state, (list, tuple)) else [state]
    world = int(states[0].get("world_size", 1)) if states and isinstance(states[0], dict) else 0
    ranks = sorted(int(s.get("rank", 0)) for s in states if isinstance(s, dict))
    if not world or ranks != list(range(world)):
        raise ResumeError(
            f"resuming on another number of ranks or DataLoader workers needs the state of every "
            f"rank of the job that saved it ({world or '?'} ranks; got ranks {ranks}): each rank "
            "read other samples. Save state_dict(all_ranks=True) (on every rank) and load that "
            "list; see docs/distributed.md"
        )
    epochs = {int(s["epoch"]) for s in states}
    if len(epochs) != 1:
        raise ResumeError(f"the ranks' states are in different epochs ({sorted(epochs)})")
    return sorted(states, key=lambda s: int(s.get("rank", 0)))


def plan_elsewhere(plan: Any, state: Any, granule: int) -> int:
    """Make ``plan`` (a :class:`~webds.shards.plan.PlannedShards`) share out the rest of the epoch
    that every rank's ``state`` was saved in; return that epoch."""
    states = every_rank(state)
    epoch = int(states[0]["epoch"])
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
