"""The stream classes that :func:`~webds.io.urls.open_url` returns, apart from any URL.

:class:`ReadStream` is the base of webds's wrapper streams; :class:`AtomicFile` and
:class:`PipeStream` are what local files and ``pipe:`` commands open as; :class:`CommitOnExit`
and :func:`discard_stream` are how writers commit a finished output and abandon a partial one.
They stand apart from urls.py so that retrying.py and remote.py can build on them without a cycle.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import select
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from typing import IO, Any, Callable, List, Optional

from ..errors import ArgumentError, OpenError, ShardReadError

try:
    import fcntl
except ImportError:  # not POSIX: pipe: commands need a POSIX shell anyway
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ReadStream",
    "CommitOnExit",
    "AtomicFile",
    "PipeStream",
    "discard_stream",
    "abandon_stream",
    "remove_stale_temps",
    "STALE_TEMP_SECONDS",
    "PIPE_DRAIN_BYTES",
    "PIPE_DRAIN_SECONDS",
    "PIPE_IDLE_SECONDS",
]

log = logging.getLogger("webds")

#: How much of a ``pipe:`` command's output :meth:`PipeStream.close` reads after the reader
#: stopped (a tar's end-of-archive padding, a trailer), and how long it waits for the output to
#: end and the command to exit, before it ends the command; see :class:`PipeStream`.
PIPE_DRAIN_BYTES = 8 << 20
PIPE_DRAIN_SECONDS = 5.0
#: How long a read waits for a ``pipe:`` command to write anything before it ends the command
#: and raises :class:`ShardReadError` (``None``: forever). A stalled ``curl`` would otherwise
#: block the reader for good, as would a command that keeps its output open after the shard.
PIPE_IDLE_SECONDS = 60.0
_PIPE_CHUNK = 1 << 20

# Exit statuses that mean "the reader went away", not "the command failed": SIGPIPE as a
# shell reports it (128 + 13), and as Popen reports a signalled child.
_BROKEN_PIPE_STATUSES = {141, -signal.SIGPIPE}


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


class _CommandError(OpenError, ShardReadError):
    """A ``pipe:`` command exited with a failure status: the shard's data can't be trusted. Both
    an :class:`OpenError` (its command is how the shard was opened) and a
    :class:`ShardReadError` (it may fail after the data was read)."""


class PipeStream(ReadStream):
    """A shell command's stdout (mode "rb") or stdin (mode "wb") as a binary stream.

    The command runs in its own process group. Reading, its exit status is checked when its
    output ends and at :meth:`close`, which first reads what is left of the output (at most
    ``drain_bytes``, for at most ``drain_seconds``) so that a command still writing a tar's
    padding, or about to exit, is waited for: a failure status raises :class:`OpenError` (also a
    :class:`ShardReadError`) naming the command, with the tail of its stderr. A command still
    running ``drain_seconds`` after its output ended or went silent is ended (with its whole
    group) and raises :class:`ShardReadError`: its status is unknown. One still writing past
    those bounds (the reader stopped early) is ended with a logged warning, not an error. A
    read that waits more than ``idle_seconds`` for any output ends the command and raises
    :class:`ShardReadError` (a stalled download, or a command that keeps its output open after
    the shard). :meth:`abandon` is the early stop on
    purpose (a reader that needs only part of the output): it ends the command at once and
    checks nothing. The bounds' defaults are :data:`PIPE_DRAIN_BYTES`,
    :data:`PIPE_DRAIN_SECONDS` and :data:`PIPE_IDLE_SECONDS`; other bounds need an opener
    registered for ``pipe`` (``SCHEMES["pipe"] = lambda url, mode, bufsize, **kw:
    PipeStream(url[5:], mode, idle_seconds=600)``).
    """

    def __init__(
        self,
        command: str,
        mode: str = "rb",
        *,
        drain_bytes: int = PIPE_DRAIN_BYTES,
        drain_seconds: float = PIPE_DRAIN_SECONDS,
        idle_seconds: Optional[float] = PIPE_IDLE_SECONDS,
    ) -> None:
        if not command.strip():
            raise ArgumentError("pipe: URL with an empty command")
        self.command = command
        self.mode = mode
        self.drain_bytes = drain_bytes
        self.drain_seconds = drain_seconds
        self.idle_seconds = idle_seconds
        self._stderr = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                command,
                shell=True,
                stdin=subprocess.PIPE if mode == "wb" else subprocess.DEVNULL,
                stdout=subprocess.PIPE if mode == "rb" else None,
                stderr=self._stderr,
                start_new_session=True,
                bufsize=0 if mode == "rb" else -1,
            )
        except OSError as exn:
            self._stderr.close()
            raise OpenError(f"cannot start command: {exn}", url=f"pipe:{command}") from None
        self._pipe: IO[bytes] = self.proc.stdout if mode == "rb" else self.proc.stdin  # type: ignore
        self._fd = self._pipe.fileno()
        if mode == "rb":
            os.set_blocking(self._fd, False)
        if mode == "rb" and fcntl is not None and hasattr(fcntl, "F_SETPIPE_SZ"):
            # A larger pipe (Linux): fewer, larger reads per chunk; the default is 64 KiB.
            try:
                fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, _PIPE_CHUNK)
            except OSError:
                pass  # above the system's limit (/proc/sys/fs/pipe-max-size): keep the default
        self._eof = False
        self._stalled = False
        self._checked = False

    def readable(self) -> bool:
        return self.mode == "rb"

    def writable(self) -> bool:
        return self.mode == "wb"

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all that is left if ``n`` < 0), fewer only at the end; b"" at the
        end, after checking the command's exit status."""
        if n == 0:
            return b""
        if self._eof:
            self._finish(time.monotonic() + self.drain_seconds)
            return b""
        parts = []
        want = n if n is not None and n >= 0 else -1
        while want:
            try:
                # Non-blocking and unbuffered: a wait happens only in select(), bounded.
                chunk = os.read(self._fd, want if 0 < want < _PIPE_CHUNK else _PIPE_CHUNK)
            except BlockingIOError:
                if not self._output_waiting(bool(parts)):
                    break  # stalled: what came so far is returned, the error follows next read
                continue
            if not chunk:
                self._eof = True
                break
            parts.append(chunk)
            if want > 0:
                want -= len(chunk)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if not data:
            self._finish(time.monotonic() + self.drain_seconds)
        return data

    def _output_waiting(self, have_data: bool) -> bool:
        """Wait (at most ``idle_seconds``) for output; False if none came and we hold data."""
        if not self._stalled and select.select([self._fd], [], [], self.idle_seconds)[0]:
            return True
        self._stalled = True
        if have_data:
            return False
        self._checked = True  # ended by us: its status says nothing
        self._kill()
        raise ShardReadError(
            f"command {self.command!r} wrote nothing for {self.idle_seconds:g} s, so it "
            "was ended (a stalled download, or a command that keeps its output open after "
            "writing the shard); make it finish, or give PipeStream(idle_seconds=) a "
            "longer wait",
            url=f"pipe:{self.command}",
        )

    def write(self, b: Any) -> int:
        try:
            self._pipe.write(b)
        except BrokenPipeError:
            self._check(self.proc.wait())
            raise OpenError(
                "command stopped reading its input", url=f"pipe:{self.command}"
            ) from None
        return len(b)

    def _stderr_tail(self) -> str:
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - 2000))
        return self._stderr.read().decode("utf-8", "replace").strip()

    def _check(self, status: int) -> None:
        if self._checked:
            return
        self._checked = True
        if status != 0 and not (self.mode == "rb" and status in _BROKEN_PIPE_STATUSES):
            tail = self._stderr_tail()
            raise _CommandError(
                f"command {self.command!r} exited with status {status}"
                + (f"; its stderr ends with:\n{tail}" if tail else " (no stderr output)"),
                url=f"pipe:{self.command}",
            )

    def _drain(self, deadline: float) -> bool:
        """Read and drop the rest of the output until it ends, within the bounds; True if the
        command was still writing when a bound was reached (not just silent)."""
        fd = self._fd
        left = self.drain_bytes
        while left > 0:
            wait = deadline - time.monotonic()
            if wait <= 0:
                return True
            if not select.select([fd], [], [], wait)[0]:
                return False
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                self._eof = True
                return False
            left -= len(chunk)
        return True

    def _finish(self, deadline: float) -> None:
        """Reading side: wait (until ``deadline``) for the command's status and check it."""
        if self._checked:
            return
        writing = False
        if not self._eof:
            writing = self._drain(deadline)
        status = None
        if self._eof:
            try:
                status = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        else:
            status = self.proc.poll()
        if status is not None:
            self._check(status)
            return
        self._checked = True
        self._kill()
        if writing:
            # More output than a tar's padding: the reader went away early. As with a command
            # that dies of SIGPIPE then, that is no verdict on the command; say so, though.
            log.warning(
                "webds: the command %r was still writing when the reader stopped (more output "
                "than the %d bytes or %.3g s waited for); it was ended, so its exit status is "
                "unknown",
                self.command,
                self.drain_bytes,
                self.drain_seconds,
            )
            return
        when = "its output ended" if self._eof else "it last wrote (its output still open)"
        raise ShardReadError(
            f"command {self.command!r} was still running {self.drain_seconds:g} s after {when}, "
            "so it was ended and its exit status is unknown; make it exit once it has written "
            "the shard (or give PipeStream(drain_seconds=) a longer wait)",
            url=f"pipe:{self.command}",
        )

    def abandon(self) -> None:
        """Stop reading on purpose (the rest of the output is not wanted): end the command now,
        without reading its remaining output or checking its status, and close the stream."""
        if self.closed:
            return
        self._checked = True
        try:
            self._pipe.close()
        finally:
            self._kill()
            self._stderr.close()
            super().close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.mode == "wb":
                try:
                    self._pipe.close()
                except BrokenPipeError:
                    pass
                self._check(self.proc.wait())
            else:
                self._finish(time.monotonic() + self.drain_seconds)
        finally:
            self._pipe.close()
            self._kill()
            self._stderr.close()
            super().close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Leaving a `with` block on an error is an early stop, not a verdict on the command.
        if exc_type is not None and self.mode == "rb":
            self.abandon()
        else:
            self.close()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        else:
            # The shell is gone; make sure nothing it started lingers in its group.
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def __del__(self) -> None:
        try:
            if not self.closed:
                self._pipe.close()
                self._kill()
                self._stderr.close()
        except Exception:
            pass
