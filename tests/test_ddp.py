"""Real torch.distributed (gloo) processes reading a balanced dataset with DataLoader workers.

Each rank is a process of its own, forked by tests/rank_forker.py from one that has made the
imports every rank makes (torch, torch._dynamo, webds) once."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from conftest import sample_members, write_tar
from rank_forker import Forker
from servers import free_port

from webds.shards.index import ShardIndex

SIZES = [13, 4, 9, 21, 6, 3, 17]  # 73 samples: divides by neither 2 nor 3
ALL = {f"s{i}-{j:06d}" for i, n in enumerate(SIZES) for j in range(n)}
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    urls = [
        str(write_tar(root / f"train-{i:03d}.tar", sample_members(n, prefix=f"s{i}-")))
        for i, n in enumerate(SIZES)
    ]
    ShardIndex.build(urls).save(str(root / "index.json"))
    return str(root / "index.json")


@pytest.fixture(scope="module")
def forker():
    """One process that has imported torch and webds, forking every job's ranks (rank_forker.py):
    each rank is still a process of its own with its own gloo group, without the 5 s of CPU each
    spent on the same imports and 1-2 s more on tearing them down."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "WDS_SEED")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    forker = Forker(env)
    yield forker
    forker.close()


def run_ranks(forker, job, tmp_path, tag, world, args, killed=False):
    """Run ``job``'s main() (a module beside this file) as ``world`` gloo ranks (``args`` plus
    --rank, --world, --port, --out); fail on a rank that hangs or errs; return what each rank
    wrote to its --out file. ``killed``: every rank must end by SIGKILL instead (nothing is
    returned)."""
    port = free_port()
    outs = [tmp_path / f"{tag}rank{r}-{port}.json" for r in range(world)]
    logs = [str(tmp_path / f"{tag}rank{r}-{port}.log") for r in range(world)]
    argvs = [
        [*args, "--rank", r, "--world", world, "--port", port, "--out", outs[r]]
        for r in range(world)
    ]
    status = forker.run(job, argvs, logs, timeout=240)
    if status is None:
        pytest.fail("a DDP rank hung")
    errors = [
        f"exit status {code}: {Path(log).read_text()[-3000:] if Path(log).exists() else ''}"
        for code, log in zip(status, logs)
        if code != (-9 if killed else 0)
    ]
    assert not errors, "\n".join(errors)
    return [] if killed else [json.loads(o.read_text()) for o in outs]


def run_job(
    forker, index, tmp_path, world, balance, workers=2, context="fork", seed=7, resume_at=3
):
    args = ["--index", index, "--balance", balance, "--context", context, "--workers", workers]
    args += ["--seed", seed, "--resume-at", resume_at]
    return run_ranks(forker, "ddp_job", tmp_path, "", world, args)


