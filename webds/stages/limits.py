"""Decompression limits at decode: how far a compressed field may expand, and how many pixels an
image may have, checked before the memory is spent.

A field of a few MB can hold gigabytes (4 GiB of zeros gzip to 4 MB, bzip2 to a few KB), and a
162 KB PNG can declare 13000x13000 pixels. So :func:`decompress_field` inflates in bounded steps
and stops one step past ``max_field_bytes`` (the memory it holds stays under the limit plus one
step), and :func:`open_image` reads an image's size from its header (Pillow opens lazily) and
refuses it before the pixels are decoded. Both raise :class:`~webds.errors.DecodeError` saying
which limit was hit and how to raise it; the decoder adds the shard, sample and field.

Both limits are arguments (``decode(..., max_field_bytes=..., max_pixels=...)``), never
process-global settings: in particular Pillow's ``Image.MAX_IMAGE_PIXELS`` (a module global, and
only a warning between 1x and 2x of it) is neither changed nor consulted here.
"""

from __future__ import annotations

import bz2
import io
import lzma
import struct
import threading
import zlib
from typing import Any, Callable, Optional

from ..errors import ArgumentError, DecodeError, SampleTooLargeError
from ..tar.reader import DEFAULT_MAX_SAMPLE_BYTES

__all__ = [
    "FIELD_CODECS",
    "MAX_FIELD_BYTES",
    "MAX_PIXELS",
    "MAX_SAMPLE_BYTES",
    "SampleBudget",
    "check_max",
    "check_pixels",
    "decompress_field",
    "open_image",
]

#: Default of ``decode(max_field_bytes=...)``: 256 MiB, the scale of Pillow's image limit (an
#: ``rgb8`` image at ``MAX_PIXELS`` is 256 MiB). A field is one file of one sample and is held
#: whole in memory (and, decoded, usually once more), so fields of real datasets stay below this;
#: a bomb is stopped after 256 MiB, so a worker's memory peaks under 512 MB for any one field
#: bomb (measured in tests/test_bombs.py). Larger genuine fields (a big ``.npy.gz`` volume) need
#: ``decode(..., max_field_bytes=N)``. A sample's fields together are held to
#: :data:`MAX_SAMPLE_BYTES`.
MAX_FIELD_BYTES = 256 << 20

#: Default of ``decode(max_sample_bytes=...)`` and of ``tarfile_to_samples(max_sample_bytes=...)``
#: (``WebDataset(max_sample_bytes=...)``): 512 MiB, one sample's budget. At decode it bounds what
#: decompression produces for all the ``.gz``/``.bz2``/``.xz`` fields of one sample together
#: (five fields each under ``max_field_bytes`` would otherwise hold 1.25 GiB); in a compressed
#: shard, the bytes of one sample's members together (checked on each header, before the member
#: is read; plain shards only when given). So a bomb in any field, or spread over a sample's
#: fields or members, stops at about 512 MiB held: the process under 640 MB (measured in
#: tests/test_sample_budget.py). Several large images (a few of 50 MB) pass with room to spare.
MAX_SAMPLE_BYTES = DEFAULT_MAX_SAMPLE_BYTES

#: Default of ``decode(max_pixels=...)``: 89,478,485 pixels (about 9459x9459), the number Pillow
#: uses for its ``Image.MAX_IMAGE_PIXELS``, so no image that decodes quietly today is refused.
#: Here it is an error rather than Pillow's warning (Pillow only refuses above twice that). At
#: the limit an ``rgb8`` image takes 256 MiB (the field limit) and a float ``rgb`` one 1 GiB;
#: a lower default would refuse 100-megapixel photos, which real datasets hold.
MAX_PIXELS = 1024 * 1024 * 1024 // 4 // 3

#: The codec extensions that decode undoes before the inner extension (``.txt.gz`` -> ``.txt``).
FIELD_CODECS = ("gz", "bz2", "xz")

# Output is produced in steps of this size, so a bomb costs at most the limit plus one step.
_STEP = 1 << 20
_IN_STEP = 1 << 16

# An xz stream names the dictionary its decoder must allocate (up to 1.5 GiB) before any output:
# that memory is held to the field limit too, but never below what xz's largest preset needs
# (65 MiB), so a small max_field_bytes does not refuse ordinary .xz fields.
_XZ_MEMLIMIT_FLOOR = 128 << 20


