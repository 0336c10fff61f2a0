"""webdataset's ``cache`` module names that webds's own cache (:mod:`webds.io.cache`, a stage
that copies a shard while streaming it) does not have: ``FileCache`` (download whole, then
open), ``StreamingOpen``, ``url_to_cache_name``, ``download`` and their helpers, with 1.x's
signatures and behaviour, built on webds's opening (so ``s3://``, ``gs://``, secure mode and
webds's errors apply). ``webds.cache`` serves them (see :data:`webds.compat.aliases.EXTRAS`).
"""

from __future__ import annotations

import os
import sys
import urllib.parse
from typing import Any, Callable, Dict, Iterable, Iterator, Optional
from urllib.parse import urlparse

from ..base.handlers import reraise_exception
from ..errors import ArgumentError, NotATarError, NotFoundError
from ..io.cache import LRUCleanup
from ..io.urls import check_secure, local_path, open_url

__all__ = [
    "default_cache_dir",
    "default_cache_size",
    "verbose_cache",
    "islocal",
    "magic_filetype",
    "get_filetype",
    "check_tar_format",
    "url_to_cache_name",
    "download",
    "StreamingOpen",
    "FileCache",
    "NotATarError",
]

#: webdataset's defaults, from the same environment variables.
default_cache_dir = os.environ.get("WDS_CACHE", "./_cache")
default_cache_size = float(os.environ.get("WDS_CACHE_SIZE", "1e18"))
verbose_cache = int(os.environ.get("WDS_VERBOSE_CACHE", "0"))


def islocal(url: str) -> bool:
    """Whether ``url`` is a local path or a ``file:`` URL."""
    return urlparse(url).scheme in ("", "file")


def magic_filetype(fname: str) -> str:
    """``"NAME: gzip compressed data"``, ``"NAME: POSIX tar archive"`` or ``"NAME: data"``, from
    the file's first bytes."""
    try:
        with open(fname, "rb") as f:
            header = f.read(512)
    except FileNotFoundError:
        raise NotFoundError("no such file to check", url=fname) from None
    if header[:2] == b"\x1f\x8b":
        return f"{fname}: gzip compressed data"
    if header[257:262] == b"ustar":
        return f"{fname}: POSIX tar archive"
    return f"{fname}: data"


#: webdataset ran the ``file`` command here; the magic bytes say what this module checks.
get_filetype = magic_filetype


def check_tar_format(fname: str) -> bool:
    """Whether a file looks like a tar archive or a gzip file (by its magic bytes)."""
    kind = magic_filetype(fname).lower()
    return "tar archive" in kind or "gzip compressed" in kind


def url_to_cache_name(url: str, ndir: int = 0) -> str:
    """webdataset's cache name for ``url``: the last ``ndir + 1`` components of its path for the
    usual schemes, else the whole URL quoted (at most its last 128 characters)."""
    if not isinstance(url, str):
        raise ArgumentError(f"url_to_cache_name needs a str URL, got {url!r}")
    parsed = urlparse(url)
    schemes = ("", "file", "http", "https", "ftp", "ftps", "gs", "s3", "ais")
    if parsed.scheme in schemes:
        parts = parsed.path.lstrip("/").split("/")
        return "/".join(parts[-1 - ndir :])
    return urllib.parse.quote(url, safe="_+{}*,-")[-128:]


def download(url: str, dest: str, chunk_size: int = 1024**2, verbose: bool = False) -> None:
    """Copy ``url`` to the file ``dest`` (through a temporary name, renamed when complete)."""
    temp = dest + f".temp{os.getpid()}"
    try:
        with open_url(url, "rb") as stream, open(temp, "wb") as f:
            while True:
                data = stream.read(chunk_size)
                if not data:
                    break
                f.write(data)
        os.rename(temp, dest)
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    if verbose:
        print(f"# downloaded {url} to {dest}", file=sys.stderr)


def _url_of(item: Any) -> str:
    return item["url"] if isinstance(item, dict) else item


class StreamingOpen:
    """A stage: each URL (or ``{"url": ...}``) opened as ``{"url", "stream"}`` (plus
    ``"local_path"`` for a local file); errors go to ``handler``."""

    def __init__(self, verbose: bool = False, handler: Callable[..., bool] = reraise_exception):
        self.verbose = verbose
        self.handler = handler

    def __call__(self, urls: Iterable[Any]) -> Iterator[Dict[str, Any]]:
        for item in urls:
            url = _url_of(item)
            try:
                stream = open_url(url, "rb")
            except Exception as exn:
                if self.handler(exn):
                    continue
                break
            out = {"url": url, "stream": stream}
            path = local_path(url)
            if path is not None:
                out["local_path"] = path
            yield out


class FileCache:
    """A stage: each remote URL downloaded whole into ``cache_dir`` (as ``url_to_name(url)``),
    checked by ``validator``, then opened: ``{"url", "stream", "local_path"}``; local URLs are
    opened in place. ``cache_size`` > 0 bounds the folder (least recently used files go first).

    webds's own cache (``WebDataset(cache_dir=...)``) streams the first epoch while it fills the
    cache; this one waits for each download, as webdataset's did.
    """

    def __init__(
        self,
        cache_dir: Optional[str] = None,
        *,
        url_to_name: Callable[[str], str] = url_to_cache_name,
        verbose: bool = False,
        validator: Optional[Callable[[str], bool]] = check_tar_format,
        handler: Callable[..., bool] = reraise_exception,
        cache_size: int = -1,
        cache_cleanup_interval: int = 30,
    ) -> None:
        self.url_to_name = url_to_name
        self.validator = validator
        self.handler = handler
        self.cache_dir = default_cache_dir if cache_dir is None else cache_dir
        self.verbose = verbose
        self.cleaner: Optional[LRUCleanup] = None
        if cache_size > 0:
            self.cleaner = LRUCleanup(
                self.cache_dir, cache_size, verbose=verbose, interval=cache_cleanup_interval
            )

    def get_file(self, url: str) -> str:
        """The local path of ``url``: the file itself, or its copy in the cache (downloaded
        now if it is not there); a copy the validator refuses is removed and raises."""
        if not isinstance(url, str):
            raise ArgumentError(f"FileCache.get_file needs a str URL, got {url!r}")
        check_secure(url)
        path = local_path(url)
        if path is not None:
            return path
        name = self.url_to_name(url)
        dest = os.path.join(self.cache_dir, name)
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        if not os.path.exists(dest):
            if self.cleaner is not None:
                self.cleaner.cleanup()
            download(url, dest, verbose=self.verbose)
            if self.validator is not None and not self.validator(dest):
                kind = magic_filetype(dest)
                with open(dest, "rb") as f:
                    head = f.read(200)
                os.remove(dest)
                raise NotATarError(
                    f"the download {dest!r} is not a tar archive ({kind}); it starts with {head!r}",
                    url=url,
                )
        return dest

    def __call__(self, urls: Iterable[Any]) -> Iterator[Dict[str, Any]]:
        for item in urls:
            url = _url_of(item)
            try:
                dest = self.get_file(url)
                stream = open(dest, "rb")
            except Exception as exn:
                if self.handler(exn):
                    continue
                break
            yield {"url": url, "stream": stream, "local_path": dest}
