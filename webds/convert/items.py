"""What :func:`~webds.convert.pack` makes of a dataset item: a sample of encoded fields and its
key.

An item (``dataset[i]``) is a dict ``{ext: value}`` or a tuple ``(input, label[, extra])``,
whose parts get the extension their type calls for (:func:`_auto_field`: an image -> ``jpg``
or ``png``, falling back to PNG, then TIFF, for modes the format can't hold; an int -> ``cls``,
a str -> ``txt``, a dict, list or float -> ``json``, other arrays -> ``npy``, bytes kept as
they are). Files that are already encoded are never decoded and encoded again
(``reencode=True`` forces it): a torchvision folder dataset's files (:func:`_folder_fields`),
and what ``__webds_raw__(i)`` or ``raw=fn`` returns (:func:`_raw_fields`). Keys
(:func:`_plan_keys`) are the dataset index, ``f"{i:08d}"``, or the file stems of a folder
dataset when those are unique. The rules in full: docs/convert.md, "Any map-style dataset".

Nothing here imports torch: tensors and PIL images are recognised by their type's module.
"""

from __future__ import annotations

import numbers
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ArgumentError, EncodeError, SampleError, WebdsError
from ..parallel import _describe
from ..stages.encode import IMAGE_FORMATS, default_handlers, encode_value, imageencoder
from ..tarwriter import check_key

# The loaders that only decode the file: storing the file's bytes gives the same image back.
_PLAIN_LOADERS = {"default_loader", "pil_loader", "accimage_loader"}
_JPEG_MODES = {"L", "P", "RGB", "CMYK", "YCbCr"}  # bilevel "1" is better off as PNG
_PNG_MODES = {"1", "L", "LA", "P", "PA", "I;16", "RGB", "RGBA"}
_BLOCK = 512
_INDEX_WIDTH = 8

RawFn = Callable[[Any, int], Optional[Mapping[str, Any]]]
KeysSpec = Union[None, str, Callable[[int], str]]


# -- items to fields ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    """What every worker needs besides the dataset."""

    image_format: str
    quality: int
    raw_mode: Optional[str]  # "user", "hook", "folder" or None (always dataset[i])
    raw: Optional[RawFn]
    key_width: int
    storage_options: Dict[str, Any]


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _is_pil(x: Any) -> bool:
    image = sys.modules.get("PIL.Image")
    return image is not None and isinstance(x, image.Image)


def _is_array(x: Any) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "shape")


def _is_image(x: Any) -> bool:
    """PIL images, CxHxW tensors (uint8 or float), HxW/HxWxC uint8 arrays (C in 1, 3, 4)."""
    if _is_pil(x):
        return True
    if _is_tensor(x):
        shape = tuple(x.shape)
        if len(shape) == 3 and shape[0] in (1, 3, 4):
            return x.dtype.is_floating_point or str(x.dtype) == "torch.uint8"
        return len(shape) == 2 and str(x.dtype) == "torch.uint8"
    if _is_array(x):
        shape = x.shape
        return str(x.dtype) == "uint8" and (
            len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3, 4))
        )
    return False


def _channels(x: Any) -> int:
    if _is_tensor(x):
        return int(x.shape[0]) if x.ndim == 3 else 1
    return int(x.shape[2]) if x.ndim == 3 else 1


def _image_ext(x: Any, image_format: str) -> str:
    """``image_format``, or where JPEG (or PNG) can't hold the image losslessly, PNG (or TIFF)."""
    if image_format not in ("jpg", "png"):
        return image_format
    if not _is_pil(x):  # uint8 arrays: only an alpha channel keeps them from JPEG
        return "png" if image_format == "png" or _channels(x) == 4 else "jpg"
    mode = x.mode
    if mode == "P" and "transparency" in x.info:
        mode = "PA"
    if image_format == "jpg" and mode in _JPEG_MODES:
        return "jpg"
    return "png" if mode in _PNG_MODES else "tiff"


def _as_int(x: Any) -> Optional[int]:
    """An int label as int (also numpy ints and 0-d int arrays/tensors), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, numbers.Integral):
        return int(x)
    if _is_tensor(x) and x.ndim == 0:
        if not (x.dtype.is_floating_point or x.dtype.is_complex or str(x.dtype) == "torch.bool"):
            return int(x.item())
    elif _is_array(x) and x.ndim == 0 and x.dtype.kind in "iu":
        return int(x.item())
    return None


_MAGIC = (
    (b"\xff\xd8\xff", "jpg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
)


def _sniff(data: bytes) -> Optional[str]:
    """The image type the bytes themselves announce (jpg, png, webp), else None."""
    for magic, ext in _MAGIC:
        if data[: len(magic)] == magic:
            return ext
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def _auto_field(value: Any, position: int, cfg: _Config) -> Tuple[str, Any]:
    """The extension a tuple item's part is stored under, and the value to encode."""
    if type(value) is int:  # the common label, first
        return "cls", value
    if _is_image(value):
        return _image_ext(value, cfg.image_format), value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _sniff(bytes(value[:16])) or "bin", value
    label = _as_int(value)
    if label is not None:
        return "cls", label
    if isinstance(value, str):
        return "txt", value
    if isinstance(value, (Mapping, list, tuple)):
        return "json", value
    if isinstance(value, numbers.Real):
        return "json", float(value)
    if _is_tensor(value) or _is_array(value):
        return "npy", value
    raise EncodeError(
        f"don't know how to store part {position} of the item, a {type(value).__name__}; "
        "return a dict {extension: value} from __getitem__ (e.g. {'jpg': image, 'cls': label, "
        "'pth': obj}), or convert it to an image, int, str, dict or array"
    )


