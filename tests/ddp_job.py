"""One rank of the torch.distributed (gloo) test in test_ddp.py; run as a script.

It trains a tiny DistributedDataParallel model over a balanced WebLoader for two epochs (DDP
all-reduces every step, so ranks with different batch counts would hang, which the process
group's timeout turns into an error), records every batch's sample keys, then checks that a
fresh loader loaded from a mid-epoch state_dict yields exactly the rest of that epoch.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
from gloo_rank import TinyModel, join

import webds


def make_loader(args: argparse.Namespace) -> webds.WebLoader:
    dataset = (
        webds.WebDataset(args.index, shardshuffle=True, seed=args.seed, balance=args.balance)
        .shuffle(20)
        .to_tuple("__key__", "cls")
        .batched(4)
    )
    return webds.WebLoader(
        dataset,
        batch_size=None,
        num_workers=args.workers,
        multiprocessing_context=args.context,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("index", "balance", "out", "context"):
        parser.add_argument(f"--{name}")
    for name in ("rank", "world", "port", "workers", "seed", "resume_at"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int)
    args = parser.parse_args()
    join(args.rank, args.world, args.port)
    model = TinyModel()
    loader = make_loader(args)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches = []
        for keys, labels in loader:
            model.step(labels)
            batches.append(list(keys))
        epochs.append(batches)
    # Interrupt epoch 1 after resume_at batches, then resume in a fresh loader.
    loader = make_loader(args)
    loader.set_epoch(1)
    it = iter(loader)
    head = [list(next(it)[0]) for _ in range(args.resume_at)]
    state = loader.state_dict()
    del it
    fresh = make_loader(args)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # a state survives JSON
    rest = [list(keys) for keys, _ in fresh]
    dist.barrier()
    with open(args.out, "w") as f:
        json.dump({"len": len(loader), "epochs": epochs, "resumed": head + rest}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
