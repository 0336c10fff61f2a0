"""Shards of small members grouped in bulk: :func:`bulk_groups`, the tar stage's fast path.

Read member by member, a shard of 1-2 KB records costs microseconds of Python per member: parse
the header, check its sum, split the name, start or extend a sample. Here numpy checks the
headers of a whole chunk of the stream at once (4 MiB: a few thousand members;
:mod:`webds.tar.scan`), follows the chain of sizes from header to header and finds where each
sample starts; Python only cuts each field's bytes out of the chunk and makes each sample's
dict.

It takes only what it can check exactly as :func:`~webds.tar.reader.read_members` and
:func:`~webds.tar.grouper.group_members` would take it: POSIX ustar headers of regular files
(type ``0``), their sizes and sums in the layout writers use (``%011o``, ``%06o\\0 ``), names
without a prefix field that have a ``key.extension`` (not metadata), no extension twice in a
sample; each maybe after a pax header whose records change nothing (the mtime tarfile and
webdataset write before every member). At anything else (a pax header that names or sizes its
member, a GNU long name, a damaged header, the end of the archive) and where members are large
(over 8 KiB on average), it hands the stream over to those two at the first member of the
sample in flight: every error, warning and end of stream is theirs, raised where they would
raise it, after every sample before it. The samples, their
start offsets and the order are theirs too (tests/test_bulk.py compares both on random and
damaged shards).
"""

from __future__ import annotations

import io
from typing import Any, BinaryIO, Dict, Iterator, List, NamedTuple, Optional, Tuple

from ..base.handlers import ErrorPolicy
from ..base.runs import Run
from ..errors import WebdsError
from .compression import compression_of, read_failed
from .fields import _SURROGATE
from .grouper import Grouping, ShardNotes, group_members
from .reader import _member_limit, read_members
from .scan import Gathered, parse

__all__ = ["bulk_groups", "takes_rules"]

_CHUNK = 4 << 20  # bytes read at a time
#: The first read: enough to tell small members from large ones without holding a chunk.
_FIRST = 64 << 10
#: Members larger than this on average (with their headers) are read one by one: for them,
#: checking a buffer at a time costs more than it saves.
_SMALL = 8 << 10
#: The fewest samples alike made a run (webds.base.runs): a shorter one costs more than it saves.
_RUN = 8


def takes_rules(rules: Grouping) -> bool:
    """Whether :func:`bulk_groups` groups by ``rules``: the tar stage's own (no renaming,
    selecting, key function or extension filter; metadata skipped; samples as the shard has
    them)."""
    return (
        rules.select_files is None
        and rules.rename_files is None
        and rules.keys is None
        and rules.suffixes is None
        and rules.skip_meta
        and not rules.count_raw
    )


class _Shard(NamedTuple):
    """One shard's stream and how its members are grouped (:func:`bulk_groups`'s arguments)."""

    stream: BinaryIO
    url: Optional[str]
    rules: Grouping
    policy: ErrorPolicy
    notes: ShardNotes
    local_path: Optional[str]
    max_member_size: Optional[int]


def bulk_groups(
    stream: BinaryIO,
    url: Optional[str],
    rules: Grouping,
    policy: ErrorPolicy,
    notes: ShardNotes,
    local_path: Optional[str] = None,
    max_member_size: Optional[int] = None,
    start: int = 0,
    runs: bool = False,
) -> Iterator[Tuple[Any, Any]]:
    """``group_members(read_members(stream, url, max_member_size, start), url, rules, policy,
    notes, local_path)``, the same items (see :func:`~webds.tar.grouper.group_members`), with
    runs of small plain members grouped in bulk. ``rules`` must pass :func:`takes_rules`.
    With ``runs``, the samples of a chunk whose samples all have the same fields come as one
    :class:`~webds.base.runs.Run` (with the start of the sample after it), not one by one: the
    same samples, as columns (what comes between them and the starts they skip is nothing).

    The stream is read into one buffer, reused (``readinto``): a new buffer per chunk cost more
    in page faults than the bulk saves. Only an :class:`io.IOBase` stream is, whose
    ``readinto`` reads what its ``read`` would (a wrapper that handed attributes on to the
    stream it wraps would be read around); any other, and a compressed one, is read member by
    member."""
    shard = _Shard(stream, url, rules, policy, notes, local_path, max_member_size)
    readinto = _readinto(stream)
    if readinto is None:
        return _handed_over(shard, b"", start, None, False)
    return _bulk(shard, readinto, start, runs)


