"""Length and resume arithmetic for :class:`~webds.pipeline.DataPipeline`.

This module owns what follows from the stages' count rules (:class:`~webds.base.stage.Count`):

- how many items a pipeline yields per stream, its ``len()`` (:func:`source_counts`,
  :func:`forward_counts`);
- whether a saved position still fits the pipeline and can be resumed exactly
  (:func:`check_state`; what was consumed is recorded by :mod:`webds.base.ledger`), and
  whether every stage says what it owes a resume (:func:`unresumable`);
- the count a rank must yield (:func:`exact_count`), and holding a stream to exactly that
  count, so that every rank yields as many items (:func:`_exactly`).

They are plain functions over a pipeline's stage list and counts (:func:`exact_count` takes the
pipeline itself); the pipeline keeps its state and calls them. Nothing here imports torch but
:func:`gather_states`, when called.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from .base.saved import PipelineState
from .base.stage import Count, Length, resume_kind
from .errors import ArgumentError, LengthError, NoSamplesError, ResumeError
from .shards.elastic import every_rank, plan_elsewhere

__all__ = [
    "source_counts",
    "forward_counts",
    "stage_name",
    "repeated",
    "check_state",
    "own_state",
    "with_topology",
    "restore_entropy",
    "fit_state",
    "resume_elsewhere",
    "gather_states",
    "random_parts",
    "exact_count",
    "unresumable",
    "refuse_unresumable",
]

log = logging.getLogger("webds")

_NONE = object()


def source_counts(source: Any, num_workers: Optional[int] = None) -> List[Length]:
    """A counted source's items per stream as :class:`~webds.base.stage.Length` values: with what
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


def repeated(lengths: List[Length], times: int, cap: Optional[int], owner: str) -> List[Length]:
    """The per-stream ``lengths`` of one pass, repeated ``times`` (``repeat(n)``), and at most
    ``cap`` items when given (``repeat(n, nbatches)``); a pass repeated forever has no length."""
    if times == 1 and cap is None:
        return lengths
    if times >= sys.maxsize:
        raise LengthError(
            f"the length of this {owner} is unknown: it repeats forever (repeat() without a "
            "count); give repeat(n), or declare an epoch with .with_epoch(n)"
        )

    def times_n(n: Optional[Length]) -> Optional[Length]:
        return None if n is None else Length(n.items * times, times_n(n.inner))

    out = [times_n(n) for n in lengths]
    if cap is not None:
        out = [n if n.items <= cap else Length(cap) for n in out]  # type: ignore[union-attr]
    return out  # type: ignore[return-value]


def stage_name(s: Any) -> str:
    """A stage's name for a saved configuration: the same in every process and run."""
    factory = getattr(s, "factory", None)
    if factory is not None:
        return str(getattr(factory, "__name__", type(s).__name__))
    return type(s).__name__


def _inner_pipelines(pipeline: Any) -> List[Any]:
    """The pipelines a pipeline's source reads: a DataLoader's dataset, a mix's datasets."""
    source = pipeline.pipeline[0] if pipeline.pipeline else None
    inner = [getattr(source, "dataset", None)] + list(getattr(source, "datasets", None) or [])
    return [x for x in inner if isinstance(getattr(x, "pipeline", None), list)]


def unresumable(pipeline: Any, where: str = "") -> List[str]:
    """The stages of ``pipeline`` (and of the pipelines it reads) that do not say what they
    owe a resume (:func:`~webds.base.stage.resume_kind` is None), each described with where
    it is and what to do."""
    owner = where or type(pipeline).__name__
    out = []
    for i, s in enumerate(pipeline.pipeline[1:], 1):
        if resume_kind(s) is None:
            out.append(f"{_describe(s)} (stage {i} of {owner}){_hint(s)}")
    for inner in _inner_pipelines(pipeline):
        out += unresumable(inner, f"{owner}'s {type(inner).__name__}")
    return out


