"""Shard lists: expanding URL patterns, shuffling and resampling shards, splitting them by node and
by DataLoader worker.

A shard list yields shard descriptors, ``{"url": ...}`` dicts, which the tar stages open.

Where each process is and the seeds every process agrees on are in :mod:`webds.base.workers`.

Importing this module does not import torch (the ``webds`` command lists shards with
:func:`expand_urls`): :class:`~webds.shards.datasets.SimpleShardList` and
:class:`~webds.shards.datasets.ResampledShards`, which subclass torch's ``IterableDataset``, are
in :mod:`webds.shards.datasets`.
"""

from __future__ import annotations

import glob
import os
import random
import re
import sys
from itertools import islice
from pathlib import Path
from typing import (
    Any,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Union,
)
from urllib.parse import urlparse

import braceexpand

from ..base.stage import stage, stateless
from ..base.workers import derive_seed, worker_info
from ..errors import ArgumentError, OpenError, SecureModeError, WebdsError
from ..io.remote import filesystem_options
from ..io.security import refuse, secure, url_to_fs
from ..io.urls import check_secure, local_path, url_scheme

__all__ = [
    "expand_urls",
    "expand_env",
    "SHARD_SUFFIXES",
    "split_by_node",
    "split_by_worker",
    "single_node_only",
    "non_empty",
    "resampled",
]

URLs = Union[str, Sequence[str]]

#: File name endings that a directory listing (a spec ending in "/") takes to be shards.
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")

_GLOB_CHARS = re.compile(r"[*?\[]")


def _is_shard_source(obj: Any) -> bool:
    """A shard list object (yields ``{"url": ...}``), told apart from an iterable of URLs."""
    data = sys.modules.get("torch.utils.data")
    return hasattr(obj, "set_epoch") or (data is not None and isinstance(obj, data.IterableDataset))


def expand_urls(urls: URLs, *, storage_options: Optional[Dict[str, Any]] = None) -> List[str]:
    """Expand a URL spec into a list of shard URLs, listing directories and globs.

    Several specs are joined by ``::`` in a string, or are the elements of a list or tuple. Each has
    its ``${NAME}`` variables replaced (:func:`expand_env`: ``WDS_NAME`` from the environment, as in
    webdataset, else ``NAME``), is brace-expanded, and each URL it gives is taken thus:

    - ending in ``/``: the directory or prefix is listed, not recursively, for shard files
      (``.tar``, ``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``; not hidden), sorted;
    - containing ``*``, ``?`` or ``[``: it is globbed (``glob`` with ``**`` locally, fsspec's
      ``fs.glob`` remotely), files only, sorted; for ``http(s)`` only the path counts, and a local
      name that matches nothing but exists literally (``a[1].tar``) is taken as is;
    - otherwise it is taken as is, without any filesystem or network call.

    ``pipe:`` and ``-`` are never listed or globbed; a listing or glob that finds nothing is an
    :class:`ArgumentError` naming the spec. Remote listings use ``storage_options`` (fsspec's),
    bypassing its listing cache ([more](../remote.md#lists-of-shards)).

    ``expand_urls("a-{000..002}.tar::b.tar") == ["a-000.tar", "a-001.tar", "a-002.tar", "b.tar"]``.
    """
    if isinstance(urls, (str, os.PathLike)):
        specs = os.fspath(urls).split("::")
    elif _is_shard_source(urls):
        # Refused before iterating: a source may act as it yields (DirectoryShardList claims).
        raise ArgumentError(
            f"{urls!r} is a shard source, not URLs: start a pipeline with it, "
            f"DataPipeline(source, tarfile_to_samples(), ...), instead of passing it as URLs"
        )
    elif isinstance(urls, Iterable):
        specs = [os.fspath(u) if isinstance(u, os.PathLike) else u for u in urls]
        if not all(isinstance(s, str) for s in specs):
            raise ArgumentError(f"shard URLs must be strings or paths, got {urls!r}")
    else:
        raise ArgumentError(f"expected a URL string or a list of URLs, got {type(urls).__name__}")
    result: List[str] = []
    for spec in specs:
        if spec == "":
            continue
        spec = expand_env(spec)
        for url in braceexpand.braceexpand(spec):
            kind = _listing_kind(url)
            if kind is None:
                result.append(url)
                continue
            found = _list_shards(url, kind, storage_options or {})
            if not found:
                what = "shard files in the directory" if kind == "dir" else "files matching"
                raise ArgumentError(
                    f"found no {what} {url!r} (from the spec {spec!r}); check the path, the "
                    f"bucket and prefix, and the credentials in storage_options"
                    + (
                        f" (listings take names ending in {', '.join(SHARD_SUFFIXES)})"
                        if kind == "dir"
                        else ""
                    ),
                    url=url,
                )
            result.extend(found)
    return result


