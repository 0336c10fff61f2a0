"""Open a URL for reading or writing.

One entry point, :func:`open_url`, for every kind of location a shard can live in:

- local paths and ``file:`` URLs (writes go to a temporary name and are renamed into place when
  closed, so a crash never leaves a partial shard under its final name);
- ``"-"``: standard input or output;
- ``pipe:CMD``: the output of (or the input to) a shell command; a non-zero exit status is an
  :class:`~webds.errors.OpenError` naming the command and showing the end of its stderr, and the
  command's whole process group is ended when the stream is closed, so no process outlives it;
- every other scheme (``s3://``, ``gs://``, ``http(s)://``, ...) through fsspec, which owns the
  registry of protocols. webds never shells out to ``curl`` or ``gsutil``.

:data:`SCHEMES` is the one registry of user-supplied openers, webdataset's ``gopen_schemes``
(the same dict): ``SCHEMES["s3"] = my_boto3_opener`` makes every ``s3://`` URL go through
``my_boto3_opener(url, mode, bufsize, **kw)`` before any built-in rule is tried.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from typing import IO, Any, BinaryIO, Callable, Dict, Optional, Union
from urllib.parse import urlparse
from urllib.request import url2pathname

from .errors import ArgumentError, OpenError, WebdsError

__all__ = [
    "open_url",
    "local_path",
    "url_scheme",
    "SCHEMES",
    "SchemeOpener",
    "DEFAULT_BUFSIZE",
    "PipeStream",
    "AtomicFile",
]

PathOrURL = Union[str, "os.PathLike[str]"]

#: ``fn(url, mode, bufsize, **kw) -> stream``: webdataset's signature for a scheme handler.
SchemeOpener = Callable[..., Any]

#: User-registered openers by URL scheme (``"s3"``, ``"myscheme"``, ``"pipe"``...), consulted by
#: :func:`open_url` before its built-in rules, so a registered scheme also works inside
#: ``WebDataset(...)``. The key ``"__default__"`` catches every remote scheme without its own
#: entry, instead of fsspec. It starts empty: webds has no built-in curl or gsutil openers.
#: It is process state, like fsspec's protocol registry: DataLoader workers started by ``fork``
#: inherit it; with ``spawn`` register in a module the workers import (or in worker_init_fn).
SCHEMES: Dict[str, SchemeOpener] = {}

#: What webdataset passed as ``bufsize`` when the caller gave none.
DEFAULT_BUFSIZE = 8192

# Exit statuses that mean "the reader went away", not "the command failed": SIGPIPE as a
# shell reports it (128 + 13), and as Popen reports a signalled child.
_BROKEN_PIPE_STATUSES = {141, -signal.SIGPIPE}


def local_path(url: PathOrURL) -> Optional[str]:
    """Return the local file path a URL names, or None if it is not a local file.

    ``local_path("data/a.tar") == "data/a.tar"``; ``local_path("file:///d/a.tar") == "/d/a.tar"``;
    ``local_path("s3://b/a.tar") is None``.
    """
    url = os.fspath(url)
    if url == "-" or url.startswith("pipe:"):
        return None
    if url.startswith("file:"):
        parsed = urlparse(url)
        return url2pathname(parsed.path)
    scheme = urlparse(url).scheme
    # A one-letter scheme is a Windows drive ("C:\\data\\a.tar"), not a protocol.
    if scheme == "" or len(scheme) == 1:
        return url
    return None


def url_scheme(url: PathOrURL) -> Optional[str]:
    """Return the scheme of ``url`` (``"s3"``, ``"pipe"``, ``"file"``), or None for a local path.

    ``url_scheme("s3://b/a.tar") == "s3"``; ``url_scheme("C:\\d\\a.tar") is None`` (a drive).
    """
    url = os.fspath(url)
    if url == "-":
        return None
    scheme = urlparse(url).scheme
    return scheme.lower() if len(scheme) > 1 else None


def open_url(
    url: PathOrURL, mode: str = "rb", *, bufsize: int = DEFAULT_BUFSIZE, **storage_options: Any
) -> BinaryIO:
    """Open ``url`` as a binary stream for reading (``"rb"``) or writing (``"wb"``).

    A scheme registered in :data:`SCHEMES` is opened by its handler, called as
    ``handler(url, mode, bufsize, **storage_options)``; ``bufsize`` is used by nothing else.
    Otherwise ``storage_options`` go to fsspec for remote URLs (credentials, endpoints, block
    sizes). The caller closes the stream; for writes, closing commits the data (renames the
    temporary file into place, or waits for the ``pipe:`` command and checks its exit status).
    """
    if mode not in ("rb", "wb"):
        raise ArgumentError(f"open_url: mode must be 'rb' or 'wb', not {mode!r}")
    url = os.fspath(url)
    if not isinstance(url, str) or url == "":
        raise ArgumentError(f"open_url: expected a URL or path string, got {url!r}")
    if url == "-":
        std = sys.stdin if mode == "rb" else sys.stdout
        return _Unclosable(std.buffer)  # type: ignore[return-value]
    registered = _registered_opener(url)
    if registered is not None:
        return _open_registered(registered, url, mode, bufsize, storage_options)
    if url.startswith("pipe:"):
        return PipeStream(url[5:], mode)  # type: ignore[return-value]
    path = local_path(url)
    if path is not None:
        return _open_local(url, path, mode)
    return _open_fsspec(url, mode, storage_options)


def _registered_opener(url: str) -> Optional[SchemeOpener]:
    scheme = url_scheme(url)
    if scheme is None:
        return None
    if scheme in SCHEMES:
        return SCHEMES[scheme]
    # As in webdataset, "__default__" stands for the remote schemes only: local files and
    # pipe: commands keep their own rules unless registered by name.
    if scheme not in ("file", "pipe"):
        return SCHEMES.get("__default__")
    return None


def _open_registered(
    opener: SchemeOpener, url: str, mode: str, bufsize: int, options: Dict[str, Any]
) -> BinaryIO:
    name = getattr(opener, "__qualname__", repr(opener))
    if not callable(opener):
        raise ArgumentError(
            f"the opener registered for {url_scheme(url)!r} URLs is not callable: {opener!r}; "
            "register fn(url, mode, bufsize, **kw) -> stream",
            url=url,
        )
    try:
        stream = opener(url, mode, bufsize, **options)
    except WebdsError:
        raise
    except Exception as exn:
        raise OpenError(
            f"the opener registered for {url_scheme(url)!r} URLs ({name}) failed: "
            f"{type(exn).__name__}: {exn}",
            url=url,
        ) from exn
    wanted = "read" if mode == "rb" else "write"
    if not hasattr(stream, wanted):
        raise OpenError(
            f"the opener registered for {url_scheme(url)!r} URLs ({name}) returned {stream!r}, "
            f"which has no {wanted}(); it must return a binary stream",
            url=url,
        )
    return stream


def _open_local(url: str, path: str, mode: str) -> BinaryIO:
    try:
        if mode == "rb":
            return open(path, "rb")
        return AtomicFile(path)  # type: ignore[return-value]
    except FileNotFoundError:
        what = "file" if mode == "rb" else "directory for"
        raise OpenError(
            f"no such {what} {path!r}; check the path (and the brace pattern that produced it)",
            url=url,
        ) from None
    except IsADirectoryError:
        raise OpenError(
            f"{path!r} is a directory; give shard files or a brace pattern like "
            "'dir/a-{000..009}.tar'",
            url=url,
        ) from None
    except PermissionError as exn:
        raise OpenError(f"permission denied opening {path!r}: {exn.strerror}", url=url) from None
    except OSError as exn:
        raise OpenError(f"cannot open {path!r}: {exn}", url=url) from None


def _open_fsspec(url: str, mode: str, storage_options: dict) -> BinaryIO:
    import fsspec
    from fsspec.registry import known_implementations

    scheme = urlparse(url).scheme
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as exn:
        hint = known_implementations.get(scheme, {}).get("err", "")
        raise OpenError(
            f"no fsspec backend installed for '{scheme}://' URLs ({exn}). {hint} "
            f"For S3 install 'webds[s3]', for GCS 'webds[gcs]'.",
            url=url,
        ) from None
    except ValueError as exn:
        raise OpenError(
            f"unknown URL scheme '{scheme}://' ({exn}); use a local path, 'pipe:CMD', or a "
            f"protocol fsspec knows",
            url=url,
        ) from None
    try:
        return fs.open(path, mode)
    except FileNotFoundError:
        raise OpenError(f"{url} not found; check the bucket, prefix and name", url=url) from None
    except PermissionError as exn:
        raise OpenError(f"permission denied: {exn}; check your credentials", url=url) from None
    except OSError as exn:
        raise OpenError(f"cannot open: {exn}", url=url) from None


class _Unclosable(io.RawIOBase):
    """stdin/stdout for a shard: closing the shard stream must not close the process's stdio."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw

    def readable(self) -> bool:
        return self._raw.readable()

    def writable(self) -> bool:
        return self._raw.writable()

    def read(self, n: int = -1) -> bytes:
        return self._raw.read(n)

    def readinto(self, b: Any) -> int:
        data = self._raw.read(len(b))
        b[: len(data)] = data
        return len(data)

    def write(self, b: Any) -> int:
        return self._raw.write(b)

    def close(self) -> None:
        if not self.closed and self._raw.writable():
            self._raw.flush()
        super().close()


class AtomicFile(io.BufferedWriter):
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

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()

    def __del__(self) -> None:
        # Garbage-collected without close(): the write was not finished, so don't commit it.
        self.discard()


class PipeStream(io.RawIOBase):
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

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

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
