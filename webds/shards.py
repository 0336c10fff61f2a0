"""Shard lists: expanding URL patterns, shuffling and resampling shards, splitting them by node and
by DataLoader worker.

A shard list yields shard descriptors, ``{"url": ...}`` dicts, which the tar stages open.

``WDS_SEED``, when set, is the default seed of :class:`~webds.fluent.WebDataset`
(:func:`default_seed`).

Where each process is (:func:`worker_info`) comes from ``torch.distributed`` and
``torch.utils.data.get_worker_info()``. The environment variables ``RANK`` and ``WORLD_SIZE``, and
``WORKER`` and ``NUM_WORKERS``, override them when set (read at call time, in this one place), so a
launcher without ``torch.distributed`` can still split shards.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from itertools import islice
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Union

import braceexpand
from torch.utils.data import IterableDataset

from .errors import ArgumentError
from .pipeline import stage

__all__ = [
    "WorkerInfo",
    "worker_info",
    "derive_seed",
    "default_seed",
    "expand_urls",
    "SimpleShardList",
    "ResampledShards",
    "split_by_node",
    "split_by_worker",
    "single_node_only",
    "non_empty",
    "resampled",
]

URLs = Union[str, Sequence[str]]


class WorkerInfo(NamedTuple):
    """This process's node ``rank`` in ``world_size``, DataLoader ``worker`` in ``num_workers``."""

    rank: int
    world_size: int
    worker: int
    num_workers: int


def worker_info(group: Any = None) -> WorkerInfo:
    """Return this process's rank and world size, and its DataLoader worker id and count."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    else:
        rank, world_size = 0, 1
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        except (ImportError, RuntimeError):
            pass
    if "WORKER" in env and "NUM_WORKERS" in env:
        worker, num_workers = int(env["WORKER"]), int(env["NUM_WORKERS"])
    else:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return WorkerInfo(rank, world_size, worker, num_workers)


def default_seed() -> Optional[int]:
    """The seed from the environment variable ``WDS_SEED`` (an integer), or None if unset.

    webdataset read it as a string, which broke ``detshuffle``; here a value that is not an
    integer is an error that says so.
    """
    value = os.environ.get("WDS_SEED", "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ArgumentError(f"WDS_SEED must be an integer, got {value!r}") from None


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any parts (seed, epoch, rank, ...), identical on every machine and run.

    Python's ``hash()`` of a str changes per process, so it must never be used for this.
    """
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def expand_urls(urls: URLs) -> List[str]:
    """Expand a URL spec into a list of shard URLs.

    A string may hold several specs joined by ``::``, each brace-expanded:
    ``expand_urls("a-{000..002}.tar::b.tar") == ["a-000.tar", "a-001.tar", "a-002.tar", "b.tar"]``.
    A list or tuple is expanded element by element.
    """
    if isinstance(urls, (str, os.PathLike)):
        specs = os.fspath(urls).split("::")
    elif isinstance(urls, Iterable):
        specs = [os.fspath(u) if isinstance(u, os.PathLike) else u for u in urls]
        if not all(isinstance(s, str) for s in specs):
            raise ArgumentError(f"shard URLs must be strings or paths, got {urls!r}")
    else:
        raise ArgumentError(f"expected a URL string or a list of URLs, got {type(urls).__name__}")
    result: List[str] = []
    for spec in specs:
        if spec == "":
            continue
        result.extend(braceexpand.braceexpand(spec))
    return result


class SimpleShardList(IterableDataset):
    """The shards named by ``urls``, in order, or shuffled anew each epoch when ``seed`` is given.

    ``seed=True`` picks a random seed once, at construction. The order for a given (seed, epoch)
    is the same in every process, so shuffling before :func:`split_by_node` is safe.
    """

    def __init__(self, urls: URLs, seed: Union[int, bool, None] = None) -> None:
        super().__init__()
        self.urls = expand_urls(urls)
        if not self.urls:
            raise ArgumentError(f"no shard URLs in {urls!r}")
        if seed is True:
            seed = random.SystemRandom().randrange(2**31)
        self.seed = None if seed is False else seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shard order the next iteration uses."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.urls)

    def __iter__(self) -> Iterator[Dict[str, str]]:
        urls = list(self.urls)
        if self.seed is not None:
            random.Random(derive_seed("shards", self.seed, self.epoch)).shuffle(urls)
        for url in urls:
            yield {"url": url}

    def __repr__(self) -> str:
        return f"SimpleShardList({len(self.urls)} shards, seed={self.seed!r})"


