"""One rank of the elastic gloo test in test_ddp.py (its ``main()`` is run by
rank_forker.py, or run this as a script).

``--phase save``: train a tiny DistributedDataParallel model over ``--k`` batches of epoch 0, then
gather every rank's loader state (``state_dict(all_ranks=True)``, a collective) and let rank 0
write it. ``--phase resume``: a job of another size loads those states and trains over the rest of
the epoch (DDP all-reduces every step: ranks with different batch counts would hang, which the
process group's timeout turns into an error), then over one more whole epoch. Each rank writes
the sample keys it read.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
from gloo_rank import TinyModel, join, leave

import webds


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("index", "phase", "states", "out"):
        parser.add_argument(f"--{name}")
    for name in ("rank", "world", "port", "workers", "k"):
        parser.add_argument(f"--{name}", type=int)
    args = parser.parse_args()
    join(args.rank, args.world, args.port)
    model = TinyModel()
    dataset = (
        webds.WebDataset(args.index, shardshuffle=True, seed=7, balance="pad")
        .shuffle(10)
        .to_tuple("__key__", "cls")
        .batched(4)
    )
    loader = webds.WebLoader(dataset, batch_size=None, num_workers=args.workers)

    out: dict = {}
    if args.phase == "save":
        it = iter(loader)
        read = []
        for _ in range(args.k):
            keys, labels = next(it)
            model.step(labels)
            read += list(keys)
        states = loader.state_dict(all_ranks=True)
        if args.rank == 0:
            with open(args.states, "w") as f:
                json.dump(states, f)
        out["read"] = read
    else:
        with open(args.states) as f:
            loader.load_state_dict(json.load(f))
        out["len"] = len(loader)
        epochs = []
        for _ in range(2):  # the rest of the resumed epoch, then a whole one
            read, batches = [], 0
            for keys, labels in loader:
                model.step(labels)
                read += list(keys)
                batches += 1
            epochs.append({"read": read, "batches": batches})
        out["epochs"] = epochs
    dist.barrier()
    with open(args.out, "w") as f:
        json.dump(out, f)
    leave(model)


if __name__ == "__main__":
    main()