def _readinto(stream: Any) -> Any:
    """``stream.readinto`` where it reads what ``stream.read`` would, else None: an
    :class:`io.IOBase`, or a wrapper whose class says it ``passes_through`` the reads of the
    stream it wraps (``wrapped``) to one."""
    inner = stream
    while getattr(type(inner), "passes_through", False):  # (the type's: not handed on)
        inner = inner.wrapped
    return stream.readinto if isinstance(inner, io.IOBase) else None


def _bulk(shard: _Shard, readinto: Any, start: int, runs: bool) -> Iterator[Tuple[Any, Any]]:
    import numpy as np  # (on the first shard read, not with webds: the command starts fast)

    url, local_path = shard.url, shard.local_path
    store = bytearray(_FIRST)
    view = memoryview(store)
    array = np.frombuffer(store, np.uint8)
    lcase = shard.rules.lcase
    fixed = 2 if local_path is None else 3  # __key__, __url__ and maybe __local_path__
    names: Dict[bytes, str] = {}  # extension bytes -> the sample's field name
    # The last sample given a start and not yet given; whether the sample at the buffer's start
    # was given its start (in the round before: its first member was whole there).
    pending: Optional[Dict[str, Any]] = None
    started = False
    base, at = start, 0  # ``at``: where in the buffer the member reader takes over
    size = _read_into(readinto, view, 0, url)
    limit = _member_limit(shard.max_member_size, None)
    gathered = Gathered(np)
    compressed = compression_of(bytes(view[:16])) is not None  # read member by member
    while size > 0 and not compressed:
        hoffs, starts, ends, keys, exts, firsts, more = parse(
            np, store, array, size, limit, gathered
        )
        samples = len(firsts) - 1  # (firsts ends with the number of members)
        if not samples or (more and len(starts) * _SMALL < size):
            break  # not one plain member whole in the buffer; or large members
        j = 0
        while j < samples:
            a, b = firsts[j], firsts[j + 1]
            if j == samples - 1:
                at = hoffs[a]  # the last sample may go on: carried over, or handed over
                if not (a == 0 and started):
                    yield pending, base + at
                    pending, started = None, True
                break
            run = None
            if runs and j + _RUN < samples and exts[b] == exts[a]:  # (a first look: cheap)
                if exts[a : a + (b - a) * _RUN] == exts[a:b] * _RUN:
                    run = _run(view, starts, ends, keys, exts, firsts, j, names, shard)
            if run is not None:  # samples j.. alike: one item (pending ends where they start)
                if not (a == 0 and started):
                    yield pending, base + hoffs[a]
                j += run.count
                yield run, base + hoffs[firsts[j]]
                pending, started = None, False
                continue
            sample = {"__key__": keys[j], "__url__": url}
            if local_path is not None:
                sample["__local_path__"] = local_path
            for i in range(a, b):
                field = names.get(exts[i])
                if field is None:
                    field = names[exts[i]] = _field_name(exts[i], lcase)
                sample[field] = view[starts[i] : ends[i]].tobytes()
            if len(sample) != fixed + b - a:  # an extension twice: the member reader says so
                at, more = hoffs[a], False
                break
            if not (a == 0 and started):
                yield pending, base + hoffs[a]
            pending, started = sample, False
            j += 1
        if not more or at == 0:
            break  # something else than a plain member; or a sample as large as the buffer
        kept = size - at
        carried = bytes(view[at:size])  # (a copy: the two ranges may overlap)
        if len(store) < _CHUNK:  # small members: from now on, read a chunk at a time
            store = bytearray(_CHUNK)
            view = memoryview(store)
            array = np.frombuffer(store, np.uint8)
        store[:kept] = carried
        base, at = base + at, 0
        size = kept + _read_into(readinto, view, kept, url)
        if size == kept:
            break  # the stream ended
    # The stream ended, or the rest is not for bulk: it is read one member at a time.
    rest = bytes(view[at:size]) if size > 0 else b""
    store = view = array = None  # type: ignore[assignment]  # (not held while it reads on)
    yield from _handed_over(shard, rest, base + at, pending, started)


