"""The tar-writing primitives: :func:`encode_header`, :func:`member_bytes`, :func:`write_member`
and :data:`END_OF_ARCHIVE` produce ustar members, with a pax header in front when a name or a
number does not fit ustar. GNU tar and Python's ``tarfile`` read them. :func:`header_encoder`
makes the headers of many members that share their other fields (what the writers use).
"""

from __future__ import annotations

from typing import BinaryIO, Callable, Dict, Optional, Tuple

from ..errors import ArgumentError
from .fields import _SURROGATE

__all__ = [
    "encode_header",
    "header_encoder",
    "member_bytes",
    "write_member",
    "END_OF_ARCHIVE",
    "BLOCK_SIZE",
]

#: Tar block size; headers and member data are aligned to it.
BLOCK_SIZE = 512
#: Two zero blocks mark the end of an archive.
END_OF_ARCHIVE = b"\0" * 1024


def _octal(value: int, width: int) -> bytes:
    """``width`` bytes: zero-padded octal digits and a NUL."""
    return b"%0*o\0" % (width - 1, value)


def _fits(value: int, width: int) -> bool:
    return 0 <= value < 8 ** (width - 1)


def _pax_records(records: Dict[str, bytes]) -> bytes:
    out = []
    for keyword, value in records.items():
        body = b" " + keyword.encode("utf-8") + b"=" + value + b"\n"
        n = len(body) + 1
        while len(str(n)) + len(body) != n:
            n = len(str(n)) + len(body)
        out.append(str(n).encode("ascii") + body)
    return b"".join(out)


def _split_ustar_name(raw: bytes) -> Optional[Tuple[bytes, bytes]]:
    """``(prefix, name)`` if ``raw`` fits the ustar name and prefix fields, else None."""
    if len(raw) <= 100:
        return b"", raw
    if len(raw) > 256:
        return None
    # Split at a slash so that the name part is <= 100 and the prefix part <= 155.
    i = raw.find(b"/", len(raw) - 101)
    while 0 < i <= 155:
        if len(raw) - i - 1 <= 100 and i + 1 < len(raw):
            return raw[:i], raw[i + 1 :]
        i = raw.find(b"/", i + 1)
    return None


def _field_number(v: int, width: int) -> bytes:
    """A ustar numeric field: octal when it fits, else GNU base-256."""
    if _fits(v, width):
        return _octal(v, width)
    # GNU base-256 (two's complement, first byte 0x80 or 0xff) for values octal can't hold;
    # a pax record carries them too, for readers that prefer pax.
    limit = 1 << (8 * (width - 1))
    if not -limit <= v < limit:
        raise ArgumentError(f"value {v} does not fit a tar header field")
    if v >= 0:
        return b"\x80" + v.to_bytes(width - 1, "big")
    return b"\xff" + (limit + v).to_bytes(width - 1, "big")


def _ustar_block(
    name: bytes,
    prefix: bytes,
    size: int,
    mtime: int,
    mode: int,
    uid: int,
    gid: int,
    uname: bytes,
    gname: bytes,
    typeflag: bytes,
) -> bytes:
    num = _field_number
    hdr = b"".join(
        (
            name.ljust(100, b"\0"),
            num(mode, 8),
            num(uid, 8),
            num(gid, 8),
            num(size, 12),
            num(mtime, 12),
            b"        ",
            typeflag,
            b"\0" * 100,  # linkname
            b"ustar\x0000",
            uname[:32].ljust(32, b"\0"),
            gname[:32].ljust(32, b"\0"),
            _octal(0, 8),  # devmajor
            _octal(0, 8),  # devminor
            prefix.ljust(155, b"\0"),
            b"\0" * 12,
        )
    )
    chksum = b"%06o\0 " % sum(hdr)
    return hdr[:148] + chksum + hdr[156:]


