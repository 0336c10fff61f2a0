"""What the gloo job scripts (ddp_job.py, elastic_job.py, resume_job.py) share: joining and
leaving the process group, and a tiny DistributedDataParallel model whose every step all-reduces
(ranks with different batch counts would hang, which the group's timeout turns into an error)."""

from __future__ import annotations

import datetime
import gc
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn


def leave(model: "TinyModel") -> None:
    """Leave the process group, ``model`` freed first. Freed after, its DDP Reducer would drop
    the group's last reference, and the group's destructor joins gloo's threads holding the
    GIL while a gloo thread freeing a finished all_gather's tensors waits for it: a deadlock
    (torch 2.13; in ranks forked by rank_forker.py the 4-rank elastic save hung so about 1 time
    in 4, none in 60 with this order; none in 25 of the same ranks started as scripts)."""
    model.close()
    dist.destroy_process_group()


def join(rank: int, world: int, port: int) -> None:
    """Join the job's gloo process group on 127.0.0.1:``port`` (60 s timeout)."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


class TinyModel:
    """``nn.Linear(1, 1)`` in DistributedDataParallel, the same start on every rank."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.parallel.DistributedDataParallel(nn.Linear(1, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def close(self) -> None:
        """Free the DDP model (its Reducer) now, while the process group is still joined."""
        del self.model, self.optimizer
        gc.collect()

    def step(self, labels: Sequence[Any]) -> None:
        """One training step on a batch's labels: an all-reduce every rank must take part in."""
        x = torch.as_tensor([float(c) for c in labels]).unsqueeze(1)
        loss = ((self.model(x) - x) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
