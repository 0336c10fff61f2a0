"""Read-ahead: the next shards of a list are fetched while one is being read.

A remote shard costs a round trip before its first byte, then streams at what one connection
carries. :func:`fetch_ahead` keeps up to ``shards`` shards in flight besides the one being read,
each fetched by a thread of its own (:class:`Fetch`) into memory, and hands them over in order,
each one's bytes in order; a background failure is raised when the reader gets to that shard,
in the reader's thread, after every byte that came before it. Stopping early cancels what is in
flight (each thread ends after its current read). Memory: the bytes fetched and not yet read
stay under ``budget``, plus one :data:`CHUNK` per shard in flight; the shard being read is never
held up by the budget (its own unread bytes are bounded by ``min(budget, 16 MiB)`` instead), so
a full budget slows the shards ahead, never the reader. How many shards are in flight is
:class:`Depth`: fixed, or (``readahead_shards="auto"``, the default) grown while the reader
waits on the link. What users see: docs/remote.md, "Throughput over slow links".
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any, Callable, Deque, Iterable, Iterator, Optional, Tuple, TypeVar, Union

from ..base.redact import redact
from ..errors import ArgumentError
from .streams import ReadStream, abandon_stream

log = logging.getLogger("webds")

__all__ = [
    "DEFAULT_READAHEAD_BYTES",
    "DEFAULT_READAHEAD_SHARDS",
    "AUTO",
    "AUTO_MAX_SHARDS",
    "AUTO_START_SHARDS",
    "AUTO_WAIT_SHARE",
    "CHUNK",
    "Depth",
    "Fetch",
    "check_readahead",
    "fetch_ahead",
    "LearnedDepth",
]

#: Bytes fetched and not yet read, over all the shards in flight in one process (a DataLoader
#: worker is a process): ``WebDataset(..., readahead=BYTES)``.
DEFAULT_READAHEAD_BYTES = 128 << 20

#: ``readahead_shards="auto"``: as many shards ahead as keep the reader busy (:class:`Depth`).
AUTO = "auto"
#: Shards fetched ahead of the one being read: ``WebDataset(..., readahead_shards=N)``, or
#: :data:`AUTO` (the default).
DEFAULT_READAHEAD_SHARDS = AUTO
#: ``"auto"`` starts with this many shards fetched ahead (the fixed default before it)...
AUTO_START_SHARDS = 8
#: ... and grows to at most this many: a shard in flight is a thread and a connection...
AUTO_MAX_SHARDS = 32
#: ... when the reader waited at least this share of a shard's time for its bytes while the
#: budget had room: below it, the depth keeps up (a busy machine's spread, not the link).
AUTO_WAIT_SHARE = 0.1

#: Bytes asked of a shard's stream per read, in its fetching thread.
CHUNK = 1 << 20

# The shard being read: at most this many bytes fetched ahead of the reader (or the budget).
_HEAD_BYTES = 16 << 20

T = TypeVar("T")
# What opening a shard gives: (url, stream, local path or None), as tar.grouping._open_shard.
Opened = Tuple[str, Any, Optional[str]]


def check_readahead(readahead: Any, shards: Any) -> Tuple[int, Union[int, str], bool]:
    """``(budget, shards, every_shard)`` from ``WebDataset``'s ``readahead`` and
    ``readahead_shards``; ``shards == 0`` means off, :data:`AUTO` grown (:class:`Depth`).

    ``readahead``: None (the default: remote shards, with :data:`DEFAULT_READAHEAD_BYTES`),
    a budget in bytes > 0 (remote shards), True (every shard, local files and ``pipe:`` commands
    too, with the default budget), or False or 0 (off).
    """
    if (
        not isinstance(shards, LearnedDepth)
        and shards != AUTO
        and (isinstance(shards, bool) or not isinstance(shards, int) or shards < 0)
    ):
        raise ArgumentError(f"readahead_shards must be an int >= 0 or 'auto', got {shards!r}")
    if readahead is None:
        return DEFAULT_READAHEAD_BYTES, shards, False
    if readahead is True:
        return DEFAULT_READAHEAD_BYTES, shards, True
    if readahead is False or (isinstance(readahead, int) and readahead == 0):
        return DEFAULT_READAHEAD_BYTES, 0, False
    if isinstance(readahead, int) and readahead > 0:
        return int(readahead), shards, False
    raise ArgumentError(
        "readahead must be None (remote shards, the default), a budget in bytes > 0, True "
        f"(every shard, local ones too) or False (off); got {readahead!r}"
    )


class _Budget:
    """The bytes fetched and not yet read by all the shards of one :func:`fetch_ahead`, and
    the seconds its reader waited for bytes while they were under the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()
        self.waited = 0.0

    def wait(self, fetch_done: Callable[[], bool]) -> None:
        """The reader waits (holding ``cond``) until ``fetch_done()``. Its wait counts when
        the shards ahead had room to fetch: then the link, not the budget, held it up."""
        room = self.used < self.limit
        start = time.perf_counter()
        while not fetch_done():
            self.cond.wait()
        if room:
            self.waited += time.perf_counter() - start


