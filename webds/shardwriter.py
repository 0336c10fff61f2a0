"""A numbered series of tar shards: :class:`~webds.shardwriter.ShardWriter`, one
:class:`~webds.tarwriter.TarWriter` per shard, and the shard index of what it wrote."""

from __future__ import annotations

import array
import logging
import os
import re
from typing import Any, BinaryIO, Callable, Dict, List, Mapping, Optional, Set, Union

from .base.redact import redact
from .errors import ArgumentError, OpenError, WebdsError, WriteError
from .io.streams import CommitOnExit, discard_stream, remove_stale_temps
from .io.urls import local_path, make_parent_folder, url_identity, url_scheme
from .shards.index import ShardIndex, ShardInfo, default_index_name
from .stages.encode import make_encoder
from .tar.grouping import is_meta_name
from .tarwriter import _FORMATS, TarWriter, _compression, is_numbered_pattern, single_shard_name

__all__ = ["ShardWriter"]

log = logging.getLogger("webds")


class ShardWriter(CommitOnExit):
    """Write samples to a series of shards named ``pattern % shard_number``, from ``start_shard``.

    A new shard starts before a write once the current one holds ``maxcount`` samples or ``maxsize``
    payload bytes (a larger sample gets one of its own; nothing written, no shard). ``post(fname)``
    runs after each shard is committed; ``opener(fname)`` may return the stream to write to (the
    writer closes it, or discards it on error). ``storage_options`` go to fsspec for a remote
    pattern, whose shards appear only once committed
    ([more](../remote.md#writing-to-remote-storage)); a local pattern's missing folder is created.
    ``verbose`` logs each shard, ``progress`` shows a bar; other keywords go to
    :class:`~webds.tarwriter.TarWriter`.

    ``index``: ``True`` (the default) writes a shard index of the committed shards (sha256 computed
    while writing) when the writer stops, next to them (``out/train-%06d.tar`` ->
    ``out/train.index.json``; none with an ``opener`` or a ``pipe:``); a str writes it there,
    ``False`` none. An index already there is extended; with ``post`` it may follow the shards
    ([more](../index-format.md#making-and-checking-an-index)). Attributes: ``fname`` (current or
    last shard), ``shard`` (the next number), ``count``/``size`` (of the current shard), ``total``,
    ``shards`` (committed names), ``index`` (the index so far).
    """

    def __init__(
        self,
        pattern: str,
        maxcount: int = 100000,
        maxsize: float = 3e9,
        post: Optional[Callable[[str], Any]] = None,
        start_shard: int = 0,
        verbose: int = 0,
        opener: Optional[Callable[[str], BinaryIO]] = None,
        progress: bool = False,
        storage_options: Optional[Mapping[str, Any]] = None,
        index: Union[bool, str, "os.PathLike[str]", None] = True,
        **kw: Any,
    ) -> None:
        pattern = os.fspath(pattern)
        if not isinstance(pattern, str) or not pattern:
            raise ArgumentError(
                f"ShardWriter needs a file name pattern such as 'out-%06d.tar', got {pattern!r}"
            )
        if isinstance(maxcount, bool) or not isinstance(maxcount, int) or maxcount <= 0:
            raise ArgumentError(f"maxcount must be a positive int, got {maxcount!r}")
        if isinstance(maxsize, bool) or not isinstance(maxsize, (int, float)) or not maxsize > 0:
            raise ArgumentError(f"maxsize must be a positive number of bytes, got {maxsize!r}")
        if isinstance(start_shard, bool) or not isinstance(start_shard, int) or start_shard < 0:
            raise ArgumentError(f"start_shard must be a non-negative int, got {start_shard!r}")
        if post is not None and not callable(post):
            raise ArgumentError(f"post must be a function post(fname), got {post!r}")
        if opener is not None and not callable(opener):
            raise ArgumentError(
                f"opener must be a function opener(fname) -> stream, got {opener!r}"
            )
        self._single: Optional[str] = None
        if not is_numbered_pattern(pattern):
            # No %-field for the shard number: fine as long as one shard is enough.
            self._single = single_shard_name(pattern)
        self.pattern = pattern
        self.start_shard = start_shard
        self.maxcount = maxcount
        self.maxsize = maxsize
        self.post = post
        self.opener = opener
        self.storage_options = dict(storage_options or {})
        self.verbose = verbose
        self.kw = kw
        # Fail now on bad TarWriter options rather than at the first write.
        self._check_writer_kw()
        if index is True:
            # With an opener (or into a pipe: command, or stdout) we don't know where the shards
            # live, so not where an index should go either.
            elsewhere = opener is not None or pattern == "-" or url_scheme(pattern) == "pipe"
            index_url = None if elsewhere else default_index_name(pattern)
        elif index is False or index is None:
            index_url = None
        elif isinstance(index, (str, os.PathLike)) and os.fspath(index):
            index_url = os.fspath(index)
        else:
            raise ArgumentError(
                f"index must be True, False or the path/URL of the index file, got {index!r}"
            )
        self._index_url = index_url
        # The default index lives with the shards: if post= took them away (an upload and
        # delete, a move), it goes through post as well, after the last shard, and follows them.
        self._post_index = index is True and post is not None
        #: The shard index of the committed shards (None with ``index=False``), with those of an
        #: index already at its place (a session that continues a dataset extends its index).
        self.index: Optional[ShardIndex] = None
        self._indexed: Dict[str, int] = {}  # url_identity -> place in self.index.shards
        self._committed = 0
        if index_url is not None:
            self.index = _existing_index(index_url, self.storage_options)
            self._indexed = {url_identity(x.url): i for i, x in enumerate(self.index.shards)}
        self._samples = 0  # samples in the current shard as a reader will group them
        self._last_key: Optional[str] = None
        self._ended = False
        self.shard = start_shard
        self.fname: Optional[str] = None
        self.count = 0
        self.size = 0
        self.total = 0
        self.shards: List[str] = []
        self.closed = False
        self.tarstream: Optional[TarWriter] = None
        self._stream: Optional[BinaryIO] = None
        self._bar = None
        self._cleaned: Set[str] = set()  # folders cleaned of stale temporary files
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(desc=pattern, unit=" samples")

    def _check_writer_kw(self) -> None:
        allowed = {"user", "group", "mode", "compress", "encoder", "keep_meta", "mtime", "format"}
        unknown = set(self.kw) - allowed
        if unknown:
            raise ArgumentError(
                f"ShardWriter: unknown keyword(s) {sorted(unknown)}; "
                f"TarWriter takes {sorted(allowed)}"
            )
        if "compress" in self.kw:
            _compression(self.kw["compress"], None)
        if self.kw.get("format") not in _FORMATS:
            raise ArgumentError(f"format={self.kw['format']!r} is not a tar format")
        make_encoder(self.kw.get("encoder", True))

    def _next_name(self) -> str:
        if self._single is None:
            return self.pattern % self.shard
        if self.shard != self.start_shard:
            raise ArgumentError(
                f"ShardWriter pattern {self.pattern!r} has no %-field (such as %06d) for the "
                f"shard number, but more than one shard is needed (maxcount={self.maxcount}, "
                f"maxsize={self.maxsize:g}); add one, e.g. 'out-%06d.tar'"
            )
        return self._single

    def _open(self) -> None:
        fname = self._next_name()
        if self.verbose:
            log.info("webds: writing %s", redact(fname))
        if self.opener is not None:
            stream = self.opener(fname)
            self._stream = stream
            kw = dict(self.kw)
            # The opener's stream has no useful name; take gzip-or-not from the shard name.
            kw.setdefault("compress", _compression(None, fname))
            try:
                self.tarstream = TarWriter(stream, checksum=self.index is not None, **kw)
            except BaseException:
                discard_stream(stream)
                raise
        else:
            self._stream = None
            # Like webds.pack: a local pattern's folder is created, for each shard (the number
            # may be in the folder name: "out/%03d/data.tar"); remote and pipe: are left alone.
            make_parent_folder(fname)
            self._clean_folder(fname)
            self.tarstream = TarWriter(
                fname,
                storage_options=self.storage_options,
                checksum=self.index is not None,
                clean_stale=False,  # done per folder, for the whole pattern
                **self.kw,
            )
        self.fname = fname
        self.shard += 1
        self.count = 0
        self.size = 0
        self._samples = 0
        self._last_key = None

    def _clean_folder(self, fname: str) -> None:
        """Once per local folder: remove the temporary files that killed writers of this
        pattern left there (a listing per folder, not per shard)."""
        path = local_path(fname)
        if path is None:
            return
        folder = os.path.dirname(os.path.abspath(path))
        if folder in self._cleaned:
            return
        self._cleaned.add(folder)
        remove_stale_temps(folder, _name_matcher(self.pattern))

    def _commit(self) -> None:
        tarstream, stream = self.tarstream, self._stream
        self.tarstream, self._stream = None, None
        if tarstream is None:
            return
        try:
            tarstream.close()
            if stream is not None:
                stream.close()
        except BaseException:
            if stream is not None:
                discard_stream(stream)
            self._end(failing=True)  # the shard's samples are lost; don't carry on silently
            raise
        assert self.fname is not None
        self.shards.append(self.fname)
        if self.index is not None:
            info = ShardInfo(self.fname, self._samples, tarstream.file_bytes, tarstream.sha256)
            starts = tarstream.sample_starts
            if starts is not None and len(starts) == self._samples:
                info.offsets = array.array("q", starts)
                info.offsets.append(tarstream.file_bytes or 0)
            place = self._indexed.setdefault(url_identity(self.fname), len(self.index.shards))
            if place == len(self.index.shards):
                self.index.shards.append(info)
            else:
                self.index.shards[place] = info  # the shard was written again: its new entry
            self._committed += 1
        if self.verbose:
            log.info(
                "webds: wrote %s (%d samples, %d bytes)", redact(self.fname), self.count, self.size
            )
        if self.post is not None:
            self.post(self.fname)

    def _discard(self) -> None:
        tarstream, stream = self.tarstream, self._stream
        self.tarstream, self._stream = None, None
        if tarstream is not None:
            tarstream.discard()
        if stream is not None:
            discard_stream(stream)

    def write(self, obj: Mapping[str, Any]) -> int:
        """Write one sample, starting a new shard first if the current one is full."""
        if self.closed:
            raise WriteError("write() on a closed ShardWriter", url=self.fname)
        if self.tarstream is not None and (
            self.count >= self.maxcount or self.size >= self.maxsize
        ):
            self._next_name()  # raises if the pattern can't number a second shard
            self._commit()
        if self.tarstream is None:
            self._open()
        assert self.tarstream is not None
        try:
            n = self.tarstream.write(obj)
        except WriteError:
            # The shard and the samples already in it are gone: stop rather than carry on.
            self._discard()
            self._end(failing=True)
            raise
        # A reader merges consecutive samples with one key, and skips meta names (__x__/...).
        key = obj["__key__"]
        if key != self._last_key and not is_meta_name(key + "."):
            self._samples += 1
        self._last_key = key
        self.count += 1
        self.size += n
        self.total += 1
        if self._bar is not None:
            self._bar.update(1)
        return n

    def finish(self) -> None:
        """Commit the current shard (if any); the next write starts a new one."""
        if self.tarstream is not None:
            self._commit()

    def close(self) -> None:
        """Commit the current shard and stop; calling it again does nothing."""
        self._stop(self.finish)

    def discard(self) -> None:
        """Abandon the shard in progress (committed shards stay) and stop."""
        self._stop(self._discard)

    def _stop(self, last_step: Callable[[], None]) -> None:
        if self.closed:
            return
        try:
            last_step()
        except BaseException:
            self._end(failing=True)
            raise
        self._end(failing=False)

    def _end(self, failing: bool) -> None:
        """Stop for good: close the progress bar and write the index of committed shards."""
        self.closed = True
        if self._ended:
            return
        self._ended = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.index is None or not self._committed:
            return
        assert self._index_url is not None
        try:
            self.index.save(self._index_url, self.storage_options)
            if self._post_index and self._shards_gone():
                assert self.post is not None
                self.post(self._index_url)
        except Exception as exn:
            message = f"writing the shard index {self._index_url!r} failed: {exn}"
            if self._post_index:
                message = f"writing the shard index {self._index_url!r} or its post() failed: {exn}"
            if failing:  # an error is on its way already; don't replace it with this one
                log.warning("webds: %s", redact(message))
                return
            if isinstance(exn, WebdsError):
                raise
            raise WriteError(message) from exn

    def _shards_gone(self) -> bool:
        """Whether ``post`` took every shard of this session away from where it was written
        (only local shards are looked at: a remote one is where the index goes anyway)."""
        paths = [local_path(fname) for fname in self.shards]
        return bool(paths) and all(p is not None and not os.path.exists(p) for p in paths)

    def __repr__(self) -> str:
        pattern = redact(self.pattern)
        return f"<ShardWriter {pattern!r}: {len(self.shards)} shards, {self.total} samples>"


def _name_matcher(pattern: str) -> Callable[[str], bool]:
    """Whether a file name is one ``pattern`` gives (its last component, any shard number)."""
    base = os.path.basename(local_path(pattern) or pattern)
    parts = re.split(r"(%%|%[-#0 +]*\d*(?:\.\d+)?[diouxX])", base)
    regex = "".join(
        "%" if p == "%%" else "[0-9A-Za-z]+" if p.startswith("%") else re.escape(p) for p in parts
    )
    return re.compile(f"^{regex}$").match  # type: ignore[return-value]


def _existing_index(url: str, storage_options: Mapping[str, Any]) -> ShardIndex:
    """The index already at ``url`` (to extend), or an empty one if there is none."""
    path = local_path(url)
    if path is not None and not os.path.exists(path):
        return ShardIndex()
    try:
        return ShardIndex.load(url, storage_options)
    except OpenError:
        if path is not None:
            raise
        return ShardIndex()  # no such object
    except WebdsError as exn:
        raise ArgumentError(
            f"there is a file at {url!r}, where this writer's shard index goes, but it is not "
            f"one it can extend ({exn.message}); move it away, or pass index= another path "
            "(or index=False)"
        ) from None
