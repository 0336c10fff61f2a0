"""The contestants: datasets, pipelines and the bare baselines the suite measures.

- :class:`FileDataset`: one JPEG file per sample plus one labels.csv, a map-style ``Dataset``
  (the way PyTorch's custom-dataset tutorial reads images);
- :class:`ZipDataset`: the same files in one zip, one ``ZipFile`` handle per worker process
  (the packed dataset of the tutorial that motivated this suite);
- webds and webdataset pipelines over the same shards;
- the bare baselines: :func:`bare_read_samples` (a 512-byte-header loop over the whole shard in
  memory, grouping members into samples, no checks: about the ceiling of pure Python),
  :func:`bare_write` (ustar headers built by hand), and :func:`decode_augment_loop` (PIL decode
  + augment + to-tensor + batching over bytes read beforehand, no loader at all).

The image work is the same everywhere: decode (PIL), a RandomResizedCrop-style augment to
224x224 (scale 0.08-1, aspect 3/4-4/3, bilinear) with a random horizontal flip, a float tensor
CHW in [0, 1], and batches stacked by torch.
"""

from __future__ import annotations

import io
import math
import os
import random
import threading
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .data import read_labels

BATCH = 32
SIZE = 224
_MTIME = 1_700_000_000

_rng = random.Random(0)


# -- the image work ---------------------------------------------------------------------------


