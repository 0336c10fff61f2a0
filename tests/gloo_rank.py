"""What the gloo job scripts (ddp_job.py, elastic_job.py, resume_job.py) share: joining the
process group, and a tiny DistributedDataParallel model whose every step all-reduces (ranks
with different batch counts would hang, which the group's timeout turns into an error)."""

from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn


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

    def step(self, labels: Sequence[Any]) -> None:
        """One training step on a batch's labels: an all-reduce every rank must take part in."""
        x = torch.as_tensor([float(c) for c in labels]).unsqueeze(1)
        loss = ((self.model(x) - x) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
