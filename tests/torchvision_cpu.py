"""Import torchvision on this project's CPU-only torch: the one place for that workaround.

The only torchvision that keeps torch 2.13.0 (0.28.0) is built for CUDA; on CPU torch its import
fails with ``operator torchvision::nms does not exist`` because its compiled ops are missing.
Declaring the two op schemas first makes the pure-Python parts (``transforms``) work;
``torchvision.io`` image decoding stays unavailable. webds itself never imports torchvision: this
is for tests (and notebooks) that show webdataset-style code using torchvision transforms.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def import_torchvision() -> ModuleType:
    """Return the ``torchvision`` module, declaring its missing ops first when needed."""
    import torch

    try:
        return importlib.import_module("torchvision")
    except RuntimeError as exn:
        if "torchvision::nms" not in str(exn):
            raise
    # The failed import left half-initialised modules behind; drop them before retrying.
    import sys

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _keep.append(lib)  # the definitions live as long as the Library object
    return importlib.import_module("torchvision")


_keep: list = []
