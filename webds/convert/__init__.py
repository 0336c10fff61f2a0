"""Packing existing datasets into shards: any map-style dataset (:func:`pack`), image folders
(:func:`pack_folder`), ImageNet's tar of tars (:mod:`webds.convert.imagenet`), long videos cut
into clip shards (:func:`pack_clips`).

Modules: ``packing`` (:func:`pack`: the plan, resume, the index), ``items`` (a dataset item as
a sample), ``workers`` (writing the planned shards), ``folders`` (image folders,
``classes.json``), ``tarstream`` (a tar's members as streams, for tars inside a tar),
``imagenet`` with ``imagenet_shuffle`` and ``imagenet_labels``, ``clips`` (one video into
clips at keyframes) and ``clipshards`` (:func:`pack_clips`).

Nothing here imports torch. The public names load on first use (PEP 562 ``__getattr__``) from
the module named in ``_EXPORTS``; no submodule has the name of a function, so
``webds.convert.pack`` is always the function.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, List

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, _EXPORTS and __getattr__
    from .clips import VIDEO_EXTENSIONS, VideoClip, clip_samples, split_video
    from .clipshards import ClipShardResult, pack_clips
    from .folders import IMAGE_SUFFIXES, ImageFolderFiles, pack_folder, write_classes
    from .packing import pack

#: Public name -> the module of this package that defines it.
_EXPORTS: Dict[str, str] = {
    "ClipShardResult": "clipshards",
    "IMAGE_SUFFIXES": "folders",
    "ImageFolderFiles": "folders",
    "pack": "packing",
    "pack_clips": "clipshards",
    "pack_folder": "folders",
    "split_video": "clips",
    "clip_samples": "clips",
    "VIDEO_EXTENSIONS": "clips",
    "VideoClip": "clips",
    "write_classes": "folders",
}

__all__ = [
    "ClipShardResult",
    "IMAGE_SUFFIXES",
    "ImageFolderFiles",
    "VIDEO_EXTENSIONS",
    "VideoClip",
    "clip_samples",
    "pack",
    "pack_clips",
    "pack_folder",
    "split_video",
    "write_classes",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))
