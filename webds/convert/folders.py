"""Image folders: :class:`ImageFolderFiles` (an ImageFolder-style tree ``DIR/CLASS/IMAGE`` as a
dataset, without torchvision), :func:`pack_folder` (such a tree into shards) and
:func:`write_classes` (the ``classes.json`` written beside the shards, also by the ImageNet
converter).

    webds.pack_folder("photos/train", "shards/train-%06d.tar", maxcount=10000)
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ArgumentError
from ..io.urls import check_secure, local_path, make_parent_folder, open_url, url_scheme
from ..shards.index import ShardIndex
from .items import _read_file
from .packing import pack

__all__ = ["IMAGE_SUFFIXES", "ImageFolderFiles", "pack_folder", "write_classes"]

log = logging.getLogger("webds")

#: The image files an ImageFolder holds (torchvision's ``IMG_EXTENSIONS``), any case.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


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
        check_secure(root)  # a local folder, listed and read: refused in secure mode
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
    make_parent_folder(url)
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
