"""Encoding sample fields for writing: the mirror of :mod:`webds.stages.decode`.

Each field is encoded by its last extension (``"seg.png"`` -> PNG); a trailing ``.gz`` gzips the
encoded bytes (deterministically: no timestamp, no file name). bytes pass through unchanged (so
re-writing samples read from a shard copies them exactly), and str is always UTF-8.

    encode_sample({"__key__": "a", "cls": 3, "json": {"x": 1}, "png": array}, True)
    # {"__key__": "a", "cls": b"3", "json": b'{"x": 1}', "png": b"\\x89PNG..."}

Every extension the default decoder understands has an encoder here, so writing a sample and
reading it back with ``decode`` gives the values back.
"""

from __future__ import annotations

import gzip
import io
import json
import numbers
import pickle
from typing import Any, Callable, Dict, Mapping, Optional, Union

from ..errors import ArgumentError, EncodeError

__all__ = [
    "make_encoder",
    "encode_sample",
    "encode_value",
    "SampleEncoder",
    "IdentityEncoder",
    "default_handlers",
    "IMAGE_FORMATS",
    "imageencoder",
    "torch_dumps",
    "numpy_dumps",
    "numpy_npz_dumps",
    "tenbin_dumps",
    "mp_dumps",
    "cbor_dumps",
    "pickle_dumps",
    "json_dumps",
    "int_dumps",
    "text_dumps",
]

_BYTES_LIKE = (bytes, bytearray, memoryview)
_GZIP_MAGIC = b"\x1f\x8b\x08"


def _is_tensor(x: Any) -> bool:
    # Checked by duck type so encoding numpy or text never imports torch.
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _to_numpy(x: Any) -> Any:
    import numpy as np

    if _is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


# -- value encoders ---------------------------------------------------------------------------


def int_dumps(x: Any) -> bytes:
    """An integer as ASCII digits (``.cls``): ``int_dumps(3) == b"3"``."""
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        # numpy scalars and one-element arrays or tensors
        size = x.numel() if _is_tensor(x) else getattr(x, "size", 1)
        if size != 1:
            raise EncodeError(f"expected an integer, got an array of shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise EncodeError(
            f"expected an integer class label, got {type(x).__name__} {x!r}; "
            "convert it with int(...) or store it under .txt/.json"
        )
    return str(int(x)).encode("ascii")


def text_dumps(x: Any) -> bytes:
    """A str as UTF-8."""
    if not isinstance(x, str):
        raise EncodeError(f"expected a str, got {type(x).__name__}; convert it with str(...)")
    return x.encode("utf-8")


def json_dumps(x: Any) -> bytes:
    """JSON as UTF-8 bytes."""
    try:
        return json.dumps(x).encode("utf-8")
    except (TypeError, ValueError) as exn:
        raise EncodeError(
            f"cannot encode as JSON ({exn}); convert arrays with .tolist() and numpy scalars "
            "with .item()"
        ) from None


def numpy_dumps(data: Any) -> bytes:
    """An array in ``.npy`` format (object arrays are refused: they would need pickle)."""
    import numpy as np

    a = _to_numpy(data)
    if a.dtype == object:
        raise EncodeError("cannot store an object array as .npy; use a numeric dtype or .pyd")
    stream = io.BytesIO()
    np.lib.format.write_array(stream, a, allow_pickle=False)
    return stream.getvalue()


def numpy_npz_dumps(x: Any) -> bytes:
    """A dict of arrays as a compressed ``.npz`` archive."""
    import numpy as np

    if not isinstance(x, Mapping):
        raise EncodeError(f".npz fields need a dict of arrays, got {type(x).__name__}")
    arrays = {str(k): _to_numpy(v) for k, v in x.items()}
    for k, a in arrays.items():
        if a.dtype == object:
            raise EncodeError(f"cannot store the object array {k!r} in .npz; use a numeric dtype")
    stream = io.BytesIO()
    # zipfile stamps entries with a fixed 1980 date here, so the output is deterministic.
    np.savez_compressed(stream, **arrays)
    return stream.getvalue()


