"""Packing existing datasets into shards: any map-style dataset (:func:`pack`), image folders
(:func:`pack_folder`), ImageNet's tar of tars.

Nothing here imports torch. Names of other modules of this package load on first use: each
module adds its names to ``_EXPORTS``.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List

# Imported now, not on first use: the function pack has the name of its module pack.py, and
# importing that submodule binds the package attribute "pack" to the module. Binding the
# function here, after that import, keeps webds.convert.pack the function.
from .pack import IMAGE_SUFFIXES, ImageFolderFiles, pack, pack_folder, write_classes

#: Public name -> the module of this package that defines it, for names loaded on first use.
_EXPORTS: Dict[str, str] = {}

__all__ = ["IMAGE_SUFFIXES", "ImageFolderFiles", "pack", "pack_folder", "write_classes"]
__all__ += sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))