def encode_header(
    name: str,
    size: int,
    *,
    mtime: int = 0,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    uname: str = "bigdata",
    gname: str = "bigdata",
    typeflag: bytes = b"0",
) -> bytes:
    """Return the tar header(s) for a member: one 512-byte ustar block, preceded by a pax ``x``
    header (and its data blocks) when the name is long or not ASCII, or a number does not fit
    ustar (a size of 8 GiB or more, for instance)::

        hdr = encode_header("000001.jpg", len(data), mtime=1_700_000_000)
        stream.write(hdr + data + b"\\0" * (-len(data) % 512))
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise ArgumentError(f"tar member name must be a non-empty str without NUL, got {name!r}")
    if not isinstance(size, int) or size < 0:
        raise ArgumentError(f"tar member size must be a non-negative int, got {size!r}")
    if not isinstance(typeflag, bytes) or len(typeflag) != 1:
        raise ArgumentError(f"typeflag must be a single byte, got {typeflag!r}")
    for label, v in (("mtime", mtime), ("mode", mode), ("uid", uid), ("gid", gid)):
        if not isinstance(v, int):
            raise ArgumentError(f"{label} must be an int, got {v!r}")
    if not 0 <= mode < 8**7:
        raise ArgumentError(f"mode must be between 0 and 0o7777777, got {mode!r}")
    records: Dict[str, bytes] = {}
    raw_name = name.encode("utf-8", _SURROGATE)
    split = _split_ustar_name(raw_name) if name.isascii() else None
    if split is None:
        records["path"] = raw_name
        # A readable ASCII stand-in for tools that ignore pax headers.
        short = raw_name.decode("ascii", "replace").encode("ascii", "replace")
        split = (b"", short.replace(b"?", b"_")[-100:])
    prefix, ustar_name = split
    if not _fits(size, 12):
        records["size"] = b"%d" % size
    if not _fits(mtime, 12):
        records["mtime"] = b"%d" % mtime
    if not _fits(uid, 8):
        records["uid"] = b"%d" % uid
    if not _fits(gid, 8):
        records["gid"] = b"%d" % gid
    unames = []
    for label, text in (("uname", uname), ("gname", gname)):
        raw = str(text).encode("utf-8", _SURROGATE)
        if not str(text).isascii() or len(raw) > 32:
            records[label] = raw
            raw = b""
        unames.append(raw)
    block = _ustar_block(
        ustar_name, prefix, size, mtime, mode, uid, gid, unames[0], unames[1], typeflag
    )
    if not records:
        return block
    pax_data = _pax_records(records)
    pax_hdr = _ustar_block(
        b"././@PaxHeader",
        b"",
        len(pax_data),
        max(0, min(mtime, 8**11 - 1)),
        0o644,
        0,
        0,
        b"",
        b"",
        b"x",
    )
    return pax_hdr + pax_data + b"\0" * (-len(pax_data) % 512) + block


def header_encoder(
    *,
    mtime: int = 0,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    uname: str = "bigdata",
    gname: str = "bigdata",
    typeflag: bytes = b"0",
) -> Callable[[str, int], bytes]:
    """Return ``header(name, size)``, giving the same bytes as ``encode_header(name, size,
    **fields)`` for these fixed fields, several times faster for a writer of many members::

        header = header_encoder(mtime=1_700_000_000)
        stream.write(header("000001.jpg", len(data)) + data + b"\\0" * (-len(data) % 512))

    The fields are checked now (the same errors as :func:`encode_header`).
    """
    fields = dict(mtime=mtime, mode=mode, uid=uid, gid=gid, uname=uname, gname=gname)
    reference = encode_header("a", 0, typeflag=typeflag, **fields)  # type: ignore[arg-type]

    def slow(name: str, size: int) -> bytes:
        return encode_header(name, size, typeflag=typeflag, **fields)  # type: ignore[arg-type]

    if len(reference) != BLOCK_SIZE:
        return slow  # a fixed field needs a pax record in every header
    # The common member (a short ASCII name, a size under 8 GiB) is a template with the name,
    # size and checksum filled in; the checksum is the template's byte sum plus theirs.
    mid, mtime_field, tail = reference[100:124], reference[136:148], reference[156:]
    base = sum(reference) - sum(reference[148:156]) + 8 * 0x20 - ord("a") - sum(reference[124:136])
    join = b"".join

    def header(name: str, size: int) -> bytes:
        if (
            type(name) is str
            and type(size) is int
            and 0 <= size < 0o100000000000
            and 0 < len(name) <= 100
            and name.isascii()
            and "\0" not in name
        ):
            raw = name.encode("ascii")
            size_field = b"%011o\0" % size
            chksum = b"%06o\0 " % (base + sum(raw) + sum(size_field))
            return join((raw.ljust(100, b"\0"), mid, size_field, mtime_field, chksum, tail))
        return slow(name, size)

    return header


def _nbytes(data: object) -> int:
    if isinstance(data, (bytes, bytearray)):
        return len(data)
    try:
        return memoryview(data).nbytes  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentError(
            f"tar member data must be bytes-like, got {type(data).__name__}; encode it first"
        ) from None


def member_bytes(name: str, data: bytes, **header_kw: object) -> bytes:
    """Return one complete tar member: header(s), ``data`` and zero padding to 512 bytes."""
    n = _nbytes(data)
    return b"".join((encode_header(name, n, **header_kw), data, b"\0" * (-n % 512)))  # type: ignore[arg-type]


def write_member(stream: BinaryIO, name: str, data: bytes, **header_kw: object) -> int:
    """Write one tar member to ``stream`` and return the number of bytes written."""
    n = _nbytes(data)
    hdr = encode_header(name, n, **header_kw)  # type: ignore[arg-type]
    pad = b"\0" * (-n % 512)
    if n < 65536:
        stream.write(b"".join((hdr, data, pad)))
    else:  # don't copy large data just to concatenate it
        stream.write(hdr)
        stream.write(data)
        stream.write(pad)
    return len(hdr) + n + len(pad)
