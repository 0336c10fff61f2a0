"""Error handlers: what a stage does when one item fails.

A handler is a callable ``handler(exn) -> bool``. It either raises (stop everything), returns
``True`` (skip this item and continue) or returns ``False`` (end this stage's stream quietly).
Unlike webdataset's, none of them sleeps. The ``warn_*`` handlers' warnings point at the first
caller outside webds (the loop over the dataset, not webds's stage code) and repeat the notes
webds added to the exception (the stage, the sample and the shard of a failed user function).

Stages never call a handler directly; they go through :class:`ErrorPolicy`, which counts what was
skipped and logs one summary line when the stage ends, so nothing disappears without a trace.
A stage that turns each item into one result runs :func:`apply_each`, the one copy of that loop.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, Callable, Generator, Iterable, Iterator, Optional

from .redact import redact
from .runs import Run, mapped

__all__ = [
    "Handler",
    "reraise_exception",
    "ignore_and_continue",
    "warn_and_continue",
    "ignore_and_stop",
    "warn_and_stop",
    "ErrorPolicy",
    "apply_each",
]

log = logging.getLogger("webds")

Handler = Callable[[BaseException], bool]


def reraise_exception(exn: BaseException) -> bool:
    """Re-raise the exception (the default everywhere)."""
    raise exn


def ignore_and_continue(exn: BaseException) -> bool:
    """Skip the failed item and go on."""
    return True


def warn_and_continue(exn: BaseException) -> bool:
    """Issue a warning naming the error, skip the failed item and go on."""
    _warn("skipping", exn)
    return True


def ignore_and_stop(exn: BaseException) -> bool:
    """End the stage's stream at the failed item."""
    return False


def warn_and_stop(exn: BaseException) -> bool:
    """Issue a warning naming the error and end the stage's stream."""
    _warn("stopping", exn)
    return False


# The webds package's folder (this module is in webds/stages/), as given and as an absolute path.
_PACKAGE_DIRS = tuple(
    {
        os.path.dirname(os.path.dirname(__file__)) + os.sep,
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    }
)


def _warn(verb: str, exn: BaseException) -> None:
    """Warn ``webds: <verb> after <error>``, plus the exception's notes (where it happened),
    reported at the first frame outside webds."""
    text = f"webds: {verb} after {type(exn).__name__}: {exn}"
    # The stages note where a user function failed ("webds: in map(f) on sample 'k' of 'u'");
    # a warning shows only its message, so they go into it.
    notes = [n for n in getattr(exn, "__notes__", ()) if isinstance(n, str)]
    if notes:
        text += " (" + "; ".join(n[7:] if n.startswith("webds: ") else n for n in notes) + ")"
    # stacklevel=2 would name webds's own stage code, which tells the user nothing: count the
    # frames up to the first one outside the package (the loop over the dataset, or the
    # DataLoader code in a worker). Generator stages are on the stack while they run.
    level = 1
    frame = sys._getframe(0)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIRS):
        frame = frame.f_back
        level += 1
    warnings.warn(redact(text), stacklevel=level if frame is not None else 2)


class ErrorPolicy:
    """Applies a handler inside one run of a stage and counts what it let through.

    Use it as ``if policy(exn): continue`` / ``else: break``; call :meth:`report` in a ``finally``.
    """

    def __init__(self, handler: Optional[Handler], stage: str) -> None:
        self.handler = handler or reraise_exception
        self.stage = stage
        self.skipped = 0
        self.stopped = False
        self.first: Optional[BaseException] = None

    def __call__(self, exn: BaseException) -> bool:
        """Return True to skip the item and continue, False to stop; or raise."""
        keep_going = bool(self.handler(exn))
        if self.first is None:
            self.first = exn
        if keep_going:
            self.skipped += 1
        else:
            self.stopped = True
        return keep_going

    def report(self) -> None:
        """Log one line if anything was skipped or the stage was stopped by the handler."""
        if self.skipped or self.stopped:
            log.warning(
                "webds: %s skipped %d item(s)%s after errors; first: %s: %s",
                self.stage,
                self.skipped,
                " and stopped" if self.stopped else "",
                type(self.first).__name__,
                redact(str(self.first)),
            )


def apply_each(
    src: Iterable[Any],
    fn: Callable[[Any], Any],
    handler: Optional[Handler],
    stage: str,
    *,
    annotate: Optional[Callable[[BaseException, str, Any], None]] = None,
    drop_none: bool = False,
) -> Iterator[Any]:
    """Yield ``fn(item)`` for each item of ``src``; an exception from ``fn`` goes to ``handler``.

    The handler skips the item, ends the stream or raises, through an :class:`ErrorPolicy` named
    ``stage`` that logs its summary when the stream ends (or is closed). ``annotate(exn, stage,
    item)``, if given, runs first, to add where the item came from to the exception. With
    ``drop_none``, ``fn`` drops an item by returning ``None``; the number dropped is logged at
    DEBUG level. Exceptions from ``src`` itself are not handled here: they belong upstream.
    A run of samples (:mod:`webds.base.runs`) goes through ``fn``'s column form where it has
    one, else sample by sample: a stage built on this loop can take runs (``@stage(runs=True)``).

    A stage checks its arguments, then ends with ``return apply_each(src, decoder, handler,
    "decode")``: returning the loop, rather than ``yield from`` it, saves a generator hop per
    item, and argument errors are raised as soon as the stage is applied to its source.
    """
    return _each(src, fn, ErrorPolicy(handler, stage), annotate, drop_none, True)


def _each(
    src: Iterable[Any],
    fn: Callable[[Any], Any],
    policy: ErrorPolicy,
    annotate: Optional[Callable[[BaseException, str, Any], None]],
    drop_none: bool,
    outer: bool,
) -> Generator[Any, None, int]:
    """:func:`apply_each`'s loop, until ``src`` ends or the handler stops it
    (``policy.stopped``); returns the number of items dropped. ``outer``: the loop over the
    stage's source (not over one run's samples), which reports when it ends."""
    dropped = 0
    try:
        for item in src:
            if type(item) is Run:
                done = mapped(item, fn)
                if done is not None:
                    yield done
                    continue
                dropped += yield from _each(item.items(), fn, policy, annotate, drop_none, False)
                if policy.stopped:
                    break
                continue
            try:
                result = fn(item)
            except Exception as exn:
                if annotate is not None:
                    annotate(exn, policy.stage, item)
                if policy(exn):
                    continue
                break
            if drop_none and result is None:
                dropped += 1
                continue
            yield result
        return dropped
    finally:
        if outer:
            policy.report()
            if dropped:
                log.debug(
                    "webds: %s returned None for %d item(s), which were dropped",
                    policy.stage,
                    dropped,
                )
