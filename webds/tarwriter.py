"""One tar shard: :class:`~webds.tarwriter.TarWriter`, and the key, field and shard-name
checks the writers share. :mod:`webds.writer` is the public face of both writers."""

from __future__ import annotations

import gzip
import hashlib
import os
import tarfile
from typing import Any, BinaryIO, List, Mapping, Optional, Union

from .base.redact import redact
from .errors import ArgumentError, EncodeError, WriteError
from .io.streams import CommitOnExit, discard_stream, remove_stale_temps
from .io.urls import local_path, open_url
from .stages.encode import EncoderSpec, make_encoder
from .tar.writing import END_OF_ARCHIVE, header_encoder

__all__ = ["TarWriter", "check_key", "is_numbered_pattern", "single_shard_name"]

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


def refused_input(exn: EncodeError, sample: Mapping[str, Any], output: Any) -> EncodeError:
    """``exn`` (a sample refused for writing to ``output``) naming the shard the sample was read
    from, if ``sample["__url__"]`` says (``webds cat``, a reshard): the fault is in that shard's
    member names, and the output is only where it would have gone."""
    source = sample.get("__url__")
    if not isinstance(source, str) or source == output:
        return EncodeError(exn.message, url=output, member=exn.member, key=exn.key)
    member = exn.member
    if member is None and isinstance(exn.key, str):
        fields = sorted(f for f in sample if isinstance(f, str) and not f.startswith("_"))
        member = f"{exn.key}.{fields[0]}" if fields else None
    into = f" to {output!r}" if output else ""
    return EncodeError(
        f"{exn.message}; the sample was read from this shard, which can't be written{into} "
        "as it is: re-create the shard, or give the sample another key before writing it",
        url=source,
        member=member,
        key=exn.key,
    )


def _check_case(key: str, encoded: Mapping[str, Any], cased: List[str], url: Any) -> None:
    """Refuse fields that differ only in case (``txt`` and ``TXT``): readers lower-case
    extensions, so the shard would hold one sample with two fields of one name."""
    for field in cased:
        twins = sorted(f for f in encoded if f != field and f.lower() == field.lower())
        if twins:
            raise EncodeError(
                f"fields {field!r} and {twins[0]!r} differ only in case, and readers lower-case "
                "extensions (webdataset too), so they would be one field twice; rename one",
                url=url,
                key=key,
                member=f"{key}.{field}",
            )


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
    (hex) are set by ``close()``. A local file is written under a hidden temporary name and
    renamed at ``close()``; with ``clean_stale`` (the default) the temporary files of this name
    that killed writers left (:func:`webds.io.streams.remove_stale_temps`) are removed first.
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
        clean_stale: bool = True,
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
            path = local_path(self.url)
            if clean_stale and path is not None:
                folder, name = os.path.split(os.path.abspath(path))
                remove_stale_temps(folder, name.__eq__)
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
        #: With ``checksum`` and no compression: the offset of each sample written (its first
        #: header), which the shard index records for random access; else None.
        self.sample_starts: Optional[List[int]] = [] if checksum and not gz else None
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
        except EncodeError as exn:
            raise refused_input(exn, obj, self.url) from None
        try:
            encoded = self.encoder(obj)
        except EncodeError as exn:
            if exn.url is not None:
                raise
            raise EncodeError(exn.message, url=self.url, member=exn.member, key=exn.key) from exn
        parts: List[Any] = []  # header, data, padding of each member, written as one
        total = 0
        header = self._header
        keep_meta = self.keep_meta
        cased: List[str] = []  # fields with capitals: a reader lower-cases them
        for field in sorted(encoded):
            if field[:1] == "_" and (field == "__key__" or not keep_meta):
                continue
            _check_field(key, field)
            if not field.islower() and field.lower() != field:
                cased.append(field)
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
        if cased:
            _check_case(key, encoded, cased, self.url)
        start = self._hasher.nbytes if self.sample_starts is not None else 0
        try:
            # One write per sample: a failure can't leave half a member behind unnoticed.
            self._stream.write(b"".join(parts))
        except WriteError:
            self.discard()
            raise  # (a remote store's refusal, already said: webds.io.remote._write_error)
        except Exception as exn:
            self.discard()
            raise WriteError(
                f"writing sample failed ({type(exn).__name__}: {exn}); the shard was discarded",
                url=self.url,
                key=key,
            ) from exn
        self.count += 1
        self.nbytes += total
        if self.sample_starts is not None:
            self.sample_starts.append(start)
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
        except WriteError:
            self.discard()
            raise  # (a remote store's refusal at the commit, already said)
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
        return redact(f"<TarWriter {self.url or self._raw!r} {state}, {self.count} samples>")


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
