"""The tenbin format: a small, aligned container for a list of numpy arrays.

Compatible with webdataset's ``tenbin`` (``.ten`` / ``.tb`` fields). A buffer is a series of
*chunks*; each chunk is the 8-byte magic ``b"~TenBin~"``, an int64 payload length, then the payload
zero-padded to a multiple of 64 bytes. Each array takes two chunks: a header (an int64 vector
``[dtype code, info, ndim, *shape]``, where dtype code and info are up to 8 ASCII characters packed
into an int64) and the raw array bytes. Lengths and array data are little-endian (the byte order
every machine that wrote the existing files used), so files are portable.

Differences from webdataset: ``uint32`` works (webdataset misspelt it), ``infos=[...]`` really
checks the infos, and corrupt input raises :class:`~webds.errors.DecodeError` instead of whatever
numpy happened to raise.

    buf = encode_buffer([np.zeros((2, 3), "f4"), np.arange(5)], infos=["img", "ids"])
    arrays = decode_buffer(buf)           # [array (2, 3) float32, array (5,) int64]
"""

from __future__ import annotations

import os
import struct
import sys
from typing import Any, BinaryIO, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import ArgumentError, DecodeError, EncodeError

__all__ = [
    "encode_buffer",
    "decode_buffer",
    "write",
    "read",
    "save",
    "load",
    "encode_list",
    "decode_list",
    "encode_chunks",
    "decode_chunks",
    "write_chunk",
    "read_chunk",
    "encode_header",
    "decode_header",
    "str64",
    "unstr64",
    "check_infos",
    "MAGIC",
    "SUPPORTED_DTYPES",
]

MAGIC = b"~TenBin~"
_ALIGN = 64
_LEN = struct.Struct("<q")

#: numpy dtype name -> the short code stored in the header.
SUPPORTED_DTYPES = {
    "float16": "f2",
    "float32": "f4",
    "float64": "f8",
    "int8": "i1",
    "int16": "i2",
    "int32": "i4",
    "int64": "i8",
    "uint8": "u1",
    "uint16": "u2",
    "uint32": "u4",
    "uint64": "u8",
}
_SHORT_TO_DTYPE = {short: np.dtype("<" + short) for short in SUPPORTED_DTYPES.values()}

Infos = Union[bool, None, Sequence[str]]


