"""webdataset's ``gopen`` module helpers: :class:`Pipe`, :func:`set_options` and the per-scheme
openers (``gopen_curl``, ``gopen_gsutil``, ...), for 1.x code that calls them or registers them
in ``gopen_schemes``.

webdataset runs a command per remote scheme; webds opens http, s3 and gs itself (fsspec, with
retries and resumed reads) and registers none of these. Each opener here runs the same command
as webdataset's, through :class:`~webds.io.pipes.PipeStream`: its exit status is checked, a
stalled command is ended after ``PIPE_IDLE_SECONDS``, and errors name the command and the tail
of its stderr. Secure mode refuses all of them, as it refuses ``pipe:`` URLs.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any, Collection, Dict, List, Optional

from ..base.redact import redact
from ..errors import ArgumentError, OpenError
from ..io.pipes import PipeStream
from ..io.security import WEBDATASET_PIPE, refuse
from ..io.urls import local_path, open_url

__all__ = [
    "PIPE",
    "info",
    "Pipe",
    "set_options",
    "gopen_file",
    "gopen_pipe",
    "gopen_curl",
    "gopen_htgs",
    "gopen_hf",
    "gopen_gsutil",
    "gopen_ais",
    "gopen_error",
]

PIPE = subprocess.PIPE

#: webdataset's dict of node details that its verbose messages print. webds names the shard
#: and command in its errors itself; what 1.x code puts here is added to :class:`Pipe`'s.
info: Dict[str, Any] = {}

# What webdataset's openers pass to curl when reading: connect timeout, retries.
_CURL_READ = ["curl", "--connect-timeout", "30", "--retry", "30", "--retry-delay", "2", "-f", "-s"]


class Pipe(PipeStream):
    """webdataset's ``Pipe(*args, mode=, timeout=, ignore_errors=, ignore_status=, **kw)``: a
    command's output (mode "rb") or input ("wb") as a stream, the command given as to
    ``subprocess.Popen`` (a list, or a string with ``shell=True``).

    It is a :class:`~webds.io.pipes.PipeStream`: ``ignore_status`` lists exit statuses that
    also mean success, ``ignore_errors=True`` checks none, and ``timeout`` bounds the wait for
    the command at close (webds's ``PIPE_DRAIN_SECONDS`` when not given; webdataset waited up to
    two hours). Of ``Popen``'s keywords, ``shell``, ``bufsize`` (unused: reads are unbuffered)
    are taken; others raise :class:`ArgumentError`.
    """

    def __init__(
        self,
        *args: Any,
        mode: Optional[str] = None,
        timeout: Optional[float] = None,
        ignore_errors: bool = False,
        ignore_status: Collection[int] = (),
        **kw: Any,
    ) -> None:
        shell = kw.pop("shell", False)
        kw.pop("bufsize", None)
        if kw or len(args) != 1:
            raise ArgumentError(
                f"Pipe: takes one command and the keywords mode, timeout, ignore_errors, "
                f"ignore_status, shell, bufsize; got {len(args)} arguments and {sorted(kw)}"
            )
        if mode is None or mode[:1] not in ("r", "w"):
            raise ArgumentError(f"Pipe: mode must be 'rb' or 'wb', not {mode!r}")
        command = args[0]
        if isinstance(command, str) and not shell:
            command = [command]  # Popen runs a lone string as a program name
        elif not isinstance(command, str) and shell:
            command = " ".join(command)
        self.args = (args, {"shell": shell})
        extra = {} if timeout is None else {"drain_seconds": timeout}
        super().__init__(
            command,
            "rb" if mode[0] == "r" else "wb",
            ok_statuses=ignore_status,
            check_status=not ignore_errors,
            **extra,
        )

    @property
    def ignore_errors(self) -> bool:
        return not self.check_status

    @property
    def ignore_status(self) -> List[int]:
        return sorted(self.ok_statuses)

    @property
    def timeout(self) -> float:
        return self.drain_seconds

    @property
    def status(self) -> Optional[int]:
        """The command's exit status, None while it runs."""
        return self.proc.poll()

    def _check(self, status: int) -> None:
        try:
            super()._check(status)
        except OpenError as exn:
            if info:
                exn.message = f"{exn.message} {info}"
            raise

    def readLine(self, *args: Any) -> bytes:  # noqa: N802 (webdataset's name)
        return self.readline(*args)

    def __str__(self) -> str:
        return redact(f"<Pipe {self.args}>")  # a command may name a URL with its password