def check_max(name: str, value: Optional[int]) -> Optional[int]:
    """``value`` if it is a positive int or None (no limit); otherwise an ArgumentError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"{name} must be a positive number or None (no limit), got {value!r}")
    return value


_NAMES = {"gz": "gzip", "bz2": "bzip2", "xz": "xz"}


def _field_limit_error(codec: str, limit: int) -> DecodeError:
    return DecodeError(
        f"{_NAMES[codec]} data expands past max_field_bytes={limit:,} ({_size(limit)}); it may "
        "be a decompression bomb. If such fields are genuine, raise the limit: "
        "decode(..., max_field_bytes=N), or max_field_bytes=None for no limit"
    )


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} bytes"


def decompress_field(
    data: bytes,
    codec: str,
    max_bytes: Optional[int] = MAX_FIELD_BYTES,
    too_large: Optional[Callable[[], Exception]] = None,
    xz_limit: Any = "max_bytes",
) -> bytes:
    """Decompress a ``gz``, ``bz2`` or ``xz`` field, refusing more than ``max_bytes`` of output.

    Concatenated members or streams are read as ``gzip``/``bz2``/``lzma.decompress`` read them.
    Output is produced in 1 MiB steps into one growing buffer (not a list joined at the end,
    which held the field twice), so a bomb is stopped holding at most ``max_bytes`` plus one
    step. ``max_bytes=None``: no limit. ``too_large()`` makes the error raised past the limit
    (default: a DecodeError naming ``max_field_bytes``); ``xz_limit`` is the limit an xz
    dictionary is held to (default ``max_bytes``; None: none).

        decompress_field(gzip.compress(b"hi"), "gz", max_bytes=2)   # b"hi"; max_bytes=1 raises
    """
    dict_limit = max_bytes if xz_limit == "max_bytes" else xz_limit
    makers: dict = {
        "gz": lambda: _Zlib(zlib.decompressobj(16 + zlib.MAX_WBITS)),
        "bz2": bz2.BZ2Decompressor,
        "xz": lambda: lzma.LZMADecompressor(
            memlimit=None if dict_limit is None else max(dict_limit, _XZ_MEMLIMIT_FLOOR)
        ),
    }
    if codec not in makers:
        raise ArgumentError(f"unknown field codec {codec!r}; known: {', '.join(FIELD_CODECS)}")
    limit = check_max("max_field_bytes", max_bytes)
    if not data and codec != "xz":
        return b""  # as gzip.decompress and bz2.decompress (lzma.decompress refuses it)
    out = io.BytesIO()  # grows in place (realloc): its getvalue() is the buffer, no copy
    pending = data if isinstance(data, bytes) else bytes(data)
    first = True
    while first or pending:
        start = out.tell()
        try:
            pending = _one_stream(makers[codec], pending, out, limit, codec, too_large)
        except (DecodeError, SampleTooLargeError):
            raise
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as exn:
            if "Memory usage limit" in str(exn):  # liblzma: the dictionary is too large
                raise DecodeError(
                    f"xz data asks for a decoder dictionary over its memory limit "
                    f"({_size(max(dict_limit or 0, _XZ_MEMLIMIT_FLOOR))}: max_field_bytes, at "
                    "least "
                    f"{_size(_XZ_MEMLIMIT_FLOOR)}). If it is genuine, raise it: "
                    "decode(..., max_field_bytes=N)"
                ) from None
            if first or codec == "gz":
                raise
            # bz2/lzma.decompress ignore what follows the first stream when it is not a stream.
            out.seek(start)
            out.truncate()
            break
        first = False
        if codec == "gz":
            pending = pending.lstrip(b"\x00")  # gzip allows zero padding after a member
    return out.getvalue()


class _Zlib:
    """A zlib decompressobj with the interface of the bz2/lzma decompressors that the loop uses.

    zlib hands back the input it did not consume as a new bytes object (``unconsumed_tail``) on
    every call; fed the whole field it would copy the rest of the input once per output step,
    so it is fed 64 KiB at a time.
    """

    def __init__(self, d: Any) -> None:
        self.d = d
        self.data = memoryview(b"")
        self.pos = 0
        self.tail: Any = b""

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if data:
            self.data, self.pos = memoryview(data), 0
        if not self.tail and self.pos < len(self.data):
            self.tail = self.data[self.pos : self.pos + _IN_STEP]
            self.pos += len(self.tail)
        out = self.d.decompress(self.tail, max_length)
        self.tail = self.d.unconsumed_tail
        return out

    @property
    def eof(self) -> bool:
        return self.d.eof

    @property
    def unused_data(self) -> bytes:
        return self.d.unused_data + self.data[self.pos :].tobytes()

    @property
    def needs_input(self) -> bool:
        return not self.tail and self.pos >= len(self.data)


def _one_stream(
    make: Callable[[], Any],
    data: bytes,
    sink: io.BytesIO,
    limit: Optional[int],
    codec: str,
    too_large: Optional[Callable[[], Exception]],
) -> bytes:
    """Decompress one member/stream of ``data`` into ``sink``; return what follows it."""
    d = make()
    feed = data
    total = sink.tell()
    while not d.eof:
        step = _STEP if limit is None else min(_STEP, limit + 1 - total)
        out = d.decompress(feed, step)
        feed = b""
        if out:
            sink.write(out)
            total += len(out)
            if limit is not None and total > limit:
                raise too_large() if too_large is not None else _field_limit_error(codec, limit)
        elif d.needs_input and not d.eof:
            raise DecodeError(
                f"{_NAMES[codec]} data is truncated: it ends inside a compressed stream"
            )
    return d.unused_data


# -- one sample's budget ----------------------------------------------------------------------

_current = threading.local()  # the SampleBudget of the sample this thread decodes, if any


class SampleBudget:
    """What decompression may still produce for the fields of one sample (``max_sample_bytes``
    of :class:`~webds.stages.decode.Decoder`). The decoder opens one per sample, for the
    thread that decodes it (``with SampleBudget(limit):``); :class:`Decompress` draws on it."""

    __slots__ = ("limit", "spent", "outer")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.spent = 0
        self.outer: Optional["SampleBudget"] = None

    def __enter__(self) -> "SampleBudget":
        self.outer = getattr(_current, "budget", None)
        _current.budget = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _current.budget = self.outer

    @staticmethod
    def current() -> Optional["SampleBudget"]:
        """The budget of the sample this thread decodes (None outside a decoder's sample)."""
        return getattr(_current, "budget", None)

    def decompress(self, data: bytes, codec: str, max_field_bytes: Optional[int]) -> bytes:
        """:func:`decompress_field` to the tighter of ``max_field_bytes`` and what is left of
        the budget; past the budget a SampleTooLargeError."""
        room = max(self.limit - self.spent, 1)
        if max_field_bytes is not None and max_field_bytes <= room:
            out = decompress_field(data, codec, max_field_bytes)
        else:
            out = decompress_field(
                data, codec, room, too_large=self._error, xz_limit=max_field_bytes
            )
        self.spent += len(out)
        return out

    def _error(self) -> SampleTooLargeError:
        return SampleTooLargeError(
            f"the sample's compressed fields decompress to more than max_sample_bytes="
            f"{self.limit:,} ({_size(self.limit)}) together; it may be a decompression bomb. "
            "If such samples are genuine, raise the limit: decode(..., max_sample_bytes=N), or "
            "max_sample_bytes=None for no limit"
        )


# -- images ----------------------------------------------------------------------------------


def check_pixels(width: int, height: int, max_pixels: Optional[int]) -> None:
    """Raise DecodeError when a ``width`` x ``height`` image is over ``max_pixels`` (None: no
    limit)."""
    if max_pixels is not None and width * height > max_pixels:
        raise DecodeError(
            f"the image is {width}x{height} = {width * height:,} pixels, over "
            f"max_pixels={max_pixels:,}; it may be a decompression bomb. If such images are "
            "genuine, raise the limit: decode(..., max_pixels=N) or "
            "imagehandler(spec, max_pixels=N), or max_pixels=None for no limit"
        )


def open_image(data: bytes, max_pixels: Optional[int] = MAX_PIXELS) -> Any:
    """Open image bytes lazily with Pillow (the header only) and check the size against
    ``max_pixels``; the caller decodes with ``load()``.

    Pillow's own check in ``Image.open`` reads its process-global ``Image.MAX_IMAGE_PIXELS`` and
    between 1x and 2x of it only warns, so it is left out: ``max_pixels`` replaces it. This
    runs Pillow's format detection as ``Image.open`` does, through its plugin registry.
    """
    from PIL import Image, UnidentifiedImageError

    fp = io.BytesIO(data)
    prefix = data[:16]
    checked: set = set()
    for loader in (Image.preinit, Image.init):
        loader()
        for fmt in [f for f in Image.ID if f not in checked]:
            checked.add(fmt)
            factory, accept = Image.OPEN[fmt]
            accepted = not accept or accept(prefix)
            if not accepted or isinstance(accepted, str):
                continue
            fp.seek(0)
            try:
                image = factory(fp, "")
            except (SyntaxError, IndexError, TypeError, struct.error):
                continue  # not this format after all: try the next, as Image.open does
            width, height = image.size
            check_pixels(width, height, max_pixels)
            return image
    raise UnidentifiedImageError("cannot identify image file")
