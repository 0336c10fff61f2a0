"""The shard cache: remote shards are kept on local disk after their first read.

``WebDataset(urls, cache_dir="/local/cache")`` (or the stage
:func:`~webds.tar.cached.cached_shards`) streams a shard that is not in the cache yet and writes
it to the cache *while* it is read, so the first epoch does not wait for whole downloads; later
epochs read the local copy. A copy is kept only once it was read to its end and is known to be
whole: all of its known size arrived (``nbytes`` from the caller, e.g. an index, or the size
the source reports), or, for a source that gives none, it ends with the tar end-of-archive
marker; otherwise the read raises :class:`~webds.errors.ShardReadError` and nothing is kept. A
copy is written under a hidden temporary name and renamed into place; several workers and
processes share a directory, the first reader of a shard locking its entry (``flock``) and
filling it. :class:`LRUCleanup` keeps the directory under ``cache_size`` bytes;
:func:`pipe_cleaner` caches a ``pipe:curl ... URL`` shard under the name of URL. The rules in
full: [Remote storage](../remote.md#the-shard-cache).
"""

from __future__ import annotations

import bz2
import hashlib
import logging
import lzma
import os
import re
import time
import uuid
import zlib
from typing import Any, BinaryIO, Callable, Optional, Tuple

from ..base.redact import redact
from ..errors import ArgumentError, ShardReadError, WebdsError
from .streams import ReadStream
from .urls import check_secure, local_path, open_url

__all__ = ["LRUCleanup", "pipe_cleaner", "ShardCache", "CopyCheck", "pid_alive"]

#: ``check(copy, url)`` raises :class:`~webds.errors.WebdsError` when a copy read to its end is
#: still not a whole shard (the tar stages pass a check that reads every member).
CopyCheck = Callable[[BinaryIO, str], None]

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


# When a reader closes a shard before its end, at most this much of the rest is read to finish
# the cache copy: a tar's end-of-archive padding fits, an abandoned shard's remainder does not.
_DRAIN_LIMIT = 1 << 20
_TEMP = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]+$")


class ShardCache:
    """A directory of complete shards, named so that distinct URLs never collide.

    ``open(url)`` returns ``(stream, local_path)``: the cached file if there is one, otherwise
    the remote stream, copied into the cache as it is read. Local files are read in place
    unless ``cache_local`` is true (e.g. shards on a slow network filesystem). ``check`` (see
    :data:`CopyCheck`) decides whether a copy read to its end is complete; without one, every
    such copy is kept.
    """

    def __init__(
        self,
        cache_dir: str,
        cache_size: int = -1,
        *,
        cache_local: bool = False,
        verbose: bool = False,
        check: Optional[CopyCheck] = None,
    ) -> None:
        if not cache_dir:
            raise ArgumentError("ShardCache needs a cache directory")
        self.cache_dir = os.fspath(cache_dir)
        os.makedirs(self.cache_dir, exist_ok=True)
        self.cache_local = cache_local
        self.verbose = verbose
        self.check = check
        # Run after every new shard: a directory walk costs far less than a shard download.
        self.lru = LRUCleanup(self.cache_dir, cache_size, interval=None) if cache_size > 0 else None
        self._remove_orphans()

    def path_for(self, url: str) -> str:
        """The cache file of ``url``: a digest of the whole URL, then its base name."""
        name = os.path.basename(pipe_cleaner(url).rstrip("/").split("?")[0]) or "shard"
        name = re.sub(r"[^A-Za-z0-9._-]", "_", name)[-80:]
        digest = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
        return os.path.join(self.cache_dir, f"{digest}-{name}")

    def open(
        self, url: str, *, nbytes: Optional[int] = None, **storage_options: Any
    ) -> Tuple[BinaryIO, Optional[str]]:
        """Open ``url`` through the cache; returns the stream and its local path if it has one.

        ``nbytes``, if known (an index's byte count), is the shard's whole size: a copy of any
        other size is not kept. Without it, the source's own size counts, if it has one.
        Secure mode refuses ``pipe:`` and local URLs here too, cached copy or not.
        """
        check_secure(url)
        lpath = local_path(url)
        if lpath is not None and not self.cache_local:
            return open_url(url, "rb"), lpath
        path = self.path_for(url)
        try:
            stream = open(path, "rb")
        except FileNotFoundError:
            pass
        else:
            os.utime(path)  # most recently used, for LRUCleanup
            return stream, path
        lock = _lock(path)
        if lock is None:
            # Another worker or process is filling this cache entry right now: read the shard
            # directly rather than download a second copy into the cache.
            return open_url(url, "rb", **storage_options), None
        if os.path.exists(path):  # committed while we were taking the lock
            _unlock(lock)
            return self.open(url, **storage_options)
        try:
            source = open_url(url, "rb", **storage_options)
        except BaseException:
            _unlock(lock)
            raise
        stream = _CachingStream(
            source, path, url, self.verbose, self.lru, lock, self.check, nbytes=nbytes
        )
        return stream, None  # type: ignore[return-value]

    def _remove_orphans(self) -> None:
        # Temporary copies of processes that died mid-read: never visible, but they take space.
        for name in os.listdir(self.cache_dir):
            if name.startswith(".") and name.endswith(".lock"):
                # A lock left by a process that died: taking it proves nobody holds it.
                lock = _lock(os.path.join(self.cache_dir, name[1 : -len(".lock")]))
                _unlock(lock)
                continue
            m = _TEMP.match(name)
            if m is None or pid_alive(int(m.group(1))):
                continue
            try:
                os.remove(os.path.join(self.cache_dir, name))
            except FileNotFoundError:
                pass


