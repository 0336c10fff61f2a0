"""Fused crop decoders: draw the crop from the image header, decode only what the crop needs.

``decode(RandomResizedCropDecoder(224))`` gives what ``decode("pil")`` followed by torchvision's
``RandomResizedCrop(224)`` gives, at a fraction of the cost (:class:`CenterCropDecoder`: what
``Resize`` + ``CenterCrop`` give). The steps: the image size is read from the header
(:func:`_header`: ``simplejpeg.decode_jpeg_header``, else Pillow's lazy open) and checked
against ``max_pixels``; the crop is drawn as torchvision draws it
(:func:`random_resized_crop_params`, :func:`center_crop_box`); a JPEG is decoded scaled by 1/2,
1/4 or 1/8 in the DCT domain where the crop allows (:func:`_decode_scaled`); the crop alone is
resized once (``resizer=``: :func:`_resize_pil` or :func:`_resize_torch`).

What the resizers do, how close the pixels are to torchvision's, and how the crops repeat from
(seed, epoch, rank, worker, shard, key, field): docs/api/decoding.md, "Fused crop decoders".
"""

from __future__ import annotations

import functools
import math
import numbers
import random
import zlib
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ArgumentError
from . import fastjpeg
from .codecs import IMAGE_EXTENSIONS
from .limits import MAX_PIXELS, check_max, check_pixels, open_image

__all__ = [
    "CenterCropDecoder",
    "RandomResizedCropDecoder",
    "center_crop_box",
    "random_resized_crop_params",
]

OUTPUTS = ("numpy", "torch", "pil")
RESIZERS = ("auto", "torch", "pil")
Size = Union[int, Tuple[int, int], Sequence[int]]
Box = Tuple[float, float, float, float]  # left, top, right, bottom in source pixels


