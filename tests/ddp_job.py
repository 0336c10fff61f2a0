"""One rank of the torch.distributed (gloo) test in test_ddp.py (its ``main()`` is run by
rank_forker.py, or run this as a script).

It trains a tiny DistributedDataParallel model over a balanced WebLoader for two epochs (DDP
all-reduces every step, so ranks with different batch counts would hang, which the process
group's timeout turns into an error), records every batch's sample keys and, after ``--resume-at``
batches of epoch 1, the loader's state_dict; then what a fresh loader loaded from that state
yields (test_ddp.py checks that it is exactly the rest of that epoch).
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
from gloo_rank import TinyModel, join, leave

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
            if epoch == 1 and len(batches) == args.resume_at:
                # Saved mid-epoch (the loader reads on): what a checkpoint there would hold.
                state, length = loader.state_dict(), len(loader)
        epochs.append(batches)
    # Resume from that state in a fresh loader: it reads the rest of epoch 1.
    fresh = make_loader(args)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # a state survives JSON
    rest = [list(keys) for keys, _ in fresh]
    dist.barrier()
    resumed = epochs[1][: args.resume_at] + rest
    with open(args.out, "w") as f:
        json.dump({"len": length, "epochs": epochs, "resumed": resumed}, f)
    leave(model)


if __name__ == "__main__":
    main()