_Lock = Tuple[int, str]


def _lock(path: str) -> Optional[_Lock]:
    """Take the fill lock of a cache entry, or return None if another process holds it."""
    directory, name = os.path.split(path)
    lock_path = os.path.join(directory, f".{name}.lock")
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps entries whole
        return fd, lock_path
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd, lock_path


def _unlock(lock: Optional[_Lock]) -> None:
    # Remove the lock file, then release it. A reader that opened the old file meanwhile may
    # also fill the entry; that only costs a second download, since commits are atomic renames
    # of complete, identical copies. The lock saves bandwidth; it is not needed for correctness.
    if lock is None:
        return
    fd, lock_path = lock
    try:
        os.remove(lock_path)
    except FileNotFoundError:
        pass
    os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_EOA_SIZE = 1024  # a tar ends with two 512-byte blocks of zeros


_CHUNK = 1 << 20


def _inflated_tail(f: BinaryIO) -> Optional[bytes]:
    """The last bytes of a gzip file's content (members may be concatenated), or None if the
    compressed stream is cut or corrupt."""
    d, tail, data = zlib.decompressobj(31), b"", b""
    while True:
        if not data:
            data = f.read(_CHUNK)
            if not data:
                return None  # the file ends inside a member
        try:
            out = d.decompress(data, _CHUNK)
        except zlib.error:
            return None
        tail = (tail + out)[-_EOA_SIZE:]
        data = d.unconsumed_tail
        if d.eof:
            data = d.unused_data.lstrip(b"\0")  # zero bytes between members are padding
            while not data:
                more = f.read(_CHUNK)
                if not more:
                    return tail
                data = more.lstrip(b"\0")
            d = zlib.decompressobj(31)


def _decompressed_tail(f: BinaryIO, new: Callable[[], Any]) -> Optional[bytes]:
    """Like :func:`_inflated_tail`, for bzip2 or xz (``new()`` makes a decompressor)."""
    d, tail, data = new(), b"", b""
    while True:
        chunk = b""
        if d.needs_input:
            if not data:
                data = f.read(_CHUNK)
                if not data:
                    return None
            chunk, data = data, b""
        try:
            out = d.decompress(chunk, _CHUNK)
        except (OSError, EOFError, ValueError, lzma.LZMAError):
            return None
        tail = (tail + out)[-_EOA_SIZE:]
        if d.eof:
            data = (d.unused_data + data).lstrip(b"\0")
            while not data:
                more = f.read(_CHUNK)
                if not more:
                    return tail
                data = more.lstrip(b"\0")
            d = new()


def _ends_with_end_of_archive(path: str, head: bytes, tail: bytes) -> bool:
    """True if the file at ``path`` ends with a tar end-of-archive marker: its last 1024 bytes
    are zero, or for a gzip, bzip2 or xz shard (told by its magic bytes) the compressed stream
    ended cleanly and the last 1024 bytes it holds are zero. Memory stays bounded (1 MiB of
    output per step); the decompression runs only for sources that gave no size."""
    if head[:2] == b"\x1f\x8b":
        with open(path, "rb") as f:
            tail = _inflated_tail(f) or b""
    elif head[:3] == b"BZh":
        with open(path, "rb") as f:
            tail = _decompressed_tail(f, bz2.BZ2Decompressor) or b""
    elif head[:6] == b"\xfd7zXZ\x00":
        with open(path, "rb") as f:
            tail = _decompressed_tail(f, lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ)) or b""
    return len(tail) == _EOA_SIZE and not any(tail)