def _describe(s: Any) -> str:
    factory = getattr(s, "factory", None)
    if factory is not None:
        return f"the stage {s!r}"
    name = getattr(s, "__qualname__", None)
    return f"the function {name}" if name else f"the stage object {s!r}"


def _hint(s: Any) -> str:
    from .stages.replay import Cached, LMDBCached

    name = getattr(getattr(s, "factory", None), "__name__", "")
    if isinstance(s, (Cached, LMDBCached)):
        return (
            ": a cache stage replays a recording made in one pass, which a saved position "
            "does not hold"
        )
    if name in ("tar_file_expander", "group_by_keys"):
        return ": it splits shards into samples without numbering them; use tarfile_to_samples()"
    return ""


#: What to do about a stage that does not say what it owes a resume.
_UNRESUMABLE_HINT = (
    "Such a stage does not say what it holds at a checkpoint, so resuming could lose or "
    "repeat those items. A stage that passes each item on (or drops it) before it pulls the "
    "next: declare it with webds.stateless(fn), or @webds.stage(stateless=True). One that holds "
    "items: give it a `ledger` parameter and record them (docs/architecture.md, 'A resumable "
    "stage'). Or save at an epoch's end, or call state_dict(strict=False) to resume "
    "approximately"
)


def refuse_unresumable(pipeline: Any, state: PipelineState, strict: bool) -> None:
    """Raise :class:`~webds.errors.ResumeError` if ``state`` (a pass in progress) was taken
    through stages that do not say what they owe a resume; with ``strict=False``, record why
    in the state instead (loading it then needs ``strict=False`` too)."""
    stages = unresumable(pipeline) if state.in_progress else []
    if not stages:
        return
    why = f"cannot save an exact position mid-pass through {'; '.join(stages)}. {_UNRESUMABLE_HINT}"
    if strict:
        raise ResumeError(why)
    state.add_problem(why)


def random_parts(pipeline: Any) -> Iterator[Any]:
    """The pipeline and every source inside it that drew entropy for its random choices (a
    DataLoader's dataset, a mix and its datasets, a resampled shard list), in a fixed order:
    a state records their entropy so that a resumed unseeded pipeline makes the same choices."""
    yield pipeline
    source = pipeline.pipeline[0] if pipeline.pipeline else None
    inner = [source, getattr(source, "dataset", None)]  # a DataLoader's dataset
    inner += list(getattr(source, "datasets", None) or [])  # a mix's
    for x in inner:
        if hasattr(x, "pipeline") and hasattr(x, "_entropy"):
            yield from random_parts(x)
        elif hasattr(x, "_entropy"):
            yield x


#: Why another topology is refused without an index, and how to get one.
_ELASTIC_HINT = (
    "resuming on another number of ranks or DataLoader workers needs a shard index, which says "
    "what every sample is wherever it was read (make one with `webds index SHARDS -o "
    "index.json` and pass it to WebDataset), and every rank's state (state_dict(all_ranks=True))"
)


def own_state(state: Any, rank: int, world_size: int, strict: bool) -> PipelineState:
    """This rank's state out of ``state`` (read by :func:`~webds.base.saved.read_states`): one
    rank's ``state_dict()``, or the list of every rank's (``state_dict(all_ranks=True)``). Raises
    :class:`~webds.errors.ResumeError` for another rank's state or another world size (each rank
    reads different samples)."""
    if isinstance(state, list):
        ranks = {s.rank: s for s in state}
        saved_world = len(state)
        if saved_world == world_size and rank in ranks:
            return ranks[rank]
        if not strict and ranks:
            return ranks.get(rank, state[0])
        raise ResumeError(
            f"these states were saved by {saved_world} ranks, and this is rank {rank} of "
            f"{world_size}; resume with the same number of ranks; {_ELASTIC_HINT}"
        )
    if not strict:
        return state
    saved, saved_world = state.rank, state.world_size
    if saved_world != world_size:
        raise ResumeError(
            f"this state was saved by a job of {saved_world} ranks, this one has {world_size}: "
            f"resume with the same number of ranks; {_ELASTIC_HINT}"
        )
    if saved != rank:
        raise ResumeError(
            f"this state was saved by rank {saved} and this is rank {rank}: each rank reads "
            "other samples, so each must load its own state. Save every rank's (call "
            "state_dict(all_ranks=True) on every rank: it gathers them into one list) and "
            "load that list on every rank; see docs/distributed.md"
        )
    return state


