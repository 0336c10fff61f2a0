"""Where a ``with_epoch`` epoch starts: epoch ``k`` of a ``with_epoch(n)`` pipeline is the items
``k * n`` to ``(k + 1) * n`` of its passes one after another (:func:`carry_start`).

A pipeline carries its stream from one epoch to the next in one process; a new process (a job
restarted at epoch ``k`` from a model checkpoint, with no loader state) computes where epoch ``k``
starts from the passes' lengths (:func:`pass_length`): from the index, or without one from the
samples of the local shards, counted once (:func:`count_shards`, :mod:`webds.shards.counts`).
Nothing here imports torch but the functions that ask whether they run in a DataLoader worker.
"""

from __future__ import annotations

import itertools
import logging
import sys
from typing import Any, Iterator, Optional, Tuple

from .base.stage import STATELESS, Length, resume_kind
from .counting import forward_counts, source_counts
from .errors import LengthError

__all__ = [
    "pass_length",
    "shard_pass_length",
    "count_shards",
    "carries",
    "carry_start",
    "dropping",
]

log = logging.getLogger("webds")


def pass_length(pipeline: Any, number: int) -> Optional[int]:
    """The items pass ``number`` of this process's stream yields (``with_epoch`` aside), or
    None where nobody can know in advance (no index, or a stage such as ``select``)."""
    from .base.workers import worker_info

    origin = pipeline._counted_source()
    if origin is None:
        return shard_pass_length(pipeline, number)
    at, src = origin
    if hasattr(src, "set_epoch"):
        src.set_epoch(number)
    where = worker_info()
    workers = where.num_workers if where.num_workers > 1 else pipeline._workers_hint()
    try:
        counts = source_counts(src, workers)
    except LengthError:  # a WebLoader's dataset without an index may count its shards
        counted = getattr(src, "counted_counts", None)
        counts = counted(number) if counted is not None else None
        if counts is None:
            return None
    try:
        counts = forward_counts(pipeline.pipeline[at + 1 :], counts, type(pipeline).__name__)
    except LengthError:
        return None
    i = src.stream_index()
    return counts[i].items if 0 <= i < len(counts) else None


def shard_pass_length(
    pipeline: Any, number: int, worker: Optional[int] = None, workers: int = 1
) -> Optional[int]:
    """:func:`pass_length` without an index, from the samples of each shard this process (or
    DataLoader ``worker`` of ``workers``) reads in pass ``number``, counted once
    (:func:`count_shards`), where the stages before the tar stage only pick shards (declared
    stateless) and those after it have count rules."""
    from .shards.shardlists import split_by_worker

    counts = getattr(pipeline, "_shard_samples", None)
    at = _tar_stage_at(pipeline)
    if counts is None or at is None:
        return None
    src = pipeline.pipeline[0]
    src.set_epoch(number)
    shards: Any = iter(src)
    for s in pipeline.pipeline[1:at]:
        if worker is not None and s is split_by_worker:
            shards = itertools.islice(shards, worker, None, workers)  # as that worker would
        else:
            shards = s(shards)
    try:
        total = sum(counts[shard["url"]] for shard in shards)
        lengths = forward_counts(pipeline.pipeline[at + 1 :], [Length(total)], "pipeline")
    except (KeyError, LengthError):
        return None
    return lengths[0].items


def _tar_stage_at(pipeline: Any) -> Optional[int]:
    """Where the tar stage is, if only stateless stages that pick shards come before it, over a
    shard list that says its URLs (``SimpleShardList``)."""
    stages = pipeline.pipeline
    expands = [getattr(getattr(s, "factory", None), "expands", False) for s in stages]
    at = expands.index(True) if True in expands else None
    if at is None or not isinstance(getattr(stages[0], "urls", None), list):
        return None
    if any(resume_kind(s) != STATELESS or hasattr(s, "factory") for s in stages[1:at]):
        return None
    return at


def count_shards(pipeline: Any) -> bool:
    """Count the samples of ``pipeline``'s local shards, once, for :func:`pass_length` (where
    it has no index); whether they are counted."""
    from .shards.counts import count_local_samples

    if getattr(pipeline, "_shard_samples", None) is not None:
        return True
    at = _tar_stage_at(pipeline)
    if pipeline._counted_source() is not None or at is None:
        return False
    counted = pipeline._shard_samples = count_local_samples(
        pipeline.pipeline[0].urls, pipeline.pipeline[at]
    )
    return counted is not None


def carries(pipeline: Any) -> bool:
    """Whether ``pipeline``'s ``with_epoch`` carries its stream from one epoch to the next:
    unless its source is endless (resampled shards), whose every epoch is a fresh draw."""
    src = pipeline.pipeline[0] if pipeline.pipeline else None
    return pipeline.repetitions == sys.maxsize and not getattr(src, "endless", False)


def carry_start(pipeline: Any, epoch: int) -> Optional[Tuple[int, int]]:
    """Where epoch ``epoch`` of a ``with_epoch(n)`` pipeline starts in its stream, the passes 0,
    1, 2, ... one after another: ``epoch * n`` items in, as (the pass, its items before the
    epoch's first). So an epoch is a function of the seed, the epoch and ``n``, whatever ran
    before in this process. None where the passes' lengths are unknown (see :func:`pass_length`).

    A worker of a plain ``DataLoader`` starts at pass ``epoch`` instead, as webdataset's do: if
    its workers are not persistent, each epoch's are new processes, which would read and drop
    up to a pass each epoch to get to where it starts (a ``WebLoader`` hands its new workers
    their stream instead: :mod:`webds.channel`)."""
    from torch.utils.data import get_worker_info

    skip, first = epoch * pipeline.nsamples, 0
    if not carries(pipeline):
        return epoch, 0  # an endless source: every epoch is a fresh pass
    if get_worker_info() is not None and getattr(pipeline, "channel", None) is None:
        return epoch, 0
    if skip and not _lengths_known(pipeline, epoch):
        return None
    origin = pipeline._counted_source()
    src = origin[1] if origin is not None else None
    was = getattr(src, "epoch", None)
    try:
        while skip:
            n = pass_length(pipeline, first)
            if n is None or n <= 0:
                return None
            if skip < n:
                break
            skip, first = skip - n, first + 1
    finally:
        if was is not None and hasattr(src, "set_epoch"):
            src.set_epoch(was)
    return first, skip


def _lengths_known(pipeline: Any, epoch: int) -> bool:
    """Whether the passes' lengths are known (:func:`carry_start`); said once if not."""
    from torch.utils.data import get_worker_info

    if pass_length(pipeline, 0) is not None or (
        count_shards(pipeline) and pass_length(pipeline, 0) is not None
    ):
        return True
    if get_worker_info() is None and not getattr(pipeline, "_warned_carry", False):
        pipeline._warned_carry = True  # (once per pipeline, in the main process)
        log.warning(
            "webds: a with_epoch(%d) pipeline started at epoch %d in a new process starts at "
            "the beginning of pass %d, not where the uninterrupted run's epoch starts: the "
            "passes' lengths are unknown (no shard index and shards that are not local, or a "
            "stage such as select whose count nobody knows). Give WebDataset an index, or load "
            "the state_dict() saved with the model (docs/distributed.md)",
            pipeline.nsamples,
            epoch,
            epoch,
        )
    return False


def dropping(it: Iterator[Any], n: int) -> Iterator[Any]:
    """``it`` without its first ``n`` items (read and dropped); closing this closes ``it``."""
    try:
        yield from itertools.islice(it, n, None)
    finally:
        it.close()  # type: ignore[attr-defined]
