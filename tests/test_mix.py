"""Mixing sources: RoundRobin, RandomMix and their function forms."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DataLoader

from webds.errors import ArgumentError
from webds.pipeline import DataPipeline
from webds.shards import SimpleShardList
from webds.stages.mix import (
    RandomMix,
    RoundRobin,
    random_samples,
    round_robin_longest,
    round_robin_shortest,
)


def test_round_robin_shortest_and_longest():
    assert list(RoundRobin([[1, 2, 3], [10]])) == [1, 10, 2]
    assert list(RoundRobin([[1, 2, 3], [10]], longest=True)) == [1, 10, 2, 3]
    assert list(RoundRobin([[1], [10, 20, 30], [100, 200]], longest=True)) == [
        1,
        10,
        100,
        20,
        200,
        30,
    ]
    assert list(round_robin_shortest([1, 2, 3], [10])) == [1, 10, 2]
    assert list(round_robin_longest([1, 2, 3], [10])) == [1, 10, 2, 3]
    assert list(round_robin_longest()) == []


def test_round_robin_is_restartable_and_rejects_nothing():
    rr = RoundRobin([range(3), range(10, 13)])
    assert list(rr) == list(rr) == [0, 10, 1, 11, 2, 12]
    with pytest.raises(ArgumentError):
        RoundRobin([])


def test_set_epoch_is_forwarded_to_sources():
    a = SimpleShardList([f"a{i}" for i in range(20)], seed=1)
    b = SimpleShardList([f"b{i}" for i in range(20)], seed=2)
    for mix in (RoundRobin([a, b]), RandomMix([a, b], seed=0)):
        mix.set_epoch(7)
        assert a.epoch == 7 and b.epoch == 7 and mix.epoch == 7
    # Epochs change the sources' order, so the mix changes too.
    rr = RoundRobin([a, b])
    rr.set_epoch(0)
    first = list(rr)
    rr.set_epoch(1)
    assert list(rr) != first


def test_random_mix_proportions():
    n = 20000
    mix = RandomMix([itertools.repeat("a"), itertools.repeat("b")], probs=[3, 1], seed=5)
    drawn = list(itertools.islice(mix, n))
    share = drawn.count("a") / n
    # Binomial sd is sqrt(.75*.25/n) ~ 0.003; 5 sd.
    assert abs(share - 0.75) < 0.016
    uniform = list(
        itertools.islice(RandomMix([itertools.repeat(0), itertools.repeat(1)], seed=1), n)
    )
    assert abs(sum(uniform) / n - 0.5) < 0.018


def test_random_mix_probabilities_zero_and_errors():
    mix = RandomMix([itertools.repeat("a"), itertools.repeat("b")], probs=[1, 0], seed=0)
    assert set(itertools.islice(mix, 500)) == {"a"}
    with pytest.raises(ArgumentError):
        RandomMix([[1], [2]], probs=[1])
    with pytest.raises(ArgumentError):
        RandomMix([[1], [2]], probs=[0, 0])
    with pytest.raises(ArgumentError):
        RandomMix([[1], [2]], probs=[-1, 2])
    with pytest.raises(ArgumentError):
        RandomMix([])


def test_random_mix_shortest_stops_longest_drains():
    a, b = list(range(100)), list(range(1000, 1010))
    short = list(RandomMix([a, b], seed=3))
    assert len(short) < 110
    assert set(short) < set(a) | set(b)
    full = list(RandomMix([a, b], longest=True, seed=3))
    assert sorted(full) == sorted(a + b)
    # Each source keeps its own order inside the mix.
    assert [x for x in full if x < 1000] == a


def test_random_mix_seed_epoch_reproducibility():
    srcs = [range(0, 300), range(1000, 1300)]
    m = RandomMix(srcs, seed=11, longest=True)
    e0 = list(m)
    assert e0 == list(RandomMix(srcs, seed=11, longest=True))
    assert e0 != list(RandomMix(srcs, seed=12, longest=True))
    # Each iteration is the next epoch, with new picks; set_epoch goes back.
    e1 = list(m)
    assert e1 != e0
    m.set_epoch(1)
    assert list(m) == e1
    m.set_epoch(0)
    assert list(m) == e0
    # No seed: fresh entropy each time.
    assert list(RandomMix(srcs, longest=True)) != list(RandomMix(srcs, longest=True))


def test_random_samples_function_form():
    srcs = [range(0, 50), range(100, 150)]
    assert list(random_samples(srcs, [1, 1], True, 4)) == list(
        RandomMix(srcs, [1, 1], longest=True, seed=4)
    )
    assert list(random_samples(srcs, seed=4, longest=True, epoch=2)) != list(
        random_samples(srcs, seed=4, longest=True, epoch=3)
    )


def test_mix_in_pipeline_gets_epochs():
    srcs = [list(range(0, 40)), list(range(100, 140))]
    pipe = DataPipeline(RandomMix(srcs, seed=0, longest=True))
    first, second = list(pipe), list(pipe)
    assert sorted(first) == sorted(second) == sorted(srcs[0] + srcs[1])
    assert first != second  # the pipeline advanced the epoch


def _loader_run(mix, workers=2):
    loader = DataLoader(mix, batch_size=None, num_workers=workers)
    out = [int(x) for x in loader]
    # Each worker yields the same number of items, and the DataLoader takes them in turn.
    return out[0::2], out[1::2]


def test_random_mix_per_worker_seeds_in_dataloader(monkeypatch):
    srcs = [list(range(0, 60)), list(range(100, 160))]
    w0, w1 = _loader_run(RandomMix(srcs, seed=21, longest=True))
    assert sorted(w0) == sorted(w1) == sorted(srcs[0] + srcs[1])
    assert w0 != w1  # each worker mixes differently
    again = _loader_run(RandomMix(srcs, seed=21, longest=True))
    assert again == (w0, w1)  # reproducible with a seed
    # Worker 0's stream is exactly what worker 0 of 2 computes in this process.
    monkeypatch.setenv("WORKER", "0")
    monkeypatch.setenv("NUM_WORKERS", "2")
    assert list(RandomMix(srcs, seed=21, longest=True)) == w0
    monkeypatch.setenv("WORKER", "1")
    assert list(RandomMix(srcs, seed=21, longest=True)) == w1


def test_round_robin_in_dataloader_workers():
    rr = RoundRobin([list(range(0, 5)), list(range(10, 15))])
    w0, w1 = _loader_run(rr)
    assert w0 == w1 == [0, 10, 1, 11, 2, 12, 3, 13, 4, 14]