def gather_states(state: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every rank's ``state``, in rank order (just this one outside torch.distributed)."""
    import torch.distributed as dist  # only here: the rest of this module needs no torch

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def restore_entropy(pipeline: Any, state: PipelineState) -> None:
    """Give the pipeline's random parts (see :func:`random_parts`) the entropy ``state`` saved."""
    entropy = state.entropy
    parts = list(random_parts(pipeline))
    if len(entropy) == len(parts):
        for part, value in zip(parts, entropy):
            part._entropy = int(value)


def fit_state(pipeline: Any, state: PipelineState, strict: bool) -> None:
    """Check what only the pipeline can judge of its own ``state`` (read, so well-formed; its
    configuration checked): each stream's pass is one of its epoch's (:func:`check_passes`) and,
    ``strict``, there is an entropy for each random part; then restore that entropy."""
    check_passes(pipeline, state)
    parts = list(random_parts(pipeline))
    if strict and len(state.entropy) != len(parts):
        raise ArgumentError(
            f"not a webds pipeline state (from state_dict()): state['entropy'] is "
            f"{state.entropy!r}, not the entropy of this pipeline's {len(parts)} random "
            "part(s) (the pipeline and the datasets inside it)"
        )
    restore_entropy(pipeline, state)


def check_passes(pipeline: Any, state: PipelineState) -> None:
    """Raise :class:`~webds.errors.ArgumentError` naming the field when a stream of ``state``
    (its own, its DataLoader workers') is in a pass that its epoch does not read: the passes of
    epoch ``e`` are ``e`` to ``e + repetitions - 1`` (one, unless ``repeat``); resuming another
    would read passes until it got there (an epoch of 10**15 never ends). A ``with_epoch``
    stream runs across passes, so any pass may be its epoch's."""
    source = pipeline.pipeline[0] if pipeline.pipeline else None
    inner = getattr(getattr(source, "loader", None), "dataset", None)
    streams = [(pipeline, state, "state")]
    if hasattr(inner, "repetitions") and hasattr(inner, "nsamples"):
        streams += [(inner, s, f"state['workers'][{str(w)!r}]") for w, s in state.streams()]
    for owner, s, path in streams:
        reps = owner.repetitions
        if s.pass_ is None or (owner.nsamples is not None and reps == sys.maxsize):
            continue
        if s.epoch <= s.pass_ < s.epoch + reps:
            continue
        last = "on" if reps == sys.maxsize else f"to {s.epoch + reps - 1}"
        raise ArgumentError(
            f"not a webds pipeline state (from state_dict()): {path}['stream'] is {s.pass_}, "
            f"not a pass of its epoch ({path}['epoch'] is {s.epoch}; this pipeline reads "
            f"passes {s.epoch} {last} in it)"
        )


def with_topology(mine: Dict[str, Any], saved: Dict[str, Any]) -> Dict[str, Any]:
    """``mine`` (a configuration) with the saved one's world size and worker count: what must
    still match when a resume is planned anew for another topology."""
    out = dict(mine)
    for key in ("world_size", "num_workers"):
        if key in out and key in saved:
            out[key] = saved[key]
    if isinstance(out.get("dataset"), dict) and isinstance(saved.get("dataset"), dict):
        out["dataset"] = with_topology(out["dataset"], saved["dataset"])
    return out


def resume_elsewhere(pipeline: Any, state: Any, strict: bool, plan: Any, granule: int) -> int:
    """Resume every rank's ``state`` (a list of :class:`~webds.base.saved.PipelineState`),
    saved on another topology: make ``plan`` share out the rest of their epoch on this one (see
    :mod:`webds.shards.elastic`) and give ``pipeline`` the saved entropy; return that epoch."""
    states = every_rank(state)
    mine = pipeline._resume_config()
    for saved in states:
        check_state(saved, with_topology(mine, saved.config), strict)
    for saved in states:
        check_passes(pipeline, saved)
    epoch = plan_elsewhere(plan, states, granule)
    restore_entropy(pipeline, states[0])
    return epoch


#: Configuration a state records that changes how fast a pipeline runs, not what it yields: a
#: WebLoader's threads (the samples, their order and a resume are the same with any number).
SPEED_ONLY = frozenset({"threads"})


def check_state(state: PipelineState, mine: Dict[str, Any], strict: bool) -> None:
    """Raise :class:`~webds.errors.ResumeError` unless ``state`` (from ``state_dict()``) can be
    resumed exactly by a pipeline whose configuration is ``mine``; ``strict=False`` lets
    everything through."""
    problems = state.problems()
    saved = state.config
    keys = (set(saved) | set(mine)) - SPEED_ONLY
    changed = sorted(k for k in keys if saved.get(k) != mine.get(k))
    if changed:
        diffs = ", ".join(f"{k}: saved {saved.get(k)!r}, now {mine.get(k)!r}" for k in changed)
        hint = f" ({_ELASTIC_HINT})" if "num_workers" in changed else ""
        problems.insert(
            0,
            f"the pipeline changed since the state was saved ({diffs}); restore the same "
            f"configuration{hint}",
        )
    if problems and strict:
        raise ResumeError(
            "cannot resume exactly: "
            + "; ".join(problems)
            + ". Pass strict=False to continue approximately"
        )


def exact_count(pipeline: Any, epoch: Optional[int] = None) -> Optional[int]:
    """The items this process must yield in ``epoch``, for sources that promise it (``exact``):
    its stream's length, or None (said once per pipeline) when the stages make that unknown."""
    origin = pipeline._counted_source()
    if origin is None or not getattr(origin[1], "exact", False):
        return None
    if epoch is not None:
        origin[1].set_epoch(epoch)  # an epoch resumed elsewhere has its own length
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


def _repeated(refill: Callable[[Any], Iterator[Any]], ids: Any) -> Any:
    """The item of a new pass whose ids are ``ids`` (the first if none is), or _NONE."""
    from .base.ledger import Ledger

    ledger = Ledger()
    items = iter(refill(ledger))
    found = _NONE
    try:
        for item in items:
            if found is _NONE or ledger.current == ids:
                found = item
            if ids is None or ledger.current == ids:
                break
    finally:
        getattr(items, "close", lambda: None)()
    return found


def _exactly(
    it: Iterator[Any],
    count: int,
    where: Any,
    refill: Optional[Callable[[Any], Iterator[Any]]] = None,
    last_ids: Any = None,
) -> Iterator[Any]:
    """Yield exactly ``count`` items: pad a short stream by repeating its last item, cut a long one.

    Every rank must yield the same number of batches or DDP hangs; a sample dropped by an error
    handler (or a shard shorter than its index says, under a skipping handler) must not break
    that, so the shortfall is made up, and said. A stream resumed inside its padding has no item
    left to repeat: ``refill(ledger)`` then gives the epoch's items again, and the one whose ids
    are ``last_ids`` (the item the padding repeated; else the first) is repeated.
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
        if n == 0 and refill is not None:
            last = _repeated(refill, last_ids)
            if last is not _NONE:
                n = 1  # what follows pads with it, as if the stream had yielded it
                count += 1
        if n == 0:
            # The condition WebDataset's empty check names without an index: the same type.
            raise NoSamplesError(
                f"{type(where).__name__} yielded no item but its plan promised {count}: every "
                "shard of this worker failed or was skipped; see the errors logged above"
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
