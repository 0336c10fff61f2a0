"""Decoding tar header blocks for the reader: numeric and name fields, checksums, and the
extended headers (pax ``x`` per member and ``g`` global, GNU long names ``L``/``K``) that change
the name or size of the member after them.

The reader (:mod:`webds.tar.reader`) keeps its fast path for plain headers inline; this module
holds the slow path and the type-flag constants both use.
"""

from __future__ import annotations

import struct
from typing import Dict, List, Optional, Tuple

from ..errors import ShardReadError

_SIGNED_HEADER = struct.Struct("148b8x356b")

# Type flags (as byte values).
_REG, _AREG, _CONT = 0x30, 0x00, 0x37  # '0', NUL, '7'
_GNU_LONGNAME, _GNU_LONGLINK, _GNU_SPARSE = 0x4C, 0x4B, 0x53  # 'L', 'K', 'S'
_PAX_MEMBER, _PAX_GLOBAL = 0x78, 0x67  # 'x', 'g'
_HARDLINK, _SYMLINK = 0x31, 0x32  # '1', '2'
_SPARSE_00 = ("GNU.sparse.offset", "GNU.sparse.numbytes")
# Link, device, directory and fifo entries carry no data whatever their size field says
# (tarfile and GNU tar agree); other unknown types are skipped over their data.
_NO_DATA_TYPES = frozenset(b"123456")
_EXTENDED_TYPES = frozenset((_PAX_MEMBER, _PAX_GLOBAL, _GNU_LONGNAME, _GNU_LONGLINK))
# Names are bytes on disk: bytes that are not UTF-8 survive the round trip to str and back (the
# writer encodes names with the same handler).
_SURROGATE = "surrogateescape"


def _nts(field: bytes) -> bytes:
    """A NUL-terminated string field."""
    i = field.find(0)
    return field if i < 0 else field[:i]


def _number(field: bytes, what: str, url: Optional[str], offset: int, member: Optional[str]) -> int:
    """An octal (or GNU base-256) numeric field, as tarfile and GNU tar read them."""
    if field and field[0] in (0x80, 0xFF):
        n = int.from_bytes(field[1:], "big")
        if field[0] == 0xFF:
            n -= 1 << (8 * (len(field) - 1))
        return n
    text = _nts(field).strip()
    if not text:
        return 0
    if text.strip(b"01234567"):
        raise ShardReadError(
            f"corrupt header: the {what} field {bytes(field)!r} is not an octal number; "
            "re-create the shard",
            url=url,
            member=member,
            offset=offset,
        )
    return int(text, 8)


def _checksum_ok(hdr: bytes) -> bool:
    """Exact check against the unsigned and the signed (old tars) header sums."""
    try:
        stored = int(_nts(hdr[148:156]).strip() or b"-1", 8)
    except ValueError:
        return False
    unsigned = sum(hdr) - sum(hdr[148:156]) + 256
    if stored == unsigned:
        return True
    return stored == sum(_SIGNED_HEADER.unpack(hdr)) + 256


def _header_name(hdr: bytes) -> bytes:
    name = _nts(hdr[:100])
    # Only POSIX ustar has a prefix field; GNU and v7 headers use those bytes otherwise.
    if hdr[345] and hdr[257:263] == b"ustar\0":
        name = _nts(hdr[345:500]) + b"/" + name
    return name


def _parse_pax(
    data: bytes, url: Optional[str], offset: int, member: Optional[str]
) -> Dict[str, bytes]:
    """Parse pax records ``"%d %s=%s\\n"`` into a dict of keyword -> raw value."""
    return dict(_pax_records(data, url, offset, member))


def _pax_records(
    data: bytes, url: Optional[str], offset: int, member: Optional[str]
) -> List[Tuple[str, bytes]]:
    """Pax records ``"%d %s=%s\\n"``, in order, repeated keywords kept (a sparse map in the pax
    0.0 format is ``GNU.sparse.offset`` and ``GNU.sparse.numbytes`` records, repeated)."""
    records: List[Tuple[str, bytes]] = []
    i, n = 0, len(data)
    while i < n:
        if data[i] == 0:  # some writers pad the record block with NULs
            break
        sp = data.find(b" ", i, i + 24)
        length_text = data[i:sp] if sp > i else b""
        end = i + int(length_text) if length_text.isdigit() else -1
        if end <= sp + 2 or end > n or data[end - 1] != 0x0A:
            raise ShardReadError(
                f"corrupt pax header: malformed record at byte {i} of {n}; re-create the shard",
                url=url,
                member=member,
                offset=offset,
            )
        keyword, eq, value = data[sp + 1 : end - 1].partition(b"=")
        if not eq or not keyword:
            raise ShardReadError(
                f"corrupt pax header: record without keyword=value at byte {i}; "
                "re-create the shard",
                url=url,
                member=member,
                offset=offset,
            )
        records.append((keyword.decode("utf-8", _SURROGATE), value))
        i = end
    return records