def _item_fields(item: Any, cfg: _Config) -> Dict[str, Any]:
    """A dataset item as ``{extension: value}``, not yet encoded."""
    if isinstance(item, Mapping):
        fields = {}
        for name, value in item.items():
            if not isinstance(name, str):
                raise EncodeError(
                    f"the item is a dict with a non-str key {name!r}; its keys must be "
                    "extensions such as 'jpg', 'cls', 'json'"
                )
            if not name.startswith("_") and value is not None:
                fields[name] = value
        return fields
    parts = list(item) if isinstance(item, (tuple, list)) else [item]
    fields = {}
    for position, value in enumerate(parts):
        if value is None:
            continue
        ext, value = _auto_field(value, position, cfg)
        if ext in fields:
            raise EncodeError(
                f"parts {list(fields).index(ext)} and {position} of the item would both be "
                f"stored as .{ext}; return a dict {{extension: value}} from __getitem__ to name "
                "the fields"
            )
        fields[ext] = value
    return fields


def _encode_field(field: str, value: Any, cfg: _Config) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if field == "cls" and type(value) is int:
        return str(value).encode("ascii")
    ext = field.lower().rsplit(".", 1)[-1]
    if ext in IMAGE_FORMATS and _is_image(value):
        fmt, options = IMAGE_FORMATS[ext]
        if fmt == "JPEG":
            options = {"quality": cfg.quality}
        return imageencoder(value, fmt, **options)
    # Everything else as webds's writer encodes it (cls digits, JSON, UTF-8, npy, ...).
    return encode_value(field, value, _HANDLERS)


_HANDLERS = default_handlers()


# -- raw (already encoded) files ---------------------------------------------------------------


def _unwrap(dataset: Any, i: int) -> Tuple[Any, int]:
    """Through ``torch.utils.data.Subset`` layers to the dataset that holds item ``i``."""
    while type(dataset).__name__ == "Subset" and hasattr(dataset, "indices"):
        i = int(dataset.indices[i])
        dataset = dataset.dataset
    return dataset, i


def _is_folder_dataset(dataset: Any) -> bool:
    """An ImageFolder/DatasetFolder whose items are just its files decoded."""
    base, _ = _unwrap(dataset, 0) if len(dataset) else (dataset, 0)
    samples = getattr(base, "samples", None)
    if not isinstance(samples, Sequence) or len(samples) == 0:
        return False
    first = samples[0]
    if not (
        isinstance(first, (tuple, list))
        and len(first) == 2
        and isinstance(first[0], (str, os.PathLike))
    ):
        return False
    if getattr(base, "transform", None) is not None:
        return False  # the items are transformed images: store those, not the files
    loader = getattr(base, "loader", None)
    return loader is None or getattr(loader, "__name__", "") in _PLAIN_LOADERS


def _file_ext(path: str, data: bytes) -> str:
    sniffed = _sniff(data[:16])
    if sniffed is not None:
        return sniffed
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return "jpg" if ext == "jpeg" else (ext or "bin")