def _roundup(n: int, k: int = _ALIGN) -> int:
    return k * ((n + k - 1) // k)


def str64(s: str) -> int:
    """Pack a string of at most 8 ASCII characters into an int64 (as tenbin headers store it)."""
    try:
        raw = s.encode("ascii")
    except UnicodeEncodeError:
        raise EncodeError(f"tenbin info {s!r} must be ASCII") from None
    if len(raw) > 8:
        raise EncodeError(f"tenbin info {s!r} is longer than 8 characters; shorten it")
    return _LEN.unpack(raw.ljust(8, b"\0"))[0]


def unstr64(i: int) -> str:
    """Inverse of :func:`str64`."""
    raw = _LEN.pack(int(i)).rstrip(b"\0")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise DecodeError(f"tenbin header holds a non-ASCII string field {raw!r}") from None


def _as_array(a: Any) -> np.ndarray:
    if hasattr(a, "detach") and hasattr(a, "cpu"):  # a torch tensor, without importing torch
        a = a.detach().cpu().numpy()
    return np.asarray(a)


def encode_header(a: np.ndarray, info: str = "") -> bytes:
    """The header chunk payload for array ``a``: ``[dtype code, info, ndim, *shape]`` as int64."""
    code = SUPPORTED_DTYPES.get(a.dtype.name)
    if code is None:
        raise EncodeError(
            f"tenbin cannot store arrays of dtype {a.dtype.name}; supported: "
            f"{', '.join(SUPPORTED_DTYPES)}. Convert with a.astype(...) first"
        )
    header = [str64(code), str64(info), a.ndim, *a.shape]
    return np.array(header, dtype="<i8").tobytes()


def decode_header(h: Union[bytes, memoryview]) -> Tuple[Tuple[int, ...], np.dtype, str]:
    """Parse a header chunk payload into ``(shape, dtype, info)``."""
    if len(h) < 24 or len(h) % 8 != 0:
        raise DecodeError(f"tenbin header chunk has {len(h)} bytes; expected 24 + 8 * ndim")
    v = np.frombuffer(h, dtype="<i8")
    code = unstr64(v[0])
    dtype = _SHORT_TO_DTYPE.get(code)
    if dtype is None:
        raise DecodeError(
            f"tenbin header names unknown dtype code {code!r}; known: {', '.join(_SHORT_TO_DTYPE)}"
        )
    info = unstr64(v[1])
    ndim = int(v[2])
    if ndim < 0 or ndim != len(v) - 3:
        raise DecodeError(f"tenbin header says ndim={ndim} but holds {len(v) - 3} dimensions")
    shape = tuple(int(d) for d in v[3:])
    if any(d < 0 for d in shape):
        raise DecodeError(f"tenbin header holds a negative dimension: {shape}")
    return shape, dtype, info


def _bytes_of(a: np.ndarray) -> memoryview:
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    # A flat byte view works for 0-d and empty arrays too (memoryview.cast refuses those).
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def encode_list(arrays: Sequence[Any], infos: Optional[Sequence[str]] = None) -> List[Any]:
    """Alternating header / data payloads for ``arrays`` (the chunks of a tenbin buffer)."""
    arrays = [_as_array(a) for a in arrays]
    if infos is None:
        infos = [""] * len(arrays)
    elif isinstance(infos, str) or len(infos) != len(arrays):
        raise ArgumentError(
            f"tenbin: infos must be a list of one string per array ({len(arrays)}), got {infos!r}"
        )
    result: List[Any] = []
    for a, info in zip(arrays, infos):
        result.append(encode_header(a, info))
        result.append(_bytes_of(a))
    return result


def check_infos(data: List[np.ndarray], infos: List[str], required_infos: Infos = None) -> Any:
    """Apply the ``infos=`` argument of the readers.

    ``False``/``None`` returns the arrays, ``True`` returns ``(arrays, infos)``, and a list of
    strings checks that the stored infos are exactly those and returns the arrays.
    """
    if required_infos is None or required_infos is False:
        return data
    if required_infos is True:
        return data, infos
    if isinstance(required_infos, str) or not isinstance(required_infos, (list, tuple)):
        raise ArgumentError(
            f"tenbin: infos must be True, False or a list of strings, got {required_infos!r}"
        )
    if list(required_infos) != list(infos):
        raise DecodeError(
            f"tenbin infos {infos!r} do not match the required infos {required_infos!r}"
        )
    return data


def decode_list(chunks: Sequence[Any], infos: Infos = False) -> Any:
    """Arrays from alternating header / data payloads; see :func:`check_infos` for ``infos``."""
    if len(chunks) % 2 != 0:
        raise DecodeError(f"tenbin data has {len(chunks)} chunks; expected header/data pairs")
    result: List[np.ndarray] = []
    found: List[str] = []
    for header, data in zip(chunks[::2], chunks[1::2]):
        shape, dtype, info = decode_header(header)
        count = 1
        for d in shape:
            count *= d
        if count * dtype.itemsize != len(data):
            raise DecodeError(
                f"tenbin array of shape {shape} and dtype {dtype.name} needs "
                f"{count * dtype.itemsize} bytes, but its data chunk has {len(data)}"
            )
        # Zero-copy: the array is a view of the buffer (read-only if the buffer is bytes).
        result.append(np.frombuffer(data, dtype=dtype, count=count).reshape(shape))
        found.append(info)
    return check_infos(result, found, infos)


def encode_chunks(chunks: Sequence[Any]) -> bytearray:
    """Frame payloads as chunks: magic, int64 length, payload padded to 64 bytes."""
    views = [memoryview(c).cast("B") for c in chunks]
    out = bytearray(sum(16 + _roundup(len(v)) for v in views))
    offset = 0
    for v in views:
        out[offset : offset + 8] = MAGIC
        out[offset + 8 : offset + 16] = _LEN.pack(len(v))
        offset += 16
        out[offset : offset + len(v)] = v
        offset += _roundup(len(v))
    return out


def decode_chunks(buf: Any) -> List[memoryview]:
    """Split a buffer into chunk payloads (views into ``buf``, no copies)."""
    try:
        view = memoryview(buf).cast("B")
    except TypeError:
        raise DecodeError(f"tenbin data must be bytes-like, not {type(buf).__name__}") from None
    result: List[memoryview] = []
    offset = 0
    total = len(view)
    while offset < total:
        if total - offset < 16:
            raise DecodeError(
                f"tenbin data truncated: {total - offset} stray bytes at offset {offset}"
            )
        if view[offset : offset + 8] != MAGIC:
            raise DecodeError(
                f"not tenbin data: expected magic {MAGIC!r} at byte offset {offset}, "
                f"found {bytes(view[offset : offset + 8])!r}"
            )
        (n,) = _LEN.unpack(view[offset + 8 : offset + 16])
        offset += 16
        # Writers pad every chunk, the last one included, so short padding means truncation.
        if n < 0 or offset + _roundup(n) > total:
            raise DecodeError(
                f"tenbin chunk at byte offset {offset - 16} claims {n} bytes (padded to "
                f"{_roundup(max(n, 0))}), but only {total - offset} remain (truncated or corrupt)"
            )
        result.append(view[offset : offset + n])
        offset += _roundup(n)
    return result


def encode_buffer(l: Sequence[Any], infos: Optional[Sequence[str]] = None) -> bytes:  # noqa: E741
    """Encode a list of arrays (numpy, or torch tensors) as one tenbin buffer."""
    if isinstance(l, np.ndarray) or not isinstance(l, (list, tuple)):
        raise ArgumentError(
            f"tenbin.encode_buffer takes a list of arrays, got {type(l).__name__}; wrap it: [a]"
        )
    return bytes(encode_chunks(encode_list(l, infos=infos)))


def decode_buffer(buf: Any, infos: Infos = False) -> Any:
    """Decode a tenbin buffer into a list of arrays (views of ``buf``; see :func:`check_infos`)."""
    return decode_list(decode_chunks(buf), infos=infos)


def write_chunk(stream: BinaryIO, payload: Any) -> None:
    """Write one chunk (magic, length, padded payload) to ``stream``."""
    view = memoryview(payload).cast("B")
    stream.write(MAGIC)
    stream.write(_LEN.pack(len(view)))
    stream.write(view)
    padding = _roundup(len(view)) - len(view)
    if padding:
        stream.write(b"\0" * padding)


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    parts = []
    while n > 0:
        # Bounded reads: a corrupt length must not make us allocate it up front.
        part = stream.read(min(n, 1 << 20))
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def read_chunk(stream: BinaryIO) -> Optional[bytes]:
    """Read one chunk's payload from ``stream``; None at a clean end of stream."""
    head = _read_exactly(stream, 16)
    if not head:
        return None
    if len(head) < 16 or head[:8] != MAGIC:
        raise DecodeError(f"not tenbin data: bad or truncated chunk header {head!r}")
    (n,) = _LEN.unpack(head[8:])
    if n < 0:
        raise DecodeError(f"tenbin chunk claims a negative length {n}")
    padded = _read_exactly(stream, _roundup(n))
    if len(padded) < _roundup(n):
        raise DecodeError(
            f"tenbin chunk truncated: expected {n} bytes padded to {_roundup(n)}, got {len(padded)}"
        )
    return padded[:n]


def write(stream: BinaryIO, l: Sequence[Any], infos: Optional[Sequence[str]] = None) -> None:  # noqa: E741
    """Write a list of arrays to a binary stream in tenbin format."""
    for chunk in encode_list(l, infos=infos):
        write_chunk(stream, chunk)


def read(stream: BinaryIO, n: int = sys.maxsize, infos: Infos = False) -> Any:
    """Read up to ``n`` arrays from a binary stream (all of them by default)."""
    chunks: List[bytes] = []
    for _ in range(n):
        header = read_chunk(stream)
        if header is None:
            break
        data = read_chunk(stream)
        if data is None:
            raise DecodeError("tenbin stream ended after an array header, before its data")
        chunks += [header, data]
    return decode_list(chunks, infos=infos)


def _check_name(fname: Any, nocheck: bool) -> str:
    fname = os.fspath(fname)
    if not nocheck and not str(fname).endswith(".ten"):
        raise ArgumentError(f"tenbin file name {fname!r} should end in .ten (or pass nocheck=True)")
    return fname


def save(
    fname: Any, *args: Any, infos: Optional[Sequence[str]] = None, nocheck: bool = False
) -> None:
    """Save arrays to a ``.ten`` file: ``save("a.ten", x, y, infos=["x", "y"])``."""
    fname = _check_name(fname, nocheck)
    with open(fname, "wb") as stream:
        write(stream, list(args), infos=infos)


def load(fname: Any, infos: Infos = False, nocheck: bool = False) -> Any:
    """Load the arrays saved in a ``.ten`` file (a list; see :func:`check_infos` for ``infos``)."""
    fname = _check_name(fname, nocheck)
    with open(fname, "rb") as stream:
        return read(stream, infos=infos)


# -- webdataset's names for tenbin's pieces ---------------------------------------------------


def bytelen(a: Any) -> int:
    """The byte size of an array (``nbytes``) or of bytes."""
    if hasattr(a, "nbytes"):
        return int(a.nbytes)
    if isinstance(a, (bytes, bytearray)):
        return len(a)
    raise ArgumentError(f"cannot tell the byte size of a {type(a).__name__}")


def bytedata(a: Any) -> Any:
    """The bytes of an array (its buffer), or bytes as they are."""
    if isinstance(a, (bytes, bytearray, memoryview)):
        return a
    if hasattr(a, "data"):
        return a.data
    raise ArgumentError(f"cannot take the bytes of a {type(a).__name__}")


#: dtype names and tenbin's short codes, both ways.
long_to_short = {np.dtype(short).name: short for short in SUPPORTED_DTYPES.values()}
short_to_long = {short: name for name, short in long_to_short.items()}


def check_acceptable_input_type(data: Iterable[Any], allow64: bool) -> None:
    """Raise unless every array's dtype is one tenbin stores, and 64-bit ones are allowed."""
    for a in data:
        if a.dtype.name not in long_to_short:
            raise ArgumentError(f"tenbin can't store dtype {a.dtype.name}")
        if not allow64 and a.dtype.name in ("float64", "int64", "uint64"):
            raise ArgumentError(f"64-bit dtypes ({a.dtype.name}) need allow64=True")


#: The tenbin header's magic, as text, bytes and the little-endian int webdataset used.
magic_str = MAGIC.decode("ascii")
magic_bytes = MAGIC
magic = int.from_bytes(MAGIC, "little")


def roundup(n: int, k: int = 64) -> int:
    """``n`` rounded up to a multiple of ``k``."""
    return k * ((n + k - 1) // k)
