"""Where clips go: the sampling of clip positions, and the seeding that makes the random draws a
function of (seed, epoch, shard, sample key, field), as the crop decoders' are, except that the
DataLoader worker and rank are left out: 0 or 2 workers, threads, or a resumed epoch give the
same clips of the same sample. Nothing here imports PyAV or torch.
"""

from __future__ import annotations

import copy
import random
import zlib
from typing import Any, Iterable, List, Mapping, Optional, Tuple, Union

from ..errors import ArgumentError

__all__ = ["SAMPLINGS", "SeededHandler", "clip_starts", "crop_origin"]

#: How clip positions are chosen: at random (independently, then sorted by time), evenly from
#: the first possible start to the last, or back to back around the middle.
SAMPLINGS = ("random", "uniform", "center")


def clip_starts(last: int, clips: int, width: int, sampling: str, rng: random.Random) -> List[int]:
    """Start positions (0..``last``, ascending) of ``clips`` clips each ``width`` long.

    clip_starts(100, 3, 10, "uniform", rng)   # [0, 50, 100]
    clip_starts(100, 3, 10, "center", rng)    # [35, 45, 55]: back to back at the middle
    """
    last = max(last, 0)
    if sampling == "random":
        return sorted(rng.randint(0, last) for _ in range(clips))
    if sampling == "uniform":
        if clips == 1:
            return [last // 2]
        return [int(round(c * last / (clips - 1))) for c in range(clips)]
    first = max((last - (clips - 1) * width) // 2, 0)
    return [min(first + c * width, last) for c in range(clips)]


def crop_origin(
    height: int, width: int, crop: Tuple[int, int], at_random: bool, rng: random.Random
) -> Tuple[int, int]:
    """(top, left) of a ``crop`` (height, width) of a ``height`` x ``width`` frame: drawn
    uniformly when ``at_random``, the centre otherwise (torchvision's CenterCrop rounding)."""
    ch, cw = crop
    if ch > height or cw > width:
        raise ArgumentError(f"crop {ch}x{cw} is larger than the {height}x{width} frames")
    if at_random:
        return rng.randint(0, height - ch), rng.randint(0, width - cw)
    return int(round((height - ch) / 2.0)), int(round((width - cw) / 2.0))


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


def pair(name: str, value: Any) -> Optional[Tuple[int, int]]:
    """None, or an int or (height, width) of positive ints as a pair."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (positive_int(name, value),) * 2
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return positive_int(name, value[0]), positive_int(name, value[1])
    raise ArgumentError(f"{name} must be an int or a (height, width) pair, got {value!r}")


def extension_set(extensions: Union[str, Iterable[str]]) -> frozenset:
    if isinstance(extensions, str):
        extensions = extensions.split()
    return frozenset(e.lower().lstrip(".") for e in extensions)


class SeededHandler:
    """A decode handler whose random draws repeat: the base of the clip decoders.

    A decode stage calls :meth:`bind_pass` once a pass (epoch) and uses the copy it returns;
    :meth:`rng` then gives each field its own generator, seeded from (seed, epoch, shard url,
    sample key, field). ``seed`` (the handler's own, else the pipeline's) None and no pipeline
    seed: fresh entropy, draws that do not repeat.
    """

    #: Decoder passes the sample as a third argument to handlers that say so (for its key).
    wants_sample = True
    #: Part of every derived seed: two kinds of handler on one field draw independently.
    _tag = "clips"

    def __init__(self, seed: Optional[int], extensions: Union[str, Iterable[str]]) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ArgumentError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed
        self.extensions = extension_set(extensions)
        self._pass: Optional[Tuple[int, int]] = None  # (seed, epoch), set by bind_pass

    def handles(self, key: str) -> bool:
        """Whether the field named ``key`` (``".mp4"``) is one this handler decodes."""
        return key.rsplit(".", 1)[-1].lower() in self.extensions

    def bind_pass(self, pipeline_seed: Optional[int], epoch: int) -> "SeededHandler":
        """The copy of this handler that one pass (epoch) of a decode stage uses."""
        bound = copy.copy(self)
        seed = self.seed if self.seed is not None else pipeline_seed
        bound._pass = None if seed is None else (seed, epoch)
        return bound

    def rng(self, key: str, data: bytes, sample: Optional[Mapping[str, Any]]) -> random.Random:
        """The generator that draws the clips of field ``key`` of ``sample``."""
        from ..base.workers import derive_seed

        if sample is not None and self._pass is not None:
            url, skey = sample.get("__url__"), sample.get("__key__")
            return random.Random(derive_seed(self._tag, *self._pass, url, skey, key))
        if self.seed is not None:
            return random.Random(derive_seed(self._tag, self.seed, zlib.crc32(data), key))
        return random.Random()