class ResampledShards(IterableDataset):
    """An endless (or ``nshards`` long) stream of shards drawn at random with replacement.

    Each node and worker draws its own sequence. With ``deterministic=True`` the draws depend only
    on (seed, epoch, rank, worker), so runs are reproducible; otherwise fresh entropy is mixed in.
    """

    def __init__(
        self,
        urls: URLs,
        nshards: int = sys.maxsize,
        seed: int = 0,
        worker_seed: Optional[Any] = None,
        deterministic: bool = False,
        max_urls: int = int(1e6),
        empty_check: bool = True,
    ) -> None:
        super().__init__()
        self.urls = expand_urls(urls)[:max_urls]
        if empty_check and not self.urls:
            raise ArgumentError(f"no shard URLs in {urls!r}")
        if nshards < 1:
            raise ArgumentError(f"nshards must be >= 1, got {nshards}")
        self.nshards = nshards
        self.seed = seed
        self.worker_seed = worker_seed
        self.deterministic = deterministic
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose draws the next iteration uses."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Dict[str, str]]:
        if not self.urls:
            return
        where = self.worker_seed() if callable(self.worker_seed) else worker_info()
        parts: tuple = ("resampled", self.seed, self.epoch, tuple(where) if where else None)
        if not self.deterministic:
            parts += (os.urandom(8),)
        rng = random.Random(derive_seed(*parts))
        for _ in range(self.nshards):
            yield {"url": rng.choice(self.urls)}


#: webdataset's other name for ResampledShards.
ResampledShardList = ResampledShards


def split_by_node(src: Iterable[Any], group: Any = None) -> Iterator[Any]:
    """Keep every ``world_size``-th shard, starting at this node's rank."""
    info = worker_info(group)
    if info.world_size > 1:
        return islice(src, info.rank, None, info.world_size)
    return iter(src)


def split_by_worker(src: Iterable[Any]) -> Iterator[Any]:
    """Keep every ``num_workers``-th shard, starting at this DataLoader worker's id."""
    info = worker_info()
    if info.num_workers > 1:
        return islice(src, info.worker, None, info.num_workers)
    return iter(src)


def single_node_only(src: Iterable[Any], group: Any = None) -> Iterator[Any]:
    """Pass shards through, but refuse to run in a multi-node job (it would repeat data)."""
    if worker_info(group).world_size > 1:
        raise ArgumentError(
            "this dataset would give every node the same shards; use nodesplitter=split_by_node "
            "(or resampled=True) for multi-node training"
        )
    return iter(src)


def non_empty(src: Iterable[Any]) -> Iterator[Any]:
    """Pass items through; raise ArgumentError at the end if there were none.

    ``DataPipeline(SimpleShardList(urls), split_by_worker, non_empty, ...)`` turns "this worker
    got no shards" into an error instead of a silently empty epoch.
    """
    empty = True
    for item in src:
        empty = False
        yield item
    if empty:
        raise ArgumentError(
            "this pipeline stage received no data at all: check the URLs, and that there are at "
            "least as many shards as nodes times DataLoader workers"
        )


@stage
def resampled(
    src: Iterable[Any],
    n: int = sys.maxsize,
    seed: Optional[int] = None,
    *,
    epoch: int = 0,
) -> Iterator[Any]:
    """Read all of ``src``, then yield ``n`` items drawn from it at random with replacement.

    With ``seed`` the draws depend only on (seed, epoch, rank, worker), as in
    :class:`ResampledShards` with ``deterministic=True``; without one they use fresh entropy.
    """
    if n < 0:
        raise ArgumentError(f"resampled: n must be >= 0, got {n}")
    items = list(src)
    if not items:
        raise ArgumentError("resampled: its source yielded nothing, so there is nothing to draw")
    where = worker_info()
    parts: tuple = ("resampled-stage", seed, epoch, tuple(where))
    if seed is None:
        parts += (os.urandom(8),)
    rng = random.Random(derive_seed(*parts))
    for _ in range(n):
        yield rng.choice(items)