class Depth:
    """How many shards are fetched ahead of the one being read: ``shards``, and, if ``grows``
    (``readahead_shards="auto"``), more while the reader waits on the link.

    Little's law, measured on each shard as the reader finishes it: the shard took ``f``
    seconds to fetch (its open to its last byte, less the time the budget held it) and ``r``
    of the reader's own time (less its waits for bytes); to keep the reader busy, ``f / r``
    shards must be in flight. When the reader waited at least ``AUTO_WAIT_SHARE`` of that
    shard's time while the budget had room (else the depth already keeps up, or the budget is
    the bound), the depth becomes ``ceil(f / r) - 1`` if that is more, at most
    :data:`AUTO_MAX_SHARDS`. It never shrinks: a deeper window costs threads and connections,
    never memory (the budget holds). It changes neither the samples nor their order, only how
    early shards are fetched; the same measurements give the same depths.
    """

    def __init__(
        self,
        shards: int,
        grows: bool = False,
        most: int = AUTO_MAX_SHARDS,
        learned: Optional["LearnedDepth"] = None,
    ) -> None:
        self.shards = shards
        self.grows = grows
        self.most = most
        self.learned = learned  # told each depth grown, for the next pass to start at
        self.fetched = False  # a shard was fetched ahead (local shards are not, by default)
        self._since: Optional[float] = None  # when the reader started on the last shard
        self._waited = 0.0  # the budget's waits then

    def handed_over(self, budget: _Budget, last: Optional["Fetch"]) -> None:
        """The reader starts on the next shard fetched ahead, done with ``last`` (None: the
        first, or one not fetched ahead)."""
        if not self.grows:
            return
        now = time.perf_counter()
        with budget.cond:
            waited = budget.waited
            fetched = None if last is None else last.link_seconds
        since, self._since, before, self._waited = self._since, now, self._waited, waited
        if since is not None and fetched is not None:
            self.grow(fetched, now - since, waited - before)

    def grow(self, fetched: float, spent: float, waited: float) -> None:
        """After a shard that took ``fetched`` seconds to fetch and ``spent`` of the reader's
        wall time, ``waited`` of which it waited for bytes with room in the budget."""
        if self.shards >= self.most or waited < AUTO_WAIT_SHARE * spent:
            return
        own = max(spent - waited, 1e-6)
        wanted = math.ceil(fetched / own) - 1
        if wanted <= self.shards:
            return
        before, self.shards = self.shards, min(self.most, wanted)
        if self.learned is not None:
            self.learned.reached(self.shards)
        log.info(
            "webds: read-ahead: %d shards fetched ahead, was %d (a shard took %.3f s to fetch "
            "and %.3f s to read; the reader waited %.3f s for it)",
            self.shards,
            before,
            fetched,
            own,
            waited,
        )


class LearnedDepth:
    """``readahead_shards="auto"`` that remembers across passes: each pass's :class:`Depth`
    starts at the deepest one the passes before it grew to (at first
    :data:`AUTO_START_SHARDS`), so only a dataset's first pass ramps up. ``WebDataset`` keeps
    one per dataset; each DataLoader worker its own copy, for as long as it lives
    (``persistent_workers=True``: every epoch after the first starts deep)."""

    def __init__(self, shards: int = AUTO_START_SHARDS) -> None:
        self.shards = shards

    def depth(self) -> Depth:
        """The depth a pass starts with, growing from what the passes before it learned."""
        return Depth(self.shards, grows=True, learned=self)

    def reached(self, shards: int) -> None:
        self.shards = max(self.shards, shards)

    def __repr__(self) -> str:
        return f"LearnedDepth({self.shards})"


