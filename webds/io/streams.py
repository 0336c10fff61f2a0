"""The stream classes that :func:`~webds.io.urls.open_url` returns, apart from any URL.

:class:`ReadStream` is the base of webds's wrapper streams; :class:`AtomicFile` is what local
files open as for writing (``pipe:`` commands open as :class:`~webds.io.pipes.PipeStream`);
:class:`CommitOnExit` and :func:`discard_stream` are how writers commit a finished output and
abandon a partial one, :func:`abandon_stream` how a reader stops early on purpose, and
:func:`remove_stale_temps` how writers clean up after killed ones.
They stand apart from urls.py so that retrying.py and remote.py can build on them without a cycle.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import socket
import time
import uuid
import zlib
from typing import IO, Any, Callable, List

from ..errors import ArgumentError

__all__ = [
    "ReadStream",
    "TranslatedWrites",
    "CommitOnExit",
    "AtomicFile",
    "discard_stream",
    "abandon_stream",
    "remove_stale_temps",
    "STALE_TEMP_SECONDS",
    "read_document",
]

log = logging.getLogger("webds")


def read_document(stream: IO[bytes], limit: int, what: str) -> bytes:
    """A document's bytes (an index, a spec file), at most ``limit`` of them, gunzipped (as
    bounded) when they came gzip-coded: webds reads HTTP bodies as sent (a shard's gzip coding
    is bounded by the tar reader), servers send JSON with ``Content-Encoding: gzip``, and no
    JSON or YAML document starts with gzip's magic bytes."""
    # In pieces: read(limit + 1) sizes its buffer by the limit (1 GiB for an index), whatever
    # the document's size.
    parts: List[bytes] = []
    have = 0
    while have <= limit:
        part = stream.read(min(limit + 1 - have, 1 << 20))
        if not part:
            break
        parts.append(part)
        have += len(part)
    data = b"".join(parts)
    if data[:2] == b"\x1f\x8b":
        inflate = zlib.decompressobj(wbits=31)
        try:
            data = inflate.decompress(data, limit + 1)
        except zlib.error as exn:
            raise ArgumentError(f"{what} came gzip-coded and does not decompress: {exn}") from None
    if len(data) > limit:
        raise ArgumentError(f"{what} is over {limit:,} bytes: not what webds expects there")
    return data


class ReadStream(io.RawIOBase):
    """Base of webds's wrapper streams: a subclass defines ``read(n)``; ``readinto`` (what
    buffered readers call) follows from it."""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class _Unclosable(ReadStream):
    """stdin/stdout for a shard: closing the shard stream must not close the process's stdio."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw

    def readable(self) -> bool:
        return self._raw.readable()

    def writable(self) -> bool:
        return self._raw.writable()

    def read(self, n: int = -1) -> bytes:
        return self._raw.read(n)

    def write(self, b: Any) -> int:
        return self._raw.write(b)

    def close(self) -> None:
        if not self.closed and self._raw.writable():
            self._raw.flush()
        super().close()


class CommitOnExit:
    """Context manager of the writers: a clean exit commits (``close()``), an exception
    abandons the output (``discard()``), so a failed write never leaves a partial result."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.discard()  # type: ignore[attr-defined]
        else:
            self.close()  # type: ignore[attr-defined]


class TranslatedWrites:
    """A write stream whose failures (in ``write``, ``flush``, ``close``) are raised as
    ``translate(exn)`` says: an upload refused at its commit reads as the open would have."""

    def __init__(self, raw: Any, translate: Callable[[BaseException], BaseException]) -> None:
        self._raw = raw
        self._translate = translate
        self.closed = False

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._raw, method)(*args)
        except Exception as exn:
            translated = self._translate(exn)
            if translated is exn:
                raise
            raise translated from exn

    def write(self, data: Any) -> Any:
        return self._call("write", data)

    def flush(self) -> None:
        self._call("flush")

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            try:
                self._call("close")
            finally:
                self.closed = True

    def discard(self) -> None:
        """Abandon the upload (see :func:`discard_stream`)."""
        discard_stream(self._raw)
        self.closed = True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._raw, name)

    def __enter__(self) -> "TranslatedWrites":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def discard_stream(stream: Any) -> None:
    """Abandon what was written to ``stream``: abort it if it can be, else just close it."""
    discard = getattr(stream, "discard", None)
    try:
        if callable(discard):
            discard()
        else:
            stream.close()
    except Exception:
        pass
    # fsspec's buffered files (s3fs, gcsfs) stay "open" after discard(): s3fs's aborts the
    # multipart upload but not a small shard still in its buffer, and gcsfs's does nothing
    # before the first part; their finalizer would then close() and upload the partial shard.
    # Marking them closed is what fsspec's own discard paths do to end a file.
    if callable(discard) and not getattr(stream, "closed", True):
        try:
            stream.closed = True
        except (AttributeError, TypeError):
            pass  # not an fsspec file; close() could commit, so leave it to its own discard()