def tenbin_dumps(x: Any) -> bytes:
    """An array, or a list of arrays, in tenbin format (decoded back as a list)."""
    from . import tenbin

    if isinstance(x, (list, tuple)):
        return tenbin.encode_buffer(list(x))
    return tenbin.encode_buffer([x])


def torch_dumps(data: Any) -> bytes:
    """Anything ``torch.save`` accepts."""
    import torch

    stream = io.BytesIO()
    torch.save(data, stream)
    return stream.getvalue()


def pickle_dumps(x: Any) -> bytes:
    """``pickle.dumps`` (reading it back needs ``decode(..., allow_pickle=True)``)."""
    return pickle.dumps(x)


def mp_dumps(x: Any) -> bytes:
    """MessagePack (needs the ``msgpack`` package)."""
    try:
        import msgpack
    except ImportError:
        raise EncodeError(
            "encoding MessagePack fields (.mp .msgpack .msg) needs the msgpack package: "
            "pip install msgpack"
        ) from None
    return msgpack.packb(x, use_bin_type=True)


def cbor_dumps(x: Any) -> bytes:
    """CBOR (needs the ``cbor2`` package, or the older ``cbor``)."""
    try:
        import cbor2 as cbor
    except ImportError:
        try:
            import cbor  # type: ignore[no-redef]
        except ImportError:
            raise EncodeError(
                "encoding CBOR fields (.cbor) needs cbor2: pip install cbor2"
            ) from None
    return cbor.dumps(x)


# -- images -----------------------------------------------------------------------------------

#: Extension -> (PIL format, save options). JPEG at quality 100 as webdataset, without chroma
#: subsampling (fidelity is the point of quality 100); WebP lossless.
IMAGE_FORMATS: Dict[str, tuple] = {
    "jpg": ("JPEG", {"quality": 100, "subsampling": 0}),
    "jpeg": ("JPEG", {"quality": 100, "subsampling": 0}),
    "img": ("JPEG", {"quality": 100, "subsampling": 0}),
    "image": ("JPEG", {"quality": 100, "subsampling": 0}),
    "png": ("PNG", {}),
    "ppm": ("PPM", {}),
    "pgm": ("PPM", {}),
    "pbm": ("PPM", {}),
    "tif": ("TIFF", {}),
    "tiff": ("TIFF", {}),
    "webp": ("WEBP", {"lossless": True}),
    "bmp": ("BMP", {}),
}


def _array_to_pil(x: Any) -> Any:
    import numpy as np
    from PIL import Image

    tensor = _is_tensor(x)
    a = _to_numpy(x)
    if tensor and a.ndim == 3:
        if a.shape[0] not in (1, 3, 4):
            raise EncodeError(
                f"image tensors must be CxHxW with C in 1, 3, 4; got {tuple(a.shape)}"
            )
        a = a.transpose(1, 2, 0)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))):
        layout = "CxHxW" if tensor else "HxW or HxWxC"
        raise EncodeError(f"images must be {layout} with C in 1, 3, 4; got shape {tuple(a.shape)}")
    if a.dtype.kind == "f":
        if a.size and not (np.isfinite(a).all() and a.min() >= 0.0 and a.max() <= 1.0):
            raise EncodeError("float images must hold values in [0, 1]; scale them or use uint8")
        a = np.round(a.astype(np.float64) * 255.0).astype(np.uint8)
    elif a.dtype.kind in "iu" and a.dtype != np.uint8:
        if a.size and (a.min() < 0 or a.max() > 255):
            raise EncodeError(f"{a.dtype} images must hold values in 0..255; convert to uint8")
        a = a.astype(np.uint8)
    elif a.dtype != np.uint8:
        raise EncodeError(f"images must be uint8 or float in [0, 1], got dtype {a.dtype}")
    mode = "L" if a.ndim == 2 else ("RGB" if a.shape[2] == 3 else "RGBA")
    return Image.fromarray(np.ascontiguousarray(a), mode=mode)