def _pax_size(value: bytes, url: Optional[str], offset: int, member: Optional[str]) -> int:
    if not value.isdigit():
        raise ShardReadError(
            f"corrupt pax header: size {value[:40]!r} is not a decimal number; re-create the shard",
            url=url,
            member=member,
            offset=offset,
        )
    return int(value)


class _Pending:
    """Extended headers (pax ``x``/``g``, GNU ``L``/``K``) and the member they apply to.

    :meth:`resolve` gives the member's name and size, and leaves what the member reader needs
    for a link or a sparse member in ``pax`` (the pax values in force for it), ``linkname``
    (its GNU ``K`` long link name, if any) and ``map00`` (its pax 0.0 sparse map, in order)."""

    __slots__ = (
        "gpax",
        "xpax",
        "longname",
        "longlink",
        "sparse00",
        "offset",
        "pax",
        "linkname",
        "map00",
    )

    def __init__(self) -> None:
        self.gpax: Dict[str, bytes] = {}  # global pax values in force
        self.xpax: Optional[Dict[str, bytes]] = None  # pax values for the next member only
        self.longname: Optional[bytes] = None
        self.longlink: Optional[bytes] = None
        self.sparse00: List[Tuple[str, bytes]] = []
        self.offset = -1  # offset of the first extended header of the next member
        # Of the member last resolved:
        self.pax: Dict[str, bytes] = {}
        self.linkname: Optional[bytes] = None
        self.map00: List[Tuple[str, bytes]] = []

    def active(self) -> bool:
        """Whether the next member header needs the slow path."""
        return self.offset >= 0 or bool(self.gpax)

    def add(self, typ: int, data: bytes, url: Optional[str], hoff: int) -> None:
        if typ == _PAX_MEMBER:
            if self.xpax is None:
                self.xpax = {}
            records = _pax_records(data, url, hoff, None)
            self.xpax.update(records)
            self.sparse00 += [r for r in records if r[0] in _SPARSE_00]
        elif typ == _PAX_GLOBAL:
            for k, v in _parse_pax(data, url, hoff, None).items():
                # Keep only what changes how members are read, so that a harmless global
                # header (git archive writes a comment) keeps the fast path.
                if k not in ("path", "size") and not k.startswith("GNU.sparse."):
                    continue
                if v:
                    self.gpax[k] = v
                else:
                    self.gpax.pop(k, None)
            return  # a global header stands alone: it does not start a member
        elif typ == _GNU_LONGNAME:
            self.longname = _nts(data)
        elif typ == _GNU_LONGLINK:
            self.longlink = _nts(data)
        if self.offset < 0:
            self.offset = hoff

    def resolve(self, hdr: bytes, url: Optional[str], hoff: int) -> Tuple[str, int, int]:
        """Apply the pending headers to member header ``hdr``: ``(name, size, offset)``."""
        pax = dict(self.gpax)
        if self.xpax:
            pax.update(self.xpax)
        name_b = _header_name(hdr)
        if self.longname is not None:
            name_b = self.longname
        if pax.get("path"):
            name_b = pax["path"]
        if pax.get("GNU.sparse.name"):  # pax sparse 0.1 and 1.0 keep the real name here
            name_b = pax["GNU.sparse.name"]
        name = name_b.decode("utf-8", _SURROGATE)
        offset = hoff if self.offset < 0 else self.offset
        self.pax, self.linkname, self.map00, self.sparse00 = pax, self.longlink, self.sparse00, []
        self.xpax = None
        self.longname = self.longlink = None
        self.offset = -1
        if pax.get("size"):
            size = _pax_size(pax["size"], url, hoff, name)
        else:
            size = _number(hdr[124:136], "size", url, hoff, name)
        return name, size, offset

    def sparse(self, hdr: bytes) -> bool:
        """Whether the member last resolved, of header ``hdr``, is a GNU sparse member."""
        return hdr[156] == _GNU_SPARSE or any(k.startswith("GNU.sparse.") for k in self.pax)
