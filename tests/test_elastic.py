"""Elastic resume: every rank's state, saved by N ranks x W workers, resumed on another number of
ranks and workers, finishes the epoch exactly: each sample nobody had consumed is read once (a few
repeated only to pad every new rank to the same count), none read before is read again, every
new rank yields as many batches; the epoch after it is a whole epoch on the new topology.

Ranks are given by RANK / WORLD_SIZE, as torchrun sets them, and run one after the other in this
process, each with real DataLoader worker processes (tests/test_ddp.py runs real gloo ranks)."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
from conftest import sample_members, write_tar

import webds
from webds.errors import ResumeError
from webds.shards.index import ShardIndex

SIZES = [7, 3, 11, 5, 9, 8, 6, 10, 4, 12]  # 75 samples
ALL = {f"s{i}-{j:06d}" for i, n in enumerate(SIZES) for j in range(n)}


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """The shards and their index (read only: every test shares them)."""
    root = tmp_path_factory.mktemp("elastic")
    urls = [
        str(write_tar(root / f"shard-{i}.tar", sample_members(n, prefix=f"s{i}-")))
        for i, n in enumerate(SIZES)
    ]
    path = root / "index.json"
    ShardIndex.build(urls).save(str(path))
    return str(path)


def make(index, workers, balance="pad"):
    ds = (
        webds.WebDataset(index, shardshuffle=True, seed=5, balance=balance)
        .shuffle(6)
        .to_tuple("__key__", "cls")
        .batched(4)
    )
    return webds.WebLoader(ds, batch_size=None, num_workers=workers)


def keys(batches):
    return [k for b in batches for k in b[0]]


def as_rank(monkeypatch, rank, world):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def interrupted(monkeypatch, index, world, workers, k, balance="pad"):
    """Every rank reads k batches of epoch 1 (after a whole epoch 0); their keys and states."""
    before, states = [], []
    for rank in range(world):
        as_rank(monkeypatch, rank, world)
        loader = make(index, workers, balance)
        list(loader)  # epoch 0
        it = iter(loader)
        before.append(keys(next(it) for _ in range(k)))
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
    return before, states


def resumed(monkeypatch, index, world, workers, states, balance="pad"):
    """Every new rank's rest of the epoch, and the epoch after it."""
    rest, after, lengths = [], [], []
    for rank in range(world):
        as_rank(monkeypatch, rank, world)
        loader = make(index, workers, balance)
        loader.load_state_dict(states)
        lengths.append(len(loader))  # on another topology: the resumed epoch's own length
        batches = list(loader)
        assert len(batches) <= lengths[-1]
        rest.append(batches)
        after.append(keys(list(loader)))
    return rest, after, lengths