def imageencoder(image: Any, format: str = "PNG", **options: Any) -> bytes:
    """Encode a PIL image, a numpy array (HxW, HxWx1/3/4) or a torch tensor (CxHxW) as bytes.

    Arrays are uint8, or float in [0, 1]. ``imageencoder(array, "JPEG", quality=95)``.
    """
    from PIL import Image

    fmt = format.upper()
    fmt = {"JPG": "JPEG", "TIF": "TIFF", "PGM": "PPM", "PBM": "PPM"}.get(fmt, fmt)
    img = image if isinstance(image, Image.Image) else _array_to_pil(image)
    if fmt == "JPEG" and img.mode not in ("L", "RGB", "CMYK"):
        if "A" in img.mode:
            raise EncodeError(
                f"JPEG cannot store an alpha channel (image mode {img.mode}); "
                "write it as .png or .webp, or drop the alpha channel"
            )
        img = img.convert("RGB")
    stream = io.BytesIO()
    try:
        img.save(stream, format=fmt, **options)
    except (OSError, ValueError, KeyError) as exn:
        raise EncodeError(f"cannot save a {img.mode} image as {fmt}: {exn}") from None
    return stream.getvalue()


class _ImageDumps:
    """Picklable per-extension image encoder."""

    def __init__(self, fmt: str, options: Dict[str, Any]) -> None:
        self.fmt = fmt
        self.options = options

    def __call__(self, x: Any) -> bytes:
        return imageencoder(x, self.fmt, **self.options)


def _make_default_handlers() -> Dict[str, Callable[[Any], bytes]]:
    table: Dict[str, Callable[[Any], bytes]] = {}
    for exts, f in [
        ("cls cls2 class count index inx id", int_dumps),
        ("txt text transcript html htm", text_dumps),
        ("json jsn", json_dumps),
        ("npy", numpy_dumps),
        ("npz", numpy_npz_dumps),
        ("pyd pickle pkl", pickle_dumps),
        ("pth", torch_dumps),
        ("ten tenbin tb", tenbin_dumps),
        ("mp msgpack msg", mp_dumps),
        ("cbor", cbor_dumps),
    ]:
        for ext in exts.split():
            table[ext] = f
    for ext, (fmt, options) in IMAGE_FORMATS.items():
        table[ext] = _ImageDumps(fmt, options)
    return table


def default_handlers() -> Dict[str, Callable[[Any], bytes]]:
    """A copy of the default ``{extension: encoder}`` table, to edit and pass as ``encoder``."""
    return _make_default_handlers()


_DEFAULT_HANDLERS = _make_default_handlers()


# -- sample encoding --------------------------------------------------------------------------


def _gzip(data: bytes) -> bytes:
    if data[:3] == _GZIP_MAGIC:
        # Already gzipped (e.g. a raw ".txt.gz" field copied from another shard): keep it.
        return data
    return gzip.compress(data, compresslevel=6, mtime=0)


