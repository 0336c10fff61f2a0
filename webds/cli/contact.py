"""Contact sheets for ``webds show --images``: a grid of thumbnails with each sample's key.

Pillow is imported only here and only when a sheet is made, so the other commands work without
it. The layout is fixed so that a sheet can be checked (and cropped) by position: ``columns``
cells per row, each ``thumb`` pixels square plus a :data:`LABEL` pixel strip for the key, with
:data:`PAD` pixels around and between cells; a thumbnail keeps its aspect ratio and is centred in
its cell. An image that cannot be decoded gets a crossed-out placeholder tile and is reported,
never a crash: one bad sample must not cost the whole sheet.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import ArgumentError, WriteError
from ..io.urls import open_url

__all__ = [
    "PAD",
    "LABEL",
    "IMAGE_EXTS",
    "is_image_field",
    "looks_like_image",
    "image_info",
    "sheet_size",
    "cell_origin",
    "contact_sheet",
    "save_image",
]

#: Pixels around and between the cells of a sheet.
PAD = 4
#: Height in pixels of the strip under each thumbnail that holds the sample's key.
LABEL = 14

BACKGROUND = (255, 255, 255)
TEXT = (0, 0, 0)
PLACEHOLDER = (200, 200, 200)
CROSS = (200, 0, 0)

#: Extensions (the last part of a field name) whose data is an image.
IMAGE_EXTS = frozenset("jpg jpeg png ppm pgm pbm pnm gif bmp tif tiff webp".split())

# File signatures, so that an image stored under another name ("img", "image") is found too.
_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00",
          b"MM\x00*")  # fmt: skip


def is_image_field(name: str) -> bool:
    """Whether a field's extension names an image format (``jpg``, ``seg.png``, ...)."""
    return name.rsplit(".", 1)[-1].lower() in IMAGE_EXTS