def _read_file(path: str) -> Tuple[str, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    return _file_ext(path, data), data


def _folder_fields(dataset: Any, i: int, cfg: _Config) -> Dict[str, Any]:
    base, j = _unwrap(dataset, i)
    path, target = base.samples[j]
    transform = getattr(base, "target_transform", None)
    if transform is not None:
        target = transform(target)
    ext, data = _read_file(os.fspath(path))
    fields: Dict[str, Any] = {ext: data}
    if target is not None:
        label = _as_int(target)
        if label is None:
            extra, value = _auto_field(target, 1, cfg)
            fields[extra] = value
        else:
            fields["cls"] = label
    return fields


def _raw_mode(dataset: Any, raw: Optional[RawFn], reencode: bool) -> Optional[str]:
    if raw is not None:
        return "user"
    if reencode:
        return None
    if callable(getattr(dataset, "__webds_raw__", None)):
        return "hook"
    return "folder" if _is_folder_dataset(dataset) else None


def _raw_fields(dataset: Any, cfg: _Config, i: int) -> Optional[Mapping[str, Any]]:
    if cfg.raw_mode == "user":
        assert cfg.raw is not None
        return cfg.raw(dataset, i)
    if cfg.raw_mode == "hook":
        return dataset.__webds_raw__(i)
    if cfg.raw_mode == "folder":
        return _folder_fields(dataset, i, cfg)
    return None


def _sample(dataset: Any, cfg: _Config, i: int, key: str) -> Dict[str, Any]:
    """Item ``i`` as a sample of encoded fields; errors name the item (the caller adds the
    shard)."""
    try:
        fields = _raw_fields(dataset, cfg, i)
        if fields is None:
            fields = _item_fields(dataset[i], cfg)
        elif not isinstance(fields, Mapping):
            raise EncodeError(
                f"the raw fields of an item must be a dict {{extension: bytes}} or None, got "
                f"{type(fields).__name__}"
            )
    except EncodeError as exn:
        raise EncodeError(f"dataset item {i}: {exn.message}", key=key) from exn
    except Exception as exn:
        raise SampleError(f"loading dataset item {i} failed: {_describe(exn)}", key=key) from exn
    sample: Dict[str, Any] = {"__key__": key}
    for field, value in fields.items():
        if field.startswith("_") or value is None:
            continue
        try:
            sample[field] = _encode_field(field, value, cfg)
        except Exception as exn:
            detail = exn.message if isinstance(exn, WebdsError) else _describe(exn)
            raise EncodeError(
                f"encoding field {field!r} of dataset item {i} failed: {detail}",
                member=f"{key}.{field}",
                key=key,
            ) from exn
    return sample


def _stored_size(sample: Mapping[str, Any]) -> int:
    """Bytes the sample takes in a tar: a header and the padded data per field."""
    total = 0
    for field, value in sample.items():
        if field != "__key__":
            total += _BLOCK + -(-len(value) // _BLOCK) * _BLOCK
            if len(sample["__key__"]) + len(field) + 1 > 100:
                total += 3 * _BLOCK  # a pax header for the long name
    return total


# -- keys ------------------------------------------------------------------------------------


def _folder_paths(dataset: Any) -> Optional[List[str]]:
    """The file path of every item of a folder dataset, in dataset order, else None."""
    if not (hasattr(dataset, "__webds_raw__") or _is_folder_dataset(dataset)):
        return None
    try:
        paths = []
        for i in range(len(dataset)):
            base, j = _unwrap(dataset, i)
            paths.append(os.fspath(base.samples[j][0]))
    except (AttributeError, TypeError, IndexError, KeyError):
        return None
    return paths


def _stem_keys(paths: Sequence[str]) -> Tuple[Optional[List[str]], str]:
    """File stems as keys (dots -> ``_``), or None with the reason they can't be."""
    keys = [os.path.splitext(os.path.basename(p))[0].replace(".", "_") for p in paths]
    seen: Dict[str, str] = {}
    for key, path in zip(keys, paths):
        try:
            check_key(key)
        except EncodeError as exn:
            return None, f"{path!r}: {exn.message}"
        if key in seen:
            return None, f"{seen[key]!r} and {path!r} have the same stem {key!r}"
        seen[key] = path
    return keys, ""


def _plan_keys(dataset: Any, keys: KeysSpec, n: int) -> Optional[List[str]]:
    """Every item's key, or None for the default ``f"{i:08d}"`` (computed where needed)."""
    if keys is None or keys == "stem":
        paths = _folder_paths(dataset)
        if paths is None:
            if keys == "stem":
                raise ArgumentError(
                    "keys='stem' needs a folder dataset (an ImageFolder or anything with "
                    "samples = [(path, target)]); use keys='index' or a function keys(i)"
                )
            return None
        stems, why = _stem_keys(paths)
        if stems is None and keys == "stem":
            raise ArgumentError(f"keys='stem': file stems can't be the keys: {why}")
        return stems
    if keys == "index":
        return None
    if callable(keys):
        out: List[str] = []
        seen: Dict[str, int] = {}
        for i in range(n):
            key = keys(i)
            try:
                check_key(key)
            except EncodeError as exn:
                raise ArgumentError(f"keys({i}) returned a bad key: {exn.message}") from None
            if key in seen:
                raise ArgumentError(f"keys({seen[key]}) and keys({i}) both returned {key!r}")
            seen[key] = i
            out.append(key)
        return out
    raise ArgumentError(
        f"keys must be None, 'index', 'stem' or a function keys(i) -> str, got {keys!r}"
    )


def _index_key(cfg: _Config, i: int) -> str:
    """The default key of item ``i``: its index, zero-padded to one width for the dataset."""
    return f"{i:0{cfg.key_width}d}"
