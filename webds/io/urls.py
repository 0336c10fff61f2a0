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

import functools
import logging
import os
import re
import stat
import sys
from typing import Any, BinaryIO, Callable, Dict, Optional, Union
from urllib.parse import urlparse
from urllib.request import url2pathname

from ..base.redact import redact
from ..errors import ArgumentError, NotFoundError, OpenError, SecureModeError, WebdsError
from .pipes import PIPE_IDLE_SECONDS, PipeStream
from .ranged import check_read_timeout
from .remote import _open_fsspec, filesystem_options, fsspec_opener
from .security import (
    WEBDATASET_LOCAL,
    WEBDATASET_PIPE,
    WEBDATASET_REWRITE,
    check_fsspec_url,
    refuse,
    secure,
    url_to_fs,
)
from .streams import AtomicFile, _Unclosable

log = logging.getLogger("webds")

__all__ = [
    "open_url",
    "deferred_open",
    "local_path",
    "url_identity",
    "url_scheme",
    "opens_at_offset",
    "registered_opener",
    "check_secure",
    "rewrite_url",
    "make_parent_folder",
    "existing_size",
    "SCHEMES",
    "SchemeOpener",
    "DEFAULT_BUFSIZE",
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
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except PermissionError as exn:
        raise _FolderPermissionError(
            f"cannot create or enter the folder {folder!r} for {path!r}: permission denied "
            f"at {exn.filename!r}; a folder on the way needs write and search (x) permission "
            "for this user: fix its mode (chmod u+wx), or write elsewhere",
            url=os.fspath(url),
        ) from None
    except OSError as exn:
        raise OpenError(
            f"cannot create the folder {folder!r} for {path!r}: {exn.strerror or exn} "
            f"(at {exn.filename!r}); check that path",
            url=os.fspath(url),
        ) from None


class _FolderPermissionError(OpenError, PermissionError):
    """An output's folder can't be created or entered (also a PermissionError, as before)."""


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

    try:
        fs, fspath = url_to_fs(url, **filesystem_options(dict(storage_options or {})))
    except SecureModeError:
        raise
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


def opens_at_offset(url: PathOrURL) -> bool:
    """Whether :func:`open_url` can open ``url`` for reading at a byte offset without reading
    what comes before (a local file, or a URL fsspec opens): not ``-``, a ``pipe:`` command, or a
    scheme with a registered opener."""
    name = os.fspath(url)
    if not isinstance(name, str) or name in ("", "-") or name.startswith("pipe:"):
        return False
    return local_path(name) is not None or registered_opener(name) is None


def open_url(
    url: PathOrURL,
    mode: str = "rb",
    *,
    bufsize: int = DEFAULT_BUFSIZE,
    offset: int = 0,
    **storage_options: Any,
) -> BinaryIO:
    """Open ``url`` as a binary stream for reading (``"rb"``) or writing (``"wb"``).

    A scheme registered in :data:`SCHEMES` is opened by its handler, called as
    ``handler(url, mode, bufsize, **storage_options)``; ``bufsize`` is used by nothing else.
    Otherwise ``storage_options`` go to fsspec for remote URLs (credentials, endpoints, block
    sizes). The caller closes the stream; for writes, closing commits the data (renames the
    temporary file into place, or waits for the ``pipe:`` command and checks its exit status).
    ``offset`` starts a read at that byte, for a URL that :func:`opens_at_offset` (a local seek,
    one range request for a remote object).
    """
    if mode not in ("rb", "wb"):
        raise ArgumentError(f"open_url: mode must be 'rb' or 'wb', not {mode!r}")
    url = os.fspath(url)
    if not isinstance(url, str) or url == "":
        raise ArgumentError(f"open_url: expected a URL or path string, got {url!r}")
    url = rewrite_url(url)
    if offset:
        _check_offset(url, mode, offset)
    if url == "-":
        std = sys.stdin if mode == "rb" else sys.stdout
        return _Unclosable(std.buffer)  # type: ignore[return-value]
    check_secure(url)  # before a registered opener: "__default__" may not take every scheme
    registered = registered_opener(url)
    if registered is not None:
        return _open_registered(registered, url, mode, bufsize, storage_options)
    if url.startswith("pipe:"):
        # A command's output is a link too: ``read_timeout`` bounds its silences (the rest of
        # storage_options is for fsspec, and a list may mix pipe: and remote URLs).
        idle = check_read_timeout(storage_options.get("read_timeout", PIPE_IDLE_SECONDS))
        return PipeStream(url[5:], mode, idle_seconds=idle)  # type: ignore[return-value]
    path = local_path(url)
    if path is not None:
        f = _open_local(url, path, mode)
        if offset:
            f.seek(offset)
        return f
    return _open_fsspec(url, mode, storage_options, offset)


def rewrite_url(url: str) -> str:
    """``url`` rewritten by webdataset's ``GOPEN_REWRITE`` rules, if that variable is set:
    ``"pattern=replacement;..."``, each pattern a regular expression matched at the start of the
    URL, the first that changes it wins (``GOPEN_REWRITE="http://old/=s3://new/"`` reads
    ``http://old/a.tar`` from ``s3://new/a.tar``). :func:`open_url` applies it to every URL.
    Secure mode refuses it, as webdataset does: the environment would choose what is read."""
    rules = os.environ.get("GOPEN_REWRITE")
    if not rules or url == "-":
        return url
    refuse("URL rewriting from the environment (GOPEN_REWRITE)", url, WEBDATASET_REWRITE)
    for rule in rules.split(";"):
        pattern, sep, replacement = rule.partition("=")
        if not sep:
            raise ArgumentError(
                f"GOPEN_REWRITE rule {rule!r} is not 'pattern=replacement' (rules are separated "
                "by ';')"
            )
        new = re.sub("^" + pattern, replacement, url)
        if new != url:
            if os.environ.get("GOPEN_VERBOSE", "0") not in ("", "0"):
                log.info("webds: GOPEN_REWRITE %s -> %s", redact(url), redact(new))
            return new
    return url


def check_secure(url: PathOrURL) -> None:
    """Raise :class:`~webds.errors.SecureModeError` if secure mode (:mod:`webds.io.security`)
    refuses ``url``: a ``pipe:`` command (``PIPE:`` and `` pipe:`` too, which would otherwise
    open files of those names), a local file in any spelling, and every fsspec URL not on
    secure mode's allow-list (:data:`~webds.io.security.ALLOWED_PROTOCOLS`). ``-`` and schemes
    with an opener registered by name are the caller's own choice, and pass; so does the
    ``"__default__"`` opener, for schemes fsspec does not know."""
    if not secure():
        return
    name = os.fspath(url)
    if not isinstance(name, str) or name == "-" or _left_to_user(name):
        return
    if url_scheme(name) == "pipe":
        refuse("pipe: URLs (they run a shell command)", name, WEBDATASET_PIPE)
    elif local_path(name) is not None:
        refuse("local files (only remote URLs are opened)", name, WEBDATASET_LOCAL)
    check_fsspec_url(name)


def _left_to_user(url: str) -> bool:
    """Whether secure mode leaves ``url`` to an opener the user registered: one registered for
    its scheme by name, or ``"__default__"`` for a scheme fsspec does not know (the user's own;
    ``local://`` or ``reference://`` are checked as fsspec would open them)."""
    scheme = url_scheme(url)
    if scheme is None or scheme in SCHEMES:
        return scheme is not None
    if scheme in ("file", "pipe") or "__default__" not in SCHEMES:
        return False
    import fsspec

    return scheme not in fsspec.available_protocols()


def _check_offset(url: str, mode: str, offset: Any) -> None:
    if mode != "rb" or not isinstance(offset, int) or offset < 0:
        raise ArgumentError(f"open_url: offset is a byte offset >= 0 to read from, got {offset!r}")
    if not opens_at_offset(url):
        raise ArgumentError(
            "open_url: only local files and fsspec URLs open at an offset (not '-', pipe: "
            "commands or schemes with a registered opener)",
            url=url,
        )


def deferred_open(
    url: PathOrURL, mode: str = "rb", *, offset: int = 0, **storage_options: Any
) -> Callable[[], BinaryIO]:
    """``open_url(url, mode, offset=offset, **storage_options)`` in two steps: what needs no
    I/O now, in this thread (an fsspec URL's filesystem, shared with this thread's other
    opens), the rest when the function returned is called, maybe in another thread. An error
    of the first step is raised by that call too, so that it comes in the shard's turn."""
    name = os.fspath(url)
    plain = functools.partial(open_url, url, mode, offset=offset, **storage_options)
    try:
        name = rewrite_url(name) if isinstance(name, str) else name
    except Exception:  # raised again, in its turn, by the same call
        return plain
    if (
        not isinstance(name, str)
        or name in ("", "-")
        or name.startswith("pipe:")
        or local_path(name) is not None
        or registered_opener(name) is not None
    ):
        return plain
    try:
        if offset:
            _check_offset(name, mode, offset)
        return fsspec_opener(name, mode, storage_options, offset)
    except Exception:  # raised again, in its turn, by the same call
        return plain


def registered_opener(url: str) -> Optional[SchemeOpener]:
    """The opener registered in :data:`SCHEMES` that :func:`open_url` would use for ``url``,
    or None."""
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
        raise NotFoundError(
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
