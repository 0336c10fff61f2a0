"""The benchmark data, built once per run (or kept with ``--data DIR`` and reused).

Images: JPEGs of about 100 KB (the size of an average ImageNet JPEG), made from the photos that
ship with scikit-image (``skimage.data``: public domain, no download): each image is a random crop
of one photo, resized to 448-640 pixels wide, sometimes mirrored, with a little film grain (the
photos are cleaner than camera JPEGs) and saved at quality 85-95. Without scikit-image the
sources are Fashion-MNIST images (examples/data/fashion-mnist) upscaled, which decode like
photos of the same size but compress differently (noted in the results). The label of an image
is the number of its source photo.

The same images are stored three ways::

    DIR/images/files/000000.jpg ...  + labels.csv   one file per sample (the tutorial's baseline)
    DIR/images/images.zip                           the same files in one zip (stored, not deflated)
    DIR/images/shards/img-000000.tar ...            webds.ShardWriter, 100 samples per shard

and a small-record set (1-2 KB samples: ``bin`` random bytes + ``cls``) as
``DIR/small/small-000000.tar ...`` (10,000 samples per shard), as webdataset's ShardWriter writes
them (``wds-small-000000.tar ...``, when webdataset is installed), and one file per sample
(``DIR/small/files/00000000.bin ...`` + labels.csv).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import random
import shutil
import struct
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .harness import ROOT, package_version, stderr

FASHION = ROOT / "examples" / "data" / "fashion-mnist"

#: Photos bundled with scikit-image (no download needed); grey ones are converted to RGB.
PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "immunohistochemistry",
    "hubble_deep_field",
    "retina",
    "camera",
    "moon",
    "grass",
    "gravel",
    "brick",
    "coins",
    "cell",
    "clock",
    "colorwheel",
)

IMAGES_PER_SHARD = 100
SMALL_PER_SHARD = 10_000
#: Bump when the way data is made changes, so a kept --data folder is rebuilt.
DATA_VERSION = 3  # 2: the small records also as webdataset writes them; 3: and as files


# -- Fashion-MNIST (also used by bench_pack.py and bench_imagenet.py) ----------------------------


def read_idx(path: Path) -> np.ndarray:
    """An idx file (gzip) as a uint8 array: images (n, rows, cols) or labels (n,)."""
    data = gzip.decompress(path.read_bytes())
    magic, n = struct.unpack(">II", data[:8])
    if magic == 2051:
        rows, cols = struct.unpack(">II", data[8:16])
        return np.frombuffer(data, np.uint8, offset=16).reshape(n, rows, cols)
    return np.frombuffer(data, np.uint8, offset=8)


def fashion_images() -> np.ndarray:
    """The 10,000 Fashion-MNIST test images, (10000, 28, 28) uint8."""
    return read_idx(FASHION / "t10k-images-idx3-ubyte.gz")


def fashion_labels() -> np.ndarray:
    return read_idx(FASHION / "t10k-labels-idx1-ubyte.gz")


# -- source photos and JPEGs ----------------------------------------------------------------------


def photo_source() -> Tuple[str, str]:
    """(source name, note): scikit-image's photos if installed, else upscaled Fashion-MNIST."""
    try:
        import skimage.data  # noqa: F401
    except ImportError:
        return (
            "fashion-mnist",
            "scikit-image is not installed: the JPEGs are upscaled Fashion-MNIST images, whose "
            "sizes and decode costs differ from photos (pip install scikit-image)",
        )
    return f"scikit-image {package_version('scikit-image')} photos", ""


def load_photos(source: str) -> List[Any]:
    """The source images as RGB PIL images."""
    from PIL import Image

    if source.startswith("scikit-image"):
        import skimage.data

        photos = []
        for name in PHOTOS:
            a = getattr(skimage.data, name)()
            if a.dtype != np.uint8:
                a = (np.clip(a, 0, 1) * 255).astype(np.uint8)
            photos.append(Image.fromarray(a).convert("RGB"))
        return photos
    pixels = fashion_images()
    # 16 "photos" of 4x4 tiles of clothes, 448x448: big enough to crop like the photos.
    photos = []
    for p in range(16):
        tiles = pixels[p * 16 : p * 16 + 16].reshape(4, 4, 28, 28).transpose(0, 2, 1, 3)
        image = Image.fromarray(np.ascontiguousarray(tiles).reshape(112, 112))
        photos.append(image.resize((448, 448), Image.BICUBIC).convert("RGB"))
    return photos


