"""Tar members that are not plain files but read as one, off the member reader's fast path.

- A **hard link** (type ``1``: ``tar cf`` writes the second name of a hard-linked file so, with
  size 0 and the first name as its link name) reads as the bytes of the member it names, as
  ``tar x`` gives them; a **symbolic link** (type ``2``) whose name can be a field, as the bytes
  of the member its target names inside the archive. The member named comes before the link,
  maybe in an earlier sample that a streaming read has passed: :class:`Earlier` finds it by a
  walk over the shard's headers from its start (a bounded record of names and data offsets,
  extended from link to link) and reads it again; its bytes count in its sample's budget as a
  sparse member's do (below), before they are read. That needs an uncompressed local shard; any
  other link is refused loudly, naming the link, its target and the fix (``tar
  --hard-dereference``, ``tar --dereference``), never dropped.
- A **GNU sparse member** (old GNU type ``S``; pax formats 0.0, 0.1 and 1.0) reads as its real
  size of bytes, the holes as zeros (:func:`read_sparse`), as ``tar x`` and webdataset read it.
  A sparse member expands like a compressed one, so its real size is bounded as a compressed
  shard's members are (1 GiB by default, ``max_member_size``), and counts in its sample's
  budget (``max_sample_bytes``, 512 MiB by default) in every shard, plain ones too, before it
  is expanded.
"""

from __future__ import annotations

import posixpath
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Tuple

from ..errors import ShardReadError
from .fields import (
    _AREG,
    _CONT,
    _EXTENDED_TYPES,
    _GNU_SPARSE,
    _HARDLINK,
    _NO_DATA_TYPES,
    _REG,
    _SURROGATE,
    _SYMLINK,
    _checksum_ok,
    _nts,
    _number,
    _Pending,
)

__all__ = ["Earlier", "link_target", "read_sparse"]

#: The most members the record of an :class:`Earlier` holds (a name and two numbers each).
MAX_RECORDED = 1 << 18
_MAX_EXTENDED = 1 << 26  # (as the member reader's cap on extended headers)
_MAX_SEGMENTS = 1 << 20  # the most holes and data runs a sparse map may list
_ZEROS = bytes(1 << 20)
_PLAIN = (_REG, _AREG, _CONT)


def link_target(hdr: bytes, pending: _Pending) -> str:
    """The link name of the entry ``hdr`` just resolved by ``pending``: pax ``linkpath``, a GNU
    long link name, or the header's own field."""
    name = pending.pax.get("linkpath") or pending.linkname or _nts(hdr[157:257])
    return name.decode("utf-8", _SURROGATE)


def _norm(name: str) -> str:
    return posixpath.normpath(name) if name else name


