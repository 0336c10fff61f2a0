"""Which rank and DataLoader worker this process is, how many CPUs it may use, and seeds that
every process derives alike.

Where a process is (:func:`worker_info`) comes from ``torch.distributed`` and
``torch.utils.data.get_worker_info()``. The environment variables ``RANK`` and ``WORLD_SIZE``, and
``WORKER`` and ``NUM_WORKERS``, override them when set (read at call time, in this one place), so a
launcher without ``torch.distributed`` can still split shards. ``WDS_SEED``, when set, is the
default seed of :class:`~webds.fluent.WebDataset` (:func:`default_seed`). Importing this module
does not import torch.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, NamedTuple, Optional

from ..errors import ArgumentError

__all__ = ["WorkerInfo", "worker_info", "usable_cpus", "derive_seed", "default_seed"]


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


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; the machine's count where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