def abandon_stream(stream: Any) -> None:
    """Close a stream that is being read, on purpose before its end: a ``pipe:`` command is
    ended at once, with no wait and no check of its exit status (:meth:`PipeStream.abandon`);
    other streams are just closed. Use it where the reader stops early by design (a planned
    part of a shard, the consumer broke off, an error already on its way) and ``close()`` where
    the reader saw the whole shard, so that a failing command is reported."""
    abandon = getattr(stream, "abandon", None)
    if callable(abandon):
        abandon()
    else:
        stream.close()


# This host, as a temporary name spells it: a pid means something only on the host that wrote it.
_HOST_TAG = hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]
# ".NAME.tmp-PID-HOST-RANDOM" (the HOST part is missing in names written before it existed).
_TEMP_NAME = re.compile(
    r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-(?:(?P<host>[0-9a-f]{8})-)?[0-9a-f]{8}$"
)
#: A writer's temporary file untouched this long is stale even if its pid can't be checked
#: (another host, or a name without a host): a live writer touches it with every write.
STALE_TEMP_SECONDS = 24 * 3600.0


def remove_stale_temps(
    directory: str, wanted: Callable[[str], bool], max_age: float = STALE_TEMP_SECONDS
) -> List[str]:
    """Remove the temporary files that dead writers left in ``directory`` for a final name
    ``wanted(name)`` accepts; return their paths.

    A temporary file (``.NAME.tmp-PID-HOST-XXXXXXXX``, see :class:`AtomicFile`) is stale when
    it was written on this host by a process that no longer runs, or when nothing wrote to it for
    ``max_age`` seconds. The file of a writer still running is never removed (unless it wrote
    nothing for ``max_age``). ``remove_stale_temps("out", lambda n: n == "a.tar")``.
    """
    removed: List[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed  # no folder (yet), or not ours to list: nothing to clean
    now = time.time()
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None or not wanted(match["name"]):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            old = now - entry.stat(follow_symlinks=False).st_mtime > max_age
            dead = match["host"] == _HOST_TAG and not _process_alive(int(match["pid"]))
            if old or dead:
                os.unlink(entry.path)
                removed.append(entry.path)
        except OSError:
            continue  # gone already (another writer cleaned it), or not ours to remove
    if removed:
        log.info("webds: removed %d stale temporary file(s) in %s", len(removed), directory)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process: alive (and not ours to judge)
    return True


class AtomicFile(CommitOnExit, io.BufferedWriter):
    """A local file written under a temporary name and renamed to ``path`` by ``close()``.

    ``discard()`` deletes the temporary file instead. The temporary name is hidden (leading dot)
    and unique per writer, so concurrent writers and crashed processes never collide with, or
    leave a partial file under, the final name. A writer killed before ``close()`` leaves its
    temporary file behind: :func:`remove_stale_temps` is how a later writer removes it.
    """

    def __init__(self, path: str) -> None:
        self.final_path = path
        directory, name = os.path.split(os.path.abspath(path))
        # pid and host in the name: a later writer can tell a dead writer's leftover
        # (remove_stale_temps) from the file of one still writing.
        unique = f"{os.getpid()}-{_HOST_TAG}-{uuid.uuid4().hex[:8]}"
        self.temp_path = os.path.join(directory, f".{name}.tmp-{unique}")
        self._done = True  # nothing to clean up until the temporary file exists
        super().__init__(io.FileIO(self.temp_path, "wb"), buffer_size=1 << 20)
        self._done = False

    def close(self) -> None:
        """Flush and rename the file into place (commit)."""
        if self._done:
            return
        try:
            super().close()
            os.replace(self.temp_path, self.final_path)
        except BaseException:
            self.discard()
            raise
        self._done = True

    def discard(self) -> None:
        """Abandon the write: delete the temporary file; the final name is never touched."""
        if self._done:
            return
        self._done = True
        try:
            super().close()
        except OSError:
            pass
        try:
            os.unlink(self.temp_path)
        except FileNotFoundError:
            pass

    def __del__(self) -> None:
        # Garbage-collected without close(): the write was not finished, so don't commit it.
        self.discard()
