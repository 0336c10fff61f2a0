"""``pipe:`` URLs: a shell command's output (or input) as a stream, :class:`PipeStream`.

Reading, the command's exit status is never missed: it is checked when the output ends and at
close, which reads what is left of the output (bounded) and waits (bounded) for the command; a
command that stalls or outlives its output is ended and reported. :func:`~webds.io.streams.
abandon_stream` is the early stop on purpose, which checks nothing.
"""

from __future__ import annotations

import logging
import os
import select
import shlex
import signal
import subprocess
import tempfile
import time
from typing import IO, Any, Collection, Optional, Sequence, Union

from ..base.redact import redact
from ..errors import ArgumentError, OpenError, ShardReadError
from .streams import ReadStream

try:
    import fcntl
except ImportError:  # not POSIX: pipe: commands need a POSIX shell anyway
    fcntl = None  # type: ignore[assignment]

__all__ = ["PipeStream", "PIPE_DRAIN_BYTES", "PIPE_DRAIN_SECONDS", "PIPE_IDLE_SECONDS"]

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


class _CommandError(OpenError, ShardReadError):
    """A ``pipe:`` command exited with a failure status: the shard's data can't be trusted. Both
    an :class:`OpenError` (its command is how the shard was opened) and a
    :class:`ShardReadError` (it may fail after the data was read)."""


class PipeStream(ReadStream):
    """A shell command's stdout (mode "rb") or stdin (mode "wb") as a binary stream.

    ``command`` is a shell command line, or an argument list run without a shell (no quoting to get
    wrong: ``PipeStream(["curl", "-f", "-s", url])``); it runs in its own process group. Reading,
    its exit status is checked when its output ends and at :meth:`close`, which first reads what is
    left of the output (at most ``drain_bytes``, for at most ``drain_seconds``): a failure status
    raises :class:`OpenError` (also a :class:`ShardReadError`) naming the command, with the tail of
    its stderr; a command still running ``drain_seconds`` after its output ended is ended with its
    group and raises :class:`ShardReadError` (its status is unknown); one still writing past those
    bounds (the reader stopped early) is ended with a logged warning. A read that waits more than
    ``idle_seconds`` for output ends the command and raises :class:`ShardReadError`.
    :meth:`abandon`, the early stop on purpose, ends the command at once and checks nothing.
    ``ok_statuses``: exit statuses that also mean success (curl's 23 when the reader stopped early);
    ``check_status=False`` checks none (webdataset's ``ignore_errors``).

    Defaults: :data:`PIPE_DRAIN_BYTES`, :data:`PIPE_DRAIN_SECONDS`, :data:`PIPE_IDLE_SECONDS`; a
    ``pipe:`` URL takes ``idle_seconds`` from ``storage_options["read_timeout"]``, other bounds need
    an opener registered in ``SCHEMES["pipe"]``. Failures: docs/damaged.md, "Pipes".
    """

    def __init__(
        self,
        command: Union[str, Sequence[str]],
        mode: str = "rb",
        *,
        drain_bytes: int = PIPE_DRAIN_BYTES,
        drain_seconds: float = PIPE_DRAIN_SECONDS,
        idle_seconds: Optional[float] = PIPE_IDLE_SECONDS,
        ok_statuses: Collection[int] = (),
        check_status: bool = True,
    ) -> None:
        if mode not in ("rb", "wb"):
            raise ArgumentError(f"PipeStream: mode must be 'rb' or 'wb', not {mode!r}")
        shell = isinstance(command, str)
        if not (command.strip() if shell else command):
            raise ArgumentError("pipe: URL with an empty command")
        self.command = command if shell else shlex.join(command)
        self.mode = mode
        self.drain_bytes = drain_bytes
        self.drain_seconds = drain_seconds
        self.idle_seconds = idle_seconds
        self.ok_statuses = set(ok_statuses)
        self.check_status = check_status
        self._stderr = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                command if shell else list(command),
                shell=shell,
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
        if not self.check_status or status == 0 or status in self.ok_statuses:
            return
        if not (self.mode == "rb" and status in _BROKEN_PIPE_STATUSES):
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
                redact(self.command),
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

    def interrupt(self) -> None:
        """End the command now, from any thread, without closing the stream: a read waiting
        for output (in another thread) sees the end of it. Its exit status is not checked."""
        self._checked = True
        self._kill()

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
