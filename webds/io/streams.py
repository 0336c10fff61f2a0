"""The stream classes that :func:`~webds.io.urls.open_url` returns, apart from any URL.

:class:`ReadStream` is the base of webds's wrapper streams; :class:`AtomicFile` and
:class:`PipeStream` are what local files and ``pipe:`` commands open as; :class:`CommitOnExit`
and :func:`discard_stream` are how writers commit a finished output and abandon a partial one.
They stand apart from urls.py so that retrying.py and remote.py can build on them without a cycle.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import tempfile
import uuid
from typing import IO, Any

from ..errors import ArgumentError, OpenError

__all__ = ["ReadStream", "CommitOnExit", "AtomicFile", "PipeStream", "discard_stream"]

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


class AtomicFile(CommitOnExit, io.BufferedWriter):
    """A local file written under a temporary name and renamed to ``path`` by ``close()``.

    ``discard()`` deletes the temporary file instead. The temporary name is hidden (leading dot)
    and unique per writer, so concurrent writers and crashed processes never collide with, or
    leave a partial file under, the final name.
    """

    def __init__(self, path: str) -> None:
        self.final_path = path
        directory, name = os.path.split(os.path.abspath(path))
        unique = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
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


class PipeStream(ReadStream):
    """A shell command's stdout (mode "rb") or stdin (mode "wb") as a binary stream.

    The command runs in its own process group; :meth:`close` ends the group if the command is
    still running (we stopped reading early), and raises :class:`OpenError` with the tail of the
    command's stderr if it exited with a failure status.
    """

    def __init__(self, command: str, mode: str = "rb") -> None:
        if not command.strip():
            raise ArgumentError("pipe: URL with an empty command")
        self.command = command
        self.mode = mode
        self._stderr = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                command,
                shell=True,
                stdin=subprocess.PIPE if mode == "wb" else subprocess.DEVNULL,
                stdout=subprocess.PIPE if mode == "rb" else None,
                stderr=self._stderr,
                start_new_session=True,
            )
        except OSError as exn:
            self._stderr.close()
            raise OpenError(f"cannot start command: {exn}", url=f"pipe:{command}") from None
        self._pipe: IO[bytes] = self.proc.stdout if mode == "rb" else self.proc.stdin  # type: ignore
        self._eof = False
        self._checked = False

    def readable(self) -> bool:
        return self.mode == "rb"

    def writable(self) -> bool:
        return self.mode == "wb"

    def read(self, n: int = -1) -> bytes:
        data = self._pipe.read(n)
        if not data and n != 0:
            self._eof = True
            self._check(self.proc.wait())
        return data

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
            raise OpenError(
                f"command {self.command!r} exited with status {status}"
                + (f"; its stderr ends with:\n{tail}" if tail else " (no stderr output)"),
                url=f"pipe:{self.command}",
            )

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
                status = self.proc.poll()
                if status is None:
                    # Stopped early: the command is still writing. End its whole group.
                    self._kill()
                else:
                    self._check(status)
        finally:
            self._pipe.close()
            self._kill()
            self._stderr.close()
            super().close()

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