@pytest.mark.parametrize("world,balance,context", [(2, "pad", "spawn"), (3, "drop", "fork")])
def test_every_rank_same_batches_union_is_the_dataset_resume_exact(
    forker, index, tmp_path, world, balance, context
):
    ranks = run_job(forker, index, tmp_path, world, balance, context=context)
    per_rank = -(-len(ALL) // world) if balance == "pad" else len(ALL) // world
    batches = -(-per_rank // 4)
    for r in ranks:
        assert r["len"] == batches
        for epoch in r["epochs"]:
            assert len(epoch) == batches
            assert sum(len(b) for b in epoch) == per_rank
    for e in range(2):
        seen = Counter(k for r in ranks for b in r["epochs"][e] for k in b)
        if balance == "pad":
            assert set(seen) == ALL
            assert sum(seen.values()) - len(ALL) == world * per_rank - len(ALL)
        else:
            assert max(seen.values()) == 1 and len(ALL) - len(seen) < world
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # a new order every epoch
    for r in ranks:
        # Each rank resumed from its own state: the rest of its epoch, the same batches in the
        # same order (the samples that sat in the shuffle buffer are put back in their places).
        assert r["resumed"] == r["epochs"][1]


def test_same_seed_same_order_across_runs(forker, index, tmp_path):
    first = run_job(forker, index, tmp_path, 2, "pad", workers=1)
    again = run_job(forker, index, tmp_path, 2, "pad", workers=1)
    assert [r["epochs"] for r in first] == [r["epochs"] for r in again]


def run_elastic(forker, index, tmp_path, phase, world, workers, states, k=0):
    args = ["--index", index, "--phase", phase, "--states", states, "--workers", workers, "--k", k]
    return run_ranks(forker, "elastic_job", tmp_path, f"{phase}-", world, args)


@pytest.fixture(scope="module")
def four_ranks_stopped(forker, index, tmp_path_factory):
    """4 gloo ranks x 2 workers, stopped after 2 batches: what they read, and their states."""
    tmp_path = tmp_path_factory.mktemp("elastic")
    states = tmp_path / "states.json"
    saved = run_elastic(forker, index, tmp_path, "save", world=4, workers=2, states=states, k=2)
    assert len(json.loads(states.read_text())) == 4  # every rank's state, gathered by rank 0
    return saved, states


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("world,workers", [(2, 3), (3, 1), (8, 2)])
def test_four_gloo_ranks_resume_on_another_topology(
    forker, index, tmp_path, four_ranks_stopped, world, workers
):
    saved, states = four_ranks_stopped
    ranks = run_elastic(
        forker, index, tmp_path, "resume", world=world, workers=workers, states=states
    )
    before = Counter(key for r in saved for key in r["read"])
    rest = Counter(key for r in ranks for key in r["epochs"][0]["read"])
    assert not set(before) & set(rest), "a sample consumed before was read again"
    assert set(before) | set(rest) == ALL
    assert sum(rest.values()) - len(rest) < world  # repeated: only to pad the ranks equal
    assert len({r["epochs"][0]["batches"] for r in ranks}) == 1  # DDP did not hang: equal
    assert all(r["epochs"][0]["batches"] == r["len"] for r in ranks)
    whole = Counter(key for r in ranks for key in r["epochs"][1]["read"])
    assert set(whole) == ALL and sum(whole.values()) - len(ALL) < world


BIG = [120, 97, 133, 88, 150, 101, 77, 134]  # 900 samples: a pass is about 57 batches per rank


@pytest.fixture(scope="module")
def big_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp-big")
    urls = [
        str(write_tar(root / f"train-{i:03d}.tar", sample_members(n, prefix=f"b{i}-")))
        for i, n in enumerate(BIG)
    ]
    ShardIndex.build(urls).save(str(root / "index.json"))
    return str(root / "index.json")


def run_kill_job(forker, index, tmp_path, phase, epoch_len, epochs, stop_epoch=0, stop_batch=0):
    args = ["--index", index, "--phase", phase, "--state", tmp_path / "state"]
    args += ["--epoch-len", epoch_len, "--epochs", epochs]
    args += ["--stop-epoch", stop_epoch, "--stop-batch", stop_batch]
    return run_ranks(forker, "resume_job", tmp_path, f"{phase}-", 2, args, killed=phase == "save")


@pytest.fixture(scope="module")
def uninterrupted(forker, big_index, tmp_path_factory):
    """Every rank's batches, epoch by epoch, of the uninterrupted runs (by epoch length)."""
    runs = {}
    for epoch_len in (40, 70):
        tmp_path = tmp_path_factory.mktemp(f"whole{epoch_len}")
        runs[epoch_len] = [
            r["epochs"] for r in run_kill_job(forker, big_index, tmp_path, "whole", epoch_len, 3)
        ]
    return runs


@pytest.mark.parametrize(
    "epoch_len,stop_epoch,stop_batch",
    [(40, 0, 7), (40, 1, 20), (70, 0, 60)],  # inside a pass, across one, and longer than one
)
def test_killed_ranks_resume_with_epoch_batch_for_batch(
    forker, big_index, tmp_path, uninterrupted, epoch_len, stop_epoch, stop_batch
):
    # 2 gloo ranks x 2 workers, with_epoch on the loader: SIGKILL after a batch, then resume
    # from the saved states. The rest of that epoch and every epoch after are the
    # uninterrupted run's, batch for batch (they used to hold other samples: issue 35).
    whole = uninterrupted[epoch_len]
    run_kill_job(forker, big_index, tmp_path, "save", epoch_len, 3, stop_epoch, stop_batch)
    resumed = run_kill_job(
        forker, big_index, tmp_path, "resume", epoch_len, 3, stop_epoch, stop_batch
    )
    for rank, r in enumerate(resumed):
        epochs = r["epochs"]
        assert whole[rank][stop_epoch][:stop_batch] + epochs[0] == whole[rank][stop_epoch]
        assert epochs[1:] == whole[rank][stop_epoch + 1 :]
        assert all(len(e) == epoch_len for e in whole[rank])
