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
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from typing import IO, Any, BinaryIO, Callable, Dict, Optional, Tuple, Union
from urllib.parse import urlparse
from urllib.request import url2pathname

from ..errors import ArgumentError, OpenError, WebdsError

log = logging.getLogger("webds")

__all__ = [
    "open_url",
    "local_path",
    "url_identity",
    "url_scheme",
    "make_parent_folder",
    "existing_size",
    "filesystem_options",
    "ReadStream",
    "CommitOnExit",
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


def make_parent_folder(url: PathOrURL) -> None:
    """Create the folder a local path or ``file:`` URL is in, if it is missing.

    Remote URLs, ``pipe:`` commands and ``-`` are left alone: object stores have no folders to
    create, and a command or stdout has no parent. ``make_parent_folder("out/a.tar")`` creates
    ``out/``.
    """
    path = local_path(url)
    if path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def url_identity(url: PathOrURL) -> str:
    """A key equal for two spellings of one local file (relative, absolute, ``file:``); other
    URLs as given. ``url_identity("a.tar") == url_identity(os.path.abspath("a.tar"))``."""
    path = local_path(url)
    return os.path.abspath(path) if path is not None else os.fspath(url)


def existing_size(
    url: PathOrURL, storage_options: Optional[Dict[str, Any]] = None
) -> Optional[int]:
    """The size of the file or object at ``url``, or None when there is none.

    ``-`` and ``pipe:`` name no stored file (None); a URL whose fsspec backend is missing gives
    None too (writing there will say what is missing). Remote listings cached earlier are
    dropped first, so an object written since is seen.
    """
    url = os.fspath(url)
    path = local_path(url)
    if path is not None:
        try:
            return os.path.getsize(path)
        except OSError:
            return None
    if url == "-" or url_scheme(url) == "pipe":
        return None
    import fsspec

    try:
        fs, fspath = fsspec.core.url_to_fs(url, **filesystem_options(dict(storage_options or {})))
    except (ImportError, ValueError):
        return None
    fs.invalidate_cache(fspath)
    try:
        return int(fs.info(fspath).get("size") or 0)
    except FileNotFoundError:
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


def _special_file(path: str) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a directory."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))


def _open_local(url: str, path: str, mode: str) -> BinaryIO:
    try:
        if mode == "rb":
            return open(path, "rb")
        if _special_file(path):
            # /dev/null, a FIFO, a terminal: renaming a temporary file over it would replace
            # the device with a plain file. Write to it directly; there is nothing to commit.
            return open(path, "wb")
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


#: Read-side block size for remote files: big enough that a shard streams in a few requests per
#: 8 MiB (S3/GCS charge and delay per request), small enough that the first sample arrives after
#: one block rather than after the whole shard.
REMOTE_BLOCK_SIZE = 8 << 20

# Arguments of ``fs.open()`` rather than of the filesystem: taken out of ``storage_options``.
_OPEN_OPTIONS = ("block_size", "cache_type", "cache_options")
# storage_options that say how to read a stream (open and retry), not how to build a filesystem.
_STREAM_OPTIONS = _OPEN_OPTIONS + ("retries", "retry_backoff")


def filesystem_options(storage_options: Dict[str, Any]) -> Dict[str, Any]:
    """The part of ``storage_options`` that configures the fsspec filesystem (credentials,
    endpoint), without the per-stream ones (``block_size``, ``cache_type``, ``retries``, ...)."""
    return {k: v for k, v in storage_options.items() if k not in _STREAM_OPTIONS}


# Which webds extra installs the fsspec backend of a scheme.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}

_S3_CREDENTIALS = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or ~/.aws/credentials), or "
    "pass storage_options={'key': ..., 'secret': ...}; for a public bucket pass "
    "storage_options={'anon': True}"
)
_GCS_CREDENTIALS = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service-account JSON file or run 'gcloud auth "
    "application-default login', or pass storage_options={'token': ...}; for a public bucket "
    "pass storage_options={'token': 'anon'}"
)
_CREDENTIAL_HINTS = {"s3": _S3_CREDENTIALS, "s3a": _S3_CREDENTIALS}
_CREDENTIAL_HINTS.update(gs=_GCS_CREDENTIALS, gcs=_GCS_CREDENTIALS)

