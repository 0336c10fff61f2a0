"""Shards: which shards each rank and worker reads, in which order.

- :mod:`webds.shards.shardlists`: expanding URL patterns and prefixes, seeds, where this process
  is (:func:`worker_info`), splitting by node and worker, resampling; torch-free.
- :mod:`webds.shards.datasets`: :class:`SimpleShardList` and :class:`ResampledShards`, the shard
  lists that are torch ``IterableDataset`` s.
- :mod:`webds.shards.index`: the shard index (sample counts and checksums per shard).
- :mod:`webds.shards.plan`: epoch plans over an index (exact per-rank, per-worker shares).

The package serves the shard lists' names (``from webds.shards import SimpleShardList,
split_by_node``); the torch datasets are imported on first use, so importing it stays torch-free.
"""

from __future__ import annotations

from typing import Any, List

from ..base.workers import WorkerInfo, default_seed, derive_seed, worker_info
from .shardlists import (
    SHARD_SUFFIXES,
    expand_env,
    expand_urls,
    non_empty,
    resampled,
    single_node_only,
    split_by_node,
    split_by_worker,
)

__all__ = [
    "WorkerInfo",
    "worker_info",
    "derive_seed",
    "default_seed",
    "expand_urls",
    "expand_env",
    "SHARD_SUFFIXES",
    "SimpleShardList",
    "ResampledShards",
    "split_by_node",
    "split_by_worker",
    "single_node_only",
    "non_empty",
    "resampled",
]

_DATASETS = ("SimpleShardList", "ResampledShards", "ResampledShardList")


def __getattr__(name: str) -> Any:
    # The torch datasets, on first use: importing webds.shards stays torch-free.
    if name in _DATASETS:
        from . import datasets

        value = getattr(datasets, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_DATASETS))
