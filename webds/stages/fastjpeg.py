"""The optional fast JPEG path: decode with ``simplejpeg`` when it is installed.

Both run libjpeg-turbo, but Pillow adds Python-level marker parsing and chunked feeding of the
decoder: to a numpy array (``rgb8``, ``torchrgb`` ...) ``simplejpeg`` is about 1.3x faster on a
~100 KB JPEG, to a PIL image (``pil``) a few percent (the copy into Pillow's storage remains).
With the same settings (accurate integer DCT, fancy upsampling) the two give identical pixels,
so the fast path changes speed, not results: the tests compare them.

It is used only where it cannot change behaviour: baseline or progressive 8-bit JPEGs decoded to
RGB. Anything else (CMYK, 12-bit, corrupt or truncated data, other formats) returns ``None`` and
the caller decodes with Pillow as before, so errors and warnings stay Pillow's. An image over
``max_pixels`` is refused from its header on either path, with the same DecodeError.
``pip install simplejpeg`` (or ``webds[fast]``) enables it; without the package nothing changes.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Optional

from .limits import MAX_PIXELS, check_pixels, open_image

_JPEG_MAGIC = b"\xff\xd8\xff"


@functools.cache  # a failed import searches sys.path each time; ask once
def _simplejpeg() -> Any:
    """The ``simplejpeg`` module, or ``None`` when it is not installed."""
    try:
        return importlib.import_module("simplejpeg")
    except ImportError:
        return None


def available() -> bool:
    """Whether the fast path can be used (``simplejpeg`` importable)."""
    return _simplejpeg() is not None


def decode_rgb(data: bytes, max_pixels: Optional[int] = MAX_PIXELS) -> Optional[Any]:
    """Decode JPEG ``data`` to an HxWx3 uint8 RGB numpy array, or ``None`` to say "use Pillow"
    (not a JPEG, ``simplejpeg`` missing, or any decoding failure). A JPEG whose header says more
    than ``max_pixels`` pixels is a DecodeError, raised before decoding."""
    return _decode(data, "RGB", max_pixels)


def _decode(data: bytes, colorspace: str, max_pixels: Optional[int]) -> Optional[Any]:
    if data[:3] != _JPEG_MAGIC:
        return None
    sj = _simplejpeg()
    if sj is None:
        return None
    try:
        height, width, source, _ = sj.decode_jpeg_header(data)
    except ValueError:
        return None
    check_pixels(width, height, max_pixels)  # before simplejpeg allocates HxWx3
    if source not in ("YCbCr", "Gray", "RGB"):  # CMYK/YCCK: Pillow converts those
        return None
    try:
        # strict: recoverable libjpeg errors (a truncated image) fail here; Pillow then reports
        # them as it always does.
        return sj.decode_jpeg(data, colorspace=colorspace, fastdct=False, fastupsample=False)
    except (ValueError, RuntimeError):
        return None


def pil_rgb(data: bytes, max_pixels: Optional[int] = MAX_PIXELS) -> Optional[Any]:
    """:func:`decode_rgb` as a PIL ``RGB`` image carrying the JPEG's ``info`` (EXIF, ICC profile,
    DPI, ...: what ``ImageOps.exif_transpose`` and colour management read) and ``format``."""
    # RGBX: Pillow keeps RGB in 4 bytes per pixel, so this layout is copied in with a memcpy
    # per row, where 3-byte RGB would be expanded pixel by pixel (a third of the decode time).
    array = _decode(data, "RGBX", max_pixels)
    if array is None:
        return None
    from PIL import Image

    # Parsing the markers again costs ~20 us of the ~1.5 ms and keeps img.info as Pillow has it.
    with open_image(data, None) as header:
        if header.format != "JPEG" or header.size != (array.shape[1], array.shape[0]):
            return None
        info = dict(header.info)
    image = Image.frombytes("RGB", header.size, array, "raw", "RGBX")
    image.info = info
    image.format = "JPEG"  # type: ignore[misc]
    return image
