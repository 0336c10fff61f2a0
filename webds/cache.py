"""The shard cache: naming cached shards and keeping the cache directory under a size bound.

:class:`LRUCleanup` deletes the least recently used files of a cache directory until it fits its
size bound; :func:`pipe_cleaner` finds the real URL inside a ``pipe:`` command, so a shard read
through ``pipe:curl ... URL`` is cached under the name of URL, not of the command.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Callable, Optional

from .errors import ArgumentError

__all__ = ["LRUCleanup", "pipe_cleaner"]

log = logging.getLogger("webds")

# A word of a pipe: command that is a URL: a scheme followed by "://", or a "file:" URL.
_URL_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://\S+$|^file:\S+$")


def pipe_cleaner(spec: str) -> str:
    """Return the URL a ``pipe:`` spec reads, for naming its cache file; other specs unchanged.

    ``pipe_cleaner("pipe:curl -s -L https://host/a-000.tar") == "https://host/a-000.tar"``.
    If the command holds no URL, the spec itself is returned.
    """
    if not spec.startswith("pipe:"):
        return spec
    for word in spec[5:].split():
        word = word.strip("'\"")
        if _URL_WORD.match(word):
            return word
    return spec


def _last_used(path: str) -> float:
    # Of access and modification time, the later one: atime alone is frozen on noatime mounts.
    st = os.stat(path)
    return max(st.st_atime, st.st_mtime)


class LRUCleanup:
    """Keep the files of ``cache_dir`` under ``cache_size`` bytes, deleting the least recently
    used first (by ``keyfn(path)``, by default the later of access and modification time).

    :meth:`cleanup` does the work at most once every ``interval`` seconds, so it can be called
    before every download. Hidden files (temporary downloads in progress) are never deleted.
    """

    def __init__(
        self,
        cache_dir: Optional[str] = None,
        cache_size: int = int(1e12),
        keyfn: Callable[[str], float] = _last_used,
        verbose: bool = False,
        interval: Optional[float] = 30,
    ) -> None:
        if cache_size < 0:
            raise ArgumentError(f"cache_size must be >= 0 bytes, got {cache_size}")
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        self.keyfn = keyfn
        self.verbose = verbose
        self.interval = interval
        self.last_run = 0.0

    def set_cache_dir(self, cache_dir: str) -> None:
        """Change the directory to keep in bounds."""
        self.cache_dir = cache_dir

    def cleanup(self) -> int:
        """Delete least recently used files until the total fits; return the bytes freed."""
        if self.cache_dir is None or not os.path.isdir(self.cache_dir):
            return 0
        now = time.monotonic()
        if self.interval is not None and self.last_run and now - self.last_run < self.interval:
            return 0
        self.last_run = now
        files = []
        for root, _, names in os.walk(self.cache_dir):
            for name in names:
                if name.startswith("."):
                    continue
                path = os.path.join(root, name)
                try:
                    files.append((self.keyfn(path), os.path.getsize(path), path))
                except FileNotFoundError:
                    continue  # removed by another process meanwhile
        total = sum(size for _, size, _ in files)
        freed = 0
        for _, size, path in sorted(files):
            if total <= self.cache_size:
                break
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            total -= size
            freed += size
            if self.verbose:
                log.info("webds: cache cleanup removed %s (%d bytes)", path, size)
        return freed