class _CachingStream(ReadStream):
    """A remote stream that copies what is read into a temporary file, committed on close when
    the shard was read to its end and passes ``check``."""

    def __init__(
        self,
        source: Any,
        path: str,
        url: str,
        verbose: bool,
        lru: Optional[LRUCleanup],
        lock: Optional[_Lock] = None,
        check: Optional[CopyCheck] = None,
        nbytes: Optional[int] = None,
    ) -> None:
        self.source = source
        self.nbytes = nbytes
        self.copied = 0
        self.head = b""  # the first bytes, to tell a compressed shard
        self.tail = b""  # the last _EOA_SIZE bytes, for the end-of-archive check
        self.check = check
        self.lru = lru
        self.lock = lock
        self.path = path
        self.url = url
        self.verbose = verbose
        directory, name = os.path.split(path)
        self.temp_path = os.path.join(
            directory, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self.temp: Optional[BinaryIO] = open(self.temp_path, "wb")
        self.eof = False
        # A read that raised (a command's failure status, a broken connection that retries did
        # not fix) taints the copy for good, even if a later read finds EOF.
        self.failed = False

    def read(self, n: int = -1) -> bytes:
        try:
            data = self.source.read(n)
        except BaseException:
            self.failed = True
            raise
        if data:
            if self.temp is not None:
                self.temp.write(data)
                self.copied += len(data)
                if len(self.head) < 8:
                    self.head = (self.head + data)[:8]
                self.tail = (self.tail + data)[-_EOA_SIZE:]
        elif n != 0 and not self.eof:
            self._check_whole()
            self.eof = True
        return data

    def _check_whole(self) -> None:
        """At the end of the source: raise (and drop the copy) unless it is the whole shard."""
        if self.temp is None:
            return
        size = self.nbytes
        if size is None:
            size = getattr(self.source, "size", None)
            size = size if isinstance(size, int) and not isinstance(size, bool) else None
        if size is not None:
            if self.copied == size:
                return
            why = f"it ended after {self.copied} of its {size} bytes"
        else:
            self.temp.flush()
            if _ends_with_end_of_archive(self.temp_path, self.head, self.tail):
                return
            why = (
                f"it ended after {self.copied} bytes without the tar end-of-archive marker, and "
                "the source gave no size (no Content-Length) that could prove it complete"
            )
        self._discard()
        raise ShardReadError(
            f"the download is incomplete: {why}; it was not cached. The connection was probably "
            "cut: read it again; if it recurs, have the server send a Content-Length or fix the "
            "shard",
            url=self.url,
            offset=self.copied,
        )

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self.eof and not self.failed and self.temp is not None:
                self._drain()
            self.source.close()
        except BaseException:
            self._discard()
            raise
        finally:
            super().close()
        if self.eof and not self.failed and self.temp is not None:
            self._commit()
        else:
            self._discard()

    def _drain(self) -> None:
        left = _DRAIN_LIMIT
        while left > 0 and not self.eof:
            data = self.read(min(left, 1 << 16))
            left -= len(data)

    def _commit(self) -> None:
        assert self.temp is not None
        self.temp.close()
        self.temp = None
        try:
            if self.check is not None:
                with open(self.temp_path, "rb") as f:
                    self.check(f, self.url)
        except WebdsError as exn:
            log.warning(
                "webds: not caching %s: the copy is not a complete tar (%s)",
                redact(self.url),
                redact(str(exn)),
            )
            self._discard()
            return
        os.replace(self.temp_path, self.path)
        self._release()
        if self.verbose:
            log.info("webds: cached %s as %s", redact(self.url), self.path)
        if self.lru is not None:
            self.lru.cleanup()

    def _discard(self) -> None:
        if self.temp is not None:
            self.temp.close()
            self.temp = None
        try:
            os.remove(self.temp_path)
        except FileNotFoundError:
            pass
        self._release()

    def _release(self) -> None:
        _unlock(self.lock)
        self.lock = None

    def __del__(self) -> None:
        # Dropped without close(): the copy may be incomplete, so it is never committed.
        try:
            if not self.closed:
                self.source.close()
        except Exception:
            pass
        self._discard()