_ENV_VAR = re.compile(r"\$\{(\w+)\}")


def expand_env(spec: str) -> str:
    """``${NAME}`` in a URL spec replaced by the environment's ``WDS_NAME`` (webdataset's rule),
    else ``NAME``, repeatedly (a value may hold another ``${...}``, up to 10 rounds); a name in
    neither is an :class:`ArgumentError` naming both. In secure mode only ``WDS_NAME`` is read,
    as in webdataset: a spec from someone else must not send ``${AWS_SECRET_ACCESS_KEY}`` to
    their server; without ``WDS_NAME`` it is a :class:`SecureModeError`.

    With ``WDS_BUCKET=s3://b/train``: ``expand_env("${BUCKET}/a-{0..9}.tar")`` ->
    ``"s3://b/train/a-{0..9}.tar"``.
    """
    only_wds = secure()

    def lookup(m: "re.Match[str]") -> str:
        name = m.group(1)
        if f"WDS_{name}" in os.environ:
            return os.environ[f"WDS_{name}"]
        if only_wds:
            # Whether NAME is set is not told either: the error must not be an oracle.
            refuse(
                f"reading ${{{name}}} of the URL spec {spec!r} from the environment variable "
                f"{name} (secure mode reads only WDS_-prefixed variables: set WDS_{name})"
            )
        if name in os.environ:
            return os.environ[name]
        raise ArgumentError(
            f"the URL spec {spec!r} uses ${{{name}}}, but neither WDS_{name} nor {name} is set "
            "in the environment"
        )

    for _ in range(10):
        expanded = _ENV_VAR.sub(lookup, spec)
        if expanded == spec:
            break
        spec = expanded
    return spec


def _listing_kind(url: str) -> Optional[str]:
    """ "dir" for a spec that names a directory/prefix, "glob" for a pattern, else None."""
    if url == "-" or url.startswith("pipe:"):
        return None
    if url.endswith("/"):
        return "dir"
    # In an http(s) URL, "?" starts the query string (signed URLs are full of them).
    part = urlparse(url).path if url_scheme(url) in ("http", "https") else url
    return "glob" if _GLOB_CHARS.search(part) else None


def _list_shards(url: str, kind: str, storage_options: Dict[str, Any]) -> List[str]:
    check_secure(url)  # before listing: which files a folder holds is already local data
    path = local_path(url)
    if path is not None:
        found = _list_local(url, path, kind)
        if url.startswith("file:"):
            return [Path(os.path.abspath(p)).as_uri() for p in found]
        return found
    return _list_remote(url, kind, storage_options)


