"""ImageNet's tar of tars -> uniformly shuffled WebDataset shards: :func:`convert_imagenet`.

ImageNet's training set arrives as one tar (``ILSVRC2012_img_train.tar``, 148 GB) holding one
tar per class (``n01440764.tar``, ...), each holding that class's JPEGs
(``n01440764_10026.JPEG``). Shards written in that order hold one class each, which wrecks
training, so the converter writes a uniformly random permutation of all samples, with bounded
memory and without extracting the original layout to disk.

**Pass 1 (scatter)** reads the outer tar once, as a stream (a path, a URL, ``-`` or
``pipe:CMD``), and each class tar inside it as a stream too. Every image gets a 64-bit random
key from ``random.Random(seed)``; the key range is cut into B equal parts and the image is
appended to the temporary bucket file of its part. B is planned from the input size so that a
bucket holds about 3/4 of ``memory`` (at most 256 buckets; 256 when the size is unknown, e.g.
from a pipe).

**Pass 2 (gather)** takes the buckets in key order: it loads one, sorts it by key, appends its
samples to a :class:`~webds.writer.ShardWriter` and deletes it. A bucket that came out larger
than ``memory`` is first split by key range into smaller buckets (the same rule, applied again;
with ``memory`` below ~1/190 of the dataset every bucket needs it: one more pass over the data).

**Why the output is a uniform random permutation.** Sorting n independent uniform keys gives
each of the n! orders with the same probability (the keys are exchangeable). The two passes are
exactly that sort, done as a distribution sort: buckets are consecutive key ranges, so the
sorted buckets, concatenated, are the sorted whole. This is Rao's (1961) two-pass shuffle (each
sample goes to a uniformly chosen bucket independently of the others, then each bucket is
shuffled uniformly), with the in-bucket shuffle taken from the low bits of the same key. So the
output depends only on the seed and the input, not on ``memory``, B or splits: the same seed
gives byte-identical shards. Equal keys (probability below n^2 / 2^65, 5e-8 for ImageNet's 1.28M
images) keep their input order.

**Bounds.**

- Memory: pass 1 holds one image plus the buffers of the B open bucket files (each
  ``min(1 MiB, memory / 4B)``, at least 8 KiB); pass 2 holds one bucket (at most ``memory``
  bytes, unless a single image is larger) plus ~250 bytes of bookkeeping per image in it, plus
  one output sample. Peak: about ``memory`` + 250 bytes x (images per bucket) + a few MiB.
- Temporary disk: every image once (about the size of the training tar) plus 23 bytes and the
  key per image. Pass 2 deletes each bucket once its samples are written, so usage falls as the
  shards grow; splitting an oversized bucket needs its size a second time while it runs.
- Where: ``tmpdir``; by default a hidden folder ``.webds-imagenet-*`` in the output folder when
  the output is local (the disk that must hold the shards anyway), else the system temporary
  folder (``TMPDIR``). It is removed at the end, also after an error or Ctrl-C (not after
  ``kill -9``).
- The shards themselves take the images plus ~2 KiB of tar headers and padding per sample.

**Classes.** A class's index is its synset's position in sorted order. All synsets are known
only once the whole outer tar has been read, so bucket records carry the class's position in
the input and the indices are assigned in pass 2: one pass over the input, so a pipe works.
``classes.json`` (``{"classes": [...], "class_to_idx": {...}}``) is written beside the shards.

**Validation.** The validation tar is flat (``ILSVRC2012_val_00000001.JPEG`` ...); it is
written in its own order, labelled from a label file (see :func:`convert_imagenet`).
"""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import math
import os
import random
import re
import shutil
import struct
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, BinaryIO, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ArgumentError, EncodeError, ShardReadError, WebdsError, WriteError
from ..index import default_index_name
from ..tario import read_members
from ..urls import local_path, open_url, url_scheme
from ..writer import ShardWriter, check_key

__all__ = ["convert_imagenet"]

log = logging.getLogger("webds")

#: Image member extensions (lower case) and the sample field each is stored as.
IMAGE_FIELDS = {"jpeg": "jpg", "jpg": "jpg", "png": "png"}
_FIELD_CODES = {"jpg": 0, "png": 1}
_FIELD_NAMES = ("jpg", "png")

