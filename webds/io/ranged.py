"""Streamed reads of remote objects: one GET from a byte offset to the end, with a read timeout.

Where the backend can ask for "the object from byte N on" in one request (http(s) through
fsspec's aiohttp session, s3 through s3fs's client, gs through gcsfs's session),
:func:`open_ranged` does: a plain GET at offset 0, after a failure an open-ended
``Range: bytes=N-`` GET from the first byte the reader has not received. Every byte that arrived
before a cut reaches the reader, so each attempt that delivers data makes progress (fsspec's
block cache asks for the whole block in flight again). A resumed request pins the first answer's
version (ETag or Last-Modified as ``If-Range``; S3's VersionId, else its ETag as ``If-Match``;
GCS's generation as ``ifGenerationMatch``): an object replaced in between is
:class:`ObjectChanged`, never a sample joined from two versions. Every request and read is
bounded by ``read_timeout``: a server that stalls raises
:class:`~webds.io.retrying.ReadStalled`, which :class:`~webds.io.retrying.ResumableStream`
retries. What users see: docs/remote.md and docs/damaged.md, "Bad links".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import sys
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

from ..base.redact import redact
from ..errors import ArgumentError, OpenError, ShardReadError
from .retrying import ReadStalled
from .streams import ReadStream

log = logging.getLogger("webds")

__all__ = [
    "DEFAULT_READ_TIMEOUT",
    "ObjectChanged",
    "RangeUnsupported",
    "check_read_timeout",
    "open_ranged",
    "ranged_get_for",
]

#: Seconds a network read may wait for its next bytes (or a request for its answer) before the
#: connection counts as dropped and is retried: ``storage_options={"read_timeout": ...}``; None
#: waits as long as the backend's own timeouts allow.
DEFAULT_READ_TIMEOUT = 30.0

# A ranged GET's answer: (read(n) coroutine function, close(), the object's whole size or None).
_Body = Tuple[Callable[[int], Awaitable[bytes]], Callable[[], None], Optional[int]]
# (fs, path, offset, pin): ``pin`` holds the object's version, taken from the read's first answer.
_RangedGet = Callable[[Any, str, int, Dict[str, Any]], Awaitable[_Body]]
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-\d+/(\d+|\*)$")


def check_read_timeout(value: Any) -> Optional[float]:
    """``read_timeout`` as seconds (> 0), or None for no limit; anything else is an error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ArgumentError(
            f"read_timeout must be a number of seconds > 0, or None for no limit; got {value!r}"
        )
    return float(value)


class RangeUnsupported(ShardReadError):
    """The server ignored the range asked for: resuming there would duplicate or skip bytes (a
    reader that wanted to start there can still read from the start instead)."""


class ObjectChanged(ShardReadError):
    """The object was replaced between two requests of one read (another ETag, version or
    generation): resuming would join two versions of it."""


def _changed(offset: int, was: Any, now: Any) -> ObjectChanged:
    return ObjectChanged(
        f"the object was replaced while it was read (it was {was}, it is now {now}): a read "
        f"resumed at byte offset {offset} would join two versions of it, so it stops here. "
        "Replace shards only where no job reads them (write a new name, then switch to it)",
        offset=offset,
    )


def _pinned(pin: Dict[str, Any], key: str, value: Any, offset: int, what: str) -> None:
    """Pin ``value`` (the first answer's version) or check a later answer's against it."""
    if value is None:
        return
    if key not in pin:
        pin[key] = value
    elif pin[key] != value:
        raise _changed(offset, f"{what} {pin[key]}", f"{what} {value}")


def _resume_error(offset: int, why: str) -> RangeUnsupported:
    return RangeUnsupported(
        f"the read failed at byte offset {offset} and this server cannot resume there ({why}); "
        "it must answer range requests (HTTP 'Accept-Ranges: bytes', status 206)",
        offset=offset,
    )


def _total_from_range(content_range: Optional[str], offset: int) -> Optional[int]:
    m = _CONTENT_RANGE.match((content_range or "").strip())
    if m is None or int(m.group(1)) != offset:
        raise _resume_error(offset, f"it answered the range 'Content-Range: {content_range}'")
    return None if m.group(2) == "*" else int(m.group(2))


def _object_size(status: int, headers: Any, offset: int) -> Optional[int]:
    """The whole object's size from a GET's answer (None if it does not say); an answer that
    is not the range asked for raises."""
    if status == 206:
        return _total_from_range(headers.get("Content-Range"), offset)
    if offset:
        raise _resume_error(offset, f"it answered HTTP {status} to a range request")
    length = headers.get("Content-Length")
    if length is None or headers.get("Content-Encoding", "identity") not in ("identity", ""):
        return None  # unknown, or the size of an encoding of the object
    return int(length)