@pytest.fixture(scope="module")
def four_ranks_stopped(index):
    """4 ranks x 2 workers stopped after 2 batches of epoch 1: what they read, and their states
    (the same for every new topology below: made once)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return interrupted(monkeypatch, index, 4, 2, k=2)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("new_world,new_workers", [(2, 3), (3, 1), (8, 2), (4, 2), (1, 0)])
def test_four_ranks_of_two_workers_resume_elsewhere(
    index, monkeypatch, four_ranks_stopped, new_world, new_workers
):
    before, states = copy.deepcopy(four_ranks_stopped)
    rest, after, lengths = resumed(monkeypatch, index, new_world, new_workers, states)
    if (new_world, new_workers) != (4, 2):  # planned anew: len() is the resumed epoch's
        assert [len(batches) for batches in rest] == lengths
    read_before = Counter(k for b in before for k in b)
    read_after = Counter(k for batches in rest for k in keys(batches))
    assert not set(read_before) & set(read_after), "a sample consumed before was read again"
    assert set(read_before) | set(read_after) == ALL
    assert sum(read_after.values()) - len(read_after) < new_world  # repeated: only padding
    assert len({len(batches) for batches in rest}) == 1  # every new rank as many batches
    assert len(set(lengths)) == 1
    # The next epoch is a whole one on the new topology.
    seen = Counter(k for a in after for k in a)
    assert set(seen) == ALL and sum(seen.values()) - len(ALL) < new_world


def test_drop_balance_and_workers_only(index, monkeypatch):
    before, states = interrupted(monkeypatch, index, 3, 2, k=3, balance="drop")
    rest, _, _ = resumed(monkeypatch, index, 3, 1, states, balance="drop")
    got_before = {k for b in before for k in b}
    got_after = Counter(k for batches in rest for k in keys(batches))
    assert max(got_after.values()) == 1 and not got_before & set(got_after)
    assert len(ALL - got_before - set(got_after)) < 3 + 3  # left out: only by "drop"


def test_elastic_resume_needs_every_rank_and_an_index(index, monkeypatch):
    _, states = interrupted(monkeypatch, index, 2, 1, k=1)
    as_rank(monkeypatch, 0, 3)
    with pytest.raises(ResumeError, match="every rank"):
        make(index, 1).load_state_dict(states[0])
    as_rank(monkeypatch, 0, 2)
    with pytest.raises(ResumeError, match="every rank"):
        make(index, 2).load_state_dict(states[:1])
    with pytest.raises(ResumeError, match="seed"):
        loader = webds.WebLoader(
            webds.WebDataset(index, shardshuffle=True, seed=6).batched(4), num_workers=2
        )
        loader.load_state_dict(states)


def test_without_an_index_another_topology_says_how_to_make_one(index, monkeypatch):
    spec = index.replace("index.json", "shard-{0..9}.tar")

    def plain(workers):
        return webds.WebLoader(webds.WebDataset(spec).batched(4), num_workers=workers)

    as_rank(monkeypatch, 0, 2)
    loader = plain(1)
    next(iter(loader))
    state = loader.state_dict()
    as_rank(monkeypatch, 0, 3)
    with pytest.raises(ResumeError, match="webds index"):
        plain(1).load_state_dict(state)
    as_rank(monkeypatch, 0, 2)
    with pytest.raises(ResumeError, match="webds index"):
        plain(2).load_state_dict(state)


def test_a_dataset_without_a_loader_resumes_on_another_number_of_ranks(index, monkeypatch):
    def make_ds():
        return webds.WebDataset(index, shardshuffle=True, seed=2).shuffle(5)

    before, states = set(), []
    for rank in range(3):
        as_rank(monkeypatch, rank, 3)
        ds = make_ds()
        it = iter(ds)
        before |= {next(it)["__key__"] for _ in range(7)}
        states.append(json.loads(json.dumps(ds.state_dict())))
    rest = Counter()
    counts = set()
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        ds = make_ds()
        ds.load_state_dict(states)
        got = [s["__key__"] for s in ds]
        counts.add(len(got))
        rest.update(got)
    assert not before & set(rest) and before | set(rest) == ALL
    assert len(counts) == 1 and sum(rest.values()) - len(rest) < 2


def test_elastic_with_dropped_samples_unseeded_and_persistent_workers(index, monkeypatch):
    # One step off the tests above: a stage that drops samples, no seed, persistent workers.
    monkeypatch.delenv("WDS_SEED", raising=False)

    def drop(sample):
        return None if sample["__key__"].endswith(("3", "7")) else sample

    def make_loader(workers):
        ds = webds.WebDataset(index, shardshuffle=True).map(drop).shuffle(6)
        ds = ds.to_tuple("__key__", "cls").batched(4)
        return webds.WebLoader(
            ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0
        )

    kept = {k for k in ALL if not k.endswith(("3", "7"))}
    before, states = set(), []
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        loader = make_loader(2)
        it = iter(loader)
        before |= set(keys(next(it) for _ in range(2)))
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
    after = set()
    for rank in range(3):
        as_rank(monkeypatch, rank, 3)
        loader = make_loader(1)
        loader.load_state_dict(states)
        after |= set(keys(list(loader)))
    assert not before & after and before | after == kept
