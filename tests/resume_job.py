"""One rank of the SIGKILL resume test in test_ddp.py (its ``main()`` is run by
rank_forker.py, or run this as a script).

Phase ``whole`` trains a tiny DistributedDataParallel model for ``--epochs`` epochs over a
``WebLoader(...).with_epoch(n)`` (2 DataLoader workers, an index, ``shuffle(100)``,
``batched(8)``) and records every batch's sample keys. Phase ``save`` does the same but, after
batch ``--stop-batch`` of epoch ``--stop-epoch``, writes the loader's ``state_dict()`` and kills
itself with SIGKILL, as a preempted job dies. Phase ``resume`` builds a fresh loader, loads that
state and records the rest of that epoch and the epochs after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch.distributed as dist
from gloo_rank import TinyModel, join, leave

import webds


def make_loader(args: argparse.Namespace) -> webds.WebLoader:
    dataset = (
        webds.WebDataset(args.index, shardshuffle=True, seed=7)
        .shuffle(100)
        .to_tuple("__key__", "cls")
        .batched(8)
    )
    loader = webds.WebLoader(dataset, batch_size=None, num_workers=2)
    return loader.with_epoch(args.epoch_len)


def train(loader, model, epoch, stop=None):
    """One epoch's batches (their keys); ``stop(i)`` is called after batch ``i``."""
    loader.set_epoch(epoch)
    batches = []
    for keys, labels in loader:
        model.step(labels)
        batches.append(list(keys))
        if stop is not None:
            stop(len(batches))
    return batches


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("index", "phase", "state", "out"):
        parser.add_argument(f"--{name}")
    for name in ("rank", "world", "port", "epochs", "epoch_len", "stop_epoch", "stop_batch"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int)
    args = parser.parse_args()
    join(args.rank, args.world, args.port)
    model = TinyModel()
    loader = make_loader(args)
    state_file = f"{args.state}.rank{args.rank}"
    epochs = []
    if args.phase == "resume":
        with open(state_file) as f:
            loader.load_state_dict(json.load(f))
        first = args.stop_epoch
    else:
        first = 0

    def stop(i: int) -> None:
        if args.phase == "save" and epoch == args.stop_epoch and i == args.stop_batch:
            with open(state_file, "w") as f:
                json.dump(loader.state_dict(), f)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, as a preempted job

    for epoch in range(first, args.epochs):
        epochs.append(train(loader, model, epoch, stop))
    dist.barrier()
    with open(args.out, "w") as f:
        json.dump({"epochs": epochs}, f)
    leave(model)


if __name__ == "__main__":
    main()
