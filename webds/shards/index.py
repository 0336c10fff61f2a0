"""The shard index: one small JSON file listing a dataset's shards with their sample counts.

An index makes exact lengths, per-rank epochs, integrity checks and resume possible without
opening any shard::

    {"format": "webds-shard-index", "version": 1, "samples": 3000,
     "shards": [{"url": "train-000000.tar", "samples": 1000, "bytes": 1234560,
                 "sha256": "<hex>"}, ...]}

Shard URLs under the index's folder are stored relative to it (:func:`_stored_url`) and resolve
against the index's own location, local or remote (:func:`_resolve`); ``offsets`` (optional)
say where each sample starts; unknown keys are kept; webdataset's ``wids`` index files load too.
The fields in full: docs/index-format.md. Make one with ``webds index SHARDS -o index.json`` or
:meth:`ShardIndex.build` (``ShardWriter`` writes one next to its shards); check shards against it
with ``webds verify index.json``.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union
from urllib.parse import urlparse

from ..base.redact import redact
from ..errors import ArgumentError, OpenError, SecureModeError, ShardReadError, WebdsError
from ..io.streams import discard_stream, read_document
from ..io.urls import check_secure, local_path, open_url, rewrite_url, url_scheme
from ..tar.compression import compression_of
from ..tar.samples import tarfile_samples
from .shardlists import expand_urls

__all__ = ["ShardIndex", "ShardInfo", "Problem", "default_index_name", "is_index_url"]

#: The ``"format"`` value of every index file, and the version this webds reads and writes.
FORMAT = "webds-shard-index"
VERSION = 1
#: The ``"__kind__"`` of webdataset's ``wids`` index files, which webds reads too.
WIDS_KIND = "wids-shard-index-v1"

_SHARD_KEYS = ("url", "samples", "bytes", "sha256", "offsets")
_TOP_KEYS = ("format", "version", "samples", "shards")
_CREATE_HINT = "to create one run: webds index SHARDS -o {name}"
#: The largest index file read (ImageNet's 1.28M samples with their offsets take about 20 MB).
MAX_INDEX_BYTES = 1 << 30


@dataclass
class ShardInfo:
    """One shard of an index: where it is, how many samples it holds, its size and checksum."""

    url: str
    samples: int
    bytes: Optional[int] = None
    sha256: Optional[str] = None
    #: Keys of the shard's entry that this webds does not know, kept for forward compatibility.
    extra: Dict[str, Any] = field(default_factory=dict)
    #: Where each sample starts, then the shard's size (``samples + 1`` numbers), or None.
    offsets: Optional[Sequence[int]] = None


@dataclass
class Problem:
    """What :meth:`ShardIndex.verify` found wrong with one shard.

    ``kind`` is ``"missing"`` (cannot be opened), ``"size"``, ``"sha256"``, ``"samples"``,
    ``"offsets"`` (the shard differs from its index entry) or ``"corrupt"`` (reading it failed).
    """

    url: str
    kind: str
    message: str

    def __str__(self) -> str:
        return redact(f"{self.url}: {self.kind}: {self.message}")


class ShardIndex:
    """A dataset's shards (URLs resolved, ready to open) with their sample counts.

    ``location`` is where the index was loaded from or saved to (None for one built in memory).
    ``len(index)`` is the number of shards; ``index.total`` the number of samples::

        index = ShardIndex.load("s3://bucket/train/index.json")
        dataset = WebDataset(index.urls)
    """

    def __init__(
        self,
        shards: Iterable[ShardInfo] = (),
        location: Optional[str] = None,
        extra: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.shards: List[ShardInfo] = list(shards)
        self.location = _normal_location(location)
        #: Top-level keys of the file that this webds does not know, kept for save().
        self.extra: Dict[str, Any] = dict(extra or {})

    @property
    def total(self) -> int:
        """The number of samples in all shards."""
        return sum(s.samples for s in self.shards)

    @property
    def urls(self) -> List[str]:
        """The shards' resolved URLs, in order."""
        return [s.url for s in self.shards]

    @property
    def counts(self) -> List[int]:
        """The shards' sample counts, in order."""
        return [s.samples for s in self.shards]

    def __len__(self) -> int:
        return len(self.shards)

    def __iter__(self) -> Iterator[ShardInfo]:
        return iter(self.shards)

    def __repr__(self) -> str:
        where = f" at {redact(self.location)!r}" if self.location else ""
        return f"<ShardIndex{where}: {len(self)} shards, {self.total} samples>"

    def digest(self) -> str:
        """A short hex fingerprint of the shard URLs (as stored, relative to the index) and their
        sample counts: copies of one dataset at different locations share it."""
        pairs = [[_stored_url(s.url, self.location), s.samples] for s in self.shards]
        blob = json.dumps(pairs, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()[:16]

    # -- reading and writing the file ------------------------------------------------------

    @classmethod
    def load(
        cls,
        url: Union[str, "os.PathLike[str]"],
        storage_options: Optional[Mapping[str, Any]] = None,
    ) -> "ShardIndex":
        """Read an index file (a local path or any fsspec URL); shard URLs come back resolved."""
        url = os.fspath(url)
        hint = _CREATE_HINT.format(name=posixpath.basename(url) or "index.json")
        check_secure(url)  # before a local path's existence is told
        path = local_path(rewrite_url(url))  # the file open_url opens (GOPEN_REWRITE)
        if path is not None and not os.path.exists(path):
            raise OpenError(f"no shard index at {path!r}; {hint}")
        try:
            with open_url(url, "rb", **dict(storage_options or {})) as stream:
                data = read_document(stream, MAX_INDEX_BYTES, f"the shard index {url!r}")
        except SecureModeError:
            raise
        except WebdsError as exn:
            raise OpenError(f"cannot read shard index {url!r}: {exn.message}; {hint}") from None
        except OSError as exn:
            raise OpenError(f"cannot read shard index {url!r}: {exn}") from None
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exn:
            raise _bad(url, f"it is not valid JSON ({exn})") from None
        return cls._from_doc(doc, url)

    @classmethod
    def _from_doc(cls, doc: Any, url: str) -> "ShardIndex":
        if isinstance(doc, dict) and doc.get("__kind__") == WIDS_KIND:
            return cls._from_wids(doc, url)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise _bad(url, f"it is not a webds shard index ('format' is {got!r}, not {FORMAT!r})")
        version = doc.get("version")
        if version != VERSION or isinstance(version, bool):
            newer = isinstance(version, int) and version > VERSION
            raise _bad(
                url,
                f"index version {version!r} is not supported (this webds reads version "
                f"{VERSION})" + ("; upgrade webds" if newer else ""),
            )
        entries = doc.get("shards")
        if not isinstance(entries, list):
            raise _bad(url, "it has no 'shards' list")
        location = _normal_location(url)
        shards = [_shard_from_entry(entry, i, url, location) for i, entry in enumerate(entries)]
        index = cls(shards, location, {k: v for k, v in doc.items() if k not in _TOP_KEYS})
        if "samples" in doc and doc["samples"] != index.total:
            raise _bad(
                url,
                f"it says 'samples': {doc['samples']!r}, but its shards add up to "
                f"{index.total}; re-create it with webds index",
            )
        return index

    @classmethod
    def _from_wids(cls, doc: Dict[str, Any], url: str) -> "ShardIndex":
        """An index file of webdataset's ``wids`` (``"__kind__": "wids-shard-index-v1"``): its
        ``shardlist`` of ``{"url", "nsamples", "filesize"?}``, URLs relative to ``base`` if it
        has one, else to the file's own location."""
        entries = doc.get("shardlist")
        if not isinstance(entries, list):
            raise _bad(url, "it is a wids index without a 'shardlist' list")
        location = _normal_location(url)
        base = doc.get("base")
        if isinstance(base, str) and base:
            location = _normal_location(posixpath.join(_resolve(base, location), "index.json"))
        shards = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise _bad(url, f"shardlist entry {i} is {type(entry).__name__}, not an object")
            mapped = {"url": entry.get("url"), "samples": entry.get("nsamples")}
            mapped["bytes"] = entry.get("filesize")
            shards.append(_shard_from_entry(mapped, i, url, location))
        extra = {k: v for k, v in doc.items() if k in ("name", "info")}
        return cls(shards, _normal_location(url), extra)

    def save(
        self,
        url: Union[str, "os.PathLike[str]"],
        storage_options: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """Write the index to ``url`` (atomically: a local file is renamed into place, a remote
        object appears when complete), with shard URLs relative to it where they lie under it."""
        location = _normal_location(os.fspath(url))
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in self._header().items()]
        entries = []
        for s in self.shards:
            entry = {"url": _stored_url(s.url, location), "samples": s.samples}
            entry.update(bytes=s.bytes, sha256=s.sha256)
            entry.update((k, v) for k, v in s.extra.items() if k not in _SHARD_KEYS)
            if s.offsets is not None:
                entry["offsets"] = list(s.offsets)
            entries.append("    " + json.dumps(entry, ensure_ascii=False))
        text = "{\n" + "\n".join(lines) + '\n  "shards": [\n' + ",\n".join(entries) + "\n  ]\n}\n"
        stream = open_url(os.fspath(url), "wb", **dict(storage_options or {}))
        try:
            stream.write(text.encode("utf-8"))
        except BaseException:
            discard_stream(stream)
            raise
        stream.close()
        self.location = location

    def _header(self) -> Dict[str, Any]:
        head = {"format": FORMAT, "version": VERSION, "samples": self.total}
        return dict(head, **{k: v for k, v in self.extra.items() if k not in _TOP_KEYS})

    # -- building and checking from the shards ---------------------------------------------

    @classmethod
    def build(
        cls,
        urls: Union[str, Iterable[str]],
        *,
        storage_options: Optional[Mapping[str, Any]] = None,
        workers: int = 1,
        progress: bool = False,
    ) -> "ShardIndex":
        """Read every shard once (``urls``: anything :func:`webds.shards.shardlists.expand_urls`
        takes) for its sample count, size and sha256. A shard that cannot be read raises the webds
        error naming it::

            ShardIndex.build("data/train-{000000..000099}.tar").save("data/index.json")
        """
        opts = dict(storage_options or {})
        spec = urls if isinstance(urls, (str, os.PathLike)) else list(urls)
        expanded = expand_urls(spec, storage_options=opts)
        return cls(_run(lambda u: _scan(u, opts), expanded, workers, progress, "indexing"))

    def verify(
        self,
        storage_options: Optional[Mapping[str, Any]] = None,
        progress: bool = False,
        workers: int = 1,
    ) -> List[Problem]:
        """Read every shard fully and compare it with its entry; return the problems found (an
        empty list when all is well). Unreadable shards are reported, not raised."""
        opts = dict(storage_options or {})
        found = _run(lambda s: _check(s, opts), self.shards, workers, progress, "verifying")
        return [p for problems in found for p in problems]


def default_index_name(pattern: str) -> str:
    """The index file ShardWriter writes for a shard name pattern: the name cut at the first
    %-field: ``"out/train-%06d.tar"`` -> ``"out/train.index.json"``, ``"out/%06d.tar"`` ->
    ``"out/index.json"``."""
    i, cut = 0, None
    while i < len(pattern):
        if pattern[i] == "%":
            if pattern[i + 1 : i + 2] != "%":
                cut = i
                break
            i += 1
        i += 1
    if cut is None:
        prefix = pattern
        for suffix in (".tar.gz", ".tar.bz2", ".tar.xz", ".tgz", ".tar"):
            if prefix.lower().endswith(suffix):
                prefix = prefix[: -len(suffix)]
                break
    else:
        prefix = pattern[:cut]
    slash = max(prefix.rfind("/"), prefix.rfind(os.sep))
    folder, stem = prefix[: slash + 1], prefix[slash + 1 :].replace("%%", "%").rstrip("-_. ")
    return folder + (f"{stem}.index.json" if stem else "index.json")


def is_index_url(url: Union[str, "os.PathLike[str]"]) -> bool:
    """True if ``url`` names a JSON file (a shard index), ignoring an http(s) query string."""
    url = os.fspath(url)
    if url_scheme(url) in ("http", "https"):
        url = urlparse(url).path
    return url.lower().endswith(".json")


# -- helpers -------------------------------------------------------------------------------


def _bad(url: str, problem: str) -> ArgumentError:
    # No url=: WebdsError would label the index file a "shard"; the message names it.
    return ArgumentError(f"bad shard index {url!r}: {problem}")


def _normal_location(location: Optional[str]) -> Optional[str]:
    # An absolute path, so relative shard URLs keep their meaning if the process changes folder.
    if location is None or location == "-" or url_scheme(location) is not None:
        return location
    return os.path.abspath(location)


def _base(location: Optional[str]) -> Optional[str]:
    """The folder (local, absolute) or prefix (remote, ending in "/") holding the index."""
    if location is None or location == "-" or location.startswith("pipe:"):
        return None
    path = local_path(location)
    if path is not None:
        return os.path.dirname(os.path.abspath(path))
    if url_scheme(location) in ("http", "https"):
        location = location.split("?", 1)[0].split("#", 1)[0]
    return location[: location.rfind("/") + 1]


def _is_relative(url: str) -> bool:
    return url != "-" and url_scheme(url) is None and not os.path.isabs(url)


def _resolve(url: str, location: Optional[str]) -> str:
    base = _base(location)
    if base is None or not _is_relative(url):
        return url
    if local_path(location) is not None:  # type: ignore[arg-type]
        return os.path.normpath(os.path.join(base, url))
    head, _, path = base.partition("://")
    netloc, _, path = path.partition("/")
    if url.startswith(("./", "../")) or "/./" in url or "/../" in url:
        return f"{head}://{netloc}/" + posixpath.normpath(path + url).lstrip("/")
    return base + url


def _stored_url(url: str, location: Optional[str]) -> str:
    """``url`` as the index file at ``location`` stores it: relative where it lies under it."""
    base = _base(location)
    if base is None:
        return url
    if local_path(location) is not None:  # type: ignore[arg-type]
        path = local_path(url)
        if path is None:
            return url
        path = os.path.abspath(path)
        if path.startswith(os.path.join(base, "")):
            return os.path.relpath(path, base).replace(os.sep, "/")
        return path if url_scheme(url) is None else url
    if url.startswith(base) and len(url) > len(base):
        return url[len(base) :]
    return os.path.abspath(url) if _is_relative(url) else url


#: The fewest bytes of tar a sample takes: one member's header (an empty member has no data block).
_MIN_SAMPLE_BYTES = 512
#: How far a compressed shard may shrink its tar, at most, for that check: gzip about 1000x,
#: bzip2 of zeros about 4.6e7x. A shard's name does not say whether it is compressed (readers
#: sniff), so every shard gets this: it only refuses absurd counts.
_MAX_RATIO = 1 << 26


def _shard_from_entry(entry: Any, i: int, url: str, location: Optional[str]) -> ShardInfo:
    what = f"shard entry {i}"
    if not isinstance(entry, dict):
        raise _bad(url, f"{what} is {type(entry).__name__}, not an object")
    shard = entry.get("url")
    if not isinstance(shard, str) or not shard:
        raise _bad(url, f"{what} has no 'url'")
    what = f"{what} ({shard!r})"
    samples, size = entry.get("samples"), entry.get("bytes")
    if samples is None:
        raise _bad(url, f"{what} has no 'samples' count")
    if not _is_count(samples):
        raise _bad(url, f"{what} has 'samples': {samples!r}, not a count")
    if size is not None and not _is_count(size):
        raise _bad(url, f"{what} has 'bytes': {size!r}, not a size")
    if size is not None and samples * _MIN_SAMPLE_BYTES > size * _MAX_RATIO:
        # Before anything is sized by the count (a sampler's order: 10**12 samples claimed
        # by an index made ChunkedSampler allocate until MemoryError, issue 54).
        raise _bad(
            url,
            f"{what} has 'samples': {samples!r}, more than its {size:,} bytes can hold (a "
            f"sample takes at least {_MIN_SAMPLE_BYTES} bytes of tar, and no compression shrinks "
            "a tar 2**26 times); re-create it with webds index",
        )
    sha = entry.get("sha256")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch("[0-9a-fA-F]{64}", sha)):
        raise _bad(url, f"{what} has 'sha256': {sha!r}, not a 64-digit hex digest")
    extra = {k: v for k, v in entry.items() if k not in _SHARD_KEYS}
    offsets = entry.get("offsets")
    if offsets is not None:
        offsets = _offsets_from_entry(offsets, samples, size, url, what)
    return ShardInfo(_resolve(shard, location), samples, size, sha and sha.lower(), extra, offsets)


