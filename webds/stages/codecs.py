"""The value codecs behind :mod:`webds.stages.decode`: the default extension table
(:class:`BasicHandlers`: ``.cls`` -> int, ``.json``, ``.npy``, ``.pth``, ...), image decoding by
image spec (:func:`imagehandler`, :data:`imagespecs`), and the video and audio handlers.

Each handler is called as ``f(".ext", data)`` and returns None for fields it does not decode; a
:class:`~webds.stages.decode.Decoder` chains them. Pickles (``.pyd .pickle .pkl``) are only
decoded with ``allow_pickle=True``; ``.pth`` is loaded with ``torch.load(weights_only=True)``
unless ``weights_only=False``.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from ..errors import ArgumentError, DecodeError
from ..io.security import WEBDATASET_PICKLE, WEBDATASET_TORCH, refuse
from . import fastjpeg
from .audio import AUDIO_EXTENSIONS, load_audio
from .limits import MAX_PIXELS, check_max, open_image
from .video import VIDEO_EXTENSIONS, read_video

__all__ = [
    "BasicHandlers",
    "ImageHandler",
    "IMAGE_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "AUDIO_EXTENSIONS",
    "basichandlers",
    "decode_image",
    "imagehandler",
    "imagespecs",
    "torch_audio",
    "torch_loads",
    "torch_video",
    "npy_loads",
    "npz_loads",
    "unpickle_loads",
    "msgpack_loads",
    "cbor_loads",
    "tenbin_loads",
]

#: Extensions the image handlers decode (those PIL reads, plus ``img``/``image`` which the writer
#: produces as JPEG). Only the *last* extension of a field counts: ``seg.png`` is an image.
IMAGE_EXTENSIONS: List[str] = (
    "jpg jpeg jpe jfif png apng gif bmp dib tif tiff webp ppm pgm pbm pnm pfm tga ico cur icns "
    "pcx sgi rgb rgba bw ras xbm xpm qoi avif avifs jp2 j2k j2c jpc jpf jpx psd dds blp msp im "
    "img image"
).split()


#: spec -> (array type, element type, PIL mode), as in webdataset.
imagespecs: Dict[str, tuple] = {
    "l8": ("numpy", "uint8", "l"),
    "rgb8": ("numpy", "uint8", "rgb"),
    "rgba8": ("numpy", "uint8", "rgba"),
    "l": ("numpy", "float", "l"),
    "rgb": ("numpy", "float", "rgb"),
    "rgba": ("numpy", "float", "rgba"),
    "torchl8": ("torch", "uint8", "l"),
    "torchrgb8": ("torch", "uint8", "rgb"),
    "torchrgba8": ("torch", "uint8", "rgba"),
    "torchl": ("torch", "float", "l"),
    "torchrgb": ("torch", "float", "rgb"),
    "torch": ("torch", "float", "rgb"),
    "torchrgba": ("torch", "float", "rgba"),
    "pil": ("pil", None, "rgb"),
    "pilrgb": ("pil", None, "rgb"),
    "pill": ("pil", None, "l"),
    "pilrgba": ("pil", None, "rgba"),
}


#: What a handler does with every field of one name, told from the name alone: the functions
#: ``f(data)`` it would call, tried in order until one returns something other than None
#: (``()``: it never decodes such fields). A handler may offer ``decode_route(".ext") -> Route``
#: (None: it can't tell from the name); a :class:`~webds.stages.decode.Decoder` whose handlers
#: all can works out each field name's route once, then calls it without walking the chain.
Route = Tuple[Callable[[bytes], Any], ...]


def _last_ext(key: str) -> str:
    return key.rsplit(".", 1)[-1].lower()


# -- images ----------------------------------------------------------------------------------------


def decode_image(
    data: bytes,
    imagespec: str,
    fast_jpeg: bool = True,
    max_pixels: Optional[int] = MAX_PIXELS,
) -> Any:
    """Decode image bytes according to an image spec (see :data:`imagespecs`).

    With ``fast_jpeg`` (the default), RGB JPEGs go through ``simplejpeg`` when it is installed
    (see :mod:`webds.stages.fastjpeg`: same pixels, faster); everything else through Pillow.
    An image of more than ``max_pixels`` pixels (None: no limit) is a DecodeError, raised from
    its header before any pixel is decoded.
    """
    atype, etype, mode = imagespecs[imagespec]
    a: Any = None
    if fast_jpeg and mode == "rgb":
        if atype == "pil":
            result = fastjpeg.pil_rgb(data, max_pixels)
            if result is not None:
                return result
        else:
            # HxWx3 uint8, writable, no PIL image in between
            a = fastjpeg.decode_rgb(data, max_pixels)
    if a is None:
        img = open_image(data, max_pixels)
        img.load()
        # convert() copies even when the mode is already right: skip it then (~15% of a decode).
        result = img if img.mode == mode.upper() else img.convert(mode.upper())
        if atype == "pil":
            return result
        a = result
    import numpy as np

    if not isinstance(a, np.ndarray):
        a = np.array(a)  # a writable copy, HxW or HxWxC uint8
    if etype == "float":
        a = a.astype(np.float32) / np.float32(255.0)
    if atype == "numpy":
        return a
    import torch

    if a.ndim == 3:
        a = np.ascontiguousarray(a.transpose(2, 0, 1))
    return torch.from_numpy(a)


class ImageHandler:
    """Decodes image fields (by last extension) according to an image spec such as ``"rgb8"``."""

    def __init__(
        self,
        imagespec: str,
        extensions: Union[str, Iterable[str]] = IMAGE_EXTENSIONS,
        fast_jpeg: bool = True,
        max_pixels: Optional[int] = MAX_PIXELS,
    ) -> None:
        if not isinstance(imagespec, str) or imagespec.lower() not in imagespecs:
            raise ArgumentError(
                f"unknown image spec {imagespec!r}; valid specs are: {', '.join(imagespecs)}"
            )
        if isinstance(extensions, str):
            extensions = extensions.split()
        self.imagespec = imagespec.lower()
        self.extensions = frozenset(e.lower().lstrip(".") for e in extensions)
        self.fast_jpeg = bool(fast_jpeg)
        self.max_pixels = check_max("max_pixels", max_pixels)

    def __call__(self, key: str, data: bytes) -> Any:
        if _last_ext(key) not in self.extensions:
            return None
        return decode_image(data, self.imagespec, self.fast_jpeg, self.max_pixels)

    def decode_route(self, key: str) -> Route:
        if _last_ext(key) not in self.extensions:
            return ()
        return (functools.partial(_decoded_image, self),)

    def __repr__(self) -> str:
        fast = "" if self.fast_jpeg else ", fast_jpeg=False"
        limit = "" if self.max_pixels == MAX_PIXELS else f", max_pixels={self.max_pixels!r}"
        return f"imagehandler({self.imagespec!r}{fast}{limit})"


def _decoded_image(handler: ImageHandler, data: bytes) -> Any:
    return decode_image(data, handler.imagespec, handler.fast_jpeg, handler.max_pixels)


def pure_route(route: Route) -> bool:
    """Whether every function of ``route`` is one of webds's decoders, which depend on the
    field's bytes alone and change nothing: a run of samples may go through them in columns
    (:mod:`webds.base.runs`), and again one by one where a column fails."""
    return all(getattr(f, "func", f) in _PURE for f in route)


def imagehandler(
    imagespec: str,
    extensions: Union[str, Iterable[str]] = IMAGE_EXTENSIONS,
    fast_jpeg: bool = True,
    max_pixels: Optional[int] = MAX_PIXELS,
) -> ImageHandler:
    """A handler decoding image fields: ``Decoder([imagehandler("torchrgb")])``.

    ``fast_jpeg=False`` decodes JPEGs with Pillow even when ``simplejpeg`` is installed. Images
    of more than ``max_pixels`` pixels (89,478,485 by default, Pillow's number; None: no limit)
    are a DecodeError, raised from the header before decoding.
    """
    return ImageHandler(imagespec, extensions, fast_jpeg, max_pixels)


# -- loaders for the extension table --------------------------------------------------------


def npy_loads(data: bytes) -> Any:
    """Load a ``.npy`` array (object arrays refused: they need pickle)."""
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


def npz_loads(data: bytes) -> Dict[str, Any]:
    """Load a ``.npz`` archive as a dict of arrays."""
    import numpy as np

    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def tenbin_loads(data: bytes) -> List[Any]:
    """Decode a tenbin field into a list of arrays."""
    from . import tenbin

    return tenbin.decode_buffer(data)


def unpickle_loads(data: bytes) -> Any:
    """``pickle.loads``; only for data you trust (unpickling can run arbitrary code). Refused in
    secure mode (:mod:`webds.io.security`)."""
    refuse("unpickling fields", webdataset=WEBDATASET_PICKLE)
    return pickle.loads(data)


def torch_loads(data: bytes, weights_only: bool = True) -> Any:
    """Load a ``torch.save`` payload on the CPU; ``weights_only=True`` refuses arbitrary objects.
    Refused in secure mode (:mod:`webds.io.security`), as webdataset refuses it."""
    refuse("torch.load of fields (.pth)", webdataset=WEBDATASET_TORCH)
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=weights_only, map_location="cpu")
    except pickle.UnpicklingError as exn:
        if not weights_only:
            raise
        raise DecodeError(
            f"torch.load(weights_only=True) refused this payload ({str(exn).splitlines()[0]}); "
            "it holds objects other than tensors and plain containers. If you trust the data, "
            "decode with weights_only=False: decode(..., weights_only=False)"
        ) from None


def msgpack_loads(data: bytes) -> Any:
    """Decode MessagePack (needs the ``msgpack`` package)."""
    try:
        import msgpack
    except ImportError:
        raise DecodeError(
            "decoding MessagePack fields (.mp .msgpack .msg) needs the msgpack package: "
            "pip install msgpack"
        ) from None
    return msgpack.unpackb(data, raw=False)


def cbor_loads(data: bytes) -> Any:
    """Decode CBOR (needs the ``cbor2`` package, or the older ``cbor``)."""
    try:
        import cbor2 as cbor
    except ImportError:
        try:
            import cbor  # type: ignore[no-redef]
        except ImportError:
            raise DecodeError(
                "decoding CBOR fields (.cbor) needs the cbor2 package: pip install cbor2"
            ) from None
    return cbor.loads(data)


def _int_loads(data: bytes) -> int:
    return int(data)


def _text_loads(data: bytes) -> str:
    return data.decode("utf-8")


_PICKLE_EXTS = ("pyd", "pickle", "pkl")

#: Route functions that never return None, each with the builtin that does what it does: a
#: column of fields goes through that one with map alone (no Python call per field).
ALWAYS_DECODE: Dict[Callable[[bytes], Any], Callable[[bytes], Any]] = {
    _int_loads: int,
    _text_loads: bytes.decode,  # (UTF-8, strict: as data.decode("utf-8"))
}


class BasicHandlers:
    """The default decoders, chosen by the last extension of a field.

    ``cls cls2 class count index inx id`` -> int; ``txt text transcript html htm`` -> str;
    ``json jsn``; ``npy``; ``npz`` -> dict of arrays; ``ten tenbin tb`` -> list of arrays;
    ``mp msgpack msg``; ``cbor``;
    ``pth`` -> ``torch.load``; ``pyd pickle pkl`` -> ``pickle.loads`` only if ``allow_pickle``.
    Other extensions (images included) are left alone.
    """

    _table: Dict[str, Callable[[bytes], Any]] = {
        **dict.fromkeys(("cls", "cls2", "class", "count", "index", "inx", "id"), _int_loads),
        **dict.fromkeys(("txt", "text", "transcript", "html", "htm"), _text_loads),
        **dict.fromkeys(("json", "jsn"), json.loads),
        "npy": npy_loads,
        "npz": npz_loads,
        **dict.fromkeys(("ten", "tenbin", "tb"), tenbin_loads),
        **dict.fromkeys(("mp", "msgpack", "msg"), msgpack_loads),
        "cbor": cbor_loads,
    }

    def __init__(self, allow_pickle: bool = False, weights_only: bool = True) -> None:
        self.allow_pickle = bool(allow_pickle)
        self.weights_only = bool(weights_only)

    def decode_route(self, key: str) -> Optional[Route]:
        ext = _last_ext(key)
        f = self._table.get(ext)
        if f is not None:
            return (f,)
        # .pth and pickles decide at each call (secure mode, allow_pickle): not routed.
        return None if ext == "pth" or ext in _PICKLE_EXTS else ()

    def __call__(self, key: str, data: bytes) -> Any:
        ext = _last_ext(key)
        f = self._table.get(ext)
        if f is not None:
            return f(data)
        if ext == "pth":
            return torch_loads(data, weights_only=self.weights_only)
        if ext in _PICKLE_EXTS:
            refuse(
                f"unpickling '.{ext}' fields, even with allow_pickle=True",
                webdataset=WEBDATASET_PICKLE,
            )
            if not self.allow_pickle:
                raise DecodeError(
                    f"'.{ext}' fields are Python pickles, and loading a pickle can run arbitrary "
                    "code, so webds does not unpickle by default. If you trust this data, opt in "
                    "with decode(..., allow_pickle=True) or Decoder(..., allow_pickle=True)"
                )
            return pickle.loads(data)
        return None

    def __repr__(self) -> str:
        return f"BasicHandlers(allow_pickle={self.allow_pickle}, weights_only={self.weights_only})"


#: The default extension handlers (pickle refused, ``torch.load(weights_only=True)``).
basichandlers = BasicHandlers()


def torch_video(key: str, data: bytes) -> Any:
    """Decode video fields (``mp4 ogv mjpeg avi mov h264 mpg webm wmv``) as
    ``torchvision.io.read_video(path, pts_unit="sec")`` did: ``(video uint8 T x H x W x 3,
    audio float32 channels x samples, {"video_fps": ..., "audio_fps": ...})``, from the bytes in
    memory with PyAV (``pip install 'webds[av]'``); see :func:`webds.stages.video.read_video`.
    Bounded by the default limits of :mod:`webds.stages.avio`."""
    if _last_ext(key) not in VIDEO_EXTENSIONS:
        return None
    return read_video(data)


def torch_audio(key: str, data: bytes) -> Any:
    """Decode audio fields (``flac mp3 sox wav m4a ogg wma opus``) as ``torchaudio.load`` did:
    ``(waveform float32 channels x samples, sample_rate)``, from the bytes in memory with PyAV
    (``pip install 'webds[av]'``); see :func:`webds.stages.audio.load_audio`."""
    if _last_ext(key) not in AUDIO_EXTENSIONS:
        return None
    return load_audio(data)


_PURE = frozenset((*BasicHandlers._table.values(), _decoded_image))
