"""Length and resume arithmetic for :class:`~webds.pipeline.DataPipeline`.

This module owns what follows from the stages' count rules (:class:`~webds.stages.core.Count`):

- how many items a pipeline yields per stream, its ``len()`` (:func:`source_counts`,
  :func:`forward_counts`);
- whether a saved position still fits the pipeline and can be resumed exactly
  (:func:`check_state`; what was consumed is recorded by :mod:`webds.stages.ledger`);
- the count a rank must yield (:func:`exact_count`), and holding a stream to exactly that
  count, so that every rank yields as many items (:func:`_exactly`).

They are plain functions over a pipeline's stage list and counts (:func:`exact_count` takes the
pipeline itself); the pipeline keeps its state and calls them. Nothing here imports torch.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence

from .errors import ArgumentError, LengthError, ResumeError
from .stages.core import Count, Length

__all__ = [
    "source_counts",
    "forward_counts",
    "stage_name",
    "check_state",
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


def stage_name(s: Any) -> str:
    """A stage's name for a saved configuration: the same in every process and run."""
    factory = getattr(s, "factory", None)
    if factory is not None:
        return str(getattr(factory, "__name__", type(s).__name__))
    return type(s).__name__


def check_state(state: Any, mine: Dict[str, Any], strict: bool) -> None:
    """Raise :class:`~webds.errors.ResumeError` unless ``state`` (from ``state_dict()``) can be
    resumed exactly by a pipeline whose configuration is ``mine``; ``strict=False`` lets
    everything but a malformed state through."""
    if not isinstance(state, dict) or state.get("version") not in (1, 2):
        raise ArgumentError(f"not a webds pipeline state (from state_dict()): {state!r}")
    if state["version"] == 1:
        if strict:
            raise ResumeError(
                "this state was saved by webds 0.1, which counted items instead of recording "
                "which samples were read; it cannot be resumed exactly. Pass strict=False to "
                "start its epoch again from the beginning"
            )
        state.pop("consumed", None)
        return
    problems = [p for p in _problems(state) if p]
    saved = state.get("config") or {}
    changed = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    if changed:
        diffs = ", ".join(f"{k}: saved {saved.get(k)!r}, now {mine.get(k)!r}" for k in changed)
        problems.insert(
            0,
            f"the pipeline changed since the state was saved ({diffs}); restore the same "
            "configuration",
        )
    if problems and strict:
        raise ResumeError(
            "cannot resume exactly: "
            + "; ".join(problems)
            + ". Pass strict=False to continue approximately"
        )


def _problems(state: Dict[str, Any]) -> List[Optional[str]]:
    """The reasons a state's streams (its own, and its DataLoader workers') can't resume."""
    out = [state.get("problem")]
    for stream in (state.get("workers") or {}).values():
        out.append(stream.get("problem"))
    return list(dict.fromkeys(out))


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