class Fetch:
    """One shard opened and read by a thread of its own, ahead of its reader.

    :meth:`opened` waits for the open's outcome and gives ``(url, stream, local_path)``, with a
    stream that delivers the bytes fetched (or raises what the open raised).
    """

    def __init__(self, name: str, open_shard: Callable[[], Opened], budget: _Budget) -> None:
        self.name = name
        self._open_shard = open_shard
        self._budget = budget
        self._cond = budget.cond
        self._chunks: Deque[bytes] = collections.deque()
        self._buffered = 0
        self._result: Optional[Opened] = None
        self._open_error: Optional[BaseException] = None
        self._error: Optional[BaseException] = None
        self._opened = False  # the open's outcome is known
        self._eof = False
        self._done = False  # the thread has finished with the stream (EOF, error or cancel)
        self._cancelled = False
        self._head = False  # being read: not held up by the budget
        self.handed_over = False  # opened() was called: its stream is the reader's to close
        #: Seconds from the start to the last byte, less those the budget held it (None
        #: before the end, or if it did not end cleanly).
        self.link_seconds: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name=f"webds-readahead {name}")
        self._thread.daemon = True
        self._thread.start()

    # -- the fetching thread ---------------------------------------------------------------------

    def _run(self) -> None:
        cond = self._cond
        start, held = time.perf_counter(), 0.0
        try:
            result = self._open_shard()
        except BaseException as exn:  # delivered to the reader, in its thread
            with cond:
                self._open_error, self._opened, self._done = exn, True, True
                cond.notify_all()
            return
        stream = result[1]
        with cond:
            self._result, self._opened = result, True
            cond.notify_all()
        try:
            while True:
                with cond:
                    waiting = time.perf_counter()
                    while not self._cancelled and not self._may_fetch():
                        cond.wait()
                    held += time.perf_counter() - waiting
                    if self._cancelled:
                        break
                data = stream.read(CHUNK)
                with cond:
                    if data:
                        self._chunks.append(data)
                        self._buffered += len(data)
                        self._budget.used += len(data)
                    else:
                        self._eof = True
                        self.link_seconds = time.perf_counter() - start - held
                    cond.notify_all()
                if not data:
                    break
        except BaseException as exn:
            with cond:
                self._error = exn
                cond.notify_all()
        finally:
            with cond:
                self._done = True
                cancelled = self._cancelled
                cond.notify_all()
            if cancelled:
                _abandon_quietly(stream)  # else the reader closes it, and sees how it ended

    def _may_fetch(self) -> bool:
        if self._head:
            return self._buffered < min(self._budget.limit, _HEAD_BYTES)
        return self._budget.used < self._budget.limit

    # -- the reader's side -----------------------------------------------------------------------

    def opened(self) -> Opened:
        """``(url, stream, local_path)`` once the open has finished; raises what it raised."""
        with self._cond:
            self.handed_over = True
            self._head = True  # its reader has come: fetch it whatever the budget says
            self._cond.notify_all()
            if not self._opened:
                self._budget.wait(lambda: self._opened)
            if self._open_error is not None:
                raise self._open_error
            assert self._result is not None
            url, _, lpath = self._result
        return url, _Fetched(self), lpath

    def read(self, n: int) -> bytes:
        cond = self._cond
        with cond:
            if not self._chunks and not self._eof and self._error is None:
                self._budget.wait(lambda: self._chunks or self._eof or self._error is not None)
            if not self._chunks:
                if self._error is not None:
                    error, self._error = self._error, None
                    self._eof = True  # raised once; later reads see the end
                    raise error
                return b""
            data = self._chunks.popleft()
            if 0 <= n < len(data):
                self._chunks.appendleft(data[n:])
                data = data[:n]
            self._buffered -= len(data)
            self._budget.used -= len(data)
            cond.notify_all()
        return data

    def cancel(self) -> None:
        """Stop fetching and drop what was fetched; the thread closes the stream."""
        with self._cond:
            if self._cancelled:
                return
            self._cancelled = True
            self._budget.used -= self._buffered
            self._buffered = 0
            self._chunks.clear()
            done = self._done
            self._cond.notify_all()
        if done and self._result is not None:
            _abandon_quietly(self._result[1])  # the thread ended first: nobody else will

    def finish(self, abandon: bool) -> None:
        """The reader is done: close the stream (``abandon``: as a reader that stops early)."""
        with self._cond:
            if not abandon and (self._eof or self._error is not None) and not self._cancelled:
                while not self._done:  # the thread has seen the end; it is finishing
                    self._cond.wait()
            done = self._done and not self._cancelled
        if not done or abandon:
            self.cancel()
            return
        assert self._result is not None
        self._result[1].close()  # in the reader's thread: a pipe: command's status shows here


