"""The shard cache as a stage: :func:`cached_shards` opens shards through a
:class:`~webds.io.cache.ShardCache`, which keeps a copy only once it reads as a complete tar.

The cache itself (:mod:`webds.io.cache`) knows nothing of the tar format; this module gives it the
check, :func:`complete_tar`, that reads every member of the copy.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO, Dict, Iterable, Iterator, Optional, Tuple

from ..base.handlers import Handler, reraise_exception
from ..base.stage import stage
from ..errors import ArgumentError
from ..io.cache import ShardCache
from .reader import read_members
from .samples import open_shards

__all__ = ["cached_shards", "complete_tar", "cache_settings"]


def cache_settings(cache_dir: Optional[str], cache_size: int) -> Tuple[Optional[str], int]:
    """``(cache_dir, cache_size)`` with webdataset's environment settings applied: ``WDS_CACHE``
    and ``WDS_CACHE_SIZE`` (bytes), when set, win over the arguments, as in webdataset."""
    cache_dir = os.environ.get("WDS_CACHE") or cache_dir
    size = os.environ.get("WDS_CACHE_SIZE", "").strip()
    if size:
        try:
            cache_size = int(size)
        except ValueError:
            raise ArgumentError(f"WDS_CACHE_SIZE must be a number of bytes, got {size!r}") from None
    return (None if cache_dir is None else os.path.expanduser(cache_dir)), cache_size


def complete_tar(copy: BinaryIO, url: str) -> None:
    """Read every member of ``copy``; a truncated or corrupt tar raises ShardReadError."""
    for _ in read_members(copy, url):
        pass


@stage(stateless=True)
def cached_shards(
    src: Iterable[Dict[str, Any]],
    cache_dir: str,
    cache_size: int = -1,
    handler: Handler = reraise_exception,
    cache_local: bool = False,
    verbose: bool = False,
    **storage_options: Any,
) -> Iterator[Dict[str, Any]]:
    """Open each shard ``{"url": ...}`` through a :class:`ShardCache` in ``cache_dir``.

    Adds ``"stream"`` (and ``"local_path"`` when the shard is read from disk), which
    :func:`~webds.tar.samples.tarfile_to_samples` reads and closes. ``cache_size`` > 0 bounds the
    directory in bytes (least recently used shards go first).
    """
    cache = ShardCache(
        cache_dir, cache_size, cache_local=cache_local, verbose=verbose, check=complete_tar
    )

    def open_shard(shard: Any) -> Tuple[str, Any, Optional[str]]:
        url = shard["url"] if isinstance(shard, dict) else os.fspath(shard)
        return (url, *cache.open(url, **storage_options))

    return open_shards(src, open_shard, handler, "cached_shards")