def looks_like_image(data: bytes) -> bool:
    """Whether ``data`` starts with the signature of a common image format."""
    head = bytes(data[:12])
    return head.startswith(_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        return None
    return Image


def image_info(data: bytes) -> Optional[str]:
    """``"JPEG 640x480"`` from the image header only (no pixel decoding); an explanation when
    the data is not a readable image; None when Pillow is not installed."""
    Image = _pil()
    if Image is None:
        return None
    try:
        with Image.open(io.BytesIO(data)) as im:  # reads the header, not the pixels
            return f"{im.format} {im.width}x{im.height}"
    except Exception as exn:
        return f"(not a readable image: {type(exn).__name__})"


def sheet_size(count: int, columns: int, thumb: int) -> Tuple[int, int]:
    """(width, height) in pixels of a sheet of ``count`` tiles."""
    rows = max(1, math.ceil(count / columns))
    cols = max(1, min(columns, count))
    return cols * (thumb + PAD) + PAD, rows * (thumb + LABEL + PAD) + PAD


def cell_origin(index: int, columns: int, thumb: int) -> Tuple[int, int]:
    """Top-left pixel of the thumbnail square of tile ``index`` (row-major)."""
    row, col = divmod(index, columns)
    return PAD + col * (thumb + PAD), PAD + row * (thumb + LABEL + PAD)


def contact_sheet(
    tiles: Sequence[Tuple[str, bytes]], columns: Optional[int] = None, thumb: int = 128
) -> Tuple[Any, List[Tuple[int, str]]]:
    """A PIL image with one tile per ``(label, image bytes)``, and the ``(index, reason)`` of
    each tile that could not be decoded (drawn as a placeholder).

    ``columns`` defaults to a square-ish grid (``ceil(sqrt(n))``).
    """
    Image = _pil()
    if Image is None:
        raise ArgumentError("--images needs Pillow; install it with: pip install pillow")
    from PIL import ImageDraw, ImageFont

    n = len(tiles)
    columns = min(columns or max(1, math.ceil(math.sqrt(n))), max(n, 1))
    sheet = Image.new("RGB", sheet_size(n, columns, thumb), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    failed: List[Tuple[int, str]] = []
    for i, (label, data) in enumerate(tiles):
        x, y = cell_origin(i, columns, thumb)
        try:
            im = _thumbnail(Image, data, thumb)
        except Exception as exn:  # any decoder error: a placeholder, not a crash
            failed.append((i, _reason(exn)))
            draw.rectangle([x, y, x + thumb - 1, y + thumb - 1], fill=PLACEHOLDER)
            draw.line([x, y, x + thumb - 1, y + thumb - 1], fill=CROSS, width=2)
            draw.line([x, y + thumb - 1, x + thumb - 1, y], fill=CROSS, width=2)
        else:
            sheet.paste(im, (x + (thumb - im.width) // 2, y + (thumb - im.height) // 2))
        _label(draw, font, label, x, y + thumb + 1, thumb)
    return sheet, failed


def _reason(exn: Exception) -> str:
    if type(exn).__name__ == "UnidentifiedImageError":
        return "not in an image format Pillow knows"  # its message shows a BytesIO repr
    return f"{type(exn).__name__}: {exn}"


def _thumbnail(Image: Any, data: bytes, thumb: int) -> Any:
    with Image.open(io.BytesIO(data)) as im:
        # thumbnail() lets JPEG decode at a reduced scale (draft mode): big photos stay cheap.
        im.thumbnail((thumb, thumb))
        return _rgb(Image, im)


def _rgb(Image: Any, im: Any) -> Any:
    """An RGB copy: 16-bit and float images stretched to 0..255, transparency over white."""
    if im.mode in ("I", "F") or im.mode.startswith("I;"):
        im = im.convert("F")
        lo, hi = im.getextrema()
        scale = 255.0 / (hi - lo) if hi > lo else 0.0
        im = im.point(lambda v: v * scale - lo * scale).convert("L")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        out = Image.new("RGB", rgba.size, BACKGROUND)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return im.convert("RGB")


def _label(draw: Any, font: Any, text: str, x: int, y: int, width: int) -> None:
    """The key under a tile, cut with '...' to fit the tile's width."""
    fitted = text
    while fitted and draw.textlength(fitted, font=font) > width:
        fitted = fitted[:-4] + "..." if len(fitted) > 4 else fitted[:-1]
    try:
        draw.text((x, y), fitted, fill=TEXT, font=font)
    except (UnicodeError, ValueError):  # a bitmap font without these characters
        draw.text((x, y), fitted.encode("ascii", "replace").decode(), fill=TEXT, font=font)


def image_format(url: str) -> str:
    """The Pillow format for an output name (``grid.png`` -> PNG); PNG when it has none."""
    Image = _pil()
    if Image is None:
        raise ArgumentError("--images needs Pillow; install it with: pip install pillow")
    ext = os.path.splitext(url.split("?", 1)[0])[1].lower()
    if not ext:
        return "PNG"
    Image.init()
    fmt = Image.registered_extensions().get(ext)
    if fmt is None or fmt not in Image.SAVE:
        raise ArgumentError(
            f"--images {url!r}: cannot write {ext!r} images; use a name ending in .png, .jpg "
            "or .webp"
        )
    return fmt


def save_image(image: Any, url: str) -> None:
    """Write ``image`` to a path or URL; it appears only when complete (``open_url`` 'wb')."""
    fmt = image_format(url)
    stream = open_url(url, "wb")
    try:
        image.save(stream, format=fmt)
    except BaseException as exn:
        discard = getattr(stream, "discard", None)
        try:
            discard() if callable(discard) else stream.close()
        except Exception:
            pass
        if isinstance(exn, Exception) and not isinstance(exn, (OSError, WriteError)):
            raise WriteError(f"writing the contact sheet failed: {exn}", url=url) from exn
        raise
    stream.close()