class Earlier:
    """The members of a shard before a link, found again (see the module's docstring).

    ``path``: the shard's local file (None where it has none: a remote object, a ``pipe:``
    command, a stream); ``compression``: the shard's, if any. A link is resolved only in an
    uncompressed local shard, where the member it names is read again at its offset."""

    def __init__(
        self,
        url: Optional[str],
        path: Optional[str],
        compression: Optional[str],
        limit: int,
        charge: Optional[Callable[[str, int, int], None]] = None,
    ) -> None:
        self.url, self.path, self.compression, self.limit = url, path, compression, limit
        # Counts a link's bytes in its sample's budget before they are read: (name, size, hoff).
        self.charge = charge
        self.record: Dict[str, Tuple[int, int, int, str]] = {}  # name -> (type, at, size, link)
        self.pending = _Pending()
        self.walked = 0  # the offset of the next header the walk reads

    def data(self, typ: int, name: str, target: str, hoff: int, hdr: bytes) -> bytes:
        """The bytes of link ``name`` (``typ``: hard or symbolic) to ``target``, whose header
        ``hdr`` is at stream offset ``hoff``."""
        why = self._cannot()
        if why is not None:
            raise self._refused(typ, name, target, hoff, why)
        assert self.path is not None
        with open(self.path, "rb") as f:
            self.walked = self._walk(f, self.walked, hoff, name, self.pending, self.record)
            f.seek(hoff)
            if f.read(512) != hdr:  # (a stream whose offsets are not the file's, or another file)
                raise self._lost(name, hoff, hoff)
            later: Dict[str, Tuple[int, int, int, str]] = {}
            for _ in range(16):  # a link to a link: followed, a few times
                wanted = _norm(_relative(typ, name, target))
                found = self.record.get(wanted)
                if found is None and typ == _SYMLINK:
                    # A symbolic link's target may come after it (`tar x` resolves it once all
                    # is extracted): the rest of the archive, walked once for this link.
                    if not later:
                        ahead = _Pending()
                        ahead.gpax = dict(self.pending.gpax)
                        self._walk(f, hoff, -1, name, ahead, later)
                    found = later.get(wanted)
                if found is None:
                    break
                kind, at, size, link = found
                if kind in _PLAIN:
                    return self._read(f, at, size, name, target, hoff)
                if kind not in (_HARDLINK, _SYMLINK):
                    break
                typ, name, target = kind, wanted, link
        raise self._refused(
            typ, name, target, hoff, "no regular member of that name comes before it"
        )

    def _cannot(self) -> Optional[str]:
        if self.compression is not None:
            return f"this shard is {self.compression}-compressed"
        if self.path is None:
            return "this shard is not a local file"
        return None

    def _read(self, f: BinaryIO, at: int, size: int, name: str, target: str, hoff: int) -> bytes:
        if size > self.limit:
            raise ShardReadError(
                f"link to {target!r}: that member is {size} bytes, more than the {self.limit} "
                "allowed (max_member_size=)",
                url=self.url,
                member=name,
                offset=hoff,
            )
        if self.charge is not None:
            self.charge(name, size, hoff)
        f.seek(at)
        data = f.read(size)
        if len(data) != size:
            raise ShardReadError(
                f"link to {target!r}: the shard changed while it was read",
                url=self.url,
                member=name,
                offset=hoff,
            )
        return data

    def _walk(
        self,
        f: BinaryIO,
        at: int,
        hoff: int,
        name: str,
        pending: _Pending,
        record: Dict[str, Tuple[int, int, int, str]],
    ) -> int:
        """Record the members whose headers lie between offsets ``at`` and ``hoff`` (-1: the
        end of the archive) in ``record``; the offset reached."""
        url = self.url
        while at < hoff or hoff < 0:
            f.seek(at)
            hdr = f.read(512)
            if hoff < 0 and (len(hdr) < 512 or not hdr.strip(b"\0")):
                return at
            if len(hdr) < 512 or not _checksum_ok(hdr):
                raise self._lost(name, hoff, at)
            typ = hdr[156]
            size = max(_number(hdr[124:136], "size", url, at, None), 0)
            if typ in _EXTENDED_TYPES:
                if size > _MAX_EXTENDED:
                    raise self._lost(name, hoff, at)
                pending.add(typ, f.read(size), url, at)
            else:
                member, size, _ = pending.resolve(hdr, url, at)
                if typ in (_HARDLINK, _SYMLINK) or (typ in _PLAIN and not pending.sparse(hdr)):
                    if len(record) >= MAX_RECORDED and _norm(member) not in record:
                        raise self._refused(
                            _HARDLINK, name, "", hoff, f"more than {MAX_RECORDED} members before it"
                        )
                    link = link_target(hdr, pending) if typ in (_HARDLINK, _SYMLINK) else ""
                    record.setdefault(_norm(member), (typ, at + 512, size, link))
                    if hoff >= 0:  # (before the link: the last of a name; after: the first)
                        record[_norm(member)] = (typ, at + 512, size, link)
                elif hoff >= 0:
                    record.pop(_norm(member), None)  # (a later entry of that name)
                if typ in _NO_DATA_TYPES:
                    size = 0
                more = typ == _GNU_SPARSE and hdr[482]
                while more:  # an old GNU sparse header's extension blocks
                    at += 512
                    f.seek(at)
                    block = f.read(512)
                    if len(block) < 512:
                        raise self._lost(name, hoff, at)
                    more = block[504]
            at += 512 + ((size + 511) & -512)
        if at != hoff:
            raise self._lost(name, hoff, at)
        return at

    def _lost(self, name: str, hoff: int, at: int) -> ShardReadError:
        return ShardReadError(
            f"cannot find the member a link names: the walk over the shard's headers from its "
            f"start reached byte {at}, not the link's header at byte {hoff}; re-create the shard "
            "with `tar --hard-dereference`",
            url=self.url,
            member=name,
            offset=hoff,
        )

    def _refused(self, typ: int, name: str, target: str, hoff: int, why: str) -> ShardReadError:
        kind, fix = (
            ("hard link", "tar --hard-dereference")
            if typ == _HARDLINK
            else ("symbolic link", "tar --dereference (-h)")
        )
        return ShardReadError(
            f"member is a {kind} to {target!r}, which cannot be read ({why}); webds reads a link "
            f"as the bytes of the member it names only in an uncompressed local shard. Re-create "
            f"the shard with `{fix}` (every name then holds its own bytes)",
            url=self.url,
            member=name,
            offset=hoff,
        )


def _relative(typ: int, name: str, target: str) -> str:
    """The archive name a link's target means: a hard link's as it is; a symbolic link's
    relative to the link's folder (an absolute target, or one that leaves the archive, names
    no member)."""
    if typ == _HARDLINK:
        return target
    if target.startswith("/"):
        return ""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    return "" if joined == ".." or joined.startswith("../") else joined


