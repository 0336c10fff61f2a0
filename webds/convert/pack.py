"""Packing existing datasets into shards: :func:`pack` (any map-style dataset) and
:func:`pack_folder` (an ImageFolder-style tree: one subfolder of images per class).

    index = webds.pack(torchvision.datasets.FashionMNIST(root), "out/fmnist-%06d.tar")
    WebDataset("out/fmnist.index.json").decode("pil").to_tuple("png;jpg", "cls")

What an item becomes (``dataset[i]``):

- a dict ``{ext: value}``: one field per key (keys starting with ``_`` are left out);
- a tuple ``(input, label)`` or ``(input, label, extra)`` (or a single value): each part is
  stored under the extension its type calls for. An image (PIL image, a CxHxW tensor uint8 or
  float in [0, 1], an HxW/HxWxC uint8 array) is encoded as ``image_format`` (``"jpg"`` or
  ``"png"``); what JPEG can't hold goes to PNG (RGBA, LA, palette images with transparency,
  bilevel ``1``, 16-bit ``I;16``), and what PNG can't hold either to TIFF (32-bit ``I``, float
  ``F``). An int (numpy or 0-d tensor too) -> ``cls``; a str -> ``txt``; a dict, list or
  float -> ``json``; other arrays and tensors -> ``npy``; bytes are kept as they are
  (``jpg``/``png``/``webp`` when the bytes say so, else ``bin``); None is left out.

Files that are already encoded are never decoded and encoded again (``reencode=True`` forces it):

- a torchvision ``ImageFolder``/``DatasetFolder`` (anything with ``samples = [(path, target)]``,
  no ``transform`` and torchvision's default image ``loader``, also inside a ``Subset``): each
  file's bytes are stored unchanged, under its own type (``jpg`` for .jpg/.jpeg/.JPEG, ``png``,
  ...; the bytes decide between jpg, png and webp when the name says otherwise), with ``cls``;
- a dataset with a method ``__webds_raw__(i)`` returning a dict of fields (bytes stored as they
  are), or None to fall back to ``dataset[i]``; or ``raw=fn`` with ``fn(dataset, i)`` alike.

Keys are ``f"{i:08d}"`` of the dataset index, or the file stems of a folder dataset when those are
unique (and usable as keys); ``keys="index"``, ``keys="stem"`` or ``keys=fn(i) -> str`` choose.

The shards are planned before anything is written, so that parallel workers and reruns agree:
the indices in a random order from ``seed`` (``shuffle=False``: in order), cut into equal
shards (sizes differ by at most one) of at most ``maxcount`` samples. ``maxsize`` (bytes of the
shard file) lowers that count: a pilot of up to 128 samples spread over the dataset is encoded
first and the count is set from their mean size (with 5% to spare, rounded down to two
significant digits so that a rerun plans the same shards). Shards are never split afterwards;
one that still comes out over ``maxsize`` gets a warning.

Shards are written by ``workers`` processes (default: one per CPU; ``0``: in this process), the
dataset going to each of them (inherited through fork on Linux, pickled elsewhere). Each shard
appears under its name only once complete, so after a crash or an error a rerun with the same
arguments writes only the shards still missing. Last comes the shard index (``index=True``:
:func:`~webds.index.default_index_name` of the pattern), listing every shard with its count,
size and sha256, and the plan under ``"pack"``; a rerun against an index whose plan differs
stops rather than mix two plans (``overwrite=True`` rewrites everything).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import multiprocessing as mp
import numbers
import os
import queue as queue_module
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..encode import IMAGE_FORMATS, default_handlers, encode_value, imageencoder
from ..errors import ArgumentError, EncodeError, OpenError, SampleError, WebdsError, WriteError
from ..index import ShardIndex, ShardInfo, default_index_name
from ..parallel import _describe, _make_parent
from ..urls import filesystem_options, local_path, open_url, url_scheme
from ..writer import TarWriter, check_key

__all__ = ["pack", "pack_folder", "ImageFolderFiles", "write_classes", "IMAGE_SUFFIXES"]

log = logging.getLogger("webds")

#: The image files an ImageFolder holds (torchvision's ``IMG_EXTENSIONS``), any case.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# The loaders that only decode the file: storing the file's bytes gives the same image back.
_PLAIN_LOADERS = {"default_loader", "pil_loader", "accimage_loader"}
_JPEG_MODES = {"L", "P", "RGB", "CMYK", "YCbCr"}  # bilevel "1" is better off as PNG
_PNG_MODES = {"1", "L", "LA", "P", "PA", "I;16", "RGB", "RGBA"}
_PILOT = 128
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


# -- writing shards (in workers) -------------------------------------------------------------


@dataclass(frozen=True)
class _Task:
    shard: int
    url: str
    indices: List[int]
    keys: Optional[List[str]]
    #: Only hash the existing shard (its index entry could not be reused).
    hash_only: bool = False


@dataclass(frozen=True)
class _Done:
    shard: int
    url: str
    samples: int
    bytes: Optional[int]
    sha256: Optional[str]


Report = Optional[Callable[[int, int], None]]


def _key(cfg: _Config, task: _Task, k: int) -> str:
    if task.keys is not None:
        return task.keys[k]
    return f"{task.indices[k]:0{cfg.key_width}d}"


def _run_task(dataset: Any, cfg: _Config, task: _Task, report: Report) -> _Done:
    if task.hash_only:
        size, sha = _hash_url(task.url, cfg.storage_options)
        return _Done(task.shard, task.url, len(task.indices), size, sha)
    _make_parent(task.url)
    last, unreported = time.monotonic(), 0
    with TarWriter(
        task.url, encoder=False, storage_options=cfg.storage_options, checksum=True
    ) as sink:
        for k, i in enumerate(task.indices):
            key = _key(cfg, task, k)
            try:
                sink.write(_sample(dataset, cfg, i, key))
            except WebdsError as exn:
                if exn.url is not None:
                    raise
                raise type(exn)(exn.message, url=task.url, member=exn.member, key=exn.key) from exn
            unreported += 1
            if report is not None and time.monotonic() - last > 0.2:
                report(task.shard, unreported)
                last, unreported = time.monotonic(), 0
    return _Done(task.shard, task.url, sink.count, sink.file_bytes, sink.sha256)


def _hash_url(url: str, storage_options: Mapping[str, Any]) -> Tuple[int, str]:
    sha, size = hashlib.sha256(), 0
    with open_url(url, "rb", **dict(storage_options)) as stream:
        while True:
            block = stream.read(1 << 20)
            if not block:
                break
            sha.update(block)
            size += len(block)
    return size, sha.hexdigest()


_WORKER: Dict[str, Any] = {}


def _init_worker(dataset: Any, cfg: _Config, progress: Any) -> None:
    _WORKER.update(dataset=dataset, cfg=cfg, progress=progress)


def _worker_task(task: _Task) -> _Done:
    progress = _WORKER["progress"]
    report = None if progress is None else (lambda shard, n: progress.put((shard, n)))
    return _run_task(_WORKER["dataset"], _WORKER["cfg"], task, report)


# -- the plan ----------------------------------------------------------------------------------


def _check_pattern(pattern: str, nshards: int) -> Callable[[int], str]:
    """The shard name of each shard number."""
    try:
        numbered = pattern % 0 != pattern % 1
    except (TypeError, ValueError):
        numbered = False
    if numbered:
        return lambda k: pattern % k
    if nshards > 1:
        raise ArgumentError(
            f"pattern {pattern!r} has no %-field (such as %06d) for the shard number, but "
            f"{nshards} shards are planned; add one, e.g. 'out/train-%06d.tar'"
        )
    try:
        single = pattern % () if "%" in pattern else pattern
    except (TypeError, ValueError) as exn:
        raise ArgumentError(f"bad shard name pattern {pattern!r}: {exn}") from None
    return lambda k: single


def _round_down(x: int) -> int:
    """Two significant digits: small changes in a pilot's mean give the same count."""
    if x < 100:
        return x
    unit = 10 ** (len(str(x)) - 2)
    return x // unit * unit


