"""Packing any map-style dataset into shards: :func:`pack`.

    index = webds.pack(torchvision.datasets.FashionMNIST(root), "out/fmnist-%06d.tar")
    WebDataset("out/fmnist.index.json").decode("pil").to_tuple("png;jpg", "cls")

What an item becomes, how files already encoded are kept as they are, and how keys are chosen:
:mod:`webds.convert.items`. How the shards are written: :mod:`webds.convert.workers`. Here: the
plan, made before anything is written so that parallel workers and reruns agree (the indices in
an order from ``seed``, cut into equal shards of at most ``maxcount`` samples, lowered by a
pilot's mean size under ``maxsize``), and the shard index written last, which records the plan
so that a rerun writes only the shards still missing and refuses another plan. The rules in
full: docs/convert.md, "Any map-style dataset".
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from ..base.redact import redact
from ..errors import ArgumentError, OpenError, WebdsError
from ..io.urls import existing_size, url_identity, url_scheme
from ..shards.index import ShardIndex, ShardInfo, default_index_name
from ..stages.encode import IMAGE_FORMATS
from ..tarwriter import is_numbered_pattern, single_shard_name
from .items import (
    _BLOCK,
    _INDEX_WIDTH,
    KeysSpec,
    RawFn,
    _Config,
    _index_key,
    _plan_keys,
    _raw_mode,
    _sample,
    _stored_size,
)
from .workers import _run_tasks, _Task

__all__ = ["pack"]

log = logging.getLogger("webds")

_PILOT = 128


# -- the plan ----------------------------------------------------------------------------------


def _check_pattern(pattern: str, nshards: int) -> Callable[[int], str]:
    """The shard name of each shard number."""
    if is_numbered_pattern(pattern):
        return lambda k: pattern % k
    if nshards > 1:
        raise ArgumentError(
            f"pattern {pattern!r} has no %-field (such as %06d) for the shard number, but "
            f"{nshards} shards are planned; add one, e.g. 'out/train-%06d.tar'"
        )
    single = single_shard_name(pattern)
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
        key = keys[i] if keys is not None else _index_key(cfg, i)
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
        log.warning("webds.pack: ignoring the unreadable index %s: %s", redact(index_url), exn)
        return {}
    if old.extra.get("pack") != plan:
        raise ArgumentError(
            f"the shard index {index_url!r} describes shards packed another way "
            f"({old.extra.get('pack')!r}, now {plan!r}), so the shards there can't be reused; "
            "pass overwrite=True (webds pack-folder --overwrite) to write them all again, or "
            "write to another pattern"
        )
    return {url_identity(s.url): s for s in old.shards}


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
    (a path or any fsspec URL) and return their :class:`~webds.shards.index.ShardIndex`.

    How items become fields and how encoded files are kept as they are:
    :mod:`webds.convert.items`; how shards are planned: :mod:`webds.convert.packing`.
    ``maxsize=None``: no size limit (and no pilot). ``workers``: processes (default one per CPU;
    0 writes in this process). ``image_format``: ``"jpg"`` (JPEG at ``quality``) or ``"png"``,
    ``"webp"`` ... for images that need encoding.
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
            size = existing_size(url, opts)
            if size is not None:
                old = previous.get(url_identity(url))
                if old is not None and old.samples == len(indices) and old.bytes == size:
                    infos[k] = ShardInfo(url, len(indices), size, old.sha256)
                    continue
                task = _Task(k, url, indices, shard_keys, hash_only=True)
        tasks.append(task)
    if nshards > 1:
        stale = name(nshards)
        if existing_size(stale, opts) is not None:
            log.warning(
                "webds.pack: %s is not part of this dataset (it has %d shards); it is left from "
                "an earlier run: delete it",
                redact(stale),
                nshards,
            )

    done = _run_tasks(dataset, cfg, tasks, infos, workers, progress, pattern, n)
    for result in done:
        infos[result.shard] = ShardInfo(result.url, result.samples, result.bytes, result.sha256)
        if maxsize is not None and result.bytes is not None and result.bytes > maxsize:
            log.warning(
                "webds.pack: shard %s is %d bytes, more than maxsize=%d (%d samples per shard "
                "were planned from a pilot's mean of %.0f bytes); pass a smaller maxcount",
                redact(result.url),
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
