"""Opening a remote object again at a byte offset: the building blocks of resumed reads.

:func:`seek_opener` turns "open the file" into "open it at byte N" (a seek, which fsspec turns into
a ranged request); :func:`resumable_fsspec` and :func:`open_resumable` wrap an fsspec path in a
:class:`~webds.io.retrying.ResumableStream` that reopens where a dropped read stopped.
(:mod:`webds.io.remote` streams whole objects through :mod:`webds.io.ranged` instead, where the
backend allows, and uses :func:`seek_opener` for the others.)
"""

from __future__ import annotations

import io
from typing import Any, BinaryIO, Callable, Dict, Optional

from ..errors import OpenError, SecureModeError, ShardReadError
from .retrying import DEFAULT_RETRIES, BackoffLike, ResumableStream, _close_quietly
from .security import url_to_fs

__all__ = ["seek_opener", "resumable_fsspec", "open_resumable"]


def seek_opener(
    open_file: Callable[[], BinaryIO], url: Optional[str] = None
) -> Callable[[int], BinaryIO]:
    """Turn ``open_file()`` into ``open_at(offset)``: open, then ``seek(offset)``.

    For fsspec files the seek makes the next read a ranged request. A file that cannot seek
    (an HTTP server without range support, a streaming ``block_size=0`` file) raises a clear
    ShardReadError for any offset past 0.
    """

    def open_at(offset: int) -> BinaryIO:
        f = open_file()
        if offset:
            try:
                f.seek(offset)
            except (ValueError, OSError, io.UnsupportedOperation) as exn:
                _close_quietly(f)
                raise ShardReadError(
                    f"the read failed at byte offset {offset} and this source cannot resume "
                    f"there ({type(exn).__name__}: {exn}); the server must support range "
                    "requests (HTTP 'Accept-Ranges: bytes'), and fsspec must open a seekable "
                    "file (block_size > 0)",
                    url=url,
                    offset=offset,
                ) from exn
        return f

    return open_at


def resumable_fsspec(
    fs: Any,
    path: str,
    *,
    url: Optional[str] = None,
    retries: int = DEFAULT_RETRIES,
    backoff: BackoffLike = None,
    open_kwargs: Optional[Dict[str, Any]] = None,
    translate: Optional[Callable[[Exception], Exception]] = None,
) -> ResumableStream:
    """A :class:`ResumableStream` over ``fs.open(path, "rb", **open_kwargs)``, resumed by seek.

    ``url`` is the name used in errors and logs (default: ``path``). A file that cannot seek is
    still retried when it fails before its first byte, and raises a clear ShardReadError past
    that (see :func:`seek_opener`).
    """
    kwargs = dict(open_kwargs or {})
    name = url if url is not None else path
    return ResumableStream(
        seek_opener(lambda: fs.open(path, "rb", **kwargs), name),
        url=name,
        retries=retries,
        backoff=backoff,
        translate=translate,
    )


def open_resumable(
    url: str,
    *,
    retries: int = DEFAULT_RETRIES,
    backoff: BackoffLike = None,
    open_kwargs: Optional[Dict[str, Any]] = None,
    **storage_options: Any,
) -> ResumableStream:
    """Open an fsspec URL for reading with retries and resume.

    ``storage_options`` configure the filesystem (credentials, endpoints); ``open_kwargs`` go to
    ``fs.open`` (``block_size``, ``cache_type``).

    >>> with open_resumable("https://host/a.tar", retries=5, backoff=Backoff(initial=1)) as s:
    ...     members = list(read_members(s, "https://host/a.tar"))
    """

    try:
        fs, path = url_to_fs(url, **storage_options)
    except SecureModeError:
        raise
    except ImportError as exn:
        raise OpenError(
            f"no fsspec backend installed for this URL's scheme ({exn}); for S3 install "
            "'webds[s3]', for GCS 'webds[gcs]'",
            url=url,
        ) from None
    except ValueError as exn:
        raise OpenError(
            f"unknown URL scheme ({exn}); use a local path, 'pipe:CMD', or a protocol fsspec knows",
            url=url,
        ) from None
    return resumable_fsspec(
        fs, path, url=url, retries=retries, backoff=backoff, open_kwargs=open_kwargs
    )