# Where a scheme's endpoint is set, for "cannot connect" errors.
_S3_ENDPOINT = (
    "the S3 endpoint (storage_options={'client_kwargs': {'endpoint_url': ...}}, or "
    "AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3)"
)
_GCS_ENDPOINT = "the GCS endpoint (storage_options={'endpoint_url': ...}, or STORAGE_EMULATOR_HOST)"
_ENDPOINT_HINTS = {
    "s3": _S3_ENDPOINT,
    "s3a": _S3_ENDPOINT,
    "gs": _GCS_ENDPOINT,
    "gcs": _GCS_ENDPOINT,
}

# Errors (by class name) of a server that closed the connection without answering: botocore's
# and aiohttp's. webds.io.retrying counts them among the failures to reach a server.
_HUNG_UP_NAMES = frozenset({"ConnectionClosedError", "ServerDisconnectedError"})

# fsspec backends (by top-level package) whose client retries a failed connection itself, with
# its own backoff: botocore under s3fs (5 attempts by default, set by AWS_MAX_ATTEMPTS and
# AWS_RETRY_MODE; s3fs adds 5 of its own for a connection closed without an answer) and gcsfs
# (6 attempts, about 35 s). webds does not retry an unreachable server on top of them before the
# first successful open: against a closed port that took 67 s (s3) and 220 s (gs) to report.
# Reads that fail after the server has answered are retried and resumed as always.
_RETRIES_CONNECTIONS = frozenset({"s3fs", "gcsfs"})

# Exception class names (anywhere in an error's chain) that mean "no usable credentials":
# botocore's and google-auth's, matched by name so that neither needs to be imported.
_NO_CREDENTIALS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "DefaultCredentialsError",
    "RefreshError",
}


def _open_fsspec(url: str, mode: str, storage_options: dict) -> BinaryIO:
    """Open a remote URL through fsspec, streaming-friendly, with errors as OpenError.

    ``block_size``, ``cache_type`` and ``cache_options`` in ``storage_options`` go to
    ``fs.open()``; ``retries`` and ``retry_backoff`` set how reads recover from a broken
    connection (:class:`~webds.io.retrying.ResumableStream`: reopen at the offset reached); the rest
    configure the filesystem (credentials, endpoint). Reads default to a read-ahead cache of
    :data:`REMOTE_BLOCK_SIZE` blocks where the backend takes them.
    """
    import fsspec

    from .retrying import DEFAULT_RETRIES, ResumableStream, seek_opener

    scheme = urlparse(url).scheme.lower()
    options = dict(storage_options)
    open_kw = {name: options.pop(name) for name in _OPEN_OPTIONS if name in options}
    retries = options.pop("retries", DEFAULT_RETRIES)
    backoff = options.pop("retry_backoff", None)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exn:
        raise _missing_backend(url, scheme, exn) from None
    except ValueError as exn:
        if "protocol not known" in str(exn).lower():
            raise OpenError(
                f"unknown URL scheme '{scheme}://' ({exn}); use a local path, 'pipe:CMD', a "
                "protocol fsspec knows, or register an opener in webds.io.urls.SCHEMES",
                url=url,
            ) from None
        raise _remote_error(exn, url, scheme) from exn
    except TypeError as exn:
        raise OpenError(
            f"the fsspec filesystem for '{scheme}://' does not accept these storage_options "
            f"({sorted(options)}): {exn}",
            url=url,
        ) from None
    except Exception as exn:
        raise _remote_error(exn, url, scheme) from exn
    defaults = _read_defaults(fs, options, open_kw) if mode == "rb" else {}

    def open_file() -> BinaryIO:
        try:
            return fs.open(path, mode, **defaults, **open_kw)
        except TypeError as exn:
            # A backend whose open() passes unknown keywords on to something stricter.
            if not any(name in str(exn) for name in defaults):
                raise
            return fs.open(path, mode, **open_kw)

    chose_blocks = any(name in options for name in ("default_block_size", "default_cache_type"))

    def open_at(offset: int) -> Any:
        # A whole shard is one sequential read: where the backend can stream an object in one
        # request (fsspec's async filesystems: s3, http), do that, unless the caller chose block
        # reads; resume after a failure with a ranged, block-wise reader from the offset reached.
        if offset == 0 and not open_kw and not chose_blocks:
            stream = _streamed(fs, path)
            if stream is not None:
                return stream
        return seek_opener(open_file, url)(offset)

    try:
        if mode == "rb":
            # Reads survive broken connections: reopen at the byte offset reached (a range
            # request), with backoff; permanent errors (404, 403) are translated at once.
            retried_below = type(fs).__module__.partition(".")[0] in _RETRIES_CONNECTIONS
            return ResumableStream(  # type: ignore[return-value]
                open_at,
                url=url,
                retries=retries,
                backoff=backoff,
                translate=lambda exn: _remote_error(exn, url, scheme, fs=fs, path=path),
                connect_retries=0 if retried_below else None,
            )
        return open_file()
    except WebdsError:
        raise
    except NotImplementedError:
        what = "writing" if mode == "wb" else "reading"
        raise OpenError(
            f"the fsspec backend for '{scheme}://' URLs ({type(fs).__name__}) does not support "
            f"{what}",
            url=url,
        ) from None
    except Exception as exn:
        raise _remote_error(exn, url, scheme, fs=fs, path=path) from exn


