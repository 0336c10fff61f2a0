"""Compressed shards: the stream as an iterator of bounded chunks of uncompressed bytes.

:func:`uncompressed_chunks` sniffs gzip (including concatenated members), bzip2 and xz from the
first bytes and decompresses with bounded output per call, so memory stays bounded by what the
stream really holds; plain tar passes through. I/O failures and corrupt or truncated compressed
data raise :class:`~webds.errors.ShardReadError` naming the shard and the uncompressed offset.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from typing import BinaryIO, Callable, Iterator, Optional, Tuple

from ..errors import ShardReadError, WebdsError

__all__ = ["uncompressed_chunks", "sniffed_chunks", "compression_of"]

_CHUNK = 1 << 20  # bytes asked of the stream (or produced by a decompressor) per read


def _raw_reader(stream: BinaryIO, url: Optional[str]) -> Callable[[int], bytes]:
    """Wrap ``stream.read`` so that I/O failures become webds errors and reads return bytes."""
    read = stream.read

    def raw(n: int) -> bytes:
        try:
            data = read(n)
        except WebdsError:
            raise
        except Exception as exn:  # OSError, ValueError on a closed file, network errors...
            raise read_failed(exn, url) from exn
        if data is None:
            raise ShardReadError(
                "the stream returned no data (a non-blocking stream?); pass a blocking stream",
                url=url,
            )
        if type(data) is not bytes:
            data = bytes(data)
        return data

    return raw


def read_failed(exn: Exception, url: Optional[str]) -> ShardReadError:
    """The error for a read of the shard's stream that raised ``exn``."""
    return ShardReadError(
        f"reading the shard failed: {type(exn).__name__}: {exn}; "
        "check that the source is reachable and retry",
        url=url,
    )


def uncompressed_chunks(stream: BinaryIO, url: Optional[str]) -> Iterator[bytes]:
    """Yield the uncompressed bytes of ``stream`` (plain, gzip, bzip2 or xz, sniffed from the
    first bytes) as non-empty chunks of at most ~1 MiB; failures raise ShardReadError."""
    yield from sniffed_chunks(stream, url)[1]


def sniffed_chunks(stream: BinaryIO, url: Optional[str]) -> Tuple[Optional[str], Iterator[bytes]]:
    """``(compression, chunks)``: the compression sniffed from the first bytes (``"gzip"``,
    ``"bzip2"``, ``"xz"`` or None for a plain stream) and :func:`uncompressed_chunks`."""
    raw = _raw_reader(stream, url)
    first = raw(_CHUNK)
    # A raw pipe or socket may return a few bytes at a time; get enough to see the magic.
    while 0 < len(first) < 512:
        more = raw(_CHUNK)
        if not more:
            break
        first += more
    kind = compression_of(first)
    if kind == "gzip":
        return "gzip", _inflate(first, raw, url)
    if kind == "bzip2":
        return "bzip2", _decompress_stream(first, raw, url, "bzip2", bz2.BZ2Decompressor)
    if kind == "xz":
        return "xz", _decompress_stream(
            first, raw, url, "xz", lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ)
        )
    return None, _plain(first, raw)


def compression_of(first: bytes) -> Optional[str]:
    """``"gzip"``, ``"bzip2"``, ``"xz"`` or None (plain), from a stream's first bytes."""
    if first[:2] == b"\x1f\x8b":
        return "gzip"
    if first[:3] == b"BZh" and (first[4:10] in (b"1AY&SY", b"\x17rE8P\x90") or len(first) < 10):
        return "bzip2"
    if first[:6] == b"\xfd7zXZ\x00":
        return "xz"
    return None


def _plain(first: bytes, raw: Callable[[int], bytes]) -> Iterator[bytes]:
    while first:
        yield first
        first = raw(_CHUNK)


def _inflate(data: bytes, raw: Callable[[int], bytes], url: Optional[str]) -> Iterator[bytes]:
    """Gzip (possibly several concatenated members) with zlib directly: faster than ``gzip``."""
    out_offset = 0
    d = zlib.decompressobj(31)
    while True:
        if not data:
            data = raw(_CHUNK)
            if not data:
                raise ShardReadError(
                    "gzip stream is truncated (it ends inside compressed data); "
                    "re-download or re-create the shard",
                    url=url,
                    offset=out_offset,
                )
        try:
            out = d.decompress(data, _CHUNK)
        except zlib.error as exn:
            raise ShardReadError(
                f"corrupt gzip data ({exn}); re-download or re-create the shard",
                url=url,
                offset=out_offset,
            ) from None
        data = d.unconsumed_tail
        if out:
            out_offset += len(out)
            yield out
        if d.eof:
            # Another gzip member may follow; zero bytes between members are padding.
            data = d.unused_data.lstrip(b"\0")
            while not data:
                data = raw(_CHUNK)
                if not data:
                    return
                data = data.lstrip(b"\0")
            d = zlib.decompressobj(31)


def _decompress_stream(
    data: bytes,
    raw: Callable[[int], bytes],
    url: Optional[str],
    kind: str,
    factory: Callable[[], "bz2.BZ2Decompressor | lzma.LZMADecompressor"],
) -> Iterator[bytes]:
    """bzip2 or xz, including concatenated streams, with bounded output per call."""
    out_offset = 0
    d = factory()
    while True:
        if d.needs_input:
            if not data:
                data = raw(_CHUNK)
                if not data:
                    raise ShardReadError(
                        f"{kind} stream is truncated (it ends inside compressed data); "
                        "re-download or re-create the shard",
                        url=url,
                        offset=out_offset,
                    )
            chunk, data = data, b""
        else:
            chunk = b""
        try:
            out = d.decompress(chunk, _CHUNK)
        except MemoryError:
            raise  # not corrupt data: read_members reports it as running out of memory
        except Exception as exn:  # OSError, lzma.LZMAError, EOFError, ValueError
            raise ShardReadError(
                f"corrupt {kind} data ({exn}); re-download or re-create the shard",
                url=url,
                offset=out_offset,
            ) from None
        if out:
            out_offset += len(out)
            yield out
        if d.eof:
            data = (d.unused_data + data).lstrip(b"\0")
            while not data:
                data = raw(_CHUNK)
                if not data:
                    return
                data = data.lstrip(b"\0")
            d = factory()
