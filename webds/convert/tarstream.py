"""A tar's members as bounded streams, read from a stream in one pass: :func:`member_streams`.

For tars inside a tar (ImageNet's training tar holds one tar per class): each member is handed
out as a stream of exactly its bytes, so a reader of the member (such as
:func:`webds.tar.reader.read_members` for a tar inside) never needs the member whole in memory, and
the outer tar can come from a pipe.
"""

from __future__ import annotations

import tarfile
from typing import Any, Dict, Iterator, Optional, Tuple

from ..errors import ShardReadError, WebdsError
from ..tar.compression import uncompressed_chunks

__all__ = ["MemberStream", "TarStreamError", "member_streams"]

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


class TarStreamError(ShardReadError):
    """A problem with the tar itself, not with the data of a member: a reader of a member's
    data (such as a tar inside the tar) can tell the two apart."""


class _Reader:
    """The uncompressed bytes of the tar, from
    :func:`webds.tar.compression.uncompressed_chunks` (which sniffs and undoes gzip, bzip2 and xz);
    its errors become TarStreamError naming the tar."""

    def __init__(self, stream: Any, url: str, what: str) -> None:
        self.url = url
        self.what = what
        self.offset = 0
        self._chunks = uncompressed_chunks(stream, url)
        self._buf = memoryview(b"")

    def read(self, n: int) -> bytes:
        """At most ``n`` bytes; fewer only at a chunk boundary, b"" at the end."""
        if not self._buf:
            try:
                self._buf = memoryview(next(self._chunks, b""))
            except WebdsError as exn:
                raise TarStreamError(
                    f"reading {self.what} failed: {exn.message}",
                    url=self.url,
                    offset=self.offset,
                ) from exn
        data = bytes(self._buf[:n])
        self._buf = self._buf[n:]
        self.offset += len(data)
        return data

    def read_exact(self, n: int) -> bytes:
        parts = []
        while n > 0:
            data = self.read(n)
            if not data:
                break
            parts.append(data)
            n -= len(data)
        return b"".join(parts)


class MemberStream:
    """One member of the tar as a stream of exactly its ``size`` bytes (``read``)."""

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
            raise TarStreamError(
                f"{self.reader.what} ends inside member {self.name!r} ({self.left} bytes "
                "missing); it is truncated: re-download it",
                url=self.reader.url,
                member=self.name,
                offset=self.reader.offset,
            )
        self.left -= len(data)
        return data

    def skip_rest(self) -> None:
        """Read past what is left of the member."""
        while self.left:
            self.read(_CHUNK)


def _pax_records(data: bytes, reader: _Reader, offset: int) -> Dict[str, bytes]:
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
        raise TarStreamError(
            f"corrupt pax extended header in {reader.what}; re-download it",
            url=reader.url,
            offset=offset,
        ) from None
    return out


def member_streams(
    stream: Any,
    url: str,
    *,
    what: str = "the tar",
    expected: str = "a regular file",
    hint: str = "",
) -> Iterator[Tuple[str, MemberStream]]:
    """Yield ``(name, stream)`` for each regular file of the tar read from ``stream`` (plain,
    gzip, bzip2 or xz; sniffed), in order, each as a :class:`MemberStream`.

    Each member must be read (or left) before the next item; the rest is skipped for you. A
    member that is itself a tar can be read as a stream in turn, e.g. with
    :func:`webds.tar.reader.read_members`, so it is never held whole in memory; tarfile's streaming
    mode would do this at a third of the speed. Errors name ``url`` and call the tar ``what``
    ("the training tar"); a link or device member is an error ("not ``expected``"), since tar
    stores a second copy of a file as a link; ``hint`` says what to give instead of something
    that is not a tar. Problems with the tar itself raise :class:`TarStreamError`::

        for name, member in member_streams(open("train.tar", "rb"), "train.tar"):
            for inner, data, _ in read_members(member, url=name): ...
    """
    reader = _Reader(stream, url, what)
    advice = f"; {hint}" if hint else ""
    longname: Optional[str] = None
    pax: Dict[str, bytes] = {}
    while True:
        offset = reader.offset
        hdr = reader.read_exact(512)
        if len(hdr) < 512:
            if offset == 0:
                raise TarStreamError(f"{what} is empty or not a tar archive", url=url, offset=0)
            if not hdr:
                return  # no end-of-archive marker: tolerated, as tarfile and GNU tar do
            raise TarStreamError(
                f"{what} ends inside a header; it is truncated: re-download it",
                url=url,
                offset=offset,
            )
        if hdr == b"\0" * 512:
            return
        try:
            info = tarfile.TarInfo.frombuf(hdr, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exn:
            problem = "not a tar archive" if offset == 0 else f"a corrupt tar header ({exn})"
            raise TarStreamError(f"{what} has {problem}{advice}", url=url, offset=offset) from None
        size = info.size
        padded = size + (-size % 512)
        if info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) or info.type in (
            tarfile.XHDTYPE,
            tarfile.XGLTYPE,
            tarfile.SOLARIS_XHDTYPE,
        ):
            if size > _MAX_EXTENDED:
                raise TarStreamError(
                    f"an extended header of {size} bytes in {what}; it is corrupt",
                    url=url,
                    offset=offset,
                )
            data = reader.read_exact(padded)[:size]
            if len(data) < size:
                raise TarStreamError(f"{what} is truncated", url=url, offset=offset)
            if info.type == tarfile.GNUTYPE_LONGNAME:
                longname = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif info.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
                pax = _pax_records(data, reader, offset)
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
                raise TarStreamError(
                    f"corrupt pax size in {what}", url=url, offset=offset
                ) from None
            padded = size + (-size % 512)
        longname, pax = None, {}
        if info.type == tarfile.DIRTYPE:
            continue
        if info.type in _NO_DATA_TYPES:
            # A hard link is how tar stores a second copy of a file: skipping it would drop
            # that file without a word.
            raise TarStreamError(
                f"member {name!r} of {what} is a link or a device, not {expected}; "
                "re-create the tar from regular files (tar --hard-dereference)",
                url=url,
                member=name,
                offset=offset,
            )
        member = MemberStream(reader, size, name)
        if info.type in tarfile.REGULAR_TYPES:
            yield name, member
        member.skip_rest()
        pad = padded - size
        if pad and len(reader.read_exact(pad)) < pad:
            return  # the padding of the last member is missing: the data is complete