def _run(
    view: memoryview,
    starts: List[int],
    ends: List[int],
    keys: List[str],
    exts: List[bytes],
    firsts: List[int],
    j: int,
    names: Dict[bytes, str],
    shard: _Shard,
) -> Optional[Run]:
    """Samples ``j``, ``j + 1``, ... of a chunk (not its last, which may go on in the next) as
    one run, as long as each has the same extensions in the same order as sample ``j`` (and no
    field twice); None where fewer than :data:`_RUN` do. (``names``: the field name of each
    extension, filled in; ``starts`` and ``ends``: where each member's data lies in ``view``.)"""
    a = firsts[j]
    k = firsts[j + 1] - a
    pattern = exts[a : a + k]
    count = _alike(exts, firsts, j, len(firsts) - 2 - j)  # (firsts ends with the members)
    if count < _RUN:
        return None
    members = k * count
    fields = []
    for ext in pattern:
        field = names.get(ext)
        if field is None:
            field = names[ext] = _field_name(ext, shard.rules.lcase)
        fields.append(field)
    columns: Dict[str, List[Any]] = {
        "__key__": keys[j : j + count],
        "__url__": [shard.url] * count,
    }
    if shard.local_path is not None:
        columns["__local_path__"] = [shard.local_path] * count
    if len({*columns, *fields}) != len(columns) + k:
        return None  # a field twice (or one named as the reader's): the member reader says
    for p, field in enumerate(fields):
        taken = slice(a + p, a + members, k)
        columns[field] = [view[s:e].tobytes() for s, e in zip(starts[taken], ends[taken])]
    return Run(columns, None, count, frozenset(fields))


def _alike(exts: List[bytes], firsts: List[int], j: int, most: int) -> int:
    """How many samples from sample ``j`` on (at most ``most``) have the members sample ``j``
    has, by extension, in order. In steps that double while they are all alike (each a list
    comparison), then one by one: the time grows with the count, not with ``most``."""
    a = firsts[j]
    k = firsts[j + 1] - a
    pattern = exts[a : a + k]

    def alike(start: int, end: int) -> bool:  # samples j + start .. j + end - 1
        return exts[a + k * start : a + k * end] == pattern * (end - start) and firsts[
            j + start : j + end + 1
        ] == list(range(a + k * start, a + k * end + 1, k))

    count, step = 1, 1
    while count < most:
        end = min(count + step, most)
        if not alike(count, end):
            break
        count, step = end, step * 2
    while count < most and alike(count, count + 1):
        count += 1
    return count


def _read_into(readinto: Any, view: memoryview, k: int, url: Optional[str]) -> int:
    """One read into ``view`` after its first ``k`` bytes; the bytes read (0 at the end; -1
    where the first read finds the stream has no ``readinto``, as an io.RawIOBase that defines
    only ``read``). One: what was read is grouped before the next read, which may fail, as the
    member reader would group it. Failures raise as the member reader raises them."""
    try:
        return readinto(view[k:]) or 0
    except (NotImplementedError, io.UnsupportedOperation):
        if k:
            raise
        return -1
    except WebdsError:
        raise
    except Exception as exn:
        raise read_failed(exn, url) from exn


def _handed_over(
    shard: _Shard,
    rest: bytes,
    offset: int,
    pending: Optional[Dict[str, Any]],
    started: bool,
) -> Iterator[Tuple[Optional[Dict[str, Any]], Any]]:
    """The members from stream offset ``offset`` on (``rest``, then the stream), grouped one by
    one. The first start the member reader gives ends ``pending``, the last sample grouped in
    bulk, or, where ``started``, was given already."""
    stream, url, rules, policy, notes, local_path, max_member_size = shard
    members = read_members(
        _Prefixed(rest, stream), url, max_member_size, offset, local_path=local_path
    )
    groups = group_members(members, url, rules, policy, notes, local_path)
    first = True
    try:
        for done, begins in groups:
            if first:
                first = False
                if started:
                    continue
                done = pending
            yield done, begins
    finally:
        groups.close()


class _Prefixed:
    """A stream that reads ``prefix`` first, then ``stream``."""

    def __init__(self, prefix: bytes, stream: BinaryIO) -> None:
        self.prefix, self.at, self.stream = memoryview(prefix), 0, stream

    def read(self, n: int = -1) -> bytes:
        left = len(self.prefix) - self.at
        if left > 0:
            n = left if n < 0 else min(n, left)
            self.at += n
            return bytes(self.prefix[self.at - n : self.at])
        return self.stream.read(n)


def _field_name(ext: bytes, lcase: bool) -> str:
    name = ext.decode("utf-8", _SURROGATE)
    return name.lower() if lcase else name