def read_jpeg(data: bytes) -> Any:
    """Decode JPEG bytes to an RGB PIL image, as a hand-written loop would."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    if image.mode != "RGB":
        return image.convert("RGB")
    image.load()
    return image


def random_resized_crop(image: Any, size: int = SIZE, rng: random.Random = _rng) -> Any:
    """torchvision's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) plus a random flip, in PIL."""
    from PIL import Image

    w, h = image.size
    area = w * h
    log_lo, log_hi = math.log(3 / 4), math.log(4 / 3)
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
            break
    else:  # the fallback: the central square-ish crop
        cw = ch = min(w, h)
        x, y = (w - cw) // 2, (h - ch) // 2
    out = image.resize((size, size), Image.BILINEAR, box=(x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return out


def to_tensor(image: Any) -> Any:
    """HWC uint8 PIL image -> CHW float32 tensor in [0, 1] (torchvision's ToTensor)."""
    import torch

    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div_(255)


def augment(image: Any) -> Any:
    """The augment every image pipeline applies after decoding: crop, flip, to tensor."""
    return to_tensor(random_resized_crop(image))


def identity(x: Any) -> Any:
    return x


def collate(images: List[Any], labels: List[int]) -> Tuple[Any, Any]:
    import torch

    return torch.stack(images), torch.tensor(labels)


def batch_size_of(batch: Any) -> int:
    """Samples in a batch (a tuple whose last field is the labels)."""
    return len(batch[-1])


# -- map-style datasets -------------------------------------------------------------------------


class FileDataset:
    """``dataset[i]``: image file ``i`` as (JPEG bytes, label), or (tensor, label) with
    ``decode=True``. Labels come from one labels.csv read at construction."""

    def __init__(self, folder: Path, n: Optional[int] = None, decode: bool = False) -> None:
        labels = read_labels((Path(folder) / "labels.csv").read_text())
        names = sorted(labels)[:n]
        self.paths = [str(Path(folder) / name) for name in names]
        self.labels = [labels[name] for name in names]
        self.decode = decode

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Tuple[Any, int]:
        with open(self.paths[i], "rb") as f:
            data = f.read()
        if self.decode:
            return augment(read_jpeg(data)), self.labels[i]
        return data, self.labels[i]


class ZipDataset:
    """The same images in one zip. Each process opens its own ``ZipFile`` on first use (a
    handle shared across fork would share its file offset): the tutorial's per-worker handles."""

    def __init__(self, path: Path, n: Optional[int] = None, decode: bool = False) -> None:
        self.path = str(path)
        with zipfile.ZipFile(self.path) as zf:
            labels = read_labels(zf.read("labels.csv").decode())
        names = sorted(labels)[:n]
        self.names = [f"images/{name}" for name in names]
        self.labels = [labels[name] for name in names]
        self.decode = decode
        self._zf: Optional[zipfile.ZipFile] = None
        self._pid = -1

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_zf": None, "_pid": -1}

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> Tuple[Any, int]:
        if self._pid != os.getpid():
            self._zf = zipfile.ZipFile(self.path)
            self._pid = os.getpid()
        data = self._zf.read(self.names[i])  # type: ignore[union-attr]
        if self.decode:
            return augment(read_jpeg(data)), self.labels[i]
        return data, self.labels[i]


class MemoryDataset:
    """The first ``n`` images' JPEG bytes held in memory (read once, at construction; forked
    workers share them): ``dataset[i]`` decodes and augments with no file or shard I/O at all.
    In a DataLoader with workers it is about the best any loader can do on this machine: what
    is left is the image work and the batches' way to the main process."""

    def __init__(self, folder: Path, n: Optional[int] = None) -> None:
        files = FileDataset(folder, n)
        self.items = [(Path(p).read_bytes(), label) for p, label in zip(files.paths, files.labels)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Tuple[Any, int]:
        data, label = self.items[i]
        return augment(read_jpeg(data)), label


def iterate_map_style(dataset: Any) -> int:
    """Read every item of a map-style dataset in this process, no DataLoader: the raw rate."""
    n = 0
    for i in range(len(dataset)):
        dataset[i]
        n += 1
    return n


def data_loader(dataset: Any, workers: int, batch_size: int = BATCH) -> Any:
    """The tutorial's DataLoader: batches, workers, persistent workers, pin_memory with CUDA."""
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=torch.cuda.is_available(),
    )


def count_batches(loader: Iterable[Any], limit: Optional[int] = None) -> int:
    """Iterate a loader of (images, labels) batches; return the number of samples seen."""
    n = 0
    for k, batch in enumerate(loader):
        n += batch_size_of(batch)
        if limit is not None and k + 1 >= limit:
            break
    return n


def shutdown(loader: Any) -> None:
    """Stop a DataLoader's (or a WebLoader's) persistent workers now."""
    dl = getattr(loader, "loader", None)
    if dl is None:
        pipeline = getattr(loader, "pipeline", None)
        dl = pipeline[0] if pipeline else loader
    it = getattr(dl, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    if hasattr(dl, "_iterator"):
        dl._iterator = None


# -- webds and webdataset -----------------------------------------------------------------------


def library(name: str) -> Any:
    """``webds`` or ``webdataset``, imported."""
    if name == "webds":
        import webds

        return webds
    if name == "webdataset":
        import webdataset

        return webdataset
    raise ValueError(f"unknown library {name!r}")


def raw_dataset(lib: str, urls: Sequence[str], **kw: Any) -> Any:
    """The library's ``WebDataset`` over ``urls``, no decoding: samples as dicts of bytes."""
    return library(lib).WebDataset(list(urls), shardshuffle=False, **kw)


def raw_loader(lib: str, urls: Sequence[str], workers: Union[int, str], **kw: Any) -> Any:
    """The library's ``WebLoader`` over :func:`raw_dataset`, samples one by one."""
    return library(lib).WebLoader(
        raw_dataset(lib, urls, **kw), batch_size=None, num_workers=workers
    )


def peak_rss_growth(run: Callable[[], Any], every: float = 0.005) -> int:
    """How far this process's resident memory rose above its start while ``run()`` ran."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    start = peak = rss()
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.wait(every):
            peak = max(peak, rss())

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        run()
    finally:
        done.set()
        thread.join()
    return max(peak, rss()) - start


def image_dataset(
    lib: str, urls: Sequence[str], batch_size: int = BATCH, decoder: Any = "pil", **kw: Any
) -> Any:
    """``WebDataset(urls).decode("pil").to_tuple("jpg", "cls").map_tuple(augment).batched(B)``:
    the pipeline a user of either library writes (``decoder`` replaces ``"pil"``; ``kw`` go to
    the WebDataset)."""
    return (
        raw_dataset(lib, urls, **kw)
        .decode(decoder)
        .to_tuple("jpg", "cls")
        .map_tuple(augment, identity)
        .batched(batch_size)
    )


def flip_to_tensor(image: Any, rng: random.Random = _rng) -> Any:
    """The rest of the recipe after a fused crop decoder: a random horizontal flip of an HxWx3
    uint8 array, then a float tensor CHW in [0, 1] (as :func:`augment` ends)."""
    import torch

    if rng.random() < 0.5:
        image = image[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float().div_(255)


def crop_dataset(urls: Sequence[str], batch_size: int = BATCH, **kw: Any) -> Any:
    """webds's RandomResizedCrop recipe with the fused decoder:
    ``decode(RandomResizedCropDecoder(224))`` + flip + float tensor + ``batched(B)``."""
    import webds

    return (
        raw_dataset("webds", urls)
        .decode(webds.RandomResizedCropDecoder(SIZE, **kw))
        .to_tuple("jpg", "cls")
        .map_tuple(flip_to_tensor, identity)
        .batched(batch_size)
    )


def web_loader(
    lib: str, urls: Sequence[str], workers: int, batch_size: int = BATCH, **kw: Any
) -> Any:
    """The library's ``WebLoader`` over :func:`image_dataset` (batched in the workers); ``kw``
    goes to the WebLoader."""
    import torch

    return library(lib).WebLoader(
        image_dataset(lib, urls, batch_size),
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=torch.cuda.is_available(),
        **kw,
    )


def count(items: Iterable[Any]) -> int:
    n = 0
    for _ in items:
        n += 1
    return n


# -- the bare baselines -------------------------------------------------------------------------


def read_shard_bytes(paths: Sequence[str], samples: int) -> int:
    """The I/O ceiling of any shard reader: every byte of the shards brought into this process
    (1 MiB reads into one reused buffer), nothing parsed, no sample made. Returns ``samples``,
    the number the shards hold, so that its rate compares with the readers'."""
    buf = bytearray(1 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return samples


def bare_read_samples(paths: Sequence[str]) -> int:
    """The bare Python reader: each shard read whole, then :func:`bare_parse`."""
    n = 0
    for path in paths:
        with open(path, "rb") as f:
            n += bare_parse(f.read(), path)
    return n


def bare_parse(buf: bytes, url: str = "") -> int:
    """A loop over the 512-byte headers of a tar in memory, grouping members into sample dicts
    by the part of the name before the first dot; returns the sample count. No checks at all
    (no checksums, pax, long names, errors): roughly the ceiling of a pure-Python reader."""
    n = 0
    pos, end = 0, len(buf) - 512
    cur: Optional[Dict[str, Any]] = None
    cur_key = None
    while pos <= end:
        hdr = buf[pos : pos + 512]
        if hdr[0] == 0:
            break
        size = int(hdr[124:136].rstrip(b" \0") or b"0", 8)
        name = hdr[:100].partition(b"\0")[0].decode()
        data = buf[pos + 512 : pos + 512 + size]
        pos += 512 + ((size + 511) & -512)
        key, _, ext = name.partition(".")
        if key != cur_key:
            if cur is not None:
                n += 1
            cur_key = key
            cur = {"__key__": key, "__url__": url}
        cur[ext] = data  # type: ignore[index]
    if cur is not None:
        n += 1
    return n


# Everything of a ustar header after the name, but size and checksum, for regular files.
_HDR_MODE = b"0000644\0" + b"0000000\0" * 2
_HDR_TAIL = (
    b"%011o\0" % _MTIME
    + b" " * 8
    + b"0"
    + b"\0" * 100
    + b"ustar\x0000"
    + b"bigdata".ljust(32, b"\0") * 2
    + b"0000000\0" * 2
    + b"\0" * 155
    + b"\0" * 12
)


def bare_header(name: bytes, size: int) -> bytes:
    """A ustar header for a short ASCII name, by hand (what a minimal writer does)."""
    hdr = name.ljust(100, b"\0") + _HDR_MODE + b"%011o\0" % size + _HDR_TAIL
    return hdr[:148] + b"%06o\0 " % sum(hdr) + hdr[156:]


def bare_write(path: str, samples: Iterable[Dict[str, Any]]) -> int:
    """The bare writer: one tar, members ``key.ext`` with hand-made headers; ints and strs
    encoded as text; returns the sample count. No checks (the ceiling for a Python writer)."""
    n = 0
    with open(path, "wb") as f:
        for sample in samples:
            key = sample["__key__"]
            parts = []
            for ext, value in sample.items():
                if ext[0] == "_":
                    continue
                if isinstance(value, int):
                    value = b"%d" % value
                elif isinstance(value, str):
                    value = value.encode()
                size = len(value)
                parts += (bare_header(f"{key}.{ext}".encode(), size), value, b"\0" * (-size % 512))
            f.write(b"".join(parts))
            n += 1
        f.write(b"\0" * 1024)
    return n


def decode_augment_loop(items: Sequence[Tuple[bytes, int]], batch_size: int = BATCH) -> int:
    """Decode + augment + to-tensor + batch over bytes already in memory: no loader, no files.
    The floor any image pipeline pays; the loaders' overhead is measured against it."""
    n = 0
    images: List[Any] = []
    labels: List[int] = []
    for data, label in items:
        images.append(augment(read_jpeg(data)))
        labels.append(label)
        if len(images) == batch_size:
            n += batch_size_of(collate(images, labels))
            images, labels = [], []
    if images:
        n += batch_size_of(collate(images, labels))
    return n
