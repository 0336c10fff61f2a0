"""Length and resume arithmetic for :class:`~webds.pipeline.DataPipeline`.

This module owns what follows from the stages' count rules (:class:`~webds.stages.core.Count`):

- how many items a pipeline yields per stream, its ``len()`` (:func:`source_counts`,
  :func:`forward_counts`);
- where a resumed epoch skips the items already consumed (:func:`skip_point`), which share of a
  saved position falls to this process (:func:`resume_share`), and whether a saved position
  still fits the pipeline (:func:`check_resume_config`);
- the count a rank must yield (:func:`exact_count`), and holding a stream to exactly that
  count, so that every rank yields as many items (:func:`_exactly`).

They are plain functions over a pipeline's stage list and counts (:func:`exact_count` takes the
pipeline itself); the pipeline keeps its state and calls them. Nothing here imports torch.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .errors import ArgumentError, LengthError
from .stages.core import Count, Length

__all__ = [
    "source_counts",
    "forward_counts",
    "skip_point",
    "resume_share",
    "check_resume_config",
    "exact_count",
]

log = logging.getLogger("webds")


def source_counts(source: Any, num_workers: Optional[int] = None) -> List[Length]:
    """A counted source's items per stream as :class:`~webds.stages.core.Length` values: with what
    came before each batching when the source says (``stream_counts``), else plain counts."""
    if hasattr(source, "stream_counts"):
        return list(source.stream_counts(num_workers))
    return [Length(n) for n in source.stream_lengths(num_workers)]


def forward_counts(stages: Sequence[Any], lengths: List[Length], owner: str) -> List[Length]:
    """The per-stream ``lengths`` after ``stages``, by each stage's count rule.

    Raises :class:`~webds.errors.LengthError` (naming the pipeline class ``owner``) at a stage
    whose output count nobody can know in advance.
    """
    for s in stages:
        rule = getattr(s, "count", None)
        out = [rule.forward(n, s) for n in lengths] if isinstance(rule, Count) else [None]
        if any(n is None for n in out):
            raise LengthError(
                f"the length of this {owner} is unknown: the stage {s!r} can "
                "change the number of items in ways nobody can count in advance. Declare it "
                "with .with_epoch(n) / .with_length(n)"
            )
        lengths = out  # type: ignore[assignment]
    return lengths


def skip_point(
    stages: Sequence[Any], origin: Optional[Tuple[int, Any]], count: int
) -> Tuple[int, int, Any]:
    """Where to skip ``count`` output items: (stage position, items there, origin or None).

    Walks back over stages that can say which inputs made their first outputs (map, batched)
    and stops at one that cannot (shuffle), where skipping means replaying and dropping.
    When it reaches the ``origin`` (position, source), the origin skips without reading.
    """
    floor = origin[0] if origin else 0
    at = len(stages) - 1
    while at > floor:
        s = stages[at]
        rule = getattr(s, "count", None)
        back = rule.backward(count, s) if isinstance(rule, Count) else None
        if back is None:
            return at, count, None
        count, at = back, at - 1
    if origin is not None:
        return at, count, origin[1]
    source = stages[0] if stages else None
    return at, count, source if at == 0 and hasattr(source, "skip") else None


def resume_share(skip: Any, worker: Optional[int]) -> int:
    """The items this process skips: ``skip`` is a count, or ``{"shift", "shares"}`` with one
    share per DataLoader worker; ``worker`` is this process's (renumbered) worker number, None
    when it is not its DataLoader's dataset (then a dict gives its first share)."""
    if isinstance(skip, dict):
        shares = skip["shares"]
        if worker is None:
            skip = shares[0]
        else:
            skip = shares[worker] if worker < len(shares) else 0
    return max(0, int(skip))


def check_resume_config(saved: Dict[str, Any], mine: Dict[str, Any], strict: bool) -> None:
    """Raise :class:`~webds.errors.ArgumentError` when ``strict`` and the configuration a state
    was saved with differs from the pipeline's now (see ``DataPipeline.load_state_dict``)."""
    changed = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    if changed and strict:
        diffs = ", ".join(f"{k}: saved {saved.get(k)!r}, now {mine.get(k)!r}" for k in changed)
        raise ArgumentError(
            f"cannot resume exactly: the pipeline changed since the state was saved ({diffs}). "
            "Restore the same configuration, or pass strict=False to continue approximately"
        )


def exact_count(pipeline: Any) -> Optional[int]:
    """The items this process must yield this epoch, for sources that promise it (``exact``):
    its stream's length, or None (said once per pipeline) when the stages make that unknown."""
    origin = pipeline._origin()
    if origin is None or not getattr(origin[1], "exact", False):
        return None
    try:
        lengths = pipeline.stream_lengths(None)
    except LengthError as exn:
        if not pipeline._warned_inexact:
            pipeline._warned_inexact = True
            log.warning(
                "webds: ranks may yield different numbers of items (and DDP may hang): %s",
                exn,
            )
        return None
    return lengths[origin[1].stream_index()]


def _exactly(it: Iterator[Any], count: int, where: Any) -> Iterator[Any]:
    """Yield exactly ``count`` items: pad a short stream by repeating its last item, cut a long one.

    Every rank must yield the same number of batches or DDP hangs; a sample dropped by an error
    handler (or a shard shorter than its index says, under a skipping handler) must not break
    that, so the shortfall is made up, and said.
    """
    n = 0
    last: Any = None
    for item in it:
        if n >= count:
            log.warning(
                "webds: %s yielded more items than its plan (%d); the rest of this epoch's items "
                "are dropped to keep ranks equal",
                type(where).__name__,
                count,
            )
            return
        n += 1
        last = item
        yield item
    if n < count:
        if n == 0:
            raise LengthError(
                f"{type(where).__name__} yielded no item but its plan promised {count}: every "
                "shard of this worker failed; see the errors logged above"
            )
        log.warning(
            "webds: %s yielded %d items, %d fewer than planned (samples dropped by an error "
            "handler?); repeating its last item to keep every rank's count equal",
            type(where).__name__,
            n,
            count - n,
        )
        for _ in range(count - n):
            yield last