async def _http_get(fs: Any, path: str, offset: int, pin: Dict[str, Any]) -> _Body:
    """GET through fsspec's HTTPFileSystem session (its headers, auth and client options)."""
    session = await fs.set_session()
    kwargs = dict(fs.kwargs)
    headers = dict(kwargs.pop("headers", None) or {})
    # The size and the range are in bytes of the object as stored, not as transfer-decoded.
    headers.setdefault("Accept-Encoding", "identity")
    # A body sent with a content coding all the same is read as it was sent, not inflated by
    # aiohttp out of sight: a gzip one is then a .tar.gz to the tar reader, its members and
    # samples bounded as in any compressed shard (issue 54: a 1 MB gzip body inflated to a
    # plain tar with a 1.1 GiB member). The caller may ask otherwise: auto_decompress=True.
    kwargs.setdefault("auto_decompress", False)
    if offset:
        headers["Range"] = f"bytes={offset}-"
        # The rest of this version only (a weak ETag can't say so: the date then).
        etag = pin.get("etag")
        validator = etag if etag and not etag.startswith("W/") else pin.get("modified")
        if validator:
            headers["If-Range"] = validator
    r = await session.get(fs.encode_url(path), headers=headers, **kwargs)
    try:
        r.raise_for_status()  # its status (404, 403, 503...) decides: retry, or say why
        if not pin.get("etag"):
            _pinned(pin, "modified", r.headers.get("Last-Modified"), offset, "last modified")
        _pinned(pin, "etag", r.headers.get("ETag"), offset, "ETag")
        size = _object_size(r.status, r.headers, offset)
        if not kwargs["auto_decompress"]:
            _check_coding(r.headers.get("Content-Encoding"), path)
    except BaseException:
        r.close()
        raise
    return _salvaging(r.content), r.close, size


#: Content codings whose bytes the readers take as they come: gzip is sniffed from its magic
#: bytes and read as a compressed shard (bounded like one).
_READ_AS_SENT = ("", "identity", "gzip", "x-gzip")


def _check_coding(coding: Optional[str], path: str) -> None:
    """Refuse a body in a content coding no reader would recognise (br, deflate, zstd...)."""
    codings = [c.strip().lower() for c in (coding or "").split(",")]
    if any(c not in _READ_AS_SENT for c in codings) or len([c for c in codings if c]) > 1:
        raise OpenError(
            f"the server sent the object with 'Content-Encoding: {coding}', though webds asked "
            "for it as stored (Accept-Encoding: identity); webds reads a body as sent and knows "
            "only gzip. Serve shards without a content coding, or pass "
            "storage_options={'auto_decompress': True} to have the HTTP client decode it (then "
            "unbounded: the decoded bytes are read as a plain tar)",
            url=path,
        )


def _salvaging(content: Any) -> Callable[[int], Awaitable[bytes]]:
    """``read(n)`` of an aiohttp body that delivers the bytes which arrived before a cut.

    aiohttp raises a cut connection (a payload error) on the next read even while bytes that came
    ahead of it are still buffered; they are handed over first, so that the attempt counts as
    progress and the resume asks only for what is missing. (``_buffer`` and ``_read_nowait`` are
    aiohttp's own; without them the error is raised as it is.)
    """

    async def read(n: int) -> bytes:
        try:
            return await content.read(n)
        except Exception:
            rest = getattr(content, "_read_nowait", None)
            if getattr(content, "_buffer", None) and rest is not None:
                return rest(n)
            raise

    return read


async def _s3_get(fs: Any, path: str, offset: int, pin: Dict[str, Any]) -> _Body:
    """get_object through s3fs's client (its credentials, endpoint, retries and errors)."""
    bucket, key, version = fs.split_path(path)
    kwargs = {"Range": f"bytes={offset}-"} if offset else {}
    version = version or pin.get("version")  # a versioned bucket: the same version again
    if version:
        kwargs["VersionId"] = version
    elif pin.get("etag"):
        kwargs["IfMatch"] = pin["etag"]
    try:
        r = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kwargs)
    except Exception as exn:
        if "IfMatch" in kwargs and _says(exn, "PreconditionFailed", "412"):
            raise _changed(offset, f"ETag {pin['etag']}", "another ETag") from None
        raise
    if r.get("VersionId") not in (None, "null"):
        _pinned(pin, "version", r["VersionId"], offset, "version")
    _pinned(pin, "etag", r.get("ETag"), offset, "ETag")
    body = r["Body"]
    content = getattr(getattr(body, "_raw_stream", None), "content", None)  # aiobotocore's
    if content is not None:
        read = _salvaging(content)
    else:

        async def read(n: int) -> bytes:
            return await body.read(n if n >= 0 else None)

    if offset:
        size = _total_from_range(r.get("ContentRange"), offset)
    else:
        size = r.get("ContentLength")
    return read, body.close, size