class ReadStream(io.RawIOBase):
    """Base of webds's wrapper streams: a subclass defines ``read(n)``; ``readinto`` (what
    buffered readers call) follows from it."""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class _SyncStreamedFile(ReadStream):
    """An fsspec async streamed file (one GET for the whole object) read synchronously."""

    def __init__(self, fs: Any, afile: Any, size: int) -> None:
        self._fs = fs
        self._afile = afile
        self.size = size  # known up front, so an early end of the body is caught and resumed

    def read(self, n: int = -1) -> bytes:
        from fsspec.asyn import sync

        return sync(self._fs.loop, self._afile.read, n)

    def close(self) -> None:
        if self.closed:
            return
        from fsspec.asyn import sync

        try:
            body = getattr(self._afile, "r", None)  # s3fs keeps the response body here
            if body is not None and hasattr(body, "close"):
                body.close()
            close = getattr(self._afile, "close", None)
            if close is not None:
                result = close()
                if hasattr(result, "__await__"):
                    sync(self._fs.loop, lambda: result)
        except Exception as exn:  # closing a half-read response must not mask the real outcome
            log.debug("webds: ignoring error closing a streamed file: %s", exn)
        finally:
            super().close()


def _streamed(fs: Any, path: str) -> Optional[BinaryIO]:
    """Open ``path`` as one streaming request if the backend supports it, else None."""
    from fsspec.asyn import AsyncFileSystem, sync

    if not isinstance(fs, AsyncFileSystem) or type(fs).open_async is AsyncFileSystem.open_async:
        return None
    if not getattr(fs, "asynchronous", False) and getattr(fs, "loop", None) is None:
        return None
    size = fs.size(path)
    if size is None:
        return None
    afile = sync(fs.loop, fs.open_async, path, "rb")
    return _SyncStreamedFile(fs, afile, size)  # type: ignore[return-value]