def set_options(
    obj: Any,
    timeout: Optional[float] = None,
    ignore_errors: Optional[bool] = None,
    ignore_status: Optional[Collection[int]] = None,
    handler: Any = None,
) -> bool:
    """Set a pipe stream's options (as :class:`Pipe` names them); False if ``obj`` is not a
    pipe stream (any other stream is left alone)."""
    if not isinstance(obj, PipeStream):
        return False
    if timeout is not None:
        obj.drain_seconds = timeout
    if ignore_errors is not None:
        obj.check_status = not ignore_errors
    if ignore_status is not None:
        obj.ok_statuses = set(ignore_status)
    if handler is not None:
        obj.handler = handler  # type: ignore[attr-defined]  (stored, as webdataset does)
    return True


def _command(url: str, mode: str, read: List[str], write: Optional[List[str]]) -> PipeStream:
    refuse(f"running {read[0]!r} for a URL", url)
    if mode[:1] == "r":
        return PipeStream(read, "rb", ok_statuses=(23,))  # 23: the reader stopped early
    if mode[:1] == "w" and write is not None:
        return PipeStream(write, "wb", ok_statuses=(26,))
    raise ArgumentError(f"{url}: mode {mode!r} is not supported by this opener", url=url)


def gopen_file(url: str, mode: str = "rb", bufsize: int = 8192) -> Any:
    """A local path or ``file:`` URL, opened as :func:`~webds.io.urls.open_url` opens it."""
    path = local_path(url)
    if path is None:
        raise ArgumentError(f"gopen_file: {url!r} is not a local path or file: URL", url=url)
    return open_url(path, mode)


def gopen_pipe(url: str, mode: str = "rb", bufsize: int = 8192) -> PipeStream:
    """A ``pipe:`` URL's command, as :class:`~webds.io.pipes.PipeStream`."""
    if not url.startswith("pipe:"):
        raise ArgumentError(f"gopen_pipe: {url!r} is not a pipe: URL", url=url)
    refuse("pipe: URLs", url, WEBDATASET_PIPE)
    if mode[:1] not in ("r", "w"):
        raise ArgumentError(f"{mode}: unknown mode", url=url)
    return PipeStream(url[5:], "rb" if mode[0] == "r" else "wb")


def gopen_curl(url: str, mode: str = "rb", bufsize: int = 8192) -> PipeStream:
    """``url`` read with ``curl`` (retrying, following redirects) or written with ``curl -T -``
    (an HTTP PUT)."""
    put = ["curl", "-f", "-s", "-X", "PUT", "-L", "-T", "-", url]
    return _command(url, mode, _CURL_READ + ["-L", url], put)


def gopen_htgs(url: str, mode: str = "rb", bufsize: int = 8192) -> PipeStream:
    """An ``htgs://bucket/path`` URL: the public Google Cloud Storage object read over HTTPS
    with ``curl`` (webdataset curls a ``gs://`` URL here, which curl cannot read)."""
    https = re.sub(r"(?i)^htgs://", "https://storage.googleapis.com/", url)
    return _command(url, mode, _CURL_READ + ["-L", https], None)


def gopen_hf(url: str, mode: str = "rb", bufsize: int = 8192) -> PipeStream:
    """An ``hf://`` URL read with ``curl`` from the Hugging Face Hub, with the token that
    ``huggingface_hub`` finds (needs ``pip install huggingface_hub``)."""
    if mode[:1] != "r":
        return _command(url, mode, ["curl"], None)
    try:
        from huggingface_hub import HfFileSystem, get_token, hf_hub_url
    except ImportError:
        raise OpenError(
            "hf:// URLs need the huggingface_hub package: pip install huggingface_hub "
            "(or read the files with fsspec's hf:// filesystem)",
            url=url,
        ) from None
    where = HfFileSystem().resolve_path(url)
    http_url = hf_hub_url(
        repo_id=where.repo_id,
        filename=where.path_in_repo,
        repo_type=where.repo_type,
        revision=where.revision,
    )
    auth = ["-H", f"Authorization:Bearer {get_token()}"]
    return _command(url, mode, _CURL_READ + ["-L"] + auth + [http_url], None)


def gopen_gsutil(url: str, mode: str = "rb", bufsize: int = 8192) -> PipeStream:
    """A ``gs://`` URL read with ``gsutil cat`` or written with ``gsutil cp -``."""
    return _command(url, mode, ["gsutil", "cat", url], ["gsutil", "cp", "-", url])


def gopen_ais(url: str, mode: str = "rb", bufsize: int = 8192) -> PipeStream:
    """An AIStore URL read with ``ais get`` or written with ``ais put``."""
    return _command(url, mode, ["ais", "get", url, "-"], ["ais", "put", "-", url])


def gopen_error(url: str, *args: Any, **kw: Any) -> Any:
    """Raise :class:`~webds.errors.OpenError` (also a ``ValueError``, as webdataset's): no
    opener for ``url``."""
    raise _NoHandlerError(
        "no opener is defined for this URL's scheme: register one in gopen_schemes",
        url=url,
    )


class _NoHandlerError(OpenError, ValueError):
    """No opener for a URL (webdataset raised ``ValueError``)."""