def read_sparse(
    scan: Any, hdr: bytes, buf: bytes, pos: int, base: int, name: str, size: int, hoff: int
) -> Tuple[bytes, bytes, int, int]:
    """The GNU sparse member of header ``hdr`` at ``buf[pos]`` (``size``: its stored bytes),
    read through ``scan`` (the member reader's ``_Scan``): ``(data, buf, pos, base)``, the
    data its real size with the holes as zeros, ``pos`` the next header."""
    url, pax, limit = scan.url, scan.pending.pax, scan.sparse_limit
    at = pos + 512
    if hdr[156] == _GNU_SPARSE:  # old GNU: the map in the header, maybe in blocks after it
        segments = _gnu_entries(hdr[386:482], url, name, hoff)
        real = _number(hdr[483:495], "real size", url, hoff, name)
        more = hdr[482]
        while more:
            _bound(len(segments), 0, limit, url, name, hoff)
            block, buf, at, base = scan.read(buf, at, base, 512, name, hoff)
            segments += _gnu_entries(block[:504], url, name, hoff)
            more = block[504]
    elif pax.get("GNU.sparse.major") == b"1":  # pax 1.0: the map at the start of the data
        real = _decimal(pax.get("GNU.sparse.realsize"), url, name, hoff)
        segments = []
    else:  # pax 0.0 (repeated records) or 0.1 (one list)
        real = _decimal(pax.get("GNU.sparse.size"), url, name, hoff)
        if "GNU.sparse.map" in pax:
            numbers = [_decimal(n, url, name, hoff) for n in pax["GNU.sparse.map"].split(b",")]
        else:
            numbers = [_decimal(v, url, name, hoff) for _, v in scan.pending.map00]
        segments = list(zip(numbers[::2], numbers[1::2]))
    _bound(len(segments), real, limit, url, name, hoff)
    _bound(0, size, limit, url, name, hoff)
    scan.charge_expanded(name, real, hoff)  # its real size, in its sample's budget, always
    stored, buf, pos, base = scan.read(buf, at, base, size, name, hoff)
    view = memoryview(stored)
    if not segments and pax.get("GNU.sparse.major") == b"1":
        segments, skip = _map_10(stored, url, name, hoff)
        view = view[skip:]
    return _expand(view, segments, real, url, name, hoff), buf, pos, base


def _bound(segments: int, real: int, limit: int, url: Optional[str], name: str, hoff: int) -> None:
    if segments > _MAX_SEGMENTS or not 0 <= real <= limit:
        raise ShardReadError(
            f"sparse member declares {real} bytes with {segments} data runs, more than the "
            f"{limit} bytes allowed (a sparse member expands like a compressed one: it may be a "
            "bomb); if it is genuine, raise the limit with max_member_size=",
            url=url,
            member=name,
            offset=hoff,
        )


def _corrupt(what: str, url: Optional[str], name: str, hoff: int) -> ShardReadError:
    return ShardReadError(
        f"corrupt sparse member: {what}; re-create the shard", url=url, member=name, offset=hoff
    )


def _decimal(value: Optional[bytes], url: Optional[str], name: str, hoff: int) -> int:
    if value is None or not value.strip().isdigit():
        raise _corrupt(f"{value!r} is not a decimal number", url, name, hoff)
    return int(value)


def _gnu_entries(fields: bytes, url: Optional[str], name: str, hoff: int) -> List[Tuple[int, int]]:
    """The (offset, size) entries of an old GNU sparse map: 24 bytes each, an empty one ends."""
    entries = []
    for i in range(0, len(fields) - 23, 24):
        if not fields[i]:
            break
        offset = _number(fields[i : i + 12], "sparse offset", url, hoff, name)
        entries.append((offset, _number(fields[i + 12 : i + 24], "sparse size", url, hoff, name)))
    return entries


def _map_10(
    data: bytes, url: Optional[str], name: str, hoff: int
) -> Tuple[List[Tuple[int, int]], int]:
    """A pax 1.0 sparse map (decimal lines: the entry count, then offset and size of each,
    padded to a block) at the start of ``data``: the entries, and the bytes it takes."""
    end = data.find(b"\n")
    count = _decimal(data[:end] if end > 0 else None, url, name, hoff)
    if count > _MAX_SEGMENTS:
        raise _corrupt(f"its map claims {count} entries", url, name, hoff)
    numbers = []
    for _ in range(2 * count):
        start, end = end + 1, data.find(b"\n", end + 1)
        numbers.append(_decimal(data[start:end] if end > start else None, url, name, hoff))
    return list(zip(numbers[::2], numbers[1::2])), (end + 1 + 511) & -512


def _expand(
    stored: memoryview,
    segments: List[Tuple[int, int]],
    real: int,
    url: Optional[str],
    name: str,
    hoff: int,
) -> bytes:
    """``real`` bytes: each segment's run of ``stored`` at its offset, zeros between."""
    parts: List[Any] = []
    at = taken = 0
    for offset, size in segments:
        if offset < at or offset + size > real or taken + size > len(stored):
            raise _corrupt(f"its map does not fit its {real} bytes", url, name, hoff)
        _zeros(parts, offset - at)
        parts.append(stored[taken : taken + size])
        taken, at = taken + size, offset + size
    if taken != len(stored):
        raise _corrupt(f"{len(stored) - taken} stored bytes are in no data run", url, name, hoff)
    _zeros(parts, real - at)
    return b"".join(parts)


def _zeros(parts: List[Any], n: int) -> None:
    """Append ``n`` zero bytes to ``parts`` as views of one block (a hole costs no memory of
    its own until the join)."""
    zeros = memoryview(_ZEROS)
    while n > 0:
        parts.append(zeros[: min(n, len(zeros))])
        n -= len(zeros)
