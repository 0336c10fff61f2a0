"""The two-pass shuffle behind :func:`~webds.convert.imagenet.convert_imagenet`: ImageNet's
training tar of class tars -> every image, in a uniformly random order fixed by the seed.

Pass 1 (:func:`_scatter`) streams the outer tar and each class tar in it
(:mod:`webds.convert.tarstream`), gives every image a 64-bit random key from
``random.Random(seed)`` and appends it to the temporary bucket file of its key range. Pass 2
(:func:`_gather`) loads the buckets in key order, sorts each by key and appends it to a
:class:`~webds.shardwriter.ShardWriter`; a bucket larger than ``memory`` is first split by key
range (:func:`_split`). The output depends only on the seed and the input, not on ``memory``,
the number of buckets or splits. Why it is uniform (Rao's two-pass shuffle), how buckets are
planned, and the memory and disk bounds: docs/convert-imagenet.md.

Class indices (sorted synsets) are known only once the whole outer tar has been read, so bucket
records carry the class's position in the input and pass 2 assigns the indices: one pass over
the input, so a pipe works.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, BinaryIO, Dict, Iterator, List, Optional, Tuple

from ..errors import EncodeError, ShardReadError, WriteError
from ..io.urls import local_path
from ..shardwriter import ShardWriter
from ..tar.reader import read_members
from ..tarwriter import check_key
from .tarstream import MemberStream, TarStreamError, member_streams

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
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


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


def _class_images(member: MemberStream, url: str, name: str) -> Iterator[Tuple[str, bytes, int]]:
    """The members of one class tar, its damage reported as such (naming the outer tar)."""
    members = read_members(member, url=name)  # type: ignore[arg-type]
    while True:
        try:
            item = next(members)
        except StopIteration:
            return
        except TarStreamError:
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


def _scatter(
    stream: Any, url: str, work: str, k: int, memory: float, seed: int, bar: Any
) -> _Scatter:
    """Pass 1: every image of the training tar read from ``stream`` into ``k`` buckets."""
    rng = random.Random(seed)
    getrandbits = rng.getrandbits
    pack = _RECORD.pack
    synsets: List[str] = []
    seen: Dict[str, str] = {}
    samples = 0
    buckets = _Buckets(work, 0, _KEY_SPACE, k, _buffer_size(memory, k))
    try:
        members = member_streams(
            stream,
            url,
            what="the training tar",
            expected="a class tar",
            hint="give ImageNet's training tar (one tar per class)",
        )
        for name, member in members:
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
