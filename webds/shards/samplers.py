"""Samplers for random access that keep reads mostly sequential: chunks of consecutive samples.

A random permutation of a sharded dataset reads every sample from a different place; these
samplers shuffle *chunks* of up to ``chunksize`` consecutive samples of one shard, and the
samples inside each chunk, anew every epoch, so each chunk's reads are close together (one shard
file, nearby offsets: the page cache and read-ahead help) while the epoch is still well mixed.
They work with any map-style dataset; with a :class:`~webds.shards.access.ShardListDataset`
chunks never cross a shard boundary.

- :class:`ChunkedSampler`: one process.
- :class:`DistributedChunkedSampler`: each of ``num_replicas`` ranks gets a contiguous slice of
  the epoch's chunked order, all slices the same length (padded with samples from the start of
  the order, as ``DistributedSampler`` pads, or cut with ``drop_last=True``).

The order depends only on ``(seed, epoch)``, so every rank computes the same one; ``set_epoch``
picks the epoch, ``state_dict()`` / ``load_state_dict()`` resume in the middle of one.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any, Dict, Iterator, List, Optional, Sequence

from ..errors import ArgumentError, ResumeError

__all__ = ["ChunkedSampler", "DistributedChunkedSampler", "DEFAULT_CHUNKSIZE"]

#: Consecutive samples per chunk (wids's default).
DEFAULT_CHUNKSIZE = 2000


def _shard_ends(dataset: Any) -> List[int]:
    """Where the shards of ``dataset`` end (cumulative counts), or one shard of ``len()``."""
    ends = getattr(dataset, "ends", None)
    if isinstance(ends, list) and all(isinstance(e, int) for e in ends):
        return list(ends)
    try:
        n = len(dataset)
    except TypeError:
        raise ArgumentError(
            f"a chunked sampler needs a dataset with len(), got {type(dataset).__name__}"
        ) from None
    return [n] if n else []


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def chunked_order(
    ends: Sequence[int], chunksize: int, shuffle: bool, seed: int, epoch: int
) -> List[int]:
    """The epoch's order of all sample indices: chunks of consecutive samples within a shard,
    the chunks and the samples inside each shuffled by ``(seed, epoch)`` (in order without
    ``shuffle``)."""
    return list(iter_chunked_order(ends, chunksize, shuffle, seed, epoch))


def iter_chunked_order(
    ends: Sequence[int], chunksize: int, shuffle: bool, seed: int, epoch: int
) -> Iterator[int]:
    """:func:`chunked_order`, one index at a time: it holds the chunks (one small ``range``
    per chunk, made as they are needed without ``shuffle``) and one chunk's list, never the
    whole order (10**9 indices would take 8 GB and more)."""
    if not shuffle:
        start = 0
        for end in ends:
            yield from range(start, end)
            start = end
        return
    chunks: List[range] = []
    start = 0
    for end in ends:
        for lo in range(start, end, chunksize):
            chunks.append(range(lo, min(lo + chunksize, end)))
        start = end
    rng = random.Random(f"webds-chunks-{seed}-{epoch}")
    rng.shuffle(chunks)
    for chunk in chunks:
        part = list(chunk)
        rng.shuffle(part)
        yield from part


class ChunkedSampler:
    """Indices of ``dataset`` in chunks of up to ``chunksize`` consecutive samples of one shard,
    shuffled per epoch (chunk order and order inside chunks)::

        ds = webds.ShardListDataset("train.index.json")
        sampler = webds.ChunkedSampler(ds, chunksize=1000, seed=0)
        loader = torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=64, num_workers=8)
        for epoch in range(10):
            sampler.set_epoch(epoch)
            for batch in loader: ...
    """

    def __init__(
        self,
        dataset: Any,
        chunksize: int = DEFAULT_CHUNKSIZE,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.ends = _shard_ends(dataset)
        self.chunksize = _check_int("chunksize", chunksize, 1)
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, -(2**63))
        self.epoch = 0
        self._start = 0  # indices of this epoch already given before a resume
        self._given = 0  # indices given so far in this epoch (for state_dict)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from the next ``iter()`` on."""
        self.epoch = _check_int("epoch", epoch, 0)

    def _order(self) -> Iterator[int]:
        return iter_chunked_order(self.ends, self.chunksize, self.shuffle, self.seed, self.epoch)

    def _mine(self) -> Iterator[int]:
        return self._order()

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __iter__(self) -> Iterator[int]:
        mine = self._mine()
        start, self._start = self._start, 0
        self._given = start
        for i in itertools.islice(mine, start, None):
            self._given += 1
            yield i

    def state_dict(self) -> Dict[str, Any]:
        """Where this epoch stands: how many indices were given (the DataLoader may have fetched
        a few more than the loop consumed: save the loader's count if it differs)."""
        return {"epoch": self.epoch, "given": self._given, "seed": self.seed, "len": len(self)}

    def load_state_dict(self, state: Dict[str, Any], given: Optional[int] = None) -> None:
        """Continue ``state``'s epoch after its first ``given`` indices (default: the state's)."""
        if state.get("seed") != self.seed or state.get("len") != len(self):
            raise ResumeError(
                "this sampler state was saved with another seed or dataset size "
                f"(seed {state.get('seed')}, {state.get('len')} indices; here seed {self.seed}, "
                f"{len(self)}): build the sampler as it was"
            )
        self.epoch = _check_int("epoch", state["epoch"], 0)
        self._start = _check_int("given", state["given"] if given is None else given, 0)
        self._given = self._start


class DistributedChunkedSampler(ChunkedSampler):
    """:class:`ChunkedSampler` split across ranks: rank ``r`` of ``num_replicas`` gets slice
    ``r`` of the epoch's chunked order, every slice ``ceil(n / num_replicas)`` long (padded with
    the order's first samples) or ``floor(n / num_replicas)`` with ``drop_last=True``.
    ``num_replicas`` and ``rank`` default to torch.distributed's world size and rank."""

    def __init__(
        self,
        dataset: Any,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        chunksize: int = DEFAULT_CHUNKSIZE,
    ) -> None:
        super().__init__(dataset, chunksize=chunksize, shuffle=shuffle, seed=seed)
        if num_replicas is None or rank is None:
            world, me = _distributed()
            num_replicas = world if num_replicas is None else num_replicas
            rank = me if rank is None else rank
        self.num_replicas = _check_int("num_replicas", num_replicas, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.num_replicas:
            raise ArgumentError(f"rank {rank} is not below num_replicas {num_replicas}")
        self.drop_last = bool(drop_last)

    def _per(self) -> int:
        n, r = super().__len__(), self.num_replicas
        return n // r if self.drop_last else math.ceil(n / r)

    def __len__(self) -> int:
        return self._per()

    def _mine(self) -> Iterator[int]:
        # The order, padded with its start again (as often as it takes) to num_replicas slices
        # of one length; this rank's slice, taken lazily.
        n, per = super().__len__(), self._per()
        padded: Iterator[int] = self._order()
        if per * self.num_replicas > n and n:
            again = itertools.chain.from_iterable(
                self._order() for _ in range(math.ceil((per * self.num_replicas - n) / n))
            )
            padded = itertools.chain(padded, again)
        return itertools.islice(padded, self.rank * per, (self.rank + 1) * per)


def _distributed() -> tuple:
    try:
        import torch.distributed as dist
    except ImportError:
        return 1, 0
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0