# A bucket record: random key, class (position in the input), field code, key length, data
# length; then the key and the image bytes.
_RECORD = struct.Struct("<QIBHQ")
_KEY_SPACE = 1 << 64
_TARGET = 0.75  # buckets are planned to hold this fraction of `memory`
_MAX_BUCKETS = 256  # open files at once in a scatter (well under the usual 1024 fd limit)
_MIN_BUFFER = 8 << 10
_MAX_BUFFER = 1 << 20
_CHUNK = 1 << 20
_MAX_EXTENDED = 1 << 20  # pax / GNU long-name data held in memory
_NO_DATA_TYPES = (
    tarfile.LNKTYPE,
    tarfile.SYMTYPE,
    tarfile.CHRTYPE,
    tarfile.BLKTYPE,
    tarfile.DIRTYPE,
    tarfile.FIFOTYPE,
)
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def convert_imagenet(
    train_tar: Optional[str],
    pattern: Optional[str] = None,
    *,
    val_tar: Optional[str] = None,
    val_labels: Optional[str] = None,
    val_pattern: Optional[str] = None,
    classes: Union[str, Sequence[str], None] = None,
    maxcount: int = 10000,
    maxsize: float = 3e9,
    seed: int = 0,
    memory: float = 2e9,
    tmpdir: Optional[str] = None,
    with_json: bool = False,
    storage_options: Optional[Mapping[str, Any]] = None,
    progress: bool = True,
) -> Dict[str, Any]:
    """Convert ImageNet's training tar of class tars (and its validation tar) into shards.

    ``train_tar`` (a path, URL, ``-`` or ``pipe:CMD``) is read as a stream, once; its samples
    are written to ``pattern`` (``"out/train-%06d.tar"``, local or remote) in a uniformly random
    order fixed by ``seed``, using at most about ``memory`` bytes of RAM and the size of the
    dataset in temporary disk under ``tmpdir`` (see the module docstring for the exact bounds
    and why the order is uniform). Each sample is ``{"__key__": "n01440764_10026", "jpg":
    <the original bytes>, "cls": <index>}`` (plus ``"json": {"synset": ...}`` with
    ``with_json``); ``classes.json`` and the shard index (``train.index.json``) are written
    beside the shards.

    ``val_tar`` (flat: ``ILSVRC2012_val_00000001.JPEG`` ...) is written to ``val_pattern`` in
    its own order, labelled from ``val_labels``, a file (path or URL) in one of these forms:

    - Kaggle's ``LOC_val_solution.csv``: ``ImageId,PredictionString``, the synset first;
    - ``FILE LABEL`` per line (space or comma between), e.g. ``ILSVRC2012_val_00000001.JPEG
      n01751748``, or Caffe's ``val.txt`` with 0-based class indices;
    - one ``LABEL`` per line for the images in sorted file-name order (the tar must be sorted).

    A LABEL is a synset or a 0-based index into the sorted synsets. The devkit's
    ``ILSVRC2012_validation_ground_truth.txt`` is refused: its 1-based ILSVRC2012 ids follow the
    devkit's own class order, which only the devkit's ``meta.mat`` maps to synsets.
    With ``train_tar=None`` only the validation set is converted, with ``classes`` (a list of
    synsets or the path/URL of a ``classes.json``) giving the class indices.

    ``storage_options`` go to fsspec for every remote input and output (credentials,
    endpoint). Returns a summary: ``{"classes": n, "classes_json": path, "train": {"samples",
    "shards", "index", "buckets", "splits", "temp_bytes"}, "val": {...}, "seconds": s}``.
    ``train``/``val`` are None when not converted. Bad input raises
    :class:`~webds.errors.ShardReadError` naming the tar and member; a bad argument or label
    file :class:`~webds.errors.ArgumentError`::

        convert_imagenet("ILSVRC2012_img_train.tar", "/data/in1k/train-%06d.tar", memory=8e9)
    """
    options = dict(storage_options or {})
    _check_arguments(
        train_tar, pattern, val_tar, val_labels, val_pattern, classes, maxcount, maxsize, seed
    )
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0:
        raise ArgumentError(f"memory must be a positive number of bytes, got {memory!r}")
    started = time.perf_counter()
    labels = _read_labels(val_labels, options) if val_tar is not None else None
    summary: Dict[str, Any] = {"classes": None, "classes_json": None, "train": None, "val": None}
    if train_tar is not None:
        assert pattern is not None
        synsets, summary["train"] = _convert_train(
            train_tar,
            pattern,
            labels=labels,
            maxcount=maxcount,
            maxsize=maxsize,
            seed=seed,
            memory=memory,
            tmpdir=tmpdir,
            with_json=with_json,
            options=options,
            progress=progress,
        )
        summary["classes_json"] = _write_classes(pattern, synsets, options)
    else:
        synsets = _load_classes(classes, options)
    summary["classes"] = len(synsets)
    if val_tar is not None:
        assert labels is not None and val_pattern is not None
        summary["val"] = _convert_val(
            val_tar,
            val_pattern,
            labels,
            maxcount=maxcount,
            maxsize=maxsize,
            synsets=synsets,
            with_json=with_json,
            options=options,
            progress=progress,
        )
    summary["seconds"] = time.perf_counter() - started
    return summary


