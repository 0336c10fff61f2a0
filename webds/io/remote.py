"""Open remote URLs through fsspec, and turn its failures into errors that say what to do.

This is what :func:`~webds.io.urls.open_url` does for every scheme fsspec owns (``s3://``,
``gs://``, ``http(s)://``...): read defaults fit for one sequential pass, reads that resume after a
dropped connection (:mod:`webds.io.retrying`), and an :class:`~webds.errors.OpenError` naming the
fix (credentials, endpoint, bucket, extra to install). fsspec is imported only when one is opened.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, BinaryIO, Callable, Dict, Optional, Tuple
from urllib.parse import urlparse

from ..base.redact import redact_exception
from ..errors import NotFoundError, OpenError, SecureModeError, WebdsError, WriteError
from .ranged import DEFAULT_READ_TIMEOUT, check_read_timeout, open_ranged
from .reopen import open_resumable, resumable_fsspec, seek_opener  # noqa: F401 (named here too)
from .retrying import _HUNG_UP_NAMES, DEFAULT_RETRIES, BackoffLike, ResumableStream
from .security import url_to_fs
from .streams import TranslatedWrites

log = logging.getLogger("webds")

__all__ = [
    "filesystem_options",
    "fsspec_opener",
    "read_range",
    "REMOTE_BLOCK_SIZE",
    "seek_opener",
    "resumable_fsspec",
    "open_resumable",
]

#: Read-side block size for remote files: big enough that a shard streams in a few requests per
#: 8 MiB (S3/GCS charge and delay per request), small enough that the first sample arrives after
#: one block rather than after the whole shard.
REMOTE_BLOCK_SIZE = 8 << 20

# Arguments of ``fs.open()`` rather than of the filesystem: taken out of ``storage_options``.
_OPEN_OPTIONS = ("block_size", "cache_type", "cache_options")
# storage_options that say how to read a stream (open and retry), not how to build a filesystem.
_STREAM_OPTIONS = _OPEN_OPTIONS + ("retries", "retry_backoff", "read_timeout")


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


def _open_fsspec(url: str, mode: str, storage_options: dict, offset: int = 0) -> BinaryIO:
    """Open a remote URL through fsspec, streaming-friendly, with errors as OpenError (see
    :func:`fsspec_opener`)."""
    return fsspec_opener(url, mode, storage_options, offset)()


def fsspec_opener(
    url: str, mode: str, storage_options: dict, offset: int = 0
) -> Callable[[], BinaryIO]:
    """Resolve a remote URL's fsspec filesystem now; the function returned opens the URL
    (for reading, from byte ``offset``: one range request, not a read of what comes before).

    The filesystem is looked up (or made) in the calling thread, so that threads which open
    for it (:mod:`webds.io.readahead`) share its session and connections: fsspec keeps one
    instance per thread, each with its own session, which a forked DataLoader worker then
    spends a second closing.

    ``block_size``, ``cache_type`` and ``cache_options`` in ``storage_options`` go to
    ``fs.open()``; ``retries``, ``retry_backoff`` and ``read_timeout`` set how reads recover from
    a broken or stalled connection (:class:`~webds.io.retrying.ResumableStream`: reopen at the
    offset reached); the rest configure the filesystem (credentials, endpoint). http(s) and s3
    objects are read as one streamed GET, resumed with an open-ended range
    (:mod:`webds.io.ranged`); other backends, or a caller who chose block reads, read ahead in
    :data:`REMOTE_BLOCK_SIZE` blocks where the backend takes them.
    """

    scheme = urlparse(url).scheme.lower()
    options = dict(storage_options)
    open_kw = {name: options.pop(name) for name in _OPEN_OPTIONS if name in options}
    retries = options.pop("retries", DEFAULT_RETRIES)
    backoff = options.pop("retry_backoff", None)
    read_timeout = check_read_timeout(options.pop("read_timeout", DEFAULT_READ_TIMEOUT))
    try:
        fs, path = url_to_fs(url, **_with_read_timeout(scheme, options, read_timeout))
    except SecureModeError:
        raise
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
    return functools.partial(
        _open_resolved, fs, path, url, scheme, mode, options, open_kw, defaults, read_timeout,
        retries, backoff, offset,
    )  # fmt: skip


def _open_resolved(
    fs: Any,
    path: str,
    url: str,
    scheme: str,
    mode: str,
    options: Dict[str, Any],
    open_kw: Dict[str, Any],
    defaults: Dict[str, Any],
    read_timeout: Optional[float],
    retries: int,
    backoff: BackoffLike,
    offset: int = 0,
) -> BinaryIO:

    def open_file() -> BinaryIO:
        try:
            return fs.open(path, mode, **defaults, **open_kw)
        except TypeError as exn:
            # A backend whose open() passes unknown keywords on to something stricter.
            if not any(name in str(exn) for name in defaults):
                raise
            return fs.open(path, mode, **open_kw)

    chose_blocks = any(name in options for name in ("default_block_size", "default_cache_type"))

    # A whole shard is one sequential read: stream it in one request where the backend can
    # (webds.io.ranged), unless the caller chose block reads; resume the same way, from the
    # first byte not yet delivered. Otherwise read blocks, and resume by seeking.
    streams = not open_kw and not chose_blocks

    pin: Dict[str, Any] = {}  # the object's version, the same for every request of this read

    def open_at(offset: int) -> Any:
        if streams:
            stream = open_ranged(fs, path, offset, read_timeout, pin)
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
                offset=offset,
                translate=lambda exn: _remote_error(exn, url, scheme, fs=fs, path=path),
                connect_retries=0 if retried_below else None,
            )
        # A refused or broken upload shows at write() or close(): said as for a read.
        return TranslatedWrites(  # type: ignore[return-value]
            open_file(), lambda exn: _write_error(exn, url, scheme, fs, path)
        )
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


def _with_read_timeout(
    scheme: str, options: Dict[str, Any], read_timeout: Optional[float]
) -> Dict[str, Any]:
    """Filesystem options with ``read_timeout`` (plus a second, so that webds's own timer fires
    first on streamed reads) as the http session's socket read timeout.

    This bounds the block reads too (fsspec's HTTPFile), and lifts aiohttp's default limit of
    300 s on a whole request, which a large shard streamed in one GET can exceed on a slow link.
    A ``client_kwargs={"timeout": ...}`` of the caller's own is kept.
    """
    if scheme not in ("http", "https") or read_timeout is None:
        return options
    client_kwargs = dict(options.get("client_kwargs") or {})
    if "timeout" in client_kwargs:
        return options
    import aiohttp

    client_kwargs["timeout"] = aiohttp.ClientTimeout(
        total=None, sock_connect=max(read_timeout, 30.0), sock_read=read_timeout + 1.0
    )
    return dict(options, client_kwargs=client_kwargs)


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


class _WriteRefused(OpenError, WriteError):
    """A remote write refused (credentials, permissions, a missing bucket): the OpenError a
    read would give, and a WriteError."""


def _write_error(exn: BaseException, url: str, scheme: str, fs: Any, path: str) -> BaseException:
    """A failed remote write (or its commit) as a webds error: refused as a read would be; a
    connection lost during the upload said so when the store still answers."""
    if isinstance(exn, WebdsError):
        return exn
    chain = _error_chain(exn)
    root = chain[-1]
    if _http_status(chain) is None and _lost_connection(chain):
        bucket, _ = _bucket_and_key(fs, path)
        if bucket is not None and _bucket_exists(fs, bucket) is not None:
            return WriteError(
                f"the connection broke during the upload ({type(root).__name__}: {root}); the "
                "store answers, so it was the link: the shard was not written, write it again",
                url=url,
            )
    return _WriteRefused(_remote_error(exn, url, scheme, fs=fs, path=path).message, url=url)


#: Exception class names (in an error's chain) that say a connection failed or was lost.
_CONNECTION_NAMES = frozenset(
    {"ConnectionError", "ClientConnectorError", "EndpointConnectionError"}
)


def _lost_connection(chain: list) -> bool:
    """Whether an error's chain says the connection failed, was lost or timed out."""
    names = {cls.__name__ for err in chain for cls in type(err).__mro__}
    timed_out = any(isinstance(e, TimeoutError) for e in chain)
    return bool(names & (_CONNECTION_NAMES | _HUNG_UP_NAMES)) or timed_out


def _remote_error(
    exn: BaseException, url: str, scheme: str, *, fs: Any = None, path: Optional[str] = None
) -> OpenError:
    """Translate an fsspec/backend failure into an OpenError that says what to do.

    fsspec reports most failures as FileNotFoundError or PermissionError (its HTTP filesystem
    even reports a refused connection or a 503 as FileNotFoundError), so the decision rests on
    the whole exception chain: credential errors by class name, then the HTTP status, then
    connection failures, then the builtin class.
    """
    redact_exception(exn)  # it becomes the cause, shown in a traceback
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
        if _lost_connection(chain):
            return OpenError(
                f"cannot connect to {server} ({detail}); check {hint} and the network",
                url=url,
            )
    if status in (401, 403) or (status is None and isinstance(exn, PermissionError)):
        code = f" (HTTP {status})" if status else ""
        if scheme in ("http", "https"):  # a web server, not an object store: no bucket policy
            return OpenError(
                f"the server refused access{code}; check the URL, and whether the server needs "
                "credentials: pass them as request options, e.g. storage_options={'headers': "
                "{'Authorization': ...}} or {'client_kwargs': {'auth': ...}}",
                url=url,
            )
        hint = _CREDENTIAL_HINTS.get(scheme, "check the credentials in storage_options")
        return OpenError(
            f"permission denied{code}: the credentials in use are wrong or may not access this "
            f"object; check them and the bucket's access policy. To choose credentials: {hint}",
            url=url,
        )
    if status in (404, 410) or (status is None and isinstance(exn, FileNotFoundError)):
        bucket, key = _bucket_and_key(fs, path) if fs is not None and path else (None, "")
        if bucket is not None and _bucket_exists(fs, bucket) is False:
            return NotFoundError(
                f"bucket {bucket!r} does not exist (or is not visible with these credentials); "
                "check the bucket name, and the endpoint or project it lives in",
                url=url,
            )
        if bucket is not None:
            return NotFoundError(
                f"object {key!r} not found in bucket {bucket!r}; check the prefix and name "
                "(and the brace pattern that produced it)",
                url=url,
            )
        code = f" (HTTP {status})" if status else ""
        return NotFoundError(f"not found{code}; check the URL", url=url)
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


def read_range(url: str, start: int, end: int, storage_options: Dict[str, Any]) -> bytes:
    """Bytes ``[start, end)`` of a remote object in one ranged request (s3 ``get_object`` with
    a Range, a GET with ``Range: bytes=start-(end-1)``...), failures as webds errors."""

    scheme = urlparse(url).scheme.lower()
    try:
        fs, path = url_to_fs(url, **filesystem_options(storage_options))
    except SecureModeError:
        raise
    except ImportError as exn:
        raise _missing_backend(url, scheme, exn) from None
    except Exception as exn:
        raise _remote_error(exn, url, scheme) from exn
    try:
        return bytes(fs.cat_file(path, start=start, end=end))
    except WebdsError:
        raise
    except Exception as exn:
        raise _remote_error(exn, url, scheme, fs=fs, path=path) from exn
