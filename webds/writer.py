"""Writing shards: :class:`TarWriter` (one tar) and :class:`ShardWriter` (a numbered series).

Samples are dicts with a ``__key__`` and one value per extension; each field is encoded by
:mod:`webds.stages.encode` and written as the tar member ``f"{key}.{ext}"``, fields in sorted order.
Output is deterministic by default (mtime 0, uid/gid 0, gzip without timestamp or name), so the
same samples always give byte-identical shards. A shard appears under its final name only once
it is complete: an exception while writing discards it. That holds for remote URLs too
(``s3://``, ``gs://``, any fsspec store, with ``storage_options``): S3 multipart and GCS
resumable uploads create the object only when the shard is closed, and a discarded shard's
upload is aborted. A shard larger than memory streams out in parts as the upload buffer fills
(its size is the store's block size, e.g. s3fs's ``default_block_size``, 50 MiB by default).

    with ShardWriter("out/train-%06d.tar", maxcount=10000) as sink:
        for i, (image, label) in enumerate(data):
            sink.write({"__key__": f"{i:08d}", "jpg": image, "cls": label})
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import tarfile
from typing import Any, BinaryIO, Callable, List, Mapping, Optional, Union

from .errors import ArgumentError, EncodeError, WebdsError, WriteError
from .io.urls import CommitOnExit, discard_stream, make_parent_folder, open_url, url_scheme
from .shards.index import ShardIndex, ShardInfo, default_index_name

# webdataset's writer module also exported its encoders; code imports them from there.
from .stages.encode import (  # noqa: F401, E402, I001
    EncoderSpec,
    cbor_dumps,
    default_handlers,
    imageencoder,
    make_encoder,
    mp_dumps,
    numpy_dumps,
    numpy_npz_dumps,
    tenbin_dumps,
    torch_dumps,
)
from .stages.encode import encode_sample as encode_based_on_extension  # noqa: F401, E402
from .tar.samples import is_meta_name
from .tar.tario import END_OF_ARCHIVE, header_encoder

# numpy_dumps and torch_dumps are re-exported because webdataset's writer module has them.
__all__ = ["TarWriter", "ShardWriter", "check_key", "numpy_dumps", "torch_dumps"]

log = logging.getLogger("webds")

_FORMATS = (
    None,
    "ustar",
    "gnu",
    "pax",
    "USTAR_FORMAT",
    "GNU_FORMAT",
    "PAX_FORMAT",
    tarfile.USTAR_FORMAT,
    tarfile.GNU_FORMAT,
    tarfile.PAX_FORMAT,
)


def check_key(key: Any) -> str:
    """Return ``key`` if it is safe to use as a sample key in a tar, else raise EncodeError.

    Refused: non-str, empty, absolute paths, backslashes, NUL, ``..`` or empty path components,
    and dots in the last component (a reader would split the key there).
    """
    if not isinstance(key, str):
        raise EncodeError(f"__key__ must be a str, got {type(key).__name__} {key!r}")
    problem = None
    if key == "":
        problem = "it is empty"
    elif "\0" in key:
        problem = "it contains a NUL character"
    elif "\\" in key:
        problem = "it contains a backslash; use '/' to separate folders"
    elif key.startswith("/"):
        problem = "it is an absolute path; use a relative key such as 'folder/000001'"
    else:
        parts = key.split("/")
        if ".." in parts:
            problem = "it has a '..' path component, which would escape the extraction folder"
        elif "" in parts:
            problem = "it has an empty path component (a doubled or trailing '/')"
        elif "." in parts[-1]:
            problem = (
                "its last component contains a dot, so readers would split the key there "
                "('a.b' + '.jpg' reads back as key 'a', field 'b.jpg'); replace the dot, "
                "e.g. with '_'"
            )
    if problem is not None:
        raise EncodeError(f"refusing sample key {key!r}: {problem}", key=key)
    return key


def _check_field(key: str, field: str) -> None:
    if field == "" or "/" in field or "\\" in field or "\0" in field:
        raise EncodeError(
            f"refusing field name {field!r}: extensions must be non-empty and contain no "
            "'/', '\\' or NUL",
            key=key,
        )


def _compression(compress: Any, name: Optional[str]) -> bool:
    """True for gzip, False for none; anything else is an ArgumentError."""
    if compress is None:
        return name is not None and name.lower().endswith((".gz", ".tgz"))
    if compress is True or (isinstance(compress, str) and compress.lower() in ("gz", "gzip")):
        return True
    if compress is False or compress == "":
        return False
    raise ArgumentError(
        f"compress={compress!r} is not supported; use None (from the file name), True or "
        "'gz' for gzip, or False"
    )


def is_numbered_pattern(pattern: str) -> bool:
    """True if ``pattern`` has a %-field for the shard number (``out-%06d.tar``)."""
    try:
        return bool(pattern % 0 != pattern % 1)
    except (TypeError, ValueError):
        return False


def single_shard_name(pattern: str) -> str:
    """The one file name a pattern without a shard-number field gives (``%%`` becomes ``%``)."""
    try:
        return pattern % () if "%" in pattern else pattern
    except (TypeError, ValueError) as exn:
        raise ArgumentError(
            f"bad shard name pattern {pattern!r} ({exn}); use one %-field for the shard "
            "number, e.g. 'out-%06d.tar'"
        ) from None


class TarWriter(CommitOnExit):
    """Write samples to one tar archive (a path or URL, or an open binary file object).

    ``write(sample)`` encodes the sample (``encoder``: see
    :func:`webds.stages.encode.make_encoder`), writes one member per field as ``f"{key}.{ext}"``
    and returns the payload byte count. Fields starting with ``_`` are skipped unless
    ``keep_meta``. A str destination is opened with
    :func:`webds.io.urls.open_url` (so ``pipe:``, ``s3://`` ... work) and committed by ``close()``;
    a file object is written to and left open. ``compress=None`` gzips when the name ends in
    ``.gz``/``.tgz``. ``format`` is accepted for webdataset compatibility: webds always writes
    ustar, with a pax header in front of a member only when its name or size does not fit.
    ``storage_options`` go to fsspec for remote URLs (credentials, endpoint, block size). A
    remote shard becomes visible only when ``close()`` completes; ``discard()``, an exception
    inside ``with``, or dropping an unclosed writer aborts the upload, so no object appears.
    ``checksum=True`` counts and hashes the bytes as written: ``file_bytes`` and ``sha256``
    (hex) are set by ``close()``.
    """

    def __init__(
        self,
        fileobj: Union[str, "os.PathLike[str]", BinaryIO],
        user: str = "bigdata",
        group: str = "bigdata",
        mode: int = 0o0644,
        compress: Any = None,
        encoder: EncoderSpec = True,
        keep_meta: bool = False,
        mtime: Optional[float] = None,
        format: Any = None,
        progress: bool = False,
        storage_options: Optional[Mapping[str, Any]] = None,
        checksum: bool = False,
    ) -> None:
        self.closed = True  # until the stream is open: nothing for discard() or __del__ to do
        if format not in _FORMATS:
            raise ArgumentError(
                f"format={format!r} is not a tar format; use None, 'ustar', 'gnu', 'pax' or a "
                "tarfile *_FORMAT constant"
            )
        if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise ArgumentError(f"mode must be a permission int such as 0o644, got {mode!r}")
        if mtime is not None and (not isinstance(mtime, (int, float)) or mtime < 0):
            raise ArgumentError(f"mtime must be None or a non-negative timestamp, got {mtime!r}")
        self.encoder = make_encoder(encoder)
        self.keep_meta = bool(keep_meta)
        # Every member shares these header fields, so headers come from one template.
        self._header = header_encoder(
            mtime=0 if mtime is None else int(mtime),
            mode=mode,
            uid=0,
            gid=0,
            uname=str(user),
            gname=str(group),
        )
        self.url: Optional[str] = None
        if isinstance(fileobj, (str, os.PathLike)):
            self.url = os.fspath(fileobj)
            gz = _compression(compress, self.url)
            self._stream: Any = open_url(self.url, "wb", **dict(storage_options or {}))
            self._own_stream = True
        elif hasattr(fileobj, "write"):
            name = getattr(fileobj, "name", None)
            gz = _compression(compress, name if isinstance(name, str) else None)
            self._stream = fileobj
            self._own_stream = False
        else:
            raise ArgumentError(
                "TarWriter needs a path, a URL or a binary file object, "
                f"got {type(fileobj).__name__}"
            )
        self._raw = self._stream
        #: With ``checksum``: the size and sha256 (hex) of the bytes written, as stored (after
        #: compression), complete once the writer is closed.
        self.file_bytes: Optional[int] = None
        self.sha256: Optional[str] = None
        self._hasher: Optional[_HashingWriter] = None
        if checksum:
            self._raw = self._stream = self._hasher = _HashingWriter(self._raw)
        if gz:
            # No file name and mtime 0 in the gzip header: same samples, same bytes.
            self._stream = gzip.GzipFile(
                filename="", mode="wb", fileobj=self._raw, compresslevel=6, mtime=0
            )
        self.compress = gz
        self.count = 0
        self.nbytes = 0
        self.closed = False
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(desc=self.url or "tar", unit=" samples")

    def write(self, obj: Mapping[str, Any]) -> int:
        """Encode and write one sample; return the number of payload bytes written."""
        if self.closed:
            raise WriteError("write() on a closed TarWriter", url=self.url)
        if type(obj) is not dict and not isinstance(obj, Mapping):
            raise EncodeError(f"samples must be dicts, got {type(obj).__name__}", url=self.url)
        if "__key__" not in obj:
            raise EncodeError(
                f"sample has no '__key__' (fields: {sorted(obj)}); give every sample a unique key",
                url=self.url,
            )
        try:
            key = check_key(obj["__key__"])
            encoded = self.encoder(obj)
        except EncodeError as exn:
            if exn.url is not None:
                raise
            raise EncodeError(exn.message, url=self.url, member=exn.member, key=exn.key) from exn
        parts: List[Any] = []  # header, data, padding of each member, written as one
        total = 0
        header = self._header
        keep_meta = self.keep_meta
        for field in sorted(encoded):
            if field[:1] == "_" and (field == "__key__" or not keep_meta):
                continue
            _check_field(key, field)
            value = encoded[field]
            if type(value) is bytes:
                n = len(value)
            else:
                if isinstance(value, str):
                    value = value.encode("utf-8")
                elif not isinstance(value, (bytes, bytearray, memoryview)):
                    raise EncodeError(
                        f"field {field!r} is {type(value).__name__} after encoding, not bytes",
                        url=self.url,
                        key=key,
                    )
                n = memoryview(value).nbytes
            parts += (header(f"{key}.{field}", n), value, _ZEROS[: -n % 512])
            total += n
        if not parts:
            raise EncodeError(
                "sample has no fields to write (only metadata); add at least one field",
                url=self.url,
                key=key,
            )
        try:
            # One write per sample: a failure can't leave half a member behind unnoticed.
            self._stream.write(b"".join(parts))
        except Exception as exn:
            self.discard()
            raise WriteError(
                f"writing sample failed ({type(exn).__name__}: {exn}); the shard was discarded",
                url=self.url,
                key=key,
            ) from exn
        self.count += 1
        self.nbytes += total
        if self._bar is not None:
            self._bar.update(1)
        return total

    def close(self) -> None:
        """Finish the archive; a destination opened from a path or URL is committed and closed."""
        if self.closed:
            return
        try:
            self._stream.write(END_OF_ARCHIVE)
            if self.compress:
                self._stream.close()  # flushes the gzip trailer; leaves the raw stream open
            if self._own_stream:
                self._raw.close()
            else:
                self._raw.flush()
        except Exception as exn:
            self.discard()
            raise WriteError(f"finishing the shard failed: {exn}", url=self.url) from exn
        finally:
            self._finish()

    def discard(self) -> None:
        """Abandon the archive: a destination we opened is deleted (or closed, if it can't be)."""
        if self.closed:
            return
        try:
            if self.compress:
                try:
                    self._stream.close()
                except Exception:
                    pass
            if self._own_stream:
                discard_stream(self._raw)
        finally:
            self._finish()

    def _finish(self) -> None:
        self.closed = True
        if self._hasher is not None:
            self.file_bytes = self._hasher.nbytes
            self.sha256 = self._hasher.sha.hexdigest()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __del__(self) -> None:
        # Dropped without close(): the shard is unfinished. fsspec's files would commit it from
        # their own finalizer (uploading a truncated tar), so abort it first.
        if not getattr(self, "closed", True) and getattr(self, "_own_stream", False):
            try:
                self.discard()
            except Exception:
                pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<TarWriter {self.url or self._raw!r} {state}, {self.count} samples>"


class ShardWriter(CommitOnExit):
    """Write samples to a series of shards named ``pattern % shard_number``.

    A new shard is started before a write when the current one holds ``maxcount`` samples or
    ``maxsize`` payload bytes (a single sample larger than ``maxsize`` gets a shard of its own).
    No shard is created if nothing is written. ``post(fname)`` runs after each shard is committed;
    ``opener(fname)`` may return the stream to write to (it is closed, or ``discard()``-ed on
    error, by the writer). ``storage_options`` go to fsspec for remote patterns such as
    ``"s3://bucket/train-%06d.tar"``: each shard is uploaded as it is written and becomes visible
    when it is committed, before ``post`` runs; a discarded shard's upload is aborted.
    A local pattern's missing folder (``out/`` of ``out/train-%06d.tar``, also with ``file:``)
    is created when a shard is opened in it, as :func:`webds.pack` does; remote stores have no
    folders to create, and ``pipe:`` and ``opener`` outputs are left alone.
    Other keywords go to :class:`TarWriter`. Attributes: ``fname`` (current
    or last shard), ``shard`` (the next shard number), ``count``/``size`` (samples and bytes in
    the current shard), ``total`` (all samples), ``shards`` (completed shard names).

    ``index`` writes a shard index (:mod:`webds.shards.index`) of the committed shards, with their
    sample counts, sizes and sha256 computed while writing, when the writer stops (``close()``,
    ``discard()``, an error), if any shard was committed: ``True`` (the default) writes it next
    to the shards as :func:`~webds.shards.index.default_index_name` of the pattern
    (``out/train-%06d.tar`` -> ``out/train.index.json``; none with an ``opener`` or into a
    ``pipe:``), a str is its path or URL, ``False`` writes none (and skips the hashing).
    The ``index`` attribute is the :class:`~webds.shards.index.ShardIndex` of the shards so far.
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
        #: The shard index of the committed shards (None with ``index=False``).
        self.index: Optional[ShardIndex] = None if index_url is None else ShardIndex()
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
            log.info("webds: writing %s", fname)
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
            self.tarstream = TarWriter(
                fname,
                storage_options=self.storage_options,
                checksum=self.index is not None,
                **self.kw,
            )
        self.fname = fname
        self.shard += 1
        self.count = 0
        self.size = 0
        self._samples = 0
        self._last_key = None

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
            self.index.shards.append(info)
        if self.verbose:
            log.info("webds: wrote %s (%d samples, %d bytes)", self.fname, self.count, self.size)
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
        if self.index is None or not self.index.shards:
            return
        assert self._index_url is not None
        try:
            self.index.save(self._index_url, self.storage_options)
        except Exception as exn:
            message = f"writing the shard index {self._index_url!r} failed: {exn}"
            if failing:  # an error is on its way already; don't replace it with this one
                log.warning("webds: %s", message)
                return
            if isinstance(exn, WebdsError):
                raise
            raise WriteError(message) from exn

    def __repr__(self) -> str:
        return f"<ShardWriter {self.pattern!r}: {len(self.shards)} shards, {self.total} samples>"


_ZEROS = bytes(511)  # tar padding is a slice of it


class _HashingWriter:
    """Passes writes through to ``raw``, counting and hashing (sha256) the bytes; ``close()``
    and ``discard()`` go to ``raw``, so commit and abort work as without it."""

    # The hashing stays on the writing thread: handing chunks to a helper thread (hashlib lets
    # go of the GIL while it hashes) measured 10-25% slower on a busy 2-CPU machine, where the
    # two threads got no more than 1.2x the CPU of one.

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: Any) -> int:
        n = self.raw.write(data)
        self.sha.update(data)
        self.nbytes += len(data) if type(data) is bytes else memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()

    def discard(self) -> None:
        discard_stream(self.raw)

    @property
    def closed(self) -> bool:
        return bool(getattr(self.raw, "closed", False))

    def __repr__(self) -> str:
        return repr(self.raw)