def _offsets_from_entry(
    offsets: Any, samples: int, size: Optional[int], url: str, what: str
) -> "array.array[int]":
    """A shard entry's ``offsets``, checked: ``samples + 1`` non-decreasing counts, the last
    the shard's size. Kept as an array of 8-byte ints (a list of a million ints is 36 MB)."""
    if not isinstance(offsets, list) or len(offsets) != samples + 1:
        n = len(offsets) if isinstance(offsets, list) else type(offsets).__name__
        raise _bad(url, f"{what} has 'offsets' of {n} numbers, not samples + 1 = {samples + 1}")
    try:
        out = array.array("q", offsets)
    except (TypeError, OverflowError):
        raise _bad(url, f"{what} has 'offsets' that are not all integers") from None
    if any(b < a for a, b in zip(out, out[1:])) or out[0] < 0:
        raise _bad(url, f"{what} has 'offsets' that are not increasing from 0")
    if size is not None and out[-1] != size:
        raise _bad(url, f"{what} has 'offsets' ending at {out[-1]}, not at its size {size}")
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _HashingReader:
    """Passes reads through, hashing and counting the raw bytes; ``close()`` is left to us, so
    the reader's close at the end-of-archive marker can't stop us reading on to EOF."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.nbytes = 0
        self.first = b""  # the first bytes, which say whether the shard is compressed

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if data:
            self.sha.update(data)
            if len(self.first) < 16:
                self.first += data[:16]
            self.nbytes += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def close(self) -> None:
        pass


def _read(url: str, opts: Dict[str, Any]) -> tuple:
    """Read a shard once: ``(samples, bytes, sha256, error, offsets)`` (offsets None for a
    compressed shard). Opening errors are raised; reading errors are returned, after reading on
    to EOF for the size and checksum."""
    raw = open_url(url, "rb", **opts)
    reader = _HashingReader(raw)
    count, error = 0, None
    starts: List[int] = []
    try:
        try:
            shard = {"url": url, "stream": reader}
            for _ in tarfile_samples([shard], sample_starts=starts, readahead=False):
                count += 1
        except WebdsError as exn:
            error = exn
        reader.drain()
    except WebdsError as exn:
        error = error or exn
    except OSError as exn:
        error = error or ShardReadError(f"reading failed: {type(exn).__name__}: {exn}", url=url)
    finally:
        try:
            raw.close()
        except Exception as exn:  # e.g. a pipe: command's exit status
            error = error or ShardReadError(f"closing failed: {exn}", url=url)
    offsets = None
    if compression_of(reader.first) is None and len(starts) == count:
        offsets = array.array("q", starts)
        offsets.append(reader.nbytes)
    return count, reader.nbytes, reader.sha.hexdigest(), error, offsets


def _scan(url: str, opts: Dict[str, Any]) -> ShardInfo:
    count, size, sha, error, offsets = _read(url, opts)
    if error is not None:
        raise error
    return ShardInfo(url, count, size, sha, offsets=offsets)


def _check(shard: ShardInfo, opts: Dict[str, Any]) -> List[Problem]:
    try:
        count, size, sha, error, offsets = _read(shard.url, opts)
    except (WebdsError, OSError) as exn:
        return [Problem(shard.url, "missing", getattr(exn, "message", None) or str(exn))]
    out = []
    if error is not None:
        out.append(Problem(shard.url, "corrupt", str(error)))
    if shard.bytes is not None and size != shard.bytes:
        out.append(Problem(shard.url, "size", f"{size} bytes, the index says {shard.bytes}"))
    elif error is None and shard.sha256 is not None and sha != shard.sha256:
        out.append(Problem(shard.url, "sha256", f"sha256 {sha}, the index says {shard.sha256}"))
    if error is None and count != shard.samples:
        out.append(
            Problem(shard.url, "samples", f"{count} samples, the index says {shard.samples}")
        )
    elif error is None and shard.offsets is not None and list(shard.offsets) != list(offsets or []):
        out.append(Problem(shard.url, "offsets", "the samples start elsewhere than the index says"))
    return out


def _run(
    fn: Callable[[Any], Any], items: List[Any], workers: int, progress: bool, what: str
) -> list:
    """``[fn(x) for x in items]``, on ``workers`` threads, with a progress bar on stderr."""
    from ..progress import progress_bar

    if not _is_count(workers) or workers < 1:
        raise ArgumentError(f"workers must be a positive int, got {workers!r}")
    bar = progress_bar(len(items), what, " shards", progress)
    pool = ThreadPoolExecutor(workers) if workers > 1 else None
    out = []
    try:
        for result in pool.map(fn, items) if pool is not None else map(fn, items):
            out.append(result)
            bar.update(1)
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
    return out