async def _gcs_get(fs: Any, path: str, offset: int, pin: Dict[str, Any]) -> _Body:
    """A media GET through gcsfs's session (its credentials, endpoint, user project)."""
    from gcsfs.retry import validate_response

    await fs._set_session()
    headers = fs._get_headers({"Range": f"bytes={offset}-"} if offset else None)
    params = fs._get_params({})
    if pin.get("generation"):
        params["ifGenerationMatch"] = pin["generation"]  # the same generation, or 412
    elif offset and pin.get("md5"):
        # No generation in the first answer (an emulator): the object's hash, asked again.
        fs.invalidate_cache(path)
        now = (await fs._info(path)).get("md5Hash")
        if now and now != pin["md5"]:
            raise _changed(offset, f"md5 {pin['md5']}", f"md5 {now}")
    r = await fs.session.get(
        fs.url(path), params=params, headers=headers, timeout=fs.requests_timeout
    )
    try:
        if r.status == 412 and pin.get("generation"):
            raise _changed(offset, f"generation {pin['generation']}", "another generation")
        _pinned(pin, "generation", r.headers.get("x-goog-generation"), offset, "generation")
        md5 = re.search(r"md5=([^,\s]+)", r.headers.get("x-goog-hash", ""))
        if md5 and not offset:
            pin.setdefault("md5", md5.group(1))
        if r.status >= 400:
            try:
                validate_response(r.status, await r.read(), path)
            except OSError as exn:
                if r.status in (401, 403):  # gcsfs says OSError("Forbidden"): not to retry
                    raise PermissionError(f"HTTP {r.status}: {exn}") from exn
                raise
        size = _object_size(r.status, r.headers, offset)
    except BaseException:
        r.close()
        raise
    return _salvaging(r.content), r.close, size


def _says(exn: BaseException, *words: str) -> bool:
    """Whether ``exn`` or its causes mention one of ``words`` (a botocore error code)."""
    seen: Any = exn
    while seen is not None:
        text = f"{type(seen).__name__} {seen} {getattr(seen, 'response', '')}"
        if any(w in text for w in words):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# Backends webds can ask for an open-ended range, by class name (matched along the MRO, so a
# subclass qualifies and neither package must be imported to check).
_RANGED_GETS = {"HTTPFileSystem": _http_get, "S3FileSystem": _s3_get, "GCSFileSystem": _gcs_get}


def ranged_get_for(fs: Any) -> Optional[_RangedGet]:
    """The ranged GET of ``fs``'s backend, or None if webds has none for it."""
    if getattr(fs, "loop", None) is None:
        return None
    for cls in type(fs).__mro__:
        get = _RANGED_GETS.get(cls.__name__)
        if get is not None:
            return get
    return None


async def _bounded(aw: Awaitable[Any], limit: Optional[float], what: str) -> Any:
    """Await ``aw`` for at most ``limit`` seconds. Not ``wait_for``: a timeout of the client's
    own (botocore's, aiohttp's) must keep its name rather than be reported as ours."""
    if limit is None:
        return await aw
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=limit)
    if done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task  # let the request clean up after itself
    raise ReadStalled(
        f"no answer for {limit:g} s while {what}; for a slow server raise "
        f"storage_options read_timeout= (now {limit:g} s; None for no limit)"
    )


