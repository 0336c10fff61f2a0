"""Remote reads that survive dropped connections: retries with resume at the byte offset reached.

:class:`ResumableStream` wraps ``open_at(offset) -> stream``. On a transient error
(:func:`is_transient`: a reset or cut connection, a timeout, a stalled read (:class:`ReadStalled`),
HTTP 5xx/429, a body that ends before the object's known size) it closes the broken stream, waits
(:class:`Backoff`) and reopens at the offset it had delivered, so the reader sees every byte
exactly once. Other errors are raised at once: not found and permission denied as
:class:`~webds.errors.OpenError`, anything else as :class:`~webds.errors.ShardReadError`.
``retries`` bounds the *consecutive* failures without progress: a byte delivered resets the count
and the backoff, so the openers must hand over the bytes that arrived before a cut
(:mod:`webds.io.ranged` does; :mod:`webds.io.reopen`'s fsspec files fetch the block in flight
again). ``connect_retries`` bounds, separately, the retries while the server was never reached
(refused, unknown host, connect timeout): :func:`~webds.io.urls.open_url` sets it to 0 for
backends whose client already retries connections (s3fs through botocore, gcsfs), where retrying
on top made a wrong endpoint take one (S3) to four (GCS) minutes to report.
What users see, and the knobs: docs/remote.md, "Streaming, retries and resume".
"""

from __future__ import annotations

import logging
import random
import socket
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Optional, Union

from ..base.redact import redact, redact_exception
from ..errors import ArgumentError, NotFoundError, OpenError, ShardReadError, WebdsError
from .streams import ReadStream

__all__ = [
    "Backoff",
    "ResumableStream",
    "is_transient",
    "ReadStalled",
    "DEFAULT_RETRIES",
]

log = logging.getLogger("webds")

#: Retries after consecutive failures at one offset before giving up.
DEFAULT_RETRIES = 5

# Exceptions from these packages are network-level failures (disconnects, payload errors,
# timeouts) unless they carry a 4xx status; importing them just to isinstance-check would make
# optional backends mandatory.
_NETWORK_PACKAGES = frozenset(
    {
        "aiohttp",
        "botocore",
        "aiobotocore",
        "urllib3",
        "requests",
        "httpx",
        "google",
        "gcsfs",
        "s3fs",
        "adlfs",
        "azure",
        "huggingface_hub",
        "fsspec",
        "ssl",
        "http",
    }
)
# Errors (by class name) of a server that closed the connection without answering: botocore's
# and aiohttp's. Defined here, where they count among the failures to reach a server, so that
# webds.io.remote can name them in its errors without importing urls.py back.
_HUNG_UP_NAMES = frozenset({"ConnectionClosedError", "ServerDisconnectedError"})
# Exceptions (by class name, so that neither package must be imported) meaning the server was
# not reached, or hung up before answering: botocore's EndpointConnectionError (refused, unknown
# host, connect timeout) and aiohttp's connector errors, plus both packages' hang-ups.
_UNREACHABLE_NAMES = _HUNG_UP_NAMES | {
    "EndpointConnectionError",
    "ClientConnectorError",
    "ConnectionTimeoutError",
}
_TRANSIENT_STATUSES = frozenset({408, 425, 429})
_NOT_FOUND_STATUSES = frozenset({404, 410})
_DENIED_STATUSES = frozenset({401, 403})


@dataclass(frozen=True)
class Backoff:
    """Delays between retries: ``initial * multiplier**(n-1)``, capped at ``maximum``.

    ``jitter`` is the fraction of each delay drawn at random (0.25: between 75% and 100% of it),
    so that many workers cut off at once do not come back in lockstep.
    ``Backoff(initial=0.01)`` suits tests.
    """

    initial: float = 0.5
    maximum: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if not (self.initial >= 0 and self.maximum >= 0 and self.multiplier >= 1):
            raise ArgumentError(
                f"Backoff needs initial >= 0, maximum >= 0 and multiplier >= 1, got {self!r}"
            )
        if not 0 <= self.jitter <= 1:
            raise ArgumentError(f"Backoff jitter must be between 0 and 1, got {self.jitter!r}")

    def delay(self, failure: int, rng: random.Random) -> float:
        """Seconds to wait before the retry that follows consecutive failure number ``failure``."""
        base = min(self.maximum, self.initial * self.multiplier ** max(0, failure - 1))
        return base * (1.0 - self.jitter * rng.random())