def _read_defaults(fs: Any, options: Dict[str, Any], open_kw: Dict[str, Any]) -> Dict[str, Any]:
    """The read-ahead cache and block size, where the backend's open() takes them.

    fsspec's defaults are poor for one sequential pass over a shard (gcsfs re-requests small
    ranges; s3fs fetches 50 MiB blocks), so reads ask for ``readahead`` with 8 MiB blocks, unless
    the caller chose either for the open or for the filesystem (``default_*``).
    """
    import inspect

    try:
        params = inspect.signature(fs._open).parameters
    except (TypeError, ValueError):
        return {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out: Dict[str, Any] = {}
    user_cache = "cache_type" in open_kw or "default_cache_type" in options
    if not user_cache and ("cache_type" in params or takes_any):
        out["cache_type"] = "readahead"
    if (
        "block_size" not in open_kw
        and "default_block_size" not in options
        and "block_size" in params
    ):
        out["block_size"] = REMOTE_BLOCK_SIZE
    return out


def _missing_backend(url: str, scheme: str, exn: ImportError) -> OpenError:
    from fsspec.registry import known_implementations

    extra = _EXTRAS.get(scheme)
    if extra is not None:
        how = f"install it with: pip install 'webds[{extra}]'"
    else:
        hint = known_implementations.get(scheme, {}).get("err", "")
        how = hint or "install the fsspec implementation for this protocol"
    return OpenError(f"no fsspec backend installed for '{scheme}://' URLs ({exn}); {how}", url=url)


def _error_chain(exn: BaseException) -> list:
    chain = []
    while exn is not None and len(chain) < 20 and exn not in chain:
        chain.append(exn)
        exn = exn.__cause__ or exn.__context__  # type: ignore[assignment]
    return chain


def _http_status(chain: list) -> Optional[int]:
    """The HTTP status an error in the chain carries (aiohttp's ``.status``, botocore's
    ``response['ResponseMetadata']['HTTPStatusCode']``), if any."""
    for exn in chain:
        status = getattr(exn, "status", None) or getattr(exn, "code", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        response = getattr(exn, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def _endpoint(chain: list) -> Optional[str]:
    """The server a connection error names: botocore keeps the request URL in ``kwargs``,
    aiohttp's connector errors have ``host`` and ``port``."""
    for exn in chain:
        fields = getattr(exn, "kwargs", None)
        if isinstance(fields, dict) and isinstance(fields.get("endpoint_url"), str):
            parsed = urlparse(fields["endpoint_url"])
            return f"{parsed.scheme}://{parsed.netloc}" if parsed.netloc else None
        host, port = getattr(exn, "host", None), getattr(exn, "port", None)
        if isinstance(host, str) and isinstance(port, int):
            return f"{host}:{port}"
    return None


def _bucket_and_key(fs: Any, path: str) -> Tuple[Optional[str], str]:
    """(bucket, key) on object stores (filesystems with ``split_path``), else (None, path)."""
    split = getattr(fs, "split_path", None)
    if split is None:
        return None, path
    try:
        parts = split(path)
        return (parts[0] or None), parts[1]
    except Exception:
        return None, path


def _bucket_exists(fs: Any, bucket: str) -> Optional[bool]:
    # One extra request, on the error path only; None when even that cannot tell.
    try:
        return bool(fs.exists(bucket))
    except Exception:
        return None


def _remote_error(
    exn: BaseException, url: str, scheme: str, *, fs: Any = None, path: Optional[str] = None
) -> OpenError:
    """Translate an fsspec/backend failure into an OpenError that says what to do.

    fsspec reports most failures as FileNotFoundError or PermissionError (its HTTP filesystem
    even reports a refused connection or a 503 as FileNotFoundError), so the decision rests on
    the whole exception chain: credential errors by class name, then the HTTP status, then
    connection failures, then the builtin class.
    """
    chain = _error_chain(exn)
    names = {cls.__name__ for err in chain for cls in type(err).__mro__}
    status = _http_status(chain)
    root = chain[-1]
    detail = f"{type(root).__name__}: {root}"
    if names & _NO_CREDENTIALS:
        hint = _CREDENTIAL_HINTS.get(scheme, "pass credentials in storage_options")
        return OpenError(f"no credentials found for '{scheme}://' URLs ({detail}); {hint}", url=url)
    if status is None:
        hint = _ENDPOINT_HINTS.get(scheme, "the host name and port in the URL")
        server = _endpoint(chain) or "the server"
        if names & _HUNG_UP_NAMES:
            return OpenError(
                f"{server} closed the connection without answering ({detail}); check {hint}: "
                "the host, the port, http or https",
                url=url,
            )
        connection = {"ConnectionError", "ClientConnectorError", "EndpointConnectionError"}
        if names & connection or any(isinstance(e, TimeoutError) for e in chain):
            return OpenError(
                f"cannot connect to {server} ({detail}); check {hint} and the network",
                url=url,
            )
    if status in (401, 403) or (status is None and isinstance(exn, PermissionError)):
        hint = _CREDENTIAL_HINTS.get(scheme, "check the credentials in storage_options")
        code = f" (HTTP {status})" if status else ""
        return OpenError(
            f"permission denied{code}: the credentials in use are wrong or may not access this "
            f"object; check them and the bucket's access policy. To choose credentials: {hint}",
            url=url,
        )
    if status in (404, 410) or (status is None and isinstance(exn, FileNotFoundError)):
        bucket, key = _bucket_and_key(fs, path) if fs is not None and path else (None, "")
        if bucket is not None and _bucket_exists(fs, bucket) is False:
            return OpenError(
                f"bucket {bucket!r} does not exist (or is not visible with these credentials); "
                "check the bucket name, and the endpoint or project it lives in",
                url=url,
            )
        if bucket is not None:
            return OpenError(
                f"object {key!r} not found in bucket {bucket!r}; check the prefix and name "
                "(and the brace pattern that produced it)",
                url=url,
            )
        code = f" (HTTP {status})" if status else ""
        return OpenError(f"not found{code}; check the URL", url=url)
    if status is not None:
        return OpenError(f"the server answered HTTP {status} ({detail})", url=url)
    if isinstance(exn, TypeError) and "keyword argument" in str(exn):
        # s3fs and gcsfs pass unknown storage_options on to their client, which rejects them
        # only when it first connects.
        return OpenError(
            f"the '{scheme}://' backend does not accept one of the storage_options ({exn}); "
            "check their names against its documentation",
            url=url,
        )
    return OpenError(f"cannot open: {type(exn).__name__}: {exn}", url=url)


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