class _Fetched(ReadStream):
    """The stream a reader gets from :meth:`Fetch.opened`: the fetched bytes, in order."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self.url = fetch.name

    def read(self, n: int = -1) -> bytes:
        if self.closed:
            raise ValueError("read from a closed stream")
        return self._fetch.read(n)

    def abandon(self) -> None:
        if not self.closed:
            super().close()
            self._fetch.finish(abandon=True)

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._fetch.finish(abandon=False)


def _abandon_quietly(stream: Any) -> None:
    try:
        abandon_stream(stream)
    except Exception as exn:
        log.debug("webds: ignoring error closing a shard read ahead: %s", redact(str(exn)))


def fetch_ahead(
    items: Iterable[T],
    name: Callable[[T], str],
    opener: Callable[[T], Callable[[], Opened]],
    ahead: Callable[[T], bool],
    shards: Union[int, Depth],
    budget: int,
) -> Iterator[Tuple[T, Callable[[], Opened]]]:
    """``(item, opened)`` for each item of ``items``, in order, where ``opened()`` opens it.

    ``opener(item)``, called in this thread, does what needs no I/O and returns the function
    that opens (see :func:`~webds.io.urls.deferred_open`). While an item is being read, up to
    ``shards`` of the next items (a number, or a :class:`Depth` that may grow) are already
    taken from ``items`` and fetched (:class:`Fetch`), as long as ``ahead(item)`` is true of
    each; an item for which it is false is the last taken ahead, and is opened by ``opened()``
    in its turn. An error raised by ``items`` itself is raised after the items before it. An
    item whose ``opened`` was not called by the time the next is asked for, and every fetch
    not handed over when the iterator is closed, is cancelled.
    """
    depth = shards if isinstance(shards, Depth) else Depth(shards)
    if depth.shards <= 0:
        for item in items:
            yield item, opener(item)
        return
    pool = _Budget(budget)
    queue: Deque[Tuple[T, Callable[[], Opened], Optional[Fetch]]] = collections.deque()
    it = iter(items)
    failure: Optional[Exception] = None
    exhausted = False
    last: Optional[Fetch] = None  # the shard fetched ahead that the reader had before
    try:
        while True:
            # Items are taken ahead only behind items being fetched: a list of local shards is
            # pulled one at a time, as without read-ahead (a source may act when its next item
            # is taken: DirectoryShardList releases the shard before).
            while not exhausted and len(queue) <= depth.shards and (not queue or queue[-1][2]):
                try:
                    item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                except Exception as exn:  # raised in its turn, after the items before it
                    failure, exhausted = exn, True
                    break
                open_it = opener(item)
                fetch = Fetch(name(item), open_it, pool) if ahead(item) else None
                depth.fetched = depth.fetched or fetch is not None
                queue.append((item, open_it, fetch))
            if not queue:
                if failure is not None:
                    raise failure
                return
            item, open_it, fetch = queue.popleft()
            if fetch is None:
                yield item, open_it
                continue
            depth.handed_over(pool, last)
            last = fetch
            try:
                yield item, fetch.opened
            finally:
                if not fetch.handed_over:
                    fetch.cancel()  # skipped, or the consumer stopped before opening it
    finally:
        for _, _, fetch in queue:
            if fetch is not None:
                fetch.cancel()