def _check_arguments(
    train_tar: Any,
    pattern: Any,
    val_tar: Any,
    val_labels: Any,
    val_pattern: Any,
    classes: Any,
    maxcount: Any,
    maxsize: Any,
    seed: Any,
) -> None:
    if train_tar is None and val_tar is None:
        raise ArgumentError("nothing to convert: give a training tar, a validation tar or both")
    if train_tar is not None:
        if not pattern:
            raise ArgumentError(
                "give the output shard pattern for the training set, e.g. 'out/train-%06d.tar'"
            )
        if classes is not None:
            raise ArgumentError(
                "classes= is for converting a validation set alone; with a training tar the "
                "classes are its synsets, sorted"
            )
    elif classes is None:
        raise ArgumentError(
            "without a training tar, give classes= (the classes.json written with the training "
            "shards, or a list of synsets) so validation labels map to the same indices"
        )
    if val_tar is not None:
        if val_labels is None:
            raise ArgumentError(
                "the validation tar needs a label file (val_labels / --val-labels), e.g. "
                "Kaggle's LOC_val_solution.csv"
            )
        if not val_pattern:
            raise ArgumentError(
                "give the output shard pattern for the validation set (val_pattern / "
                "--val-output), e.g. 'out/val-%06d.tar'"
            )
        if val_pattern == pattern:
            raise ArgumentError("the training and validation shard patterns must differ")
    elif val_labels is not None or val_pattern is not None:
        raise ArgumentError("val_labels and val_pattern need a validation tar (val_tar / --val)")
    if isinstance(maxcount, bool) or not isinstance(maxcount, int) or maxcount < 1:
        raise ArgumentError(f"maxcount must be a positive int, got {maxcount!r}")
    if isinstance(maxsize, bool) or not isinstance(maxsize, (int, float)) or not maxsize > 0:
        raise ArgumentError(f"maxsize must be a positive number of bytes, got {maxsize!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ArgumentError(f"seed must be an int, got {seed!r}")


# ---------------------------------------------------------------------------------------------
# The outer tar: members as bounded streams, so a class tar is never held whole in memory
# ---------------------------------------------------------------------------------------------


class _OuterError(ShardReadError):
    """A problem with the outer tar itself (so not re-labelled as a damaged class tar)."""


class _Prefixed:
    """``stream`` with ``head`` (already read, to sniff compression) put back in front."""

    def __init__(self, head: bytes, stream: Any) -> None:
        self.head = head
        self.stream = stream

    def read(self, n: int = -1) -> bytes:
        if self.head:
            if n < 0:
                out, self.head = self.head + self.stream.read(), b""
                return out
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.stream.read(n)

    def readable(self) -> bool:
        return True


class _Reader:
    """The uncompressed outer stream; read errors become ShardReadError naming it."""

    def __init__(self, stream: Any, url: str) -> None:
        self.url = url
        self.offset = 0
        head = self._raw(stream.read, 512)
        src: Any = _Prefixed(head, stream)
        if head[:2] == b"\x1f\x8b":
            src = gzip.GzipFile(fileobj=src, mode="rb")
        elif head[:3] == b"BZh":
            src = bz2.BZ2File(src)
        elif head[:6] == b"\xfd7zXZ\x00":
            src = lzma.LZMAFile(src)
        self._read = src.read

    def _raw(self, read: Any, n: int) -> bytes:
        try:
            return bytes(read(n) or b"")
        except WebdsError:
            raise
        except Exception as exn:  # OSError, EOFError, zlib/lzma errors, network errors
            raise _OuterError(
                f"reading the training tar failed: {type(exn).__name__}: {exn}; check that it "
                "is a complete (re-downloaded) tar",
                url=self.url,
                offset=self.offset,
            ) from exn

    def read(self, n: int) -> bytes:
        data = self._raw(self._read, n)
        self.offset += len(data)
        return data

    def read_exact(self, n: int) -> bytes:
        parts = []
        while n > 0:
            data = self.read(min(n, _CHUNK))
            if not data:
                break
            parts.append(data)
            n -= len(data)
        return b"".join(parts)


class _Member:
    """One member of the outer tar as a stream of exactly its ``size`` bytes."""

    def __init__(self, reader: _Reader, size: int, name: str) -> None:
        self.reader = reader
        self.left = size
        self.name = name

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > self.left:
            n = self.left
        if n == 0:
            return b""
        data = self.reader.read(n)
        if not data:
            raise _OuterError(
                f"the training tar ends inside member {self.name!r} ({self.left} bytes "
                "missing); it is truncated: re-download it",
                url=self.reader.url,
                member=self.name,
                offset=self.reader.offset,
            )
        self.left -= len(data)
        return data

    def skip_rest(self) -> None:
        while self.left:
            self.read(_CHUNK)


def _pax_records(data: bytes, url: str, offset: int) -> Dict[str, bytes]:
    out: Dict[str, bytes] = {}
    pos = 0
    try:
        while pos < len(data) and data[pos] != 0:
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            record = data[space + 1 : pos + length - 1]
            key, _, value = record.partition(b"=")
            out[key.decode("utf-8", "surrogateescape")] = value
            pos += length
    except ValueError:
        raise _OuterError(
            "corrupt pax extended header in the training tar; re-download it",
            url=url,
            offset=offset,
        ) from None
    return out


def _outer_members(reader: _Reader) -> Iterator[Tuple[str, _Member]]:
    """Yield ``(name, stream)`` for each regular file of the outer tar, in order.

    Each stream must be read (or left) before the next item; the rest is skipped for you.
    tarfile's streaming mode would do this at a third of the speed; ``read_members`` would
    hold each class tar whole in memory.
    """
    url = reader.url
    longname: Optional[str] = None
    pax: Dict[str, bytes] = {}
    while True:
        offset = reader.offset
        hdr = reader.read_exact(512)
        if len(hdr) < 512:
            if offset == 0:
                raise _OuterError(
                    "the training tar is empty or not a tar archive", url=url, offset=0
                )
            if not hdr:
                return  # no end-of-archive marker: tolerated, as tarfile and GNU tar do
            raise _OuterError(
                "the training tar ends inside a header; it is truncated: re-download it",
                url=url,
                offset=offset,
            )
        if hdr == b"\0" * 512:
            return
        try:
            info = tarfile.TarInfo.frombuf(hdr, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exn:
            what = "not a tar archive" if offset == 0 else f"a corrupt tar header ({exn})"
            raise _OuterError(
                f"the training tar has {what}; give ImageNet's training tar (one tar per class)",
                url=url,
                offset=offset,
            ) from None
        size = info.size
        padded = size + (-size % 512)
        if info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) or info.type in (
            tarfile.XHDTYPE,
            tarfile.XGLTYPE,
            tarfile.SOLARIS_XHDTYPE,
        ):
            if size > _MAX_EXTENDED:
                raise _OuterError(
                    f"an extended header of {size} bytes in the training tar; it is corrupt",
                    url=url,
                    offset=offset,
                )
            data = reader.read_exact(padded)[:size]
            if len(data) < size:
                raise _OuterError("the training tar is truncated", url=url, offset=offset)
            if info.type == tarfile.GNUTYPE_LONGNAME:
                longname = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif info.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
                pax = _pax_records(data, url, offset)
            continue
        name = info.name
        if longname is not None:
            name = longname
        if "path" in pax:
            name = pax["path"].decode("utf-8", "surrogateescape")
        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError:
                raise _OuterError(
                    "corrupt pax size in the training tar", url=url, offset=offset
                ) from None
            padded = size + (-size % 512)
        longname, pax = None, {}
        if info.type == tarfile.DIRTYPE:
            continue
        if info.type in _NO_DATA_TYPES:
            # A hard link is how tar stores a second copy of a file: skipping it would drop a
            # class without a word.
            raise _OuterError(
                f"member {name!r} of the training tar is a link or a device, not a class tar; "
                "re-create the tar from regular files (tar --hard-dereference)",
                url=url,
                member=name,
                offset=offset,
            )
        member = _Member(reader, size, name)
        if info.type in tarfile.REGULAR_TYPES:
            yield name, member
        member.skip_rest()
        pad = padded - size
        if pad and len(reader.read_exact(pad)) < pad:
            return  # the padding of the last member is missing: the data is complete


# ---------------------------------------------------------------------------------------------
# Pass 1: scatter the images into key-range buckets
# ---------------------------------------------------------------------------------------------


@dataclass
class _Bucket:
    lo: int  # the keys in this bucket lie in [lo, hi)
    hi: int
    path: str
    nbytes: int = 0
    count: int = 0


class _Buckets:
    """Temporary bucket files splitting the key range [lo, hi) into ``k`` equal parts."""

    serial = 0  # bucket file names only need to be unique within one work folder

    def __init__(self, work: str, lo: int, hi: int, k: int, buffer: int) -> None:
        width = hi - lo
        self.lo, self.width, self.k = lo, width, k
        self.buckets: List[_Bucket] = []
        self.files: List[BinaryIO] = []
        try:
            for j in range(k):
                _Buckets.serial += 1
                path = os.path.join(work, f"bucket-{_Buckets.serial:07d}.bin")
                # Part j holds the keys r with floor((r - lo) * k / width) == j.
                b = _Bucket(
                    lo + (j * width + k - 1) // k, lo + ((j + 1) * width + k - 1) // k, path
                )
                self.files.append(open(path, "wb", buffering=buffer))
                self.buckets.append(b)
        except BaseException:
            self.close()
            raise

    def add(self, r: int, head: bytes, key: bytes, data: bytes) -> None:
        j = ((r - self.lo) * self.k) // self.width
        f = self.files[j]
        f.write(head)
        f.write(key)
        f.write(data)
        b = self.buckets[j]
        b.nbytes += len(head) + len(key) + len(data)
        b.count += 1

    def close(self) -> None:
        files, self.files = self.files, []
        for f in files:
            f.close()


def _buffer_size(memory: float, k: int) -> int:
    return int(max(_MIN_BUFFER, min(_MAX_BUFFER, memory / 4 / k)))


def _plan_buckets(size: Optional[int], memory: float) -> int:
    if size is None:
        return _MAX_BUCKETS
    return max(1, min(_MAX_BUCKETS, math.ceil(size / (_TARGET * memory))))


def _input_size(url: str) -> Optional[int]:
    path = local_path(url)
    if path is None:
        return None
    try:
        return os.path.getsize(path) if os.path.isfile(path) else None
    except OSError:
        return None


def _class_name(name: str) -> Optional[str]:
    """``n01440764`` for ``[dir/]n01440764.tar``; None if the member is not a tar."""
    base = name.rsplit("/", 1)[-1]
    lower = base.lower()
    for suffix in _TAR_SUFFIXES:
        if lower.endswith(suffix) and len(base) > len(suffix):
            return base[: -len(suffix)]
    return None


def _split_image_name(name: str) -> Tuple[str, Optional[str]]:
    """(stem, field) of an image member name; field None if it is not an image."""
    base = name.rsplit("/", 1)[-1]
    stem, dot, ext = base.rpartition(".")
    if not dot or not stem:
        return base, None
    return stem, IMAGE_FIELDS.get(ext.lower())


def _class_images(member: _Member, url: str, name: str) -> Iterator[Tuple[str, bytes, int]]:
    """The members of one class tar, its damage reported as such (naming the outer tar)."""
    members = read_members(member, url=name)  # type: ignore[arg-type]
    while True:
        try:
            item = next(members)
        except StopIteration:
            return
        except _OuterError:
            raise
        except ShardReadError as exn:
            where = []
            if exn.member is not None:
                where.append(f"its member {exn.member!r}")
            if exn.offset is not None:
                where.append(f"byte offset {exn.offset} in it")
            at = f" ({', '.join(where)})" if where else ""
            raise ShardReadError(
                f"class tar {name!r} is damaged{at}: {exn.message}",
                url=url,
                member=name,
            ) from None
        yield item


@dataclass
class _Scatter:
    synsets: List[str]  # in input order; position = the class number in the records
    buckets: List[_Bucket]
    samples: int
    nbytes: int


def _scatter(reader: _Reader, work: str, k: int, memory: float, seed: int, bar: Any) -> _Scatter:
    url = reader.url
    rng = random.Random(seed)
    getrandbits = rng.getrandbits
    pack = _RECORD.pack
    synsets: List[str] = []
    seen: Dict[str, str] = {}
    samples = 0
    buckets = _Buckets(work, 0, _KEY_SPACE, k, _buffer_size(memory, k))
    try:
        for name, member in _outer_members(reader):
            synset = _class_name(name)
            if synset is None:
                raise ShardReadError(
                    f"member {name!r} of the training tar is not a class tar: ImageNet's "
                    "training tar holds only one tar per class, named like n01440764.tar",
                    url=url,
                    member=name,
                )
            if synset in seen:
                raise ShardReadError(
                    f"class {synset!r} appears twice in the training tar ({seen[synset]!r} and "
                    f"{name!r}); each class must be one tar",
                    url=url,
                    member=name,
                )
            seen[synset] = name
            cid = len(synsets)
            synsets.append(synset)
            keys = set()
            for inner, data, _ in _class_images(member, url, name):
                stem, field = _split_image_name(inner)
                if field is None:
                    raise ShardReadError(
                        f"class tar {name!r} holds {inner!r}, which is not a JPEG (expected "
                        f"names like {synset}_10026.JPEG); remove it from the class tar",
                        url=url,
                        member=name,
                    )
                key = stem if stem.startswith(synset) else f"{synset}_{stem}"
                try:
                    check_key(key)
                except EncodeError as exn:
                    raise ShardReadError(
                        f"image {inner!r} in class tar {name!r} cannot be a sample key: "
                        f"{exn.message}",
                        url=url,
                        member=name,
                    ) from None
                if key in keys:
                    raise ShardReadError(
                        f"class tar {name!r} holds two images named {stem!r}; names must be unique",
                        url=url,
                        member=name,
                    )
                keys.add(key)
                kb = key.encode("utf-8", "surrogateescape")
                r = getrandbits(64)
                buckets.add(r, pack(r, cid, _FIELD_CODES[field], len(kb), len(data)), kb, data)
                samples += 1
                if bar is not None:
                    bar.update(1)
            if not keys:
                raise ShardReadError(
                    f"class tar {name!r} holds no images; every class needs at least one JPEG",
                    url=url,
                    member=name,
                )
        if not synsets:
            raise ShardReadError(
                "the training tar holds no class tars; give ImageNet's training tar "
                "(ILSVRC2012_img_train.tar: one tar per class)",
                url=url,
            )
    finally:
        buckets.close()
    nbytes = sum(b.nbytes for b in buckets.buckets)
    return _Scatter(synsets, buckets.buckets, samples, nbytes)


# ---------------------------------------------------------------------------------------------
# Pass 2: gather the buckets in key order into shards
# ---------------------------------------------------------------------------------------------


def _split(bucket: _Bucket, work: str, memory: float) -> List[_Bucket]:
    """Split an oversized bucket by key range (streaming it: never loaded whole)."""
    k = max(2, math.ceil(bucket.nbytes / (_TARGET * memory)))
    k = min(k, _MAX_BUCKETS, bucket.hi - bucket.lo)
    parts = _Buckets(work, bucket.lo, bucket.hi, k, _buffer_size(memory, k))
    try:
        with open(bucket.path, "rb", buffering=_MAX_BUFFER) as f:
            while True:
                head = f.read(_RECORD.size)
                if not head:
                    break
                if len(head) < _RECORD.size:
                    raise _damaged_bucket(bucket.path)
                r, _, _, klen, dlen = _RECORD.unpack(head)
                key = f.read(klen)
                data = f.read(dlen)
                if len(key) < klen or len(data) < dlen:
                    raise _damaged_bucket(bucket.path)
                parts.add(r, head, key, data)
    finally:
        parts.close()
    os.unlink(bucket.path)
    return parts.buckets


def _damaged_bucket(path: str) -> WriteError:
    return WriteError(
        f"temporary bucket file {path!r} is truncated (was the disk full or the file "
        "touched?); rerun the conversion",
        url=path,
    )


def _load_bucket(
    bucket: _Bucket, buffer: bytearray
) -> Tuple[memoryview, List[Tuple[int, int, int, int, int, int]]]:
    """Read a bucket into ``buffer`` (reused: fresh memory for every bucket costs page faults)
    and return a view of it with its records sorted by key."""
    end = bucket.nbytes
    view = memoryview(buffer)[:end]
    with open(bucket.path, "rb") as f:
        got = f.readinto(view)
    if got != end:
        view.release()
        raise _damaged_bucket(bucket.path)
    os.unlink(bucket.path)
    records = []
    unpack = _RECORD.unpack_from
    size = _RECORD.size
    pos = 0
    while pos < end:
        if pos + size > end:
            view.release()
            raise _damaged_bucket(bucket.path)
        r, cid, code, klen, dlen = unpack(view, pos)
        ks = pos + size
        ds = ks + klen
        pos = ds + dlen
        records.append((r, cid, code, ks, ds, pos))
    if pos != end:
        view.release()
        raise _damaged_bucket(bucket.path)
    # Stable: equal keys keep their input order, so the output is deterministic.
    records.sort(key=itemgetter(0))
    return view, records


def _gather(
    scatter: _Scatter,
    writer: ShardWriter,
    work: str,
    memory: float,
    with_json: bool,
    bar: Any,
) -> int:
    """Write every sample in key order; return the number of bucket splits."""
    order = sorted(scatter.synsets)
    index_of = {s: i for i, s in enumerate(order)}
    cls_of = [str(index_of[s]).encode() for s in scatter.synsets]
    json_of = [json.dumps({"synset": s}).encode() for s in scatter.synsets]
    splits = 0
    buffer = bytearray()
    stack = scatter.buckets[::-1]
    while stack:
        bucket = stack.pop()
        if bucket.count == 0:
            os.unlink(bucket.path)
            continue
        if bucket.nbytes > memory and bucket.count > 1 and bucket.hi - bucket.lo > 1:
            stack.extend(_split(bucket, work, memory)[::-1])
            splits += 1
            continue
        if len(buffer) < bucket.nbytes:
            buffer = bytearray()  # free the old buffer before taking the bigger one
            buffer = bytearray(bucket.nbytes)
        view, records = _load_bucket(bucket, buffer)
        sample: Dict[str, Any] = {}
        try:
            for _, cid, code, ks, ds, de in records:
                sample = {
                    "__key__": str(view[ks:ds], "utf-8", "surrogateescape"),
                    _FIELD_NAMES[code]: view[ds:de],
                    "cls": cls_of[cid],
                }
                if with_json:
                    sample["json"] = json_of[cid]
                writer.write(sample)
                if bar is not None:
                    bar.update(1)
        finally:
            # No view of the buffer may outlive the bucket: a bigger buffer for the next one
            # would then come on top of this one instead of replacing it.
            sample.clear()
            view.release()
    return splits


def _convert_train(
    train_tar: str,
    pattern: str,
    *,
    labels: Optional["_Labels"],
    maxcount: int,
    maxsize: float,
    seed: int,
    memory: float,
    tmpdir: Optional[str],
    with_json: bool,
    options: Dict[str, Any],
    progress: bool,
) -> Tuple[List[str], Dict[str, Any]]:
    k = _plan_buckets(_input_size(train_tar), memory)
    _make_output_folder(pattern)
    work = tempfile.mkdtemp(prefix=".webds-imagenet-", dir=_temp_root(tmpdir, pattern))
    try:
        with open_url(train_tar, "rb", **options) as stream:
            reader = _Reader(stream, train_tar)
            with _bar(progress, f"reading {train_tar}") as bar:
                scatter = _scatter(reader, work, k, memory, seed, bar)
        synsets = sorted(scatter.synsets)
        if labels is not None:
            labels.resolve(synsets)  # a bad label file fails now, not after the shards
        writer = ShardWriter(
            pattern, maxcount=maxcount, maxsize=maxsize, encoder=False, storage_options=options
        )
        with writer, _bar(progress, f"writing {pattern}", scatter.samples) as bar:
            splits = _gather(scatter, writer, work, memory, with_json, bar)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return synsets, {
        "samples": writer.total,
        "shards": list(writer.shards),
        "index": default_index_name(pattern) if writer.index is not None else None,
        "buckets": k,
        "splits": splits,
        "temp_bytes": scatter.nbytes,
    }


def _temp_root(tmpdir: Optional[str], pattern: str) -> str:
    if tmpdir is not None:
        try:
            os.makedirs(tmpdir, exist_ok=True)
        except OSError as exn:
            raise ArgumentError(f"cannot use tmpdir {tmpdir!r}: {exn}") from None
        return tmpdir
    path = _local_pattern_path(pattern)
    if path is not None:
        return os.path.dirname(os.path.abspath(path))
    return tempfile.gettempdir()


def _local_pattern_path(pattern: str) -> Optional[str]:
    if pattern == "-" or url_scheme(pattern) == "pipe":
        return None
    return local_path(pattern)


def _make_output_folder(pattern: str) -> None:
    path = _local_pattern_path(pattern)
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exn:
            raise ArgumentError(f"cannot create the output folder {folder!r}: {exn}") from None


class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _bar(progress: bool, desc: str, total: Optional[int] = None) -> Any:
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(desc=desc, total=total, unit=" samples", file=sys.stderr, leave=False)


# ---------------------------------------------------------------------------------------------
# classes.json
# ---------------------------------------------------------------------------------------------


def _write_classes(pattern: str, synsets: List[str], options: Dict[str, Any]) -> Optional[str]:
    """classes.json beside the shards (none for shards written into a pipe)."""
    if _local_pattern_path(pattern) is None and (pattern == "-" or url_scheme(pattern) == "pipe"):
        return None
    from .pack import write_classes  # one definition of the classes.json format

    return write_classes(pattern, synsets, options)


def _load_classes(classes: Union[str, Sequence[str], None], options: Dict[str, Any]) -> List[str]:
    if isinstance(classes, (str, os.PathLike)):
        source = os.fspath(classes)
        try:
            with open_url(source, "rb", **options) as f:
                doc = json.loads(f.read().decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exn:
            raise ArgumentError(f"{source!r} is not a classes.json file: {exn}") from None
        names = doc.get("classes") if isinstance(doc, dict) else doc
    else:
        source, names = "classes", classes
    if (
        not isinstance(names, (list, tuple))
        or not names
        or not all(isinstance(n, str) and n for n in names)
        or len(set(names)) != len(names)
    ):
        raise ArgumentError(
            f"{source!r} must be a non-empty list of distinct class names, or a classes.json "
            'with {"classes": [...]}'
        )
    return list(names)


# ---------------------------------------------------------------------------------------------
# Validation: the label file and the flat validation tar
# ---------------------------------------------------------------------------------------------


def _image_stem(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    stem, dot, _ = base.rpartition(".")
    return stem if dot and stem else base


@dataclass
class _Labels:
    source: str
    named: bool  # entries name their image; else they follow sorted file-name order
    entries: List[Tuple[int, Optional[str], str]]  # (line number, image stem, label)

    def resolve(self, synsets: List[str]) -> Union[List[int], Dict[str, int]]:
        """The labels as class indices: a list (positional) or a dict by image stem."""
        index_of = {s: i for i, s in enumerate(synsets)}
        n = len(synsets)
        values = []
        for line, _, label in self.entries:
            idx = index_of.get(label)
            if idx is None and label.isdigit():
                idx = int(label)
                if idx >= n:
                    raise ArgumentError(
                        f"line {line} of {self.source!r}: class index {idx} is out of range "
                        f"0..{n - 1}. Integer labels are 0-based indices into the sorted "
                        "synsets; ILSVRC2012_validation_ground_truth.txt holds 1-based "
                        "ILSVRC2012 ids in the devkit's order, which need the devkit to map: "
                        "use LOC_val_solution.csv or a file of synsets instead"
                    )
            if idx is None:
                raise ArgumentError(
                    f"line {line} of {self.source!r}: unknown class {label!r}; it is not one "
                    f"of the {n} training classes (e.g. {synsets[0]!r}): the validation labels "
                    "must use the training set's synsets (or 0-based indices)"
                )
            values.append(idx)
        if not self.named:
            return values
        by_name: Dict[str, int] = {}
        for (line, stem, _), idx in zip(self.entries, values):
            assert stem is not None
            if stem in by_name:
                raise ArgumentError(f"line {line} of {self.source!r}: {stem!r} is labelled twice")
            by_name[stem] = idx
        return by_name


_KAGGLE_HEADER = "imageid,predictionstring"


def _read_labels(source: Optional[str], options: Dict[str, Any]) -> _Labels:
    assert source is not None
    source = os.fspath(source)
    with open_url(source, "rb", **options) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ArgumentError(f"label file {source!r} is not UTF-8 text") from None
    lines = [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise ArgumentError(f"label file {source!r} is empty")
    entries: List[Tuple[int, Optional[str], str]] = []
    if re.sub(r"\s", "", lines[0][1]).lower().startswith(_KAGGLE_HEADER):
        for n, line in lines[1:]:
            image, comma, prediction = line.partition(",")
            words = prediction.split()
            if not comma or not image.strip() or not words:
                raise ArgumentError(
                    f"line {n} of {source!r}: expected 'ImageId,PredictionString' with the "
                    f"synset first (Kaggle's LOC_val_solution.csv), got {line[:80]!r}"
                )
            entries.append((n, _image_stem(image.strip()), words[0]))
        if not entries:
            raise ArgumentError(f"label file {source!r} has a header but no labels")
        return _Labels(source, True, entries)
    for n, line in lines:
        words = re.split(r"[\s,]+", line)
        if len(words) == 1:
            entries.append((n, None, words[0]))
        elif len(words) == 2:
            entries.append((n, _image_stem(words[0]), words[1]))
        else:
            raise ArgumentError(
                f"line {n} of {source!r}: expected one label (a synset such as n01440764, or a "
                f"0-based class index) or 'FILE LABEL', got {line[:80]!r}"
            )
    named = entries[0][1] is not None
    for n, stem, _ in entries:
        if (stem is not None) != named:
            raise ArgumentError(
                f"line {n} of {source!r}: mixes 'LABEL' and 'FILE LABEL' lines; use one form"
            )
    if (
        not named
        and "ground_truth" in source.rsplit("/", 1)[-1].lower()
        and all(label.isdigit() for _, _, label in entries)
    ):
        raise ArgumentError(
            f"{source!r} looks like ILSVRC2012_validation_ground_truth.txt: its 1-based "
            "ILSVRC2012 ids follow the devkit's class order, which only the devkit's meta.mat "
            "maps to synsets. Use Kaggle's LOC_val_solution.csv, or a file with one synset "
            "per line"
        )
    return _Labels(source, named, entries)


def _convert_val(
    val_tar: str,
    pattern: str,
    label_file: _Labels,
    *,
    maxcount: int,
    maxsize: float,
    synsets: List[str],
    with_json: bool,
    options: Dict[str, Any],
    progress: bool,
) -> Dict[str, Any]:
    labels = label_file.resolve(synsets)
    positional = isinstance(labels, list)
    cls_of = [str(i).encode() for i in range(len(synsets))]
    json_of = [json.dumps({"synset": s}).encode() for s in synsets]
    _make_output_folder(pattern)
    seen = set()
    previous: Optional[str] = None
    count = 0
    writer = ShardWriter(
        pattern, maxcount=maxcount, maxsize=maxsize, encoder=False, storage_options=options
    )
    with open_url(val_tar, "rb", **options) as stream, writer:
        with _bar(progress, f"writing {pattern}") as bar:
            for name, data, _ in read_members(stream, url=val_tar):
                stem, field = _split_image_name(name)
                if field is None:
                    raise ShardReadError(
                        f"{name!r} in the validation tar is not a JPEG; the validation tar "
                        "must hold only images (ILSVRC2012_val_00000001.JPEG ...)",
                        url=val_tar,
                        member=name,
                    )
                try:
                    check_key(stem)
                except EncodeError as exn:
                    raise ShardReadError(
                        f"{name!r} cannot be a sample key: {exn.message}",
                        url=val_tar,
                        member=name,
                    ) from None
                base = name.rsplit("/", 1)[-1]
                if positional:
                    if previous is not None and base <= previous:
                        raise ArgumentError(
                            f"the validation tar is not in sorted file-name order ({base!r} "
                            f"after {previous!r}), but the label file {label_file.source!r} "
                            "gives one label per line in that order; use a label file that "
                            "names the files (LOC_val_solution.csv, or 'FILE LABEL' lines)"
                        )
                    if count >= len(labels):
                        raise ArgumentError(
                            f"the label file {label_file.source!r} has {len(labels)} labels but "
                            f"the validation tar holds more images ({name!r} has none)"
                        )
                    idx = labels[count]  # type: ignore[index]
                else:
                    if stem in seen:
                        raise ShardReadError(
                            f"the validation tar holds {stem!r} twice",
                            url=val_tar,
                            member=name,
                        )
                    seen.add(stem)
                    found = labels.get(stem)  # type: ignore[union-attr]
                    if found is None:
                        raise ArgumentError(
                            f"the label file {label_file.source!r} has no label for {stem!r} "
                            f"(member {name!r} of {val_tar!r}); give the label file of this "
                            "validation set"
                        )
                    idx = found
                previous = base
                sample = {"__key__": stem, field: data, "cls": cls_of[idx]}
                if with_json:
                    sample["json"] = json_of[idx]
                writer.write(sample)
                count += 1
                if bar is not None:
                    bar.update(1)
            if count == 0:
                raise ShardReadError("the validation tar holds no images", url=val_tar)
            if positional and count != len(labels):
                raise ArgumentError(
                    f"the label file {label_file.source!r} has {len(labels)} labels but the "
                    f"validation tar holds {count} images; labels by position need exactly "
                    "one per image (the validation shards written are incomplete)"
                )
    return {
        "samples": writer.total,
        "shards": list(writer.shards),
        "index": default_index_name(pattern) if writer.index is not None else None,
    }