def encode_value(field: str, value: Any, handlers: Mapping[str, Callable[[Any], bytes]]) -> Any:
    """Encode one field by its extension; metadata fields (``_...``) must be str and stay str."""
    if field.startswith("_"):
        if not isinstance(value, str):
            raise EncodeError(f"metadata field {field!r} must be a str, got {type(value).__name__}")
        return value
    name = field.lower()
    compress = name.endswith(".gz")
    if compress:
        name = name[:-3]
    if isinstance(value, _BYTES_LIKE):
        data = bytes(value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
    else:
        ext = name.rsplit(".", 1)[-1]
        f = handlers.get(ext)
        if f is None:
            raise EncodeError(
                f"no encoder for extension {ext!r} (a {type(value).__name__} value); pass bytes, "
                f"or use one of: {' '.join(sorted(handlers))}"
            )
        data = f(value)
        if not isinstance(data, _BYTES_LIKE):
            raise EncodeError(f"the encoder for {ext!r} returned {type(data).__name__}, not bytes")
        data = bytes(data)
    return _gzip(data) if compress else data


def _encode_error(exn: Exception, sample: Mapping[str, Any], field: str) -> EncodeError:
    key = sample.get("__key__")
    key = key if isinstance(key, str) else None
    detail = exn.message if isinstance(exn, EncodeError) else f"{type(exn).__name__}: {exn}"
    return EncodeError(
        f"cannot encode field {field!r}: {detail}",
        member=f"{key}.{field}" if key is not None else None,
        key=key,
    )


class SampleEncoder:
    """Encodes every field of a sample with a table ``{extension: fn(value) -> bytes}``."""

    def __init__(self, handlers: Optional[Mapping[str, Callable[[Any], bytes]]] = None) -> None:
        self.handlers = dict(_DEFAULT_HANDLERS if handlers is None else handlers)

    def __call__(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        result: Dict[str, Any] = {}
        handlers = self.handlers
        for field, value in sample.items():
            try:
                # Inline the commonest cases of encode_value (same results): writers spend
                # much of their time here on samples of small fields.
                kind = type(value)
                if field[:1] == "_":
                    if kind is str:
                        result[field] = value
                        continue
                else:
                    name = field.lower()
                    if not name.endswith(".gz"):
                        if kind is bytes:
                            result[field] = value
                            continue
                        if kind is str:
                            result[field] = value.encode("utf-8")
                            continue
                        if kind is int and handlers.get(name.rpartition(".")[2]) is int_dumps:
                            result[field] = b"%d" % value
                            continue
                result[field] = encode_value(field, value, handlers)
            except Exception as exn:
                raise _encode_error(exn, sample, field) from exn
        return result


class IdentityEncoder:
    """``encoder=False``: fields must already be bytes (metadata fields str or bytes)."""

    def __call__(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        for field, value in sample.items():
            if type(value) is bytes:
                continue  # what every field may be
            if field.startswith("_"):
                ok, want = isinstance(value, (str,) + _BYTES_LIKE), "str or bytes"
            else:
                ok, want = (
                    isinstance(value, _BYTES_LIKE),
                    "bytes (encoder=False writes fields as they are)",
                )
            if not ok:
                raise _encode_error(
                    EncodeError(f"must be {want}, got {type(value).__name__}"), sample, field
                )
        return dict(sample)


class _CallableEncoder:
    """A user function ``sample -> sample`` whose result is checked like the identity encoder."""

    def __init__(self, f: Callable[[Dict[str, Any]], Dict[str, Any]]) -> None:
        self.f = f

    def __call__(self, sample: Mapping[str, Any]) -> Dict[str, Any]:
        result = self.f(dict(sample))
        if not isinstance(result, Mapping):
            raise EncodeError(f"the encoder function returned {type(result).__name__}, not a dict")
        return IdentityEncoder()(result)


Encoder = Callable[[Mapping[str, Any]], Dict[str, Any]]
EncoderSpec = Union[bool, None, Callable[..., Any], Mapping[str, Callable[[Any], bytes]]]


def make_encoder(spec: EncoderSpec) -> Encoder:
    """Turn an encoder spec into a function ``sample -> encoded sample``.

    ``True``: the default table; ``False``/``None``: fields must already be bytes; a callable:
    ``f(sample) -> sample`` of bytes; a dict ``{ext: fn(value) -> bytes}``: that table (added to
    nothing; start from :func:`default_handlers` to extend the defaults).
    """
    if spec is True:
        return SampleEncoder()
    if spec is False or spec is None:
        return IdentityEncoder()
    if isinstance(spec, Mapping):
        table = {}
        for ext, f in spec.items():
            if not callable(f):
                raise ArgumentError(f"encoder table entry {ext!r} must be callable, got {f!r}")
            table[str(ext).lower().lstrip(".")] = f
        return SampleEncoder(table)
    if callable(spec):
        return _CallableEncoder(spec)
    raise ArgumentError(
        f"encoder must be True, False, None, a function sample -> sample or a dict "
        f"{{ext: fn}}; got {spec!r}"
    )


def encode_sample(sample: Mapping[str, Any], encoder: EncoderSpec = True) -> Dict[str, Any]:
    """Encode one sample: ``encode_sample({"__key__": "a", "cls": 3})["cls"] == b"3"``."""
    return make_encoder(encoder)(sample)
