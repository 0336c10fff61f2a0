"""The shard lists that are torch datasets: :class:`SimpleShardList` and :class:`ResampledShards`.

They subclass ``torch.utils.data.IterableDataset`` (so a ``DataLoader`` takes them as iterable
datasets), which makes this the one part of the shard-list machinery that imports torch. Their
public home is :mod:`webds.shards`, which serves them from here on first use; everything else
(URL expansion, worker info, seeds, splitting: :mod:`webds.shards.shardlists`) stays importable
without torch, for the ``webds`` command and the writers.
"""

from __future__ import annotations

import random
import secrets
import sys
from typing import Any, Dict, Iterator, Optional, Union

from torch.utils.data import IterableDataset

from ..base.workers import derive_seed, worker_info
from ..errors import ArgumentError
from .shardlists import URLs, expand_urls

__all__ = ["SimpleShardList", "ResampledShards", "ResampledShardList"]


class SimpleShardList(IterableDataset):
    """The shards named by ``urls``, in order, or shuffled anew each epoch when ``seed`` is given.

    ``seed=True`` picks a random seed once, at construction. The order for a given (seed, epoch)
    is the same in every process, so shuffling before :func:`split_by_node` is safe.
    Directories, prefixes and globs (see :func:`expand_urls`; remote ones listed with
    ``storage_options``) are listed once, here at construction, so every DataLoader worker and
    every rank that builds the same dataset splits the same list.
    """

    def __init__(
        self,
        urls: URLs,
        seed: Union[int, bool, None] = None,
        *,
        storage_options: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        self.urls = expand_urls(urls, storage_options=storage_options)
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
    on (seed, epoch, rank, worker), so runs are reproducible (``worker_seed``, a function
    returning an int or a tuple, replaces rank and worker); otherwise entropy drawn when the
    object is made is mixed in too (a resumed pipeline restores it from its state), so every
    object draws differently, and each one differently every epoch: the one ``set_epoch``
    chose, or else the next (``epoch`` is -1 before the first iteration, as in webdataset).
    ``urls`` are expanded (and directories or globs listed, with ``storage_options``) once, at
    construction.
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
        *,
        storage_options: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        self.urls = expand_urls(urls, storage_options=storage_options)[:max_urls]
        if empty_check and not self.urls:
            raise ArgumentError(f"no shard URLs in {urls!r}")
        if nshards < 1:
            raise ArgumentError(f"nshards must be >= 1, got {nshards}")
        self.nshards = nshards
        self.seed = seed
        self.worker_seed = worker_seed
        self.deterministic = deterministic
        #: The epoch of the last iteration: -1 before the first, as in webdataset.
        self.epoch = -1
        self._chosen = False  # set_epoch() chose the next iteration's epoch
        # Not deterministic: entropy drawn once, so that a resumed epoch (which restores it
        # from the state) draws the same shards again.
        self._entropy = secrets.randbits(63)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose draws the next iteration uses (without it, each iteration
        takes the next epoch, starting at 0, as webdataset's does)."""
        self.epoch = epoch
        self._chosen = True

    @property
    def endless(self) -> bool:
        """Whether one iteration never ends (no ``nshards``): ``with_epoch`` then draws each
        epoch afresh, from (seed, epoch), instead of carrying the stream on."""
        return self.nshards >= sys.maxsize

    def __iter__(self) -> Iterator[Dict[str, str]]:
        if not self._chosen:
            self.epoch += 1
        self._chosen = False
        if not self.urls:
            return
        where = self.worker_seed() if callable(self.worker_seed) else worker_info()
        if isinstance(where, (list, tuple)):
            where = tuple(where) or None  # worker_info(), or a function returning a tuple
        # else webdataset's kind of worker_seed: a function returning an int (rank * 1000 +
        # worker, or lambda: 1), mixed in as it is.
        parts: tuple = ("resampled", self.seed, self.epoch, where)
        if not self.deterministic:
            parts += (self._entropy,)
        rng = random.Random(derive_seed(*parts))
        for _ in range(self.nshards):
            yield {"url": rng.choice(self.urls)}


#: webdataset's other name for ResampledShards.
ResampledShardList = ResampledShards
