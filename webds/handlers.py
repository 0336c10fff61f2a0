"""Error handlers: what a stage does when one item fails.

A handler is a callable ``handler(exn) -> bool``. It either raises (stop everything), returns
``True`` (skip this item and continue) or returns ``False`` (end this stage's stream quietly).
Unlike webdataset's, none of them sleeps.

Stages never call a handler directly; they go through :class:`ErrorPolicy`, which counts what was
skipped and logs one summary line when the stage ends, so nothing disappears without a trace.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Optional

__all__ = [
    "Handler",
    "reraise_exception",
    "ignore_and_continue",
    "warn_and_continue",
    "ignore_and_stop",
    "warn_and_stop",
    "ErrorPolicy",
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
    warnings.warn(f"webds: skipping after {type(exn).__name__}: {exn}", stacklevel=2)
    return True


def ignore_and_stop(exn: BaseException) -> bool:
    """End the stage's stream at the failed item."""
    return False


def warn_and_stop(exn: BaseException) -> bool:
    """Issue a warning naming the error and end the stage's stream."""
    warnings.warn(f"webds: stopping after {type(exn).__name__}: {exn}", stacklevel=2)
    return False


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
                self.first,
            )
