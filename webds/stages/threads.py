"""Per-sample work in a pool of threads: ``.map(f, threads=N)``, ``.decode("pil", threads=N)``.

Decoding and most augmentation release the GIL, so N threads of one process can use N cores
with no trip between processes. The stages that turn each item into one result (map, map_tuple,
decode) take ``threads=N`` and run :func:`apply_threaded` instead of
:func:`~webds.base.handlers.apply_each`, keeping what the serial loop guarantees: results in
input order; an error of ``f`` handled by the stage's
:class:`~webds.base.handlers.ErrorPolicy` in the consuming thread when its item's turn comes
(``None`` drops the item); an error of the source after the results of the items read before
it; at most ``2 * threads`` items read and not yet yielded, held in the stage's slot, so a
checkpoint counts them as not consumed and a resume puts them back in flight, in order. The
source is read by the consuming thread only, so the stages upstream and the ledger
(:mod:`webds.base.ledger`) see one thread. ``f`` runs in several threads at once: it must
guard state of its own, and seed its randomness per sample where runs must repeat. The user's
view: docs/api/loading.md. This module imports nothing of webds but the handlers and the errors.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, Iterable, Iterator, List, Optional, Tuple

from ..base.handlers import ErrorPolicy, Handler, apply_each, log
from ..base.runs import expanded
from ..errors import ArgumentError

__all__ = ["apply_threaded", "apply_maybe_threaded", "check_threads"]


def check_threads(stage: str, threads: Any) -> int:
    """``threads`` as an int >= 0 (0: run in the consuming thread), or an ArgumentError."""
    try:
        if isinstance(threads, bool):  # threads=True would mean one thread: say what you mean
            raise TypeError
        n = int(threads.__index__())
    except (AttributeError, TypeError):
        raise ArgumentError(f"{stage}: threads must be an integer, got {threads!r}") from None
    if n < 0:
        raise ArgumentError(f"{stage}: threads must be 0 (no pool) or more, got {n}")
    return n


def apply_maybe_threaded(
    src: Iterable[Any],
    fn: Callable[[Any], Any],
    handler: Optional[Handler],
    stage: str,
    threads: int,
    *,
    ledger: Any = None,
    annotate: Optional[Callable[[BaseException, str, Any], None]] = None,
    drop_none: bool = False,
) -> Iterator[Any]:
    """:func:`apply_threaded` with ``threads`` > 0, else the serial
    :func:`~webds.base.handlers.apply_each`."""
    if threads == 0:
        return apply_each(src, fn, handler, stage, annotate=annotate, drop_none=drop_none)
    return apply_threaded(
        expanded(src),  # (runs of samples, see webds.base.runs: their samples in the pool)
        fn,
        handler,
        stage,
        threads,
        ledger=ledger,
        annotate=annotate,
        drop_none=drop_none,
    )


def apply_threaded(
    src: Iterable[Any],
    fn: Callable[[Any], Any],
    handler: Optional[Handler],
    stage: str,
    threads: int,
    *,
    ledger: Any = None,
    annotate: Optional[Callable[[BaseException, str, Any], None]] = None,
    drop_none: bool = False,
) -> Iterator[Any]:
    """Yield ``fn(item)`` for each item of ``src``, in order, computed by ``threads`` threads.

    The same contract as :func:`~webds.base.handlers.apply_each` (handler, ``annotate``,
    ``drop_none``), with at most ``2 * threads`` items read ahead; with a ``ledger`` they are
    recorded as held (see the module doc).
    """
    policy = ErrorPolicy(handler, stage)
    window = 2 * threads
    # The ids of the items in flight, in order, in the stage's slot (see the module doc).
    slot = ledger.slot() if ledger is not None else None
    pending: Deque[Tuple[Future, Any]] = collections.deque()
    it = iter(src)
    end = object()
    exhausted = False
    dropped = 0
    restored: List[Any] = []
    if slot is not None and ledger.resuming:
        # The items of later stages are computed and go by; the ones in flight come back.
        for item in slot.restore(it):
            i = ledger.current
            result = _apply_one(fn, item, policy, stage, annotate)
            if result is not _DROPPED and not (drop_none and result is None):
                ledger.current = i
                yield result
        restored = slot.captured
        it = slot.rest(it)
    pool = ThreadPoolExecutor(threads, thread_name_prefix=f"webds-{stage}")
    try:
        for item in restored:
            pending.append((pool.submit(fn, item), item))
        del restored
        upstream: Optional[BaseException] = None  # an error of the source, raised in turn
        while True:
            while not exhausted and len(pending) < window:
                try:
                    item = next(it, end)
                except Exception as exn:
                    # The items read before it are yielded first, as the serial loop would.
                    upstream, exhausted = exn, True
                    break
                if item is end:
                    exhausted = True
                    break
                pending.append((pool.submit(fn, item), item))
                if slot is not None:
                    slot.hold(ledger.current)
            if not pending:
                if upstream is not None:
                    raise upstream
                break
            future, item = pending.popleft()
            if slot is not None:
                slot.take_first()  # the oldest item in flight leaves: its id is current
            try:
                result = future.result()
            except Exception as exn:
                if annotate is not None:
                    annotate(exn, stage, item)
                if not policy(exn):
                    # Stopped: this item is consumed, as in the serial loop; the ones read
                    # ahead stay held, as if never read (the serial loop would not have).
                    break
                continue
            if drop_none and result is None:
                dropped += 1
                continue
            del item, future
            yield result
    finally:
        # Closed early, stopped or failed: the items read ahead are not computed for nothing,
        # and no thread outlives the stage.
        for future, _ in pending:
            future.cancel()
        pending.clear()
        pool.shutdown(wait=True)
        policy.report()
        if dropped:
            log.debug("webds: %s returned None for %d item(s), which were dropped", stage, dropped)


#: What :func:`_apply_one` returns for an item whose error the handler skipped.
_DROPPED = object()


def _apply_one(
    fn: Callable[[Any], Any],
    item: Any,
    policy: ErrorPolicy,
    stage: str,
    annotate: Optional[Callable[[BaseException, str, Any], None]],
) -> Any:
    """``fn(item)`` in this thread, its error through the policy (re-raised if it stops)."""
    try:
        return fn(item)
    except Exception as exn:
        if annotate is not None:
            annotate(exn, stage, item)
        if not policy(exn):
            raise
        return _DROPPED