def _per_shard(
    dataset: Any,
    cfg: _Config,
    order: List[int],
    keys: Optional[List[str]],
    maxcount: int,
    maxsize: Optional[float],
) -> Tuple[int, Optional[float], List[Tuple[int, WebdsError]]]:
    """Samples per shard: ``maxcount``, lowered by ``maxsize`` over a pilot's mean size; and
    the pilot's failures (item, error), raised once the shard they belong to is known."""
    if maxsize is None:
        return maxcount, None, []
    n = len(order)
    m = min(n, _PILOT)
    total, measured = 0, 0
    failures: List[Tuple[int, WebdsError]] = []
    for j in range(m):
        i = order[j * n // m]
        key = keys[i] if keys is not None else f"{i:0{cfg.key_width}d}"
        try:
            total += _stored_size(_sample(dataset, cfg, i, key))
            measured += 1
        except WebdsError as exn:
            failures.append((i, exn))
            if len(failures) >= 3:
                break  # enough to report; the plan won't be used
    if not measured:
        return maxcount, None, failures
    mean = total / measured
    fits = int((maxsize - 2 * _BLOCK) / (mean * 1.05))
    return max(1, min(maxcount, _round_down(fits))), mean, failures


def _pilot_failure(
    failures: List[Tuple[int, WebdsError]], order: List[int], nshards: int, name: Any
) -> WebdsError:
    """The pilot's first failure, naming the shard its item belongs to."""
    i, exn = failures[0]
    n = len(order)
    position = order.index(i)
    shard = position * nshards // n
    while (shard + 1) * n // nshards <= position:
        shard += 1
    message = f"{exn.message} (found while measuring sample sizes, before writing any shard)"
    return type(exn)(message, url=name(shard), member=exn.member, key=exn.key)


def _existing_size(url: str, storage_options: Mapping[str, Any]) -> Optional[int]:
    """The size of the shard at ``url``, or None when there is none."""
    path = local_path(url)
    if path is not None:
        try:
            return os.path.getsize(path)
        except OSError:
            return None
    import fsspec

    fs, fspath = fsspec.core.url_to_fs(url, **filesystem_options(dict(storage_options)))
    fs.invalidate_cache(fspath)  # a listing cached earlier must not hide a new object
    try:
        return int(fs.info(fspath)["size"])
    except FileNotFoundError:
        return None


def _identity(url: str) -> str:
    path = local_path(url)
    return os.path.abspath(path) if path is not None else url


def _previous_index(
    index_url: Optional[str], plan: Dict[str, Any], overwrite: bool, opts: Dict[str, Any]
) -> Dict[str, ShardInfo]:
    """Entries of an index from an earlier run of the same plan, by shard identity."""
    if index_url is None or overwrite:
        return {}
    try:
        old = ShardIndex.load(index_url, opts)
    except OpenError:
        return {}
    except WebdsError as exn:
        log.warning("webds.pack: ignoring the unreadable index %s: %s", index_url, exn)
        return {}
    if old.extra.get("pack") != plan:
        raise ArgumentError(
            f"the shard index {index_url!r} describes shards packed another way "
            f"({old.extra.get('pack')!r}, now {plan!r}), so the shards there can't be reused; "
            "pass overwrite=True (webds pack-folder --overwrite) to write them all again, or "
            "write to another pattern"
        )
    return {_identity(s.url): s for s in old.shards}


# -- pack --------------------------------------------------------------------------------------


def pack(
    dataset: Any,
    pattern: Union[str, "os.PathLike[str]"],
    *,
    maxcount: int = 10000,
    maxsize: Optional[float] = 3e9,
    workers: Optional[int] = None,
    shuffle: bool = True,
    seed: int = 0,
    image_format: str = "jpg",
    quality: int = 95,
    keys: KeysSpec = None,
    raw: Optional[RawFn] = None,
    reencode: bool = False,
    storage_options: Optional[Mapping[str, Any]] = None,
    overwrite: bool = False,
    progress: bool = True,
    index: Union[bool, str, "os.PathLike[str]"] = True,
) -> ShardIndex:
    """Write a map-style dataset (``len`` and ``dataset[i]``) to shards named ``pattern % n``
    (a path or any fsspec URL) and return their :class:`~webds.index.ShardIndex`.

    See the module documentation for how items become fields, how encoded files are kept as
    they are, and how shards are planned. ``maxsize=None``: no size limit (and no pilot).
    ``workers``: processes (default one per CPU; 0 writes in this process). ``image_format``:
    ``"jpg"`` (JPEG at ``quality``) or ``"png"``, ``"webp"`` ... for images that need encoding.
    ``progress``: a bar of samples on stderr. ``index``: True writes the index beside the
    shards, a str is its path or URL, False writes none. A failing item raises the webds error
    naming the dataset index and the shard; completed shards are kept, and a rerun writes only
    the missing ones (``overwrite=True``: all)::

        webds.pack(ImageFolder("train/"), "s3://bucket/train-%06d.tar", storage_options=opts)
    """
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ArgumentError(
            f"pack needs a map-style dataset (with __len__ and __getitem__), got "
            f"{type(dataset).__name__}; write an iterable dataset with ShardWriter instead"
        )
    pattern = os.fspath(pattern)
    if not isinstance(pattern, str) or not pattern or pattern == "-":
        raise ArgumentError(
            f"pack needs a shard name pattern such as 'out/train-%06d.tar', got {pattern!r}"
        )
    if url_scheme(pattern) == "pipe":
        raise ArgumentError("pack writes shards in parallel and resumes; it can't write to pipe:")
    if isinstance(maxcount, bool) or not isinstance(maxcount, int) or maxcount < 1:
        raise ArgumentError(f"maxcount must be a positive int, got {maxcount!r}")
    if maxsize is not None and (
        isinstance(maxsize, bool) or not isinstance(maxsize, (int, float)) or not maxsize > 0
    ):
        raise ArgumentError(f"maxsize must be a positive number of bytes or None, got {maxsize!r}")
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 0
    ):
        raise ArgumentError(f"workers must be an int >= 0 (0: in this process), got {workers!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ArgumentError(f"seed must be an int, got {seed!r}")
    fmt = str(image_format).lower().lstrip(".")
    fmt = "jpg" if fmt == "jpeg" else fmt
    if fmt not in IMAGE_FORMATS or fmt in ("img", "image"):
        raise ArgumentError(
            f"image_format={image_format!r} is not an image type; use 'jpg' or 'png' (or webp, "
            "tiff, bmp, ppm)"
        )
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ArgumentError(f"quality must be an int from 1 to 100, got {quality!r}")
    if raw is not None and not callable(raw):
        raise ArgumentError(f"raw must be a function raw(dataset, i) -> dict or None, got {raw!r}")
    opts = dict(storage_options or {})
    if index is True:
        index_url: Optional[str] = default_index_name(pattern)
    elif index is False or index is None:
        index_url = None
    elif isinstance(index, (str, os.PathLike)) and os.fspath(index):
        index_url = os.fspath(index)
    else:
        raise ArgumentError(f"index must be True, False or a path/URL, got {index!r}")

    n = len(dataset)
    if n == 0:
        raise ArgumentError("the dataset is empty: nothing to pack")
    cfg = _Config(
        image_format=fmt,
        quality=quality,
        raw_mode=_raw_mode(dataset, raw, bool(reencode)),
        raw=raw,
        key_width=max(_INDEX_WIDTH, len(str(n - 1))),
        storage_options=opts,
    )
    all_keys = _plan_keys(dataset, keys, n)
    order = list(range(n))
    if shuffle:
        random.Random(seed).shuffle(order)
    per_shard, mean, failures = _per_shard(dataset, cfg, order, all_keys, maxcount, maxsize)
    nshards = -(-n // per_shard)
    name = _check_pattern(pattern, nshards)
    if failures:
        raise _pilot_failure(failures, order, nshards, name) from failures[0][1]
    plan = {
        "samples": n,
        "shards": nshards,
        "shuffle": bool(shuffle),
        "seed": seed if shuffle else None,
        "image_format": fmt,
        "quality": quality if fmt == "jpg" else None,
        "raw": cfg.raw_mode is not None,
    }
    previous = _previous_index(index_url, plan, bool(overwrite), opts)

    tasks: List[_Task] = []
    infos: List[Optional[ShardInfo]] = [None] * nshards
    for k in range(nshards):
        # Equal shards (sizes differ by at most one): even work per worker and per rank.
        indices = order[k * n // nshards : (k + 1) * n // nshards]
        url = name(k)
        shard_keys = None if all_keys is None else [all_keys[i] for i in indices]
        task = _Task(k, url, indices, shard_keys)
        if not overwrite:
            size = _existing_size(url, opts)
            if size is not None:
                old = previous.get(_identity(url))
                if old is not None and old.samples == len(indices) and old.bytes == size:
                    infos[k] = ShardInfo(url, len(indices), size, old.sha256)
                    continue
                task = _Task(k, url, indices, shard_keys, hash_only=True)
        tasks.append(task)
    if nshards > 1:
        stale = name(nshards)
        if _existing_size(stale, opts) is not None:
            log.warning(
                "webds.pack: %s is not part of this dataset (it has %d shards); it is left from "
                "an earlier run: delete it",
                stale,
                nshards,
            )

    done = _run_tasks(dataset, cfg, tasks, infos, workers, progress, pattern, n)
    for result in done:
        infos[result.shard] = ShardInfo(result.url, result.samples, result.bytes, result.sha256)
        if maxsize is not None and result.bytes is not None and result.bytes > maxsize:
            log.warning(
                "webds.pack: shard %s is %d bytes, more than maxsize=%d (%d samples per shard "
                "were planned from a pilot's mean of %.0f bytes); pass a smaller maxcount",
                result.url,
                result.bytes,
                maxsize,
                per_shard,
                mean or 0,
            )
    shards = [info for info in infos if info is not None]
    assert len(shards) == nshards
    result_index = ShardIndex(shards, extra={"pack": plan})
    if index_url is not None:
        result_index.save(index_url, opts)
    return result_index


def _run_tasks(
    dataset: Any,
    cfg: _Config,
    tasks: List[_Task],
    infos: List[Optional[ShardInfo]],
    workers: Optional[int],
    progress: bool,
    pattern: str,
    n: int,
) -> List[_Done]:
    from tqdm.auto import tqdm

    bar = tqdm(
        total=n,
        desc=f"packing {os.path.basename(pattern) or pattern}",
        unit=" samples",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        bar.update(sum(info.samples for info in infos if info is not None))
        if workers is None:
            workers = os.cpu_count() or 1
        workers = min(workers, len(tasks))
        if workers == 0:
            return _run_here(dataset, cfg, tasks, bar)
        return _run_pool(dataset, cfg, tasks, workers, bar, progress)
    finally:
        bar.close()


def _run_here(dataset: Any, cfg: _Config, tasks: List[_Task], bar: Any) -> List[_Done]:
    results = []
    for task in tasks:
        reported = 0

        def report(shard: int, k: int) -> None:
            nonlocal reported
            reported += k
            bar.update(k)

        try:
            result = _run_task(dataset, cfg, task, report)
        except Exception as exn:
            raise _failure([(task, exn)], len(results)) from exn
        bar.update(len(task.indices) - reported)
        results.append(result)
    return results


def _context() -> Any:
    # fork: the dataset is inherited, not pickled (fast, and works for datasets that can't
    # be pickled); elsewhere the platform's default, which pickles it once per worker.
    if sys.platform.startswith("linux"):
        return mp.get_context("fork")
    return mp.get_context()


def _run_pool(
    dataset: Any, cfg: _Config, tasks: List[_Task], workers: int, bar: Any, progress: bool
) -> List[_Done]:
    ctx = _context()
    updates = ctx.Queue() if progress else None
    pool = cf.ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(dataset, cfg, updates)
    )
    results: List[_Done] = []
    errors: List[Tuple[_Task, BaseException]] = []
    closed: set = set()  # shards done: their late progress messages count for nothing
    reported: Dict[int, int] = {}  # samples the bar has counted, per shard in progress
    try:
        futures = {pool.submit(_worker_task, task): task for task in tasks}
        pending = set(futures)
        while pending:
            finished, pending = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
            _drain(updates, reported, closed, bar)
            for future in finished:
                task = futures[future]
                if future.cancelled():
                    continue
                exn = future.exception()
                if exn is not None:
                    if not errors:
                        # Stop starting shards: the dataset is likely to fail again. Shards in
                        # progress finish, so a rerun has less to do.
                        for other in pending:
                            other.cancel()
                    errors.append((task, exn))
                    continue
                results.append(future.result())
                bar.update(len(task.indices) - reported.pop(task.shard, 0))
                closed.add(task.shard)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    if errors:
        raise _failure(errors, len(results)) from errors[0][1]
    return results


def _drain(updates: Any, reported: Dict[int, int], closed: set, bar: Any) -> None:
    if updates is None:
        return
    while True:
        try:
            shard, k = updates.get_nowait()
        except queue_module.Empty:
            return
        except (OSError, EOFError, ValueError):
            return
        if shard not in closed:
            reported[shard] = reported.get(shard, 0) + k
            bar.update(k)


def _failure(errors: List[Tuple[_Task, BaseException]], written: int) -> WebdsError:
    """The first shard's error, saying what was kept and what a rerun does."""
    task, exn = errors[0]
    more = f" ({len(errors) - 1} other shard(s) failed too)" if len(errors) > 1 else ""
    tail = (
        f"{more}; the {written} shard(s) completed in this run were kept and no partial shard "
        "was left: fix the problem and run again to write only the missing shards"
    )
    if isinstance(exn, WebdsError):
        try:
            return type(exn)(
                exn.message + tail,
                url=exn.url or task.url,
                member=exn.member,
                key=exn.key,
                offset=exn.offset,
            )
        except TypeError:  # a subclass with another constructor
            pass
    return WriteError(f"writing the shard failed: {_describe(exn)}{tail}", url=task.url)


# -- image folders ---------------------------------------------------------------------------


class ImageFolderFiles:
    """The image files of an ImageFolder-style tree (``DIR/CLASS/.../IMAGE``), as a map-style
    dataset: ``classes`` (sorted subfolder names), ``class_to_idx``, ``samples`` ([(path, class
    index)]) in torchvision's order, ``dataset[i]`` = (RGB PIL image, class index).

    Files are images by extension, any case (:data:`IMAGE_SUFFIXES`); hidden folders and files
    (names starting with ``.``, such as ``.ipynb_checkpoints``) are skipped. Needs no
    torchvision; :func:`pack` stores the files' own bytes.
    """

    def __init__(self, root: Union[str, "os.PathLike[str]"]) -> None:
        root = os.fspath(root)
        if url_scheme(root) is not None and local_path(root) is None:
            raise ArgumentError(
                f"pack_folder reads a local folder; {root!r} is a URL (copy it locally first)"
            )
        root = local_path(root) or root
        if not os.path.isdir(root):
            raise ArgumentError(f"{root!r} is not a folder; give the folder of class subfolders")
        self.root = root
        self.classes: List[str] = sorted(
            e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")
        )
        if not self.classes:
            raise ArgumentError(
                f"{root!r} has no class subfolders; an image folder is laid out as "
                "DIR/CLASS/IMAGE (e.g. train/cat/001.jpg, train/dog/002.jpg)"
            )
        self.class_to_idx: Dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self.samples: List[Tuple[str, int]] = []
        empty = []
        for name in self.classes:
            found = _images_under(os.path.join(root, name))
            if not found:
                empty.append(name)
            self.samples.extend((path, self.class_to_idx[name]) for path in found)
        if not self.samples:
            raise ArgumentError(
                f"no image files under {root!r} (looked for {' '.join(IMAGE_SUFFIXES)} in "
                "the class subfolders)"
            )
        if empty:
            log.warning(
                "webds: %d class folder(s) under %s hold no images (they keep their index): %s",
                len(empty),
                root,
                ", ".join(empty[:10]) + (" ..." if len(empty) > 10 else ""),
            )
        self.targets = [t for _, t in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Tuple[Any, int]:
        from PIL import Image

        path, target = self.samples[i]
        with open(path, "rb") as f:
            image = Image.open(f)
            return image.convert("RGB"), target

    def __webds_raw__(self, i: int) -> Dict[str, Any]:
        path, target = self.samples[i]
        ext, data = _read_file(path)
        return {ext: data, "cls": target}

    def __repr__(self) -> str:
        return f"<ImageFolderFiles {self.root!r}: {len(self)} images, {len(self.classes)} classes>"


def _images_under(folder: str) -> List[str]:
    found = []
    # Sorted walk, sorted names: torchvision's make_dataset order.
    for dirpath, dirnames, filenames in sorted(os.walk(folder, followlinks=True)):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for fname in sorted(filenames):
            if not fname.startswith(".") and fname.lower().endswith(IMAGE_SUFFIXES):
                found.append(os.path.join(dirpath, fname))
    return found


def _beside(pattern: str, name: str) -> str:
    """``name`` in the folder (or under the prefix) of the shard pattern."""
    if local_path(pattern) is not None:
        return os.path.join(os.path.dirname(local_path(pattern) or pattern), name)
    return pattern[: pattern.rfind("/") + 1] + name


def write_classes(
    pattern: str,
    classes: Sequence[str],
    storage_options: Optional[Mapping[str, Any]] = None,
) -> str:
    """Write ``classes.json`` (``{"classes": [...], "class_to_idx": {...}}``) beside the shards
    of ``pattern`` (atomically); return its path or URL."""
    url = _beside(os.fspath(pattern), "classes.json")
    doc = {"classes": list(classes), "class_to_idx": {c: i for i, c in enumerate(classes)}}
    text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    _make_parent(url)
    stream = open_url(url, "wb", **dict(storage_options or {}))
    try:
        stream.write(text.encode("utf-8"))
    except BaseException:
        discard = getattr(stream, "discard", None)
        if callable(discard):
            discard()
        raise
    stream.close()
    return url


def pack_folder(
    directory: Union[str, "os.PathLike[str]"],
    pattern: Union[str, "os.PathLike[str]"],
    **pack_kw: Any,
) -> ShardIndex:
    """Pack an ImageFolder-style tree (``DIR/CLASS/IMAGE``, see :class:`ImageFolderFiles`) into
    shards with :func:`pack` (``pack_kw``), storing each file's bytes unchanged with its class
    index as ``cls``, and write ``classes.json`` beside the shards::

        webds.pack_folder("imagenet/train", "shards/train-%06d.tar", maxcount=10000)
    """
    dataset = ImageFolderFiles(directory)
    index = pack(dataset, pattern, **pack_kw)
    write_classes(os.fspath(pattern), dataset.classes, pack_kw.get("storage_options"))
    return index