BackoffLike = Union[Backoff, float, int, None]


def _backoff(value: BackoffLike) -> Backoff:
    if value is None:
        return Backoff()
    if isinstance(value, Backoff):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Backoff(initial=float(value))
    raise ArgumentError(f"backoff must be a Backoff or an initial delay in seconds, not {value!r}")


def _chain(exn: BaseException) -> list:
    """The exception and its causes (explicit, or implicit unless suppressed), outermost first."""
    out: list = []
    cur: Optional[BaseException] = exn
    while cur is not None and len(out) < 8 and not any(cur is e for e in out):
        out.append(cur)
        if cur.__cause__ is not None:
            cur = cur.__cause__
        elif not cur.__suppress_context__:
            cur = cur.__context__
        else:
            cur = None
    return out


def _status(exn: BaseException) -> Optional[int]:
    """The HTTP status an exception reports (aiohttp, botocore, requests, gcsfs, urllib)."""
    candidates = [getattr(exn, "status", None), getattr(exn, "status_code", None)]
    response = getattr(exn, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        candidates.append(response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
    elif response is not None:
        candidates.append(getattr(response, "status_code", None))
    # ``code`` means an HTTP status only on HTTP error classes; aiohttp's parser errors use
    # ``code=400`` for "the server's response was malformed", which is a network fault.
    if type(exn).__name__ in ("HttpError", "HTTPError"):
        candidates.append(getattr(exn, "code", None))
    for value in candidates:
        if isinstance(value, int) and 100 <= value <= 599:
            return value
    return None


def _kind(exn: BaseException) -> str:
    """``"transient"``, ``"not_found"``, ``"denied"`` or ``"permanent"``."""
    chain = _chain(exn)
    # A status anywhere in the chain decides: fsspec's http backend reports a 503 on its size
    # lookup as FileNotFoundError *from* the 503, which must be retried, not reported missing.
    for e in chain:
        status = _status(e)
        if status is None:
            continue
        if status in _NOT_FOUND_STATUSES:
            return "not_found"
        if status in _DENIED_STATUSES:
            return "denied"
        if status >= 500 or status in _TRANSIENT_STATUSES:
            return "transient"
        if status >= 400:
            return "permanent"
    if isinstance(exn, WebdsError) and not isinstance(exn, _Truncated):
        return "permanent"
    for e in chain:
        if isinstance(e, FileNotFoundError):
            # fsspec's http backend also says FileNotFoundError when its size lookup could not
            # connect at all; the cause tells a refused connection from a missing object.
            cause = e.__cause__
            if cause is not None and not isinstance(cause, FileNotFoundError):
                return _kind(cause)
            return "not_found"
        if isinstance(e, PermissionError) or "Credentials" in type(e).__name__:
            return "denied"
    if isinstance(exn, (IsADirectoryError, NotADirectoryError, ValueError, TypeError)):
        return "permanent"
    if isinstance(exn, (OSError, EOFError, TimeoutError)):
        return "transient"
    for e in chain:
        if type(e).__module__.partition(".")[0] in _NETWORK_PACKAGES:
            return "transient"
    return "permanent"


def _unreachable(exn: BaseException) -> bool:
    """True if ``exn`` says no answer came from the server: it could not be connected to (refused,
    unknown host, connect timeout) or it closed the connection before responding."""
    for e in _chain(exn):
        if isinstance(e, (ConnectionRefusedError, socket.gaierror)):
            return True
        if any(cls.__name__ in _UNREACHABLE_NAMES for cls in type(e).__mro__):
            return True
    return False


def _count(n: int, one: str, many: str) -> str:
    """``_count(1, "attempt", "attempts") == "1 attempt"``; ``"3 attempts"`` for 3."""
    return f"{n} {one if n == 1 else many}"


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArgumentError(f"{name} must be a non-negative integer, got {value!r}")


def is_transient(exn: BaseException) -> bool:
    """True if retrying could fix ``exn`` (a dropped connection, a timeout, a 5xx, a short body).

    ``is_transient(ConnectionResetError())`` is True; ``is_transient(FileNotFoundError())`` is
    False.
    """
    return _kind(exn) == "transient"


class _Truncated(ShardReadError):
    """The body ended before the object's known size: a cut that raised no exception."""


class ReadStalled(TimeoutError):
    """No bytes arrived within the read timeout: retried like a dropped connection.

    Its message names the ``read_timeout`` storage option that sets the limit.
    """


def _close_quietly(stream: Any) -> None:
    try:
        stream.close()
    except Exception as exn:  # a broken connection may fail to close too; it is abandoned
        log.debug("webds: ignoring error closing a broken stream: %s", redact(str(exn)))


class ResumableStream(ReadStream):
    """A read-only stream that reopens ``open_at(offset)`` at the offset reached after a failure.

    ``size`` (or the ``size`` attribute of the first stream opened, which fsspec files have)
    makes an early end of the body a failure to retry rather than the end of the data.
    ``stream.retries`` counts the retries made; ``stream.offset`` is the position reached
    (``offset``, where reading starts, plus the bytes delivered).
    The first open happens here, with the same retries, except that ``connect_retries`` (default:
    ``retries``) bounds them while the server has not been reached yet (refused, unknown host,
    closed without an answer; see the module docstring). ``translate(exn)``, if given, turns an
    error that retrying cannot fix into the WebdsError to raise (say, one naming the bucket);
    by default not-found and permission errors become OpenError, the others ShardReadError.

    >>> ranged = lambda off: urlopen(Request(url, headers={"Range": f"bytes={off}-"}))
    >>> s = ResumableStream(ranged, url=url, size=total_size, retries=3, backoff=0.1)
    """

    def __init__(
        self,
        open_at: Callable[[int], BinaryIO],
        *,
        url: Optional[str] = None,
        size: Optional[int] = None,
        retries: int = DEFAULT_RETRIES,
        backoff: BackoffLike = None,
        offset: int = 0,
        translate: Optional[Callable[[Exception], Exception]] = None,
        connect_retries: Optional[int] = None,
    ) -> None:
        super().__init__()
        if not callable(open_at):
            raise ArgumentError(f"open_at must be callable as open_at(offset), got {open_at!r}")
        _check_count("retries", retries)
        if connect_retries is not None:
            _check_count("connect_retries", connect_retries)
        self.url = url
        self.size = size
        self.offset = offset
        self._start = offset  # where reading began: offset beyond it means bytes were delivered
        self.retries = 0
        self.max_retries = retries
        self.connect_retries = retries if connect_retries is None else connect_retries
        self._reached = False  # a stream was opened: the server answered at least once
        self.backoff = _backoff(backoff)
        self._open_at = open_at
        self._translate = translate
        self._rng = random.Random()
        self._failures = 0  # consecutive failures since the last byte delivered
        self._stream: Optional[BinaryIO] = None
        self._open()

    # -- opening and recovery ------------------------------------------------------------------

    def _open(self) -> None:
        """Open at ``self.offset``, retrying transient failures."""
        while True:
            try:
                stream = self._open_at(self.offset)
            except Exception as exn:
                self._recover(exn)
                continue
            self._adopt(stream)
            return

    def _adopt(self, stream: BinaryIO) -> None:
        size = getattr(stream, "size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
            if self.size is None:
                self.size = size
            elif size != self.size:
                _close_quietly(stream)
                raise ShardReadError(
                    f"the object changed while it was being read (size {self.size}, now {size}); "
                    "bytes of two versions can't be joined: read the shard again",
                    url=self.url,
                    offset=self.offset,
                )
        self._stream = stream
        self._reached = True

    @property
    def current(self) -> Optional[Any]:
        """The underlying stream of the current attempt (e.g. to inspect an fsspec file)."""
        return self._stream

    def _recover(self, exn: Exception) -> None:
        """Raise if ``exn`` is final; otherwise drop the broken stream and wait to retry."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            _close_quietly(stream)
        kind = _kind(exn)
        # From here exn is shown (the log, the message, a traceback's chain): no credentials.
        redact_exception(exn)
        where = f"at byte offset {self.offset}" if self.offset or self._reached else "opening"
        detail = f"{type(exn).__name__}: {exn}"
        if kind != "transient" and self._translate is not None and not isinstance(exn, WebdsError):
            final = self._translate(exn)
            if isinstance(final, WebdsError) and final.offset is None and self.offset:
                final.offset = self.offset
            raise final from exn
        if kind == "not_found":
            raise NotFoundError(
                f"not found ({detail}); check the bucket, prefix and name",
                url=self.url,
                offset=self.offset or None,
            ) from exn
        if kind == "denied":
            raise OpenError(
                f"permission denied ({detail}); check your credentials and the object's access "
                "rights",
                url=self.url,
                offset=self.offset or None,
            ) from exn
        if kind == "permanent":
            if isinstance(exn, WebdsError):
                if exn.url is None:
                    exn.url = self.url
                raise exn
            raise ShardReadError(
                f"reading failed {where} with an error retrying cannot fix: {detail}",
                url=self.url,
                offset=self.offset,
            ) from exn
        self._failures += 1
        # Until the server has answered once, a failure to reach it has its own budget: a
        # client below that retries connections itself has already spent one (module docstring).
        unreachable = not self._reached and _unreachable(exn)
        limit = self.connect_retries if unreachable else self.max_retries
        delivered = self.offset != self._start
        if self._failures > limit and not delivered and not isinstance(exn, ReadStalled):
            if self._translate is not None and not isinstance(exn, WebdsError):
                # Not a byte delivered yet: say why the URL can't be read (e.g. "HTTP 503"), and
                # that retrying did not help (unless webds did not retry: then the attempts
                # were the client's, which only it can count).
                final = self._translate(exn)
                if isinstance(final, WebdsError) and not (unreachable and limit == 0):
                    final.message += f" (after {_count(self._failures, 'attempt', 'attempts')})"
                raise final from exn
        if self._failures > limit:
            raise ShardReadError(
                f"reading failed {where} after {_count(self._failures, 'attempt', 'attempts')} "
                f"({_count(limit, 'retry', 'retries')}); last error: "
                f"{detail}. The source keeps failing: check the network or server, or raise "
                "retries=",
                url=self.url,
                offset=self.offset,
            ) from exn
        wait = self.backoff.delay(self._failures, self._rng)
        self.retries += 1
        log.warning(
            "webds: retry %d/%d of %r at byte offset %d in %.2fs after %s",
            self._failures,
            limit,
            redact(self.url),
            self.offset,
            wait,
            detail,
        )
        if wait > 0:
            time.sleep(wait)

    # -- reading -------------------------------------------------------------------------------

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.offset

    def read(self, n: Optional[int] = -1) -> bytes:
        """Up to ``n`` bytes (all the rest for ``n < 0``); ``b""`` only at the true end."""
        if self.closed:
            raise ValueError("read from a closed ResumableStream")
        if n is None or n < 0:
            return self.readall()
        if n == 0:
            return b""
        while True:
            if self.size is not None and self.offset >= self.size:
                return b""  # all there: a connection lost after the last byte costs nothing
            if self._stream is None:
                self._open()
            try:
                data = self._stream.read(n)  # type: ignore[union-attr]
                if not data and self.size is not None and self.offset < self.size:
                    raise _Truncated(
                        f"the body ended after {self.offset} of {self.size} bytes",
                        url=self.url,
                        offset=self.offset,
                    )
            except Exception as exn:
                self._recover(exn)
                continue
            if not data:
                return b""
            if type(data) is not bytes:
                data = bytes(data)
            if self.size is not None and self.offset + len(data) > self.size:
                raise ShardReadError(
                    f"the source sent more than its size of {self.size} bytes; the object "
                    "changed, or the server ignored the requested range",
                    url=self.url,
                    offset=self.offset,
                )
            self.offset += len(data)
            self._failures = 0
            return data

    def readall(self) -> bytes:
        parts = []
        while True:
            data = self.read(1 << 20)
            if not data:
                return b"".join(parts)
            parts.append(data)

    def close(self) -> None:
        if self.closed:
            return
        stream, self._stream = self._stream, None
        try:
            if stream is not None:
                stream.close()
        finally:
            super().close()

    def __repr__(self) -> str:
        return (
            f"ResumableStream(url={redact(self.url)!r}, offset={self.offset}, size={self.size}, "
            f"retries={self.retries})"
        )