_PHOTOS: List[Any] = []


def _init_worker(source: str) -> None:
    _PHOTOS[:] = load_photos(source)


def make_jpeg(i: int, seed: int = 0) -> Tuple[bytes, int]:
    """Image ``i``: (JPEG bytes, label); the same bytes for the same (i, seed)."""
    from PIL import Image

    rng = np.random.default_rng([seed, i])
    label = i % len(_PHOTOS)
    photo = _PHOTOS[label]
    w, h = photo.size
    s = rng.uniform(0.4, 1.0)
    cw, ch = int(w * s), int(h * s)
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    tw = int(rng.choice([448, 512, 640]))
    th = int(tw * rng.choice([0.75, 0.66, 1.0]))
    image = photo.resize((tw, th), Image.BICUBIC, box=(x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    grain = rng.normal(0, rng.uniform(8, 16), (th, tw, 1)).astype(np.int16)
    pixels = np.clip(np.asarray(image, np.int16) + grain, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=int(rng.integers(85, 96)))
    return out.getvalue(), label


def _make_chunk(args: Tuple[int, int, int]) -> List[Tuple[bytes, int]]:
    start, stop, seed = args
    return [make_jpeg(i, seed) for i in range(start, stop)]


def make_jpegs(n: int, source: str, seed: int = 0, workers: int = 0) -> List[Tuple[bytes, int]]:
    """``n`` images (JPEG bytes, label), made on ``workers`` processes (0: all CPUs)."""
    workers = workers or os.cpu_count() or 1
    chunks = [(s, min(n, s + 50), seed) for s in range(0, n, 50)]
    if workers == 1 or n <= 50:
        _init_worker(source)
        return [item for chunk in chunks for item in _make_chunk(chunk)]
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(source,)) as pool:
        return [item for chunk in pool.map(_make_chunk, chunks) for item in chunk]


# -- the data folder ----------------------------------------------------------------------------


class Data:
    """Paths of the built data, and what it holds."""

    def __init__(self, root: Path, meta: Dict[str, Any]) -> None:
        self.root = root
        self.meta = meta
        self.files = root / "images" / "files"
        self.zip = root / "images" / "images.zip"
        self.shards = root / "images" / "shards"
        self.small = root / "small"
        self.small_files = root / "small" / "files"

    @property
    def n_images(self) -> int:
        return int(self.meta["images"]["count"])

    @property
    def n_small(self) -> int:
        return int(self.meta["small"]["count"])

    def image_shards(self, n: Optional[int] = None) -> List[str]:
        """The shards holding the first ``n`` images (``n`` a multiple of the shard size)."""
        n = self.n_images if n is None else n
        k = -(-n // IMAGES_PER_SHARD)
        return [str(self.shards / f"img-{s:06d}.tar") for s in range(k)]

    def small_shards(self) -> List[str]:
        k = -(-self.n_small // SMALL_PER_SHARD)
        return [str(self.small / f"small-{s:06d}.tar") for s in range(k)]

    def small_shards_wds(self) -> List[str]:
        """The same small records written by webdataset's TarWriter (a pax header per member,
        as most users' shards have), or [] when webdataset was not installed at build time."""
        k = -(-self.n_small // SMALL_PER_SHARD)
        paths = [self.small / f"wds-small-{s:06d}.tar" for s in range(k)]
        return [str(p) for p in paths] if all(p.exists() for p in paths) else []

    def link_shards(self, count: int, samples: int) -> List[str]:
        """``count`` shards of ``samples`` random 105 KB records (8.4 MB with 80), for the slow
        link workload; made on first use (and kept with ``--data``)."""
        import webds

        folder = self.root / "link" / f"{count}x{samples}"
        paths = [folder / f"link-{i:06d}.tar" for i in range(count)]
        if not all(p.exists() for p in paths):
            folder.mkdir(parents=True, exist_ok=True)
            rng = random.Random(count * 1000 + samples)
            blob = os.urandom(1 << 20)
            for i, path in enumerate(paths):
                with webds.TarWriter(str(path)) as sink:
                    for j in range(samples):
                        start = rng.randrange(0, len(blob) - 105_000)
                        key = f"{i:04d}-{j:04d}"
                        sink.write({"__key__": key, "bin": blob[start : start + 105_000]})
        return [str(p) for p in paths]

    def image_files(self, n: Optional[int] = None) -> List[Path]:
        n = self.n_images if n is None else n
        return [self.files / f"{i:06d}.jpg" for i in range(n)]


def _wanted(n_images: int, n_small: int, source: str) -> Dict[str, Any]:
    return {"version": DATA_VERSION, "source": source, "n_images": n_images, "n_small": n_small}


def build(root: Path, n_images: int, n_small: int, seed: int = 0) -> Data:
    """Build (or reuse, when ``root/meta.json`` says it holds the same) the benchmark data."""
    import webds

    source, note = photo_source()
    wanted = _wanted(n_images, n_small, source)
    meta_path = root / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("wanted") == wanted:
            stderr(f"reusing the data in {root}")
            return Data(root, meta)
    for sub in ("images", "small"):
        shutil.rmtree(root / sub, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    data = Data(root, {"images": {"count": n_images}, "small": {"count": n_small}})
    stderr(f"building {n_images} JPEGs from {source} and {n_small} small records in {root} ...")
    images = make_jpegs(n_images, source, seed)
    sizes = [len(b) for b, _ in images]

    data.files.mkdir(parents=True)
    labels_csv = "".join(f"{i:06d}.jpg,{label}\n" for i, (_, label) in enumerate(images))
    for i, (jpg, _) in enumerate(images):
        (data.files / f"{i:06d}.jpg").write_bytes(jpg)
    (data.files / "labels.csv").write_text(labels_csv)

    # The tutorial's packed format: the same files in one zip; JPEGs do not deflate, so stored.
    with zipfile.ZipFile(data.zip, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("labels.csv", labels_csv)
        for i, (jpg, _) in enumerate(images):
            zf.writestr(f"images/{i:06d}.jpg", jpg)

    data.shards.mkdir(parents=True)
    pattern = str(data.shards / "img-%06d.tar")
    with webds.ShardWriter(pattern, maxcount=IMAGES_PER_SHARD) as sink:
        for i, (jpg, label) in enumerate(images):
            sink.write({"__key__": f"{i:06d}", "jpg": jpg, "cls": label})
    del images

    data.small.mkdir(parents=True)
    rng = random.Random(seed)
    blob = os.urandom(1 << 16)
    small_bytes = 0
    records = small_records(n_small, rng, blob)
    with webds.ShardWriter(str(data.small / "small-%06d.tar"), maxcount=SMALL_PER_SHARD) as sink:
        for rec in records:
            small_bytes += len(rec["bin"])
            sink.write(rec)
    data.small_files.mkdir()
    for rec in records:
        (data.small_files / f"{rec['__key__']}.bin").write_bytes(rec["bin"])
    small_csv = "".join(f"{rec['__key__']}.bin,{rec['cls']}\n" for rec in records)
    (data.small_files / "labels.csv").write_text(small_csv)
    try:
        import webdataset
    except ImportError:
        webdataset = None
    if webdataset is not None:
        pattern = str(data.small / "wds-small-%06d.tar")
        with webdataset.ShardWriter(pattern, maxcount=SMALL_PER_SHARD, verbose=0) as sink:
            for rec in records:
                sink.write(rec)
    meta = {
        "wanted": wanted,
        "source": source,
        "source_note": note,
        "images": {
            "count": n_images,
            "mean_jpeg_bytes": sum(sizes) / len(sizes),
            "median_jpeg_bytes": float(np.median(sizes)),
            "p5_p95_jpeg_bytes": [float(x) for x in np.percentile(sizes, [5, 95])],
            "per_shard": IMAGES_PER_SHARD,
            "shard_bytes": sum(Path(p).stat().st_size for p in data.image_shards()),
            "zip_bytes": data.zip.stat().st_size,
        },
        "small": {
            "count": n_small,
            "mean_record_bytes": small_bytes / max(1, n_small),
            "per_shard": SMALL_PER_SHARD,
            "shard_bytes": sum(Path(p).stat().st_size for p in data.small_shards()),
        },
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    data.meta = meta
    return data


def small_records(n: int, rng: random.Random, blob: bytes) -> List[Dict[str, Any]]:
    """``n`` small samples: ``bin`` of 1-2 KB (random bytes, so nothing compresses) + ``cls``."""
    out = []
    for i in range(n):
        size = rng.randint(1024, 2048)
        start = rng.randint(0, len(blob) - size)
        out.append({"__key__": f"{i:08d}", "bin": blob[start : start + size], "cls": i % 10})
    return out


def read_labels(text: str) -> Dict[str, int]:
    return {name: int(label) for name, label in csv.reader(io.StringIO(text))}
