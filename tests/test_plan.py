"""Epoch plans (webds.shards.plan): every rank gets the same count, the union is the dataset."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from webds.errors import ArgumentError
from webds.shards.plan import epoch_order, plan_worker, rank_size, split_warning, worker_spans

COUNTS = [7, 3, 0, 11, 5, 1, 9]  # uneven, one empty shard
URLS = [f"shard-{i}.tar" for i in range(len(COUNTS))]
TOTAL = sum(COUNTS)


def read(counts, world, workers, balance, granule=1, seed=5, epoch=0):
    """Every (rank, worker)'s sample ids, as (shard, index) pairs."""
    out = {}
    for rank, worker in itertools.product(range(world), range(workers)):
        plan = plan_worker(
            counts,
            URLS[: len(counts)],
            seed=seed,
            epoch=epoch,
            world_size=world,
            rank=rank,
            num_workers=workers,
            worker=worker,
            balance=balance,
            granule=granule,
        )
        ids = [(s.shard, i) for s in plan.segments for i in range(s.start, s.stop)]
        assert len(ids) == plan.samples
        for s in plan.segments:
            assert 0 <= s.start < s.stop <= counts[s.shard]
        out[rank, worker] = ids
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 50])
@pytest.mark.parametrize("workers", [1, 2, 3, 8])
@pytest.mark.parametrize("granule", [1, 4])
def test_pad_gives_equal_counts_and_covers_everything(world, workers, granule):
    got = read(COUNTS, world, workers, "pad", granule)
    per_rank = [sum(len(got[r, w]) for w in range(workers)) for r in range(world)]
    assert len(set(per_rank)) == 1
    assert per_rank[0] == -(-TOTAL // world)
    seen = Counter(i for ids in got.values() for i in ids)
    everything = {(s, i) for s, n in enumerate(COUNTS) for i in range(n)}
    assert set(seen) == everything
    # Padding repeats as few samples as it must.
    assert sum(seen.values()) - TOTAL == world * per_rank[0] - TOTAL < world * (1 + TOTAL // world)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_drop_gives_equal_counts_and_each_sample_at_most_once(world, workers):
    got = read(COUNTS, world, workers, "drop")
    per_rank = [sum(len(got[r, w]) for w in range(workers)) for r in range(world)]
    assert per_rank == [TOTAL // world] * world
    seen = Counter(i for ids in got.values() for i in ids)
    assert max(seen.values()) == 1
    assert TOTAL - len(seen) < world


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_batches_per_rank_do_not_depend_on_workers(workers):
    granule = 4
    got = read(COUNTS, 3, workers, "pad", granule)
    for rank in range(3):
        batches = sum(-(-len(got[rank, w]) // granule) for w in range(workers))
        assert batches == -(-rank_size(TOTAL, 3, "pad") // granule)


def test_fewer_shards_than_workers_splits_inside_shards():
    got = read([40], 2, 4, "drop")
    assert all(len(ids) == 5 for ids in got.values())
    assert sorted(i for ids in got.values() for i in ids) == [(0, i) for i in range(40)]


def test_same_seed_same_plan_other_epoch_other_order():
    a, b = read(COUNTS, 2, 2, "pad", epoch=3), read(COUNTS, 2, 2, "pad", epoch=3)
    assert a == b
    assert read(COUNTS, 2, 2, "pad", epoch=4) != a
    assert epoch_order(7, None, 9) == list(range(7))
    assert sorted(epoch_order(7, 1, 2)) == list(range(7))


def test_skip_drops_a_workers_first_samples():
    base = dict(seed=1, epoch=0, world_size=2, rank=1, num_workers=2, worker=1, balance="pad")
    whole = plan_worker(COUNTS, URLS, **base)
    later = plan_worker(COUNTS, URLS, skip=4, **base)
    ids = [(s.shard, i) for s in whole.segments for i in range(s.start, s.stop)]
    assert [(s.shard, i) for s in later.segments for i in range(s.start, s.stop)] == ids[4:]


def test_worker_spans_and_errors():
    assert worker_spans(10, 3, 4) == [(0, 4), (4, 8), (8, 10)]
    assert worker_spans(3, 4, 1) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    with pytest.raises(ArgumentError, match="balance must be"):
        rank_size(10, 2, "even")
    with pytest.raises(ArgumentError, match="rank 2"):
        plan_worker(
            COUNTS,
            URLS,
            seed=0,
            epoch=0,
            world_size=2,
            rank=2,
            num_workers=1,
            worker=0,
            balance="pad",
        )


def test_split_warning_names_the_problem():
    assert split_warning([1000] * 64, 2, 4, "pad", 8) is None
    warning = split_warning([1000, 1000, 1000, 1000, 1000, 1000, 1000], 2, 4, "pad", 1)
    assert "reads about 50% of the data twice" in warning and "no sample offsets" in warning
    assert "8 readers (2 ranks x 4 workers) start inside shards" in warning
    # With offsets, reads enter the shards where they start: nothing is read twice.
    assert split_warning([1000] * 7, 2, 4, "pad", 1, [True] * 7) is None
    assert "twice" in split_warning([1000] * 7, 2, 4, "pad", 1, [True] + [False] * 6)
    assert "get no samples" in split_warning([10], 1, 4, "pad", 8)