def _sync(loop: Any, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """fsspec's ``sync``, raising our ReadStalled as it is (``sync`` turns any TimeoutError
    into its own FSTimeoutError, which would lose the message naming ``read_timeout``)."""
    from fsspec.asyn import sync
    from fsspec.exceptions import FSTimeoutError

    try:
        return sync(loop, fn, *args)
    except FSTimeoutError as exn:
        if isinstance(exn.__cause__, ReadStalled):
            raise exn.__cause__ from None
        raise


def _mark_inherited_fsspec_loop_stopped() -> None:
    """In a forked child (a DataLoader worker), mark fsspec's IO loop inherited from the parent
    as not running: its thread did not survive the fork, but the loop object says it runs, so
    closing each http session inherited from the parent (when its filesystem is collected, or
    at exit) waits a second on it for nothing. Marked stopped, fsspec closes their connections
    at once. fsspec itself starts a new loop in the child."""
    held: List[Any] = []

    def before() -> None:
        asyn = sys.modules.get("fsspec.asyn")
        loop = getattr(asyn, "loop", [None])[0] if asyn is not None else None
        held[:] = [loop] if loop is not None else []

    def after_in_child() -> None:
        for loop in held:
            if hasattr(loop, "_thread_id"):
                loop._thread_id = None  # what BaseEventLoop.is_running() reads
        held.clear()

    os.register_at_fork(before=before, after_in_child=after_in_child, after_in_parent=held.clear)


if hasattr(os, "register_at_fork"):
    _mark_inherited_fsspec_loop_stopped()


def _forked(pid: int) -> bool:
    """Whether this is a forked child of the process that opened the stream (``pid``): a
    stream inherited as garbage (a pipeline abandoned before a DataLoader forked its workers)
    is collected there, and its connection belongs to the parent's event loop, whose thread
    does not exist in the child. Closing it would wait on that loop forever; it is dropped."""
    return os.getpid() != pid


async def _call(fn: Callable[[], Any]) -> None:
    fn()  # in the event loop's thread: aiohttp and aiobotocore objects belong to it


class RangedStream(ReadStream):
    """A synchronous stream over one ranged GET; ``size`` is the whole object's, if known."""

    def __init__(
        self,
        fs: Any,
        path: str,
        offset: int,
        get: _RangedGet,
        read_timeout: Optional[float],
        pin: Optional[Dict[str, Any]] = None,
    ) -> None:
        self._loop = fs.loop
        self._limit = read_timeout
        self._read: Optional[Callable[[int], Awaitable[bytes]]] = None
        answer = get(fs, path, offset, {} if pin is None else pin)
        self._read, self._close, self.size = _sync(
            self._loop, _bounded, answer, read_timeout, "waiting for the response"
        )
        self._eof = False
        self._pid = os.getpid()

    def read(self, n: int = -1) -> bytes:
        if self._read is None:
            raise ValueError("read from a closed stream")
        what = "waiting for the next bytes of the body"
        data = _sync(self._loop, _bounded, self._read(n), self._limit, what)
        if not data and n != 0:
            self._eof = True
        return data

    def close(self) -> None:
        if self.closed:
            return
        from fsspec.asyn import sync

        self._read = None
        if _forked(self._pid):
            super().close()
            return
        try:
            sync(self._loop, _call, self._close)
        except Exception as exn:  # closing a broken response must not mask the real outcome
            log.debug("webds: ignoring error closing a ranged read: %s", redact(str(exn)))
        finally:
            super().close()


class StreamedFile(ReadStream):
    """Another backend's async streamed file (one GET for the whole object), read synchronously
    with every read bounded by ``read_timeout``."""

    def __init__(self, fs: Any, afile: Any, size: int, read_timeout: Optional[float]) -> None:
        self._fs = fs
        self._afile = afile
        self._limit = read_timeout
        self.size = size  # known up front, so an early end of the body is caught and resumed
        self._pid = os.getpid()

    def read(self, n: int = -1) -> bytes:
        what = "waiting for the next bytes of the body"
        return _sync(self._fs.loop, _bounded, self._afile.read(n), self._limit, what)

    def close(self) -> None:
        if self.closed:
            return
        from fsspec.asyn import sync

        if _forked(self._pid):
            super().close()
            return
        try:
            close = getattr(self._afile, "close", None)
            if close is not None:
                result = close()
                if hasattr(result, "__await__"):
                    sync(self._fs.loop, lambda: result)
        except Exception as exn:  # closing a half-read response must not mask the real outcome
            log.debug("webds: ignoring error closing a streamed file: %s", redact(str(exn)))
        finally:
            super().close()


def open_ranged(
    fs: Any,
    path: str,
    offset: int,
    read_timeout: Optional[float],
    pin: Optional[Dict[str, Any]] = None,
) -> Optional[ReadStream]:
    """Stream ``path`` from ``offset`` to its end in one request, or None if the backend can't.

    http(s), s3 and gs take an open-ended range at any offset; another fsspec async filesystem with
    a streamed open is used from offset 0 only (None elsewhere: resume through block reads).
    ``pin``, one dict for all the requests of one read, holds the version its first answer
    had; a later answer of another version raises :class:`ObjectChanged`.
    """
    get = ranged_get_for(fs)
    if get is not None:
        return RangedStream(fs, path, offset, get, read_timeout, pin)
    if offset:
        return None
    from fsspec.asyn import AsyncFileSystem

    if not isinstance(fs, AsyncFileSystem) or type(fs).open_async is AsyncFileSystem.open_async:
        return None
    if getattr(fs, "loop", None) is None:
        return None
    size = fs.size(path)
    if size is None:
        return None
    afile = _sync(fs.loop, _bounded, fs.open_async(path, "rb"), read_timeout, "opening")
    return StreamedFile(fs, afile, size, read_timeout)