def random_resized_crop_params(
    rng: random.Random,
    width: int,
    height: int,
    scale: Tuple[float, float] = (0.08, 1.0),
    ratio: Tuple[float, float] = (3 / 4, 4 / 3),
) -> Tuple[int, int, int, int]:
    """``(top, left, height, width)`` of a crop drawn as torchvision's
    ``RandomResizedCrop.get_params`` draws it, with ``rng`` in place of torch's generator.

        random_resized_crop_params(random.Random(0), 500, 375)   # (i, j, h, w)
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            i = rng.randint(0, height - h)  # torch.randint(0, height - h + 1): inclusive here
            j = rng.randint(0, width - w)
            return i, j, h, w
    # torchvision's fallback: the central crop of the whole image, clamped to the ratio range
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_crop_box(width: int, height: int, size: Size, resize: int) -> Box:
    """The source box that torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` keep, in the
    source image's pixels (fractional): resizing that box to ``size`` is the same transform."""
    th, tw = _pair(size)
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(resize * long / short)  # torchvision's _compute_resized_output_size
    rw, rh = (resize, new_long) if width <= height else (new_long, resize)
    top = int(round((rh - th) / 2.0))
    left = int(round((rw - tw) / 2.0))
    sx, sy = width / rw, height / rh
    return (left * sx, top * sy, (left + tw) * sx, (top + th) * sy)


def _pair(size: Any) -> Tuple[int, int]:
    if isinstance(size, numbers.Integral) and not isinstance(size, bool) and size > 0:
        return int(size), int(size)
    if (
        isinstance(size, (tuple, list))
        and len(size) == 2
        and all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in size)
        and min(size) > 0
    ):
        return int(size[0]), int(size[1])
    raise ArgumentError(f"size must be a positive int or a (height, width) pair, got {size!r}")


def _range(name: str, value: Any) -> Tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ArgumentError(f"{name} must be a (min, max) pair of numbers, got {value!r}") from None
    if not 0 < lo <= hi:
        raise ArgumentError(f"{name} must be a (min, max) pair with 0 < min <= max, got {value!r}")
    return lo, hi


# -- decoding a region ------------------------------------------------------------------------


def _scale_factor(box: Box, out_w: int, out_h: int) -> int:
    """The largest DCT scale (8, 4, 2) that leaves the box at least the output size."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    for f in (8, 4, 2):
        if bw >= f * out_w and bh >= f * out_h:
            return f
    return 1


def _header(data: bytes, max_pixels: Optional[int]) -> Tuple[int, int, Any]:
    """(width, height, a lazily opened PIL image or None) from the header, checked against
    ``max_pixels`` before anything is decoded."""
    if data[:3] == fastjpeg._JPEG_MAGIC and fastjpeg.available():
        try:
            height, width, source, _ = fastjpeg._simplejpeg().decode_jpeg_header(data)
        except ValueError:
            pass  # not a JPEG simplejpeg reads: Pillow opens it, and its error is the one shown
        else:
            check_pixels(width, height, max_pixels)
            if source in ("YCbCr", "Gray", "RGB"):
                return width, height, None
    image = open_image(data, max_pixels)
    return image.size[0], image.size[1], image


def _decode_scaled(
    data: bytes, width: int, height: int, lazy: Any, f: int, colorspace: str
) -> Tuple[Any, float]:
    """Decode ``data`` scaled by 1/``f`` where the decoder can; (pixels, the scale it used).
    Pixels are an HxWxC uint8 array (simplejpeg: ``colorspace``) or an RGB PIL image."""
    if lazy is None:  # simplejpeg: an RGB-family JPEG (see _header)
        try:
            pixels = fastjpeg._simplejpeg().decode_jpeg(
                data,
                colorspace=colorspace,
                fastdct=False,
                fastupsample=False,
                min_height=-(-height // f),
                min_width=-(-width // f),
            )
        except (ValueError, RuntimeError):
            # strict: it refuses what libjpeg only warns about (a truncated image, stray
            # bytes); Pillow decodes or reports those, as decode("pil") does
            lazy = open_image(data, None)  # the size was checked from the header already
        else:
            return pixels, float(f)  # libjpeg's pixel k covers source pixels [k*f, (k+1)*f)
    image, scale = lazy, 1.0
    if f > 1 and image.format == "JPEG":
        # Pillow picks the largest scale s with size // s >= the request: ask for size // f.
        drafted = image.draft(None, (max(1, width // f), max(1, height // f)))
        if drafted is not None:
            scale = width / drafted[1][2]
    image.load()
    if image.mode != "RGB":
        image = image.convert("RGB")  # as decode("pil") does (CMYK, L, P, RGBA ...)
    return image, scale


def _resize_pil(pixels: Any, sbox: List[float], out_w: int, out_h: int, exact: bool) -> Any:
    """Resize the box ``sbox`` of ``pixels`` with Pillow (torchvision's PIL path)."""
    from PIL import Image

    if exact:
        # The region holding the box, whole pixels of the decoded image; copied out alone.
        x0, y0 = int(math.floor(sbox[0])), int(math.floor(sbox[1]))
        x1, y1 = int(math.ceil(sbox[2])), int(math.ceil(sbox[3]))
    else:
        x0 = y0 = 0
        x1, y1 = pixels.size if isinstance(pixels, Image.Image) else pixels.shape[1::-1]
    if isinstance(pixels, Image.Image):
        image = (
            pixels if (x0, y0, x1, y1) == (0, 0, *pixels.size) else pixels.crop((x0, y0, x1, y1))
        )
    else:
        region = pixels[y0:y1, x0:x1]
        if not region.flags.c_contiguous:
            region = region.copy()  # the crop's rows only
        # RGBX: Pillow takes 4-byte pixels with a memcpy per row (see fastjpeg.pil_rgb)
        raw = "RGBX" if region.shape[2] == 4 else "RGB"
        image = Image.frombytes("RGB", (region.shape[1], region.shape[0]), region, "raw", raw)
    rel = (sbox[0] - x0, sbox[1] - y0, sbox[2] - x0, sbox[3] - y0)
    return image.resize((out_w, out_h), Image.Resampling.BILINEAR, box=rel)


def _resize_torch(pixels: Any, sbox: List[float], out_w: int, out_h: int) -> Any:
    """Resize the box ``sbox`` (whole pixels) of ``pixels`` with torch's antialiased bilinear
    uint8 kernel (torchvision's tensor path); an HxWx3 uint8 tensor."""
    import numpy as np
    import torch

    if not isinstance(pixels, np.ndarray):
        pixels = np.asarray(pixels)
    x0, y0, x1, y1 = (int(round(c)) for c in sbox)
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)  # a box under one decoded pixel keeps one
    region = pixels[y0:y1, x0:x1, :3]  # RGBX decodes keep RGB
    if not region.flags.writeable:  # a Pillow image's array view: torch wants its own
        region = region.copy()
    region = torch.from_numpy(region).permute(2, 0, 1).unsqueeze(0)
    # channels_last (HxWxC in memory) is the layout torch's fast uint8 kernel reads
    region = region.contiguous(memory_format=torch.channels_last)
    out = torch.nn.functional.interpolate(
        region, size=(out_h, out_w), mode="bilinear", antialias=True, align_corners=False
    )
    return out[0].permute(1, 2, 0)  # HxWxC view of channels_last memory: contiguous


def _convert(image: Any, output: str) -> Any:
    """A PIL image or an HxWx3 uint8 tensor as ``output`` asks."""
    import numpy as np

    if not hasattr(image, "getbands"):  # a tensor from _resize_torch
        if output == "torch":
            return image.permute(2, 0, 1).contiguous()
        a = image.numpy()
        if output == "numpy":
            return a
        from PIL import Image

        return Image.fromarray(a)
    if output == "pil":
        return image
    a = np.array(image)  # HxWx3 uint8, writable
    if output == "numpy":
        return a
    import torch

    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


def _torch_single_thread() -> bool:
    """``resizer="auto"``: torch's kernel where it is the fast one (:func:`_torch_resizes_fast`)
    and torch runs one thread per process (DataLoader workers; ``torch.set_num_threads(1)``),
    Pillow elsewhere: spread over intra-op threads, one small image costs more CPU in waiting
    than it saves (2x slower on a busy 2-core machine), and a loader's other workers or threads
    want those cores."""
    if not _torch_resizes_fast():
        return False
    import torch

    return torch.get_num_threads() == 1


@functools.cache
def _torch_resizes_fast() -> bool:
    """Whether torch runs its vectorized uint8 resize here: torch writes it for AVX2 and
    AVX-512 only (about 3x Pillow's on a 224 crop); its generic path, on ARM, older x86 or
    under ``ATEN_CPU_CAPABILITY=default``, measured 1.8x slower than Pillow's (the whole
    decoder 1.6x). A fact of the process (torch picks its kernels once, at start), not a
    timing: the same seed gives the same pixels in every run on one machine."""
    if not _torch_resizes_uint8():
        return False
    import torch

    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return capability is None or capability() in ("AVX2", "AVX512")


@functools.cache
def _torch_resizes_uint8() -> bool:
    """Whether this torch resizes uint8 images with antialiasing (torch >= 2.1: a fast kernel;
    older versions refuse uint8)."""
    try:
        import torch

        x = torch.zeros((1, 3, 4, 4), dtype=torch.uint8)
        torch.nn.functional.interpolate(x, size=(2, 2), mode="bilinear", antialias=True)
    except Exception:  # ImportError, or RuntimeError "not implemented for 'Byte'"
        return False
    return True


class _CropDecoder:
    """What both decoders share: the handler protocol, the extension test and the output."""

    #: Decoder passes the sample as a third argument to handlers that say so (for its key).
    wants_sample = True
    #: Crop, then resize (RandomResizedCrop): nothing outside the box reaches the output.
    exact = True

    def __init__(
        self,
        size: Size,
        output: str,
        extensions: Union[str, Iterable[str]],
        max_pixels: Optional[int],
        resizer: str,
    ) -> None:
        self.size = _pair(size)
        if output not in OUTPUTS:
            raise ArgumentError(f"output must be one of {', '.join(OUTPUTS)}; got {output!r}")
        self.output = output
        if resizer not in RESIZERS:
            raise ArgumentError(f"resizer must be one of {', '.join(RESIZERS)}; got {resizer!r}")
        if resizer == "torch" and not _torch_resizes_uint8():
            raise ArgumentError(
                "resizer='torch' needs torch >= 2.1 (antialiased uint8 resizing); "
                "use resizer='pil' or 'auto'"
            )
        self.resizer = resizer
        if isinstance(extensions, str):
            extensions = extensions.split()
        self.extensions = frozenset(e.lower().lstrip(".") for e in extensions)
        self.max_pixels = check_max("max_pixels", max_pixels)

    def _box(self, width: int, height: int, key: str, data: bytes, sample: Any) -> Box:
        raise NotImplementedError

    def __call__(self, key: str, data: bytes, sample: Optional[Mapping[str, Any]] = None) -> Any:
        if key.rsplit(".", 1)[-1].lower() not in self.extensions:
            return None
        width, height, lazy = _header(data, self.max_pixels)
        box = self._box(width, height, key, data, sample)
        out_h, out_w = self.size
        f = _scale_factor(box, out_w, out_h)
        fast = self.resizer == "torch" or (self.resizer == "auto" and _torch_single_thread())
        # torch's kernel resizes whole pixels only: a box between pixels (DCT scaling, centre
        # crops) goes to Pillow, which takes fractional boxes (rounding would shift the crop by
        # up to half a decoded pixel, a visible shift in detailed images)
        fast = fast and all(c % f == 0 for c in box)
        pixels, scale = _decode_scaled(data, width, height, lazy, f, "RGB" if fast else "RGBX")
        sbox = [c / scale for c in box]
        if fast and all(c == int(c) for c in sbox):
            image = _resize_torch(pixels, sbox, out_w, out_h)
        else:
            image = _resize_pil(pixels, sbox, out_w, out_h, self.exact)
        return _convert(image, self.output)


class RandomResizedCropDecoder(_CropDecoder):
    """A decode handler giving torchvision's ``RandomResizedCrop(size, scale, ratio)`` of each
    image field, decoding only what the crop needs (see :mod:`webds.stages.crop`).

        ds = webds.WebDataset(url, seed=0).decode(webds.RandomResizedCropDecoder(224))

    ``output``: ``"numpy"`` (uint8 HxWx3, the default), ``"torch"`` (uint8 3xHxW) or ``"pil"``.
    ``seed`` (default: the pipeline's), with the epoch, rank, worker, url, key and field, fixes
    every crop. Images over ``max_pixels`` are a DecodeError raised from the header.
    ``resizer``: ``"auto"``, ``"torch"`` or ``"pil"`` (see :mod:`webds.stages.crop`).
    """

    def __init__(
        self,
        size: Size,
        scale: Tuple[float, float] = (0.08, 1.0),
        ratio: Tuple[float, float] = (3 / 4, 4 / 3),
        *,
        seed: Optional[int] = None,
        output: str = "numpy",
        extensions: Union[str, Iterable[str]] = IMAGE_EXTENSIONS,
        max_pixels: Optional[int] = MAX_PIXELS,
        resizer: str = "auto",
    ) -> None:
        super().__init__(size, output, extensions, max_pixels, resizer)
        self.scale = _range("scale", scale)
        self.ratio = _range("ratio", ratio)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ArgumentError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed
        # Set by bind_pass on the copy a decode stage uses: (seed, epoch, rank, worker).
        self._pass: Optional[Tuple[int, int, int, int]] = None

    def bind_pass(self, pipeline_seed: Optional[int], epoch: int) -> "RandomResizedCropDecoder":
        """The copy of this decoder that one pass (epoch) of a decode stage uses: its crops
        depend on (seed or ``pipeline_seed``, ``epoch``, rank, worker) and each sample."""
        from ..base.workers import worker_info

        seed = self.seed if self.seed is not None else pipeline_seed
        bound = RandomResizedCropDecoder.__new__(RandomResizedCropDecoder)
        bound.__dict__.update(self.__dict__)
        if seed is not None:
            where = worker_info()
            bound._pass = (seed, epoch, where.rank, where.worker)
        return bound

    def rng(self, key: str, data: bytes, sample: Optional[Mapping[str, Any]]) -> random.Random:
        """The generator that draws the crop of field ``key`` of ``sample``."""
        from ..base.workers import derive_seed

        if sample is not None and self._pass is not None:
            url, skey = sample.get("__url__"), sample.get("__key__")
            return random.Random(derive_seed("crop", *self._pass, url, skey, key))
        if self.seed is not None:
            return random.Random(derive_seed("crop", self.seed, zlib.crc32(data), key))
        return random.Random()  # fresh entropy: no seed and nothing to derive one from

    def _box(self, width: int, height: int, key: str, data: bytes, sample: Any) -> Box:
        i, j, h, w = random_resized_crop_params(
            self.rng(key, data, sample), width, height, self.scale, self.ratio
        )
        return (j, i, j + w, i + h)

    def __repr__(self) -> str:
        return (
            f"RandomResizedCropDecoder({self.size!r}, scale={self.scale!r}, "
            f"ratio={self.ratio!r}, seed={self.seed!r}, output={self.output!r})"
        )


class CenterCropDecoder(_CropDecoder):
    """A decode handler giving torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` of each
    image field (the evaluation transform), decoding only what it needs.

        ds = webds.WebDataset(url).decode(webds.CenterCropDecoder(224))   # resize=256

    ``resize`` (the short side before cropping) defaults to ``size / 0.875`` rounded (256 for
    224) and must be at least the crop's larger side. ``output``, ``max_pixels`` and ``resizer``
    as for :class:`RandomResizedCropDecoder`.
    """

    exact = False  # resize-then-crop: the filter reads past the crop's edge

    def __init__(
        self,
        size: Size,
        resize: Optional[int] = None,
        *,
        output: str = "numpy",
        extensions: Union[str, Iterable[str]] = IMAGE_EXTENSIONS,
        max_pixels: Optional[int] = MAX_PIXELS,
        resizer: str = "auto",
    ) -> None:
        super().__init__(size, output, extensions, max_pixels, resizer)
        if resize is None:
            resize = int(round(max(self.size) / 0.875))
        if isinstance(resize, bool) or not isinstance(resize, int) or resize < max(self.size):
            raise ArgumentError(
                f"resize must be an int at least the crop size {max(self.size)}, got {resize!r}"
            )
        self.resize = resize

    def _box(self, width: int, height: int, key: str, data: bytes, sample: Any) -> Box:
        return center_crop_box(width, height, self.size, self.resize)

    def __repr__(self) -> str:
        return f"CenterCropDecoder({self.size!r}, resize={self.resize!r}, output={self.output!r})"