def _is_shard_name(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(SHARD_SUFFIXES)


def _list_local(url: str, path: str, kind: str) -> List[str]:
    if kind == "glob":
        found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not found and os.path.isfile(path):
            return [path]
        return found
    try:
        with os.scandir(path) as entries:
            names = sorted(e.name for e in entries if _is_shard_name(e.name) and e.is_file())
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ArgumentError(
            f"{path!r} is a file, not a directory; drop the trailing '/' to read it as a shard",
            url=url,
        ) from None
    except OSError as exn:
        raise OpenError(f"cannot list the directory {path!r}: {exn}", url=url) from None
    return [path + name for name in names]


def _list_remote(url: str, kind: str, storage_options: Dict[str, Any]) -> List[str]:

    scheme = url_scheme(url) or ""
    try:
        fs, root = url_to_fs(url, **filesystem_options(storage_options))
    except SecureModeError:
        raise
    except ImportError as exn:
        raise OpenError(
            f"listing '{scheme}://' URLs needs an fsspec backend ({exn}); for S3 install "
            "'webds[s3]', for GCS 'webds[gcs]'",
            url=url,
        ) from None
    except ValueError as exn:
        raise ArgumentError(
            f"cannot list '{scheme}://' URLs ({exn}): fsspec does not know the protocol; name "
            "the shards one by one or with a brace pattern instead",
            url=url,
        ) from None
    # Listing happens once per dataset; a stale listing from earlier in the process (shards
    # written since) would silently drop shards, so ask the store again.
    fs.invalidate_cache()
    try:
        if kind == "dir":
            try:
                entries = fs.ls(root, detail=True)
            except FileNotFoundError:
                entries = []
            names = [
                e["name"]
                for e in entries
                if e.get("type") == "file" and _is_shard_name(e["name"].rstrip("/").split("/")[-1])
            ]
        else:
            matches = fs.glob(root, detail=True)
            names = [name for name, info in matches.items() if info.get("type") != "directory"]
    except WebdsError:
        raise
    except PermissionError as exn:
        raise OpenError(
            f"permission denied listing {url!r}: {exn}; check the credentials in storage_options",
            url=url,
        ) from None
    except Exception as exn:
        raise OpenError(
            f"listing {url!r} failed ({type(exn).__name__}: {exn}); check the endpoint and "
            "credentials in storage_options",
            url=url,
        ) from exn
    return sorted(fs.unstrip_protocol(name) for name in names)


@stateless
def split_by_node(src: Iterable[Any], group: Any = None) -> Iterator[Any]:
    """Keep every ``world_size``-th shard, starting at this node's rank."""
    info = worker_info(group)
    if info.world_size > 1:
        return islice(src, info.rank, None, info.world_size)
    return iter(src)


@stateless
def split_by_worker(src: Iterable[Any]) -> Iterator[Any]:
    """Keep every ``num_workers``-th shard, starting at this DataLoader worker's id."""
    info = worker_info()
    if info.num_workers > 1:
        return islice(src, info.worker, None, info.num_workers)
    return iter(src)


@stateless
def single_node_only(src: Iterable[Any], group: Any = None) -> Iterator[Any]:
    """Pass shards through, but refuse to run in a multi-node job (it would repeat data)."""
    if worker_info(group).world_size > 1:
        raise ArgumentError(
            "this dataset would give every node the same shards; use nodesplitter=split_by_node "
            "(or resampled=True) for multi-node training"
        )
    return iter(src)


@stateless
def non_empty(src: Iterable[Any]) -> Iterator[Any]:
    """Pass items through; raise ArgumentError at the end if there were none.

    ``DataPipeline(SimpleShardList(urls), split_by_worker, non_empty, ...)`` turns "this worker
    got no shards" into an error instead of a silently empty epoch.
    """
    empty = True
    for item in src:
        empty = False
        yield item
    if empty:
        raise ArgumentError(
            "this pipeline stage received no data at all: check the URLs, and that there are at "
            "least as many shards as nodes times DataLoader workers"
        )


@stage
def resampled(
    src: Iterable[Any],
    n: int = sys.maxsize,
    seed: Optional[int] = None,
    *,
    epoch: int = 0,
    pipeline_seed: Optional[int] = None,
) -> Iterator[Any]:
    """Read all of ``src``, then yield ``n`` items drawn from it at random with replacement.

    With ``seed`` the draws depend only on (seed, epoch, rank, worker), as in
    :class:`ResampledShards` with ``deterministic=True``; without one they follow the
    pipeline's seed (drawn for the pipeline if it has none), else fresh entropy.
    """
    if seed is None:
        seed = pipeline_seed
    if n < 0:
        raise ArgumentError(f"resampled: n must be >= 0, got {n}")
    items = list(src)
    if not items:
        raise ArgumentError("resampled: its source yielded nothing, so there is nothing to draw")
    where = worker_info()
    parts: tuple = ("resampled-stage", seed, epoch, tuple(where))
    if seed is None:
        parts += (os.urandom(8),)
    rng = random.Random(derive_seed(*parts))
    for _ in range(n):
        yield rng.choice(items)
