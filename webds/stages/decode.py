"""Decoding sample fields: the extension table, image specs, and the ``decode`` stage.

A :class:`Decoder` runs a chain of handlers over each field of a sample. A handler is called as
``f(".ext", data)`` (``".jpg"``, ``".seg.jpg"``, ``".txt.gz"``); the first result that is not None
wins, and a :class:`Continue` result rewrites the key and data and carries on down the chain (that
is how ``.gz`` fields are gunzipped and then decoded by their inner extension). The default chain
is ``[gzfilter] + handlers + [basichandlers]``.

    decoder = Decoder([imagehandler("rgb8")])
    decoder({"__key__": "a", "jpg": b"...", "cls": b"3"})   # {"jpg": uint8 HxWx3 array, "cls": 3}

Pickles (``.pyd .pickle .pkl``) run arbitrary code when loaded, so they are only decoded with
``allow_pickle=True``; ``.pth`` is loaded with ``torch.load(weights_only=True)`` unless
``weights_only=False``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import re
import tempfile
from fnmatch import fnmatchcase
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

from ..errors import ArgumentError, DecodeError
from . import fastjpeg
from .core import SAME, stage
from .handlers import Handler, apply_each, reraise_exception

__all__ = [
    "Continue",
    "Decoder",
    "DecodingError",
    "BasicHandlers",
    "ExtensionHandler",
    "ImageHandler",
    "IMAGE_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "AUDIO_EXTENSIONS",
    "basichandlers",
    "decode",
    "decode_image",
    "default_decoder",
    "gzfilter",
    "handle_extension",
    "imagehandler",
    "imagespecs",
    "make_decoder",
    "torch_audio",
    "torch_loads",
    "torch_video",
    "npy_loads",
    "npz_loads",
    "unpickle_loads",
    "msgpack_loads",
    "cbor_loads",
    "tenbin_loads",
    "xdecode",
    "default_xdecoders",
    "decode_bin",
    "decode_text",
    "decode_pickle",
    "find_decoder",
]

#: webdataset's flag for ``.pth`` decoding. In webds it documents the default of
#: ``decode(..., weights_only=True)``; assigning it changes nothing (as in webdataset, where it
#: was a copy of a bool): pass ``weights_only=False`` to ``decode`` instead.
pytorch_weights_only = True

#: webdataset's name for :class:`~webds.errors.DecodeError`.
DecodingError = DecodeError

#: Extensions the image handlers decode (those PIL reads, plus ``img``/``image`` which the writer
#: produces as JPEG). Only the *last* extension of a field counts: ``seg.png`` is an image.
IMAGE_EXTENSIONS: List[str] = (
    "jpg jpeg jpe jfif png apng gif bmp dib tif tiff webp ppm pgm pbm pnm pfm tga ico cur icns "
    "pcx sgi rgb rgba bw ras xbm xpm qoi avif avifs jp2 j2k j2c jpc jpf jpx psd dds blp msp im "
    "img image"
).split()

VIDEO_EXTENSIONS: List[str] = "mp4 ogv mjpeg avi mov h264 mpg webm wmv".split()
AUDIO_EXTENSIONS: List[str] = "flac mp3 sox wav m4a ogg wma".split()

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


def _last_ext(key: str) -> str:
    return key.rsplit(".", 1)[-1].lower()


class Continue:
    """A handler result meaning "go on down the chain with this key and data instead"."""

    def __init__(self, key: str, data: Any) -> None:
        self.key = key
        self.data = data

    def __repr__(self) -> str:
        return f"Continue({self.key!r}, <{type(self.data).__name__}>)"


def gzfilter(key: str, data: bytes) -> Optional[Continue]:
    """Gunzip ``.gz`` fields and continue with the inner extension (``.txt.gz`` -> ``.txt``)."""
    if not key.lower().endswith(".gz"):
        return None
    return Continue(key[:-3], gzip.decompress(data))


class ExtensionHandler:
    """Calls ``f(data)`` for fields whose trailing extensions match one of ``extensions``."""

    def __init__(self, extensions: Union[str, Sequence[str]], f: Callable[[bytes], Any]) -> None:
        if isinstance(extensions, str):
            extensions = extensions.split()
        self.extensions = [e.lower().lstrip(".").split(".") for e in extensions]
        self.f = f

    def __call__(self, key: str, data: bytes) -> Any:
        parts = key.lower().lstrip(".").split(".")
        for target in self.extensions:
            if len(target) <= len(parts) and parts[-len(target) :] == target:
                return self.f(data)
        return None

    def __repr__(self) -> str:
        exts = " ".join(".".join(t) for t in self.extensions)
        return f"handle_extension({exts!r}, {self.f!r})"


def handle_extension(
    extensions: Union[str, Sequence[str]], f: Callable[[bytes], Any]
) -> ExtensionHandler:
    """A handler applying ``f(data)`` to the given space-separated extensions (case-insensitive).

    A multi-dot extension matches the trailing parts: ``handle_extension("seg.png", f)`` fires on
    ``".seg.png"`` and ``".x.seg.png"`` but not on ``".png"``.
    """
    return ExtensionHandler(extensions, f)


def decode_image(data: bytes, imagespec: str, fast_jpeg: bool = True) -> Any:
    """Decode image bytes according to an image spec (see :data:`imagespecs`).

    With ``fast_jpeg`` (the default), RGB JPEGs go through ``simplejpeg`` when it is installed
    (see :mod:`webds.stages.fastjpeg`: same pixels, faster); everything else through Pillow.
    """
    atype, etype, mode = imagespecs[imagespec]
    a: Any = None
    if fast_jpeg and mode == "rgb":
        if atype == "pil":
            result = fastjpeg.pil_rgb(data)
            if result is not None:
                return result
        else:
            a = fastjpeg.decode_rgb(data)  # HxWx3 uint8, writable, no PIL image in between
    if a is None:
        from PIL import Image

        img = Image.open(io.BytesIO(data))
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

    def __call__(self, key: str, data: bytes) -> Any:
        if _last_ext(key) not in self.extensions:
            return None
        return decode_image(data, self.imagespec, self.fast_jpeg)

    def __repr__(self) -> str:
        fast = "" if self.fast_jpeg else ", fast_jpeg=False"
        return f"imagehandler({self.imagespec!r}{fast})"


def imagehandler(
    imagespec: str,
    extensions: Union[str, Iterable[str]] = IMAGE_EXTENSIONS,
    fast_jpeg: bool = True,
) -> ImageHandler:
    """A handler decoding image fields: ``Decoder([imagehandler("torchrgb")])``.

    ``fast_jpeg=False`` decodes JPEGs with Pillow even when ``simplejpeg`` is installed.
    """
    return ImageHandler(imagespec, extensions, fast_jpeg)


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
    """``pickle.loads``; only for data you trust (unpickling can run arbitrary code)."""
    return pickle.loads(data)


def torch_loads(data: bytes, weights_only: bool = True) -> Any:
    """Load a ``torch.save`` payload on the CPU; ``weights_only=True`` refuses arbitrary objects."""
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

    def __call__(self, key: str, data: bytes) -> Any:
        ext = _last_ext(key)
        f = self._table.get(ext)
        if f is not None:
            return f(data)
        if ext == "pth":
            return torch_loads(data, weights_only=self.weights_only)
        if ext in _PICKLE_EXTS:
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


def _media_via_tempfile(key: str, data: bytes, load: Callable[[str], Any]) -> Any:
    # The video/audio readers want a file name, and the extension tells them the container.
    with tempfile.TemporaryDirectory() as dirname:
        fname = os.path.join(dirname, f"file.{_last_ext(key)}")
        with open(fname, "wb") as stream:
            stream.write(data)
        return load(fname)


def torch_video(key: str, data: bytes) -> Any:
    """Decode video fields (``mp4 avi webm ...``) with ``torchvision.io.read_video``."""
    if _last_ext(key) not in VIDEO_EXTENSIONS:
        return None
    try:
        import torchvision.io
    except Exception as exn:  # a torchvision built for another torch fails with RuntimeError
        raise DecodeError(
            f"decoding video needs a working torchvision with video support ({exn}); "
            "pip install torchvision av (matching your torch version)"
        ) from None
    read_video = getattr(torchvision.io, "read_video", None)
    if read_video is None:
        raise DecodeError(
            "this torchvision has no io.read_video; install a torchvision with video support, "
            "or decode videos with your own handler"
        )
    return _media_via_tempfile(key, data, lambda fname: read_video(fname, pts_unit="sec"))


def torch_audio(key: str, data: bytes) -> Any:
    """Decode audio fields (``flac mp3 wav ...``) with ``torchaudio.load``."""
    if _last_ext(key) not in AUDIO_EXTENSIONS:
        return None
    try:
        import torchaudio
    except Exception as exn:
        raise DecodeError(
            f"decoding audio needs torchaudio ({exn}); pip install torchaudio "
            "(matching your torch version)"
        ) from None
    return _media_via_tempfile(key, data, torchaudio.load)


# -- the decoder ----------------------------------------------------------------------------

KeyHandler = Callable[[str, bytes], Any]
_BYTES_LIKE = (bytes, bytearray, memoryview)


class Decoder:
    """Decode every field of a sample through a chain of handlers ``pre + handlers + post``.

    ``pre`` defaults to ``[gzfilter]`` and ``post`` to ``[BasicHandlers(allow_pickle,
    weights_only)]``. ``only`` (a space-separated string or a list of exact field names) limits
    decoding to those fields. With ``partial=False`` every field must still be bytes; with
    ``partial=True`` fields that are not bytes pass through.
    """

    def __init__(
        self,
        handlers: Sequence[KeyHandler],
        pre: Optional[Sequence[KeyHandler]] = None,
        post: Optional[Sequence[KeyHandler]] = None,
        only: Union[None, str, Iterable[str]] = None,
        partial: bool = False,
        *,
        allow_pickle: bool = False,
        weights_only: bool = True,
    ) -> None:
        pre = [gzfilter] if pre is None else list(pre)
        post = [BasicHandlers(allow_pickle, weights_only)] if post is None else list(post)
        chain = pre + list(handlers) + post
        for h in chain:
            if not callable(h):
                raise ArgumentError(f"decoder handlers must be callables f(key, data); got {h!r}")
        self.handlers = chain
        if isinstance(only, str):
            only = only.split()
        self.only = None if only is None else frozenset(only)
        self.partial = bool(partial)

    def decode1(self, key: str, data: bytes) -> Any:
        """Decode one field's bytes; ``key`` is the field name without the leading dot."""
        key = "." + key
        for f in self.handlers:
            result = f(key, data)
            if isinstance(result, Continue):
                key, data = result.key, result.data
                continue
            if result is not None:
                return result
        return data

    def decode(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        """Return a new dict with every selected field decoded; raise DecodeError naming it."""
        if not isinstance(sample, Mapping):
            raise DecodeError(
                f"decode works on dict samples, got a {type(sample).__name__}; "
                "put decode before to_tuple / batched"
            )
        url = sample.get("__url__")
        skey = sample.get("__key__")
        result: Dict[str, Any] = {}
        for k, v in sample.items():
            try:
                if k.startswith("__"):
                    result[k] = bytes(v).decode("utf-8") if isinstance(v, _BYTES_LIKE) else v
                    continue
                if self.only is not None and k not in self.only:
                    result[k] = v
                    continue
                if not isinstance(v, _BYTES_LIKE):
                    if self.partial:
                        result[k] = v
                        continue
                    raise DecodeError(
                        f"field holds a {type(v).__name__}, not bytes: decode expects raw fields "
                        "from the tar reader. Decode only once, or pass partial=True to leave "
                        "non-bytes fields as they are"
                    )
                result[k] = self.decode1(k, bytes(v) if not isinstance(v, bytes) else v)
            except Exception as exn:
                raise _decode_error(exn, url, skey, k) from exn
        return result

    def __call__(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        return self.decode(sample)

    def __repr__(self) -> str:
        return f"Decoder({self.handlers!r}, only={self.only!r}, partial={self.partial})"


def _decode_error(exn: Exception, url: Any, key: Any, field: str) -> DecodeError:
    if isinstance(exn, DecodeError):
        detail = exn.message
    else:
        detail = (
            f"{type(exn).__name__}: {exn}. Check that the member holds valid '.{field}' data; "
            "decode(only=[...]) limits which fields are decoded, and "
            "handler=warn_and_continue skips bad samples"
        )
    member = f"{key}.{field}" if isinstance(key, str) else None
    return DecodeError(
        f"cannot decode field {field!r}: {detail}",
        url=url if isinstance(url, str) else None,
        member=member,
        key=key if isinstance(key, str) else None,
    )


#: A decoder with only the default extension table (no images, no pickles).
default_decoder = Decoder([])


def make_decoder(
    *args: Union[str, KeyHandler, Decoder],
    pre: Optional[Sequence[KeyHandler]] = None,
    post: Optional[Sequence[KeyHandler]] = None,
    only: Union[None, str, Iterable[str]] = None,
    partial: bool = False,
    allow_pickle: bool = False,
    weights_only: bool = True,
) -> Decoder:
    """Build the Decoder that ``decode(*args, ...)`` uses.

    Strings are image specs (``"rgb8"``), callables are handlers ``f(key, data)``, and a single
    :class:`Decoder` is used as it is.
    """
    if len(args) == 1 and isinstance(args[0], Decoder):
        return args[0]
    handlers: List[KeyHandler] = []
    for arg in args:
        if isinstance(arg, str):
            handlers.append(imagehandler(arg))
        elif isinstance(arg, Decoder):
            raise ArgumentError(
                "decode: pass a Decoder on its own (decode(my_decoder)), or pass handlers and "
                "image specs, not both"
            )
        elif callable(arg):
            handlers.append(arg)
        else:
            raise ArgumentError(
                f"decode: arguments must be image specs (one of {', '.join(imagespecs)}), "
                f"handlers f(key, data) or a Decoder; got {arg!r}"
            )
    return Decoder(
        handlers,
        pre=pre,
        post=post,
        only=only,
        partial=partial,
        allow_pickle=allow_pickle,
        weights_only=weights_only,
    )


@stage(count=SAME)
def decode(
    src: Iterable[Mapping[str, Any]],
    *args: Union[str, KeyHandler, Decoder],
    handler: Handler = reraise_exception,
    pre: Optional[Sequence[KeyHandler]] = None,
    post: Optional[Sequence[KeyHandler]] = None,
    only: Union[None, str, Iterable[str]] = None,
    partial: bool = False,
    allow_pickle: bool = False,
    weights_only: bool = True,
) -> Iterator[Dict[str, Any]]:
    """Decode the fields of each sample by extension; strings are image specs.

    ``decode("rgb8")`` gives images as uint8 HxWx3 arrays, ``.cls`` as int, ``.json`` parsed...
    ``allow_pickle=True`` enables ``.pyd/.pickle/.pkl``; ``weights_only=False`` lets ``.pth``
    hold arbitrary objects. Failures raise DecodeError unless ``handler`` says otherwise.
    """
    decoder = make_decoder(
        *args,
        pre=pre,
        post=post,
        only=only,
        partial=partial,
        allow_pickle=allow_pickle,
        weights_only=weights_only,
    )
    return apply_each(src, decoder, handler, "decode")


# -- xdecode: webdataset's second decoder family, whose functions read a stream ------------------


def decode_bin(stream: Any) -> bytes:
    """Read the whole stream as bytes."""
    return stream.read()


def decode_text(stream: Any) -> str:
    """Read the whole stream as UTF-8 text."""
    return stream.read().decode("utf-8")


def decode_pickle(stream: Any) -> Any:
    """``pickle.load``: only for data you trust. :func:`xdecode` uses it only with
    ``allow_pickle=True``."""
    return pickle.load(stream)


StreamDecoder = Callable[[Any], Any]

#: xdecode's defaults: ``(pattern, fn)`` pairs; later entries win.
default_xdecoders: List[tuple] = [
    ("*.bin", decode_bin),
    ("*.txt", decode_text),
    ("*.pyd", decode_pickle),
]


def find_decoder(decoders: Sequence[tuple], path: str) -> Optional[StreamDecoder]:
    """The decoder of the last ``(pattern, fn)`` whose fnmatch pattern matches the lower-cased
    basename of ``path`` (or it with a leading dot); None if none does."""
    fname = re.sub(r".*/", "", path).lower()
    for pattern, fn in reversed(decoders):
        if fnmatchcase(fname, pattern) or fnmatchcase("." + fname, pattern):
            return fn
    return None


@stage(count=SAME)
def xdecode(
    src: Iterable[Mapping[str, Any]],
    *args: tuple,
    must_decode: bool = True,
    defaults: Sequence[tuple] = default_xdecoders,
    allow_pickle: bool = False,
    handler: Handler = reraise_exception,
    **kw: StreamDecoder,
) -> Iterator[Dict[str, Any]]:
    """Decode fields with functions that read a stream, chosen by fnmatch patterns on the name.

    ``xdecode(("*.jpg", PIL.Image.open), npy=numpy.load)``: ``args`` are ``(pattern, fn)`` pairs,
    ``ext=fn`` means ``("*.ext", fn)``, later entries win, and ``fn=False`` keeps a field raw.
    Defaults: ``*.bin`` -> bytes, ``*.txt`` -> str, ``*.pyd`` -> pickle (only with
    ``allow_pickle=True``, as in :func:`decode`). ``__`` fields pass through. With
    ``must_decode`` a field no pattern matches is a DecodeError; otherwise it stays bytes.
    """
    decoders = list(defaults) + list(args) + [("*." + k, v) for k, v in kw.items()]
    for entry in decoders:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ArgumentError(f"xdecode: decoders are (pattern, fn) pairs, got {entry!r}")
        if entry[1] is not False and not callable(entry[1]):
            raise ArgumentError(f"xdecode: the decoder for {entry[0]!r} is not callable")

    def decode_sample(sample: Mapping[str, Any]) -> Dict[str, Any]:
        if not isinstance(sample, Mapping):
            raise DecodeError(f"xdecode works on dict samples, got a {type(sample).__name__}")
        url, skey = sample.get("__url__"), sample.get("__key__")
        result: Dict[str, Any] = {}
        for path, data in sample.items():
            if path.startswith("__"):
                result[path] = data
                continue
            try:
                fn = find_decoder(decoders, path)
                if fn is False or (fn is None and not must_decode):
                    result[path] = data
                    continue
                if fn is None:
                    raise DecodeError(
                        f"no xdecode pattern matches this field; add one, e.g. "
                        f'xdecode(("*.{path}", fn)), or pass must_decode=False'
                    )
                if fn is decode_pickle and not allow_pickle:
                    raise DecodeError(
                        "pickle fields can run arbitrary code when loaded; if you trust the "
                        "data, enable them with xdecode(..., allow_pickle=True)"
                    )
                stream = io.BytesIO(data) if isinstance(data, _BYTES_LIKE) else data
                result[path] = fn(stream)
            except Exception as exn:
                raise _decode_error(exn, url, skey, path) from exn
        return result

    return apply_each(src, decode_sample, handler, "xdecode")
