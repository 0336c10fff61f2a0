"""Indexed datasets: exact len(), deterministic epochs, mid-epoch resume, resumable mixing."""

from __future__ import annotations

import pytest
from conftest import sample_members, write_tar

import webds
from webds.errors import ArgumentError, LengthError, ShardReadError
from webds.shards.index import ShardIndex

SIZES = [7, 3, 11, 5, 9]  # 35 samples


@pytest.fixture
def indexed(tmp_path):
    urls = [
        str(write_tar(tmp_path / f"shard-{i}.tar", sample_members(n, prefix=f"s{i}-")))
        for i, n in enumerate(SIZES)
    ]
    path = tmp_path / "index.json"
    ShardIndex.build(urls).save(str(path))
    return str(path)


def keys(batches):
    return [list(b[0]) for b in batches]


def make_loader(index, workers, *, seed=3, batch=4, persistent=False, **kw):
    ds = (
        webds.WebDataset(index, shardshuffle=True, seed=seed, **kw)
        .shuffle(5)
        .to_tuple("__key__", "cls")
        .batched(batch)
    )
    return webds.WebLoader(
        ds, batch_size=None, num_workers=workers, persistent_workers=persistent and workers > 0
    )


def test_len_is_exact_and_every_sample_once(indexed):
    ds = webds.WebDataset(indexed)
    assert len(ds) == 35
    assert sorted(s["__key__"] for s in ds) == sorted(
        f"s{i}-{j:06d}" for i, n in enumerate(SIZES) for j in range(n)
    )
    batched = webds.WebDataset(indexed).decode().batched(4)
    assert len(batched) == 9 == sum(1 for _ in batched)
    assert len(webds.WebDataset(indexed).batched(4, partial=False)) == 8
    rebatched = webds.WebDataset(indexed).batched(4).unbatched().batched(6)
    assert len(rebatched) == 6 == sum(1 for _ in rebatched)


def test_len_is_refused_where_it_cannot_be_known(indexed, tmp_path):
    with pytest.raises(LengthError, match="select"):
        len(webds.WebDataset(indexed).select(lambda s: True))
    with pytest.raises(TypeError, match="unknown"):  # what frameworks catch
        len(webds.WebDataset(str(tmp_path / "shard-{0..4}.tar")))
    assert len(webds.WebDataset(indexed).select(bool).with_epoch(5)) == 5


@pytest.mark.parametrize("world,balance,expect", [(2, "pad", 18), (2, "drop", 17), (3, "pad", 12)])
def test_rank_share(indexed, monkeypatch, world, balance, expect):
    seen = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        ds = webds.WebDataset(indexed, balance=balance, shardshuffle=True, seed=1)
        assert len(ds) == expect
        got = [s["__key__"] for s in ds]
        assert len(got) == expect
        seen += got
    assert len(set(seen)) == (35 if balance == "pad" else expect * world)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_len_and_same_seed_same_order(indexed, workers):
    a, b = make_loader(indexed, workers), make_loader(indexed, workers)
    assert len(a) == 9
    first = keys(a)
    assert len(first) == 9 and first == keys(b)
    second = keys(a)  # the next epoch: another order, same samples
    assert second != first
    assert sorted(sum(second, [])) == sorted(sum(first, []))
    a.set_epoch(0)
    assert keys(a) == first
    assert keys(make_loader(indexed, workers, seed=4)) != first


@pytest.mark.parametrize("workers", [0, 2])
def test_rebatching_after_the_workers_keeps_len_exact(indexed, workers):
    # Batches of 4 made in each worker (2 workers: 18 and 17 samples, partial batches at each
    # end), mixed and rebatched by 6 in the main process: 35 samples, 6 batches (5 whole).
    loader = make_loader(indexed, workers).unbatched().shuffle(10).batched(6)
    assert len(loader) == 6
    batches = list(loader)
    assert len(batches) == 6 and sorted(len(b[0]) for b in batches) == [5] + [6] * 5
    assert len(make_loader(indexed, workers).unbatched().batched(6, partial=False)) == 5
    assert len(make_loader(indexed, workers).unbatched()) == 35


@pytest.mark.parametrize("drop_last,samples", [(False, 35), (True, 32)])
def test_rebatching_a_dataloader_that_batches_keeps_len_exact(indexed, drop_last, samples):
    # The DataLoader batches by 4 in each of 2 workers (18 and 17 samples): with drop_last,
    # each worker's last partial batch (2 and 1 samples) is dropped.
    ds = webds.WebDataset(indexed).to_tuple("__key__", "cls")
    loader = webds.WebLoader(ds, batch_size=4, num_workers=2, drop_last=drop_last)
    assert len(loader.unbatched()) == samples == len(list(loader.unbatched()))
    rebatched = loader.unbatched().batched(8)
    assert len(rebatched) == -(-samples // 8) == len(list(rebatched))


# Three workers on a 2-core machine: torch warns, and that is the point (more workers than cores).
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (3, True)])
def test_resume_mid_epoch_gives_the_remaining_batches(indexed, workers, persistent):
    def run(loader, epochs=2):
        return [keys(loader) for _ in range(epochs)]

    full = run(make_loader(indexed, workers, persistent=persistent), 3)
    for k in (1, 4, 8):
        loader = make_loader(indexed, workers, persistent=persistent)
        assert keys(loader) == full[0]
        it = iter(loader)
        got = [list(next(it)[0]) for _ in range(k)]
        state = loader.state_dict()
        assert (state["epoch"], state["items"]) == (1, k)
        del it
        fresh = make_loader(indexed, workers, persistent=persistent)
        fresh.load_state_dict(state)
        fresh.set_epoch(1)  # what a training loop does at the top of each epoch
        rest = keys(fresh)
        # Every sample of the epoch once; as many batches as uninterrupted (the samples that
        # sat in shuffle buffers come again in another order).
        assert sorted(sum(got + rest, [])) == sorted(sum(full[1], []))
        assert len(got + rest) == len(full[1])
        assert keys(fresh) == full[2]  # and the epochs after go on as before


def test_state_after_a_whole_epoch_is_the_next_epoch(indexed):
    loader = make_loader(indexed, 0)
    keys(loader)
    assert (loader.state_dict()["epoch"], loader.state_dict()["items"]) == (1, 0)


def test_resume_refuses_a_changed_configuration(indexed):
    loader = make_loader(indexed, 2)
    state = loader.state_dict()
    make_loader(indexed, 0).load_state_dict(state)  # with an index: planned anew (elastic)
    plain = webds.WebLoader(
        webds.WebDataset(str(indexed).replace("index.json", "shard-{0..4}.tar")), num_workers=2
    )
    with pytest.raises(ArgumentError, match="num_workers"):
        webds.WebLoader(plain.loader.dataset, num_workers=0).load_state_dict(plain.state_dict())
    with pytest.raises(ArgumentError, match="seed"):
        make_loader(indexed, 2, seed=9).load_state_dict(state)
    make_loader(indexed, 0).load_state_dict(state, strict=False)
    with pytest.raises(ArgumentError, match="not a webds pipeline state"):
        loader.load_state_dict({"epoch": 1})


def test_resume_with_epoch_continues_the_stream(tmp_path):
    urls = str(write_tar(tmp_path / "a.tar", sample_members(10)))
    ds = webds.WebDataset(urls).with_epoch(4)
    whole = [[s["__key__"] for s in ds] for _ in range(4)]
    again = webds.WebDataset(urls).with_epoch(4)
    [s for s in again]
    it = iter(again)
    got = [next(it)["__key__"] for _ in range(3)]
    state = again.state_dict()
    fresh = webds.WebDataset(urls).with_epoch(4)
    fresh.load_state_dict(state)
    assert got + [s["__key__"] for s in fresh] == whole[1]  # no buffer: even the same order
    assert [s["__key__"] for s in fresh] == whole[2]


def test_set_epoch_of_the_next_epoch_keeps_the_carried_stream(tmp_path):
    """A loop that calls set_epoch(e) at the top of every epoch gets the same epochs with
    with_epoch as one that does not: the stream carries on; another epoch restarts it."""
    urls = str(write_tar(tmp_path / "a.tar", sample_members(10)))
    plain = webds.WebDataset(urls, shardshuffle=True, seed=3).shuffle(5).with_epoch(4)
    expected = [[s["__key__"] for s in plain] for _ in range(4)]
    ds = webds.WebDataset(urls, shardshuffle=True, seed=3).shuffle(5).with_epoch(4)
    got = []
    for epoch in range(4):
        ds.set_epoch(epoch)
        got.append([s["__key__"] for s in ds])
    assert got == expected
    assert len(set(sum(got[:2], []))) == 8  # epochs 0 and 1: 8 different samples of pass 0
    ds.set_epoch(0)  # another epoch than the next one: start over
    assert [s["__key__"] for s in ds] == expected[0]


def test_seed_reaches_the_sample_shuffle(indexed):
    def order(seed):
        return [s["__key__"] for s in webds.WebDataset(indexed, seed=seed).shuffle(10)]

    assert order(1) == order(1) != order(2)


def test_balance_needs_an_index_and_excludes_splitters(indexed, tmp_path):
    with pytest.raises(ArgumentError, match="webds index"):
        webds.WebDataset(str(tmp_path / "shard-0.tar"), balance="pad")
    with pytest.raises(ArgumentError, match="balance must be"):
        webds.WebDataset(indexed, balance="even")
    with pytest.raises(ArgumentError, match="resampled"):
        webds.WebDataset(indexed, resampled=True)
    # The default splitters, passed explicitly as 1.x code does, are what the plan does.
    keys = [s["__key__"] for s in webds.WebDataset(indexed)]
    explicit = webds.WebDataset(
        indexed, nodesplitter=webds.split_by_node, workersplitter=webds.split_by_worker
    )
    assert [s["__key__"] for s in explicit] == keys
    for other in (dict(nodesplitter=None), dict(workersplitter=webds.single_node_only)):
        with pytest.raises(ArgumentError, match="other than the default"):
            webds.WebDataset(indexed, **other)


def test_index_true_counts_now_and_subsets_must_be_indexed(indexed, tmp_path):
    spec = str(tmp_path / "shard-{0..1}.tar")
    assert len(webds.WebDataset(spec, index=True)) == 10
    assert len(webds.WebDataset(spec, index=indexed)) == 10
    write_tar(tmp_path / "other.tar", sample_members(2))
    with pytest.raises(ArgumentError, match="not in the index"):
        webds.WebDataset(str(tmp_path / "other.tar"), index=indexed)


def test_stale_index_is_an_error_naming_the_shard(indexed, tmp_path):
    write_tar(tmp_path / "shard-1.tar", sample_members(2, prefix="s1-"))  # was 3
    with pytest.raises(ShardReadError, match="index is out of date.*shard-1.tar"):
        list(webds.WebDataset(indexed))
    write_tar(tmp_path / "shard-1.tar", sample_members(4, prefix="s1-"))  # more than indexed
    with pytest.raises(ShardReadError, match="more than 3"):
        list(webds.WebDataset(indexed))


def test_dropped_samples_are_padded_to_keep_the_count(indexed, caplog):
    def fail_some(sample):
        if sample["__key__"].endswith("2"):
            raise ValueError("bad sample")
        return sample

    ds = webds.WebDataset(indexed).map(fail_some, handler=webds.ignore_and_continue)
    got = list(ds)
    assert len(got) == 35
    assert "fewer than planned" in caplog.text


@pytest.mark.parametrize("skip", [0, 5, 17])
def test_random_mix_resumes(tmp_path, skip):
    a = str(write_tar(tmp_path / "a.tar", sample_members(20, prefix="a")))
    b = str(write_tar(tmp_path / "b.tar", sample_members(20, prefix="b")))

    def mix():
        return webds.WebDataset(a, seed=1).mix(webds.WebDataset(b), probs=[2, 1], seed=7)

    whole = [s["__key__"] for s in mix()]
    m = mix()
    it = iter(m)
    got = [next(it)["__key__"] for _ in range(skip)]
    fresh = mix()
    fresh.load_state_dict(m.state_dict())
    assert got + [s["__key__"] for s in fresh] == whole


def test_round_robin_resumes():
    rr = webds.RoundRobin([webds.FluidWrapper(list(range(5))), list(range(10, 14))])
    whole = list(rr)
    rr2 = webds.RoundRobin([webds.FluidWrapper(list(range(5))), list(range(10, 14))])
    rr2.load_state_dict({"version": 1, "epoch": 0, "consumed": 3})
    assert list(rr2) == whole[3:]


def test_mix_in_workers_resumes(tmp_path):
    write_tar(tmp_path / "a-0.tar", sample_members(30, prefix="a"))
    write_tar(tmp_path / "a-1.tar", sample_members(30, prefix="c"))
    b = str(write_tar(tmp_path / "b.tar", sample_members(40, prefix="b")))
    spec = str(tmp_path / "a-{0..1}.tar")

    def loader():
        mixed = webds.WebDataset(spec, index=True, seed=1).mix(
            webds.WebDataset(b, index=True, seed=1), probs=[1, 1], seed=5
        )
        return webds.WebLoader(mixed.map(lambda s: s["__key__"]), batch_size=None, num_workers=2)

    whole = list(loader())
    interrupted = loader()
    it = iter(interrupted)
    got = [next(it) for _ in range(6)]
    fresh = loader()
    fresh.load_state_dict(interrupted.state_dict())
    assert got + list(fresh) == whole


# -- an epoch is a function of (seed, epoch, with_epoch's n, topology) ----------------------------


def carried(index, n, workers=None, persistent=False, loader_epoch=None):
    """A with_epoch(n) pipeline over the 35 indexed samples; through a WebLoader when
    ``workers`` is given (``loader_epoch``: the loader's with_epoch instead of the dataset's)."""
    ds = webds.WebDataset(index, shardshuffle=True, seed=3).shuffle(5)
    if workers is None:
        return ds.with_epoch(n)
    if loader_epoch is None:
        ds = ds.with_epoch(n)
    loader = webds.WebLoader(
        ds, batch_size=None, num_workers=workers, persistent_workers=persistent and workers > 0
    )
    return loader if loader_epoch is None else loader.with_epoch(loader_epoch)


def epochs(make, first, count):
    it = make()
    out = []
    for e in range(first, first + count):
        it.set_epoch(e)
        out.append([s["__key__"] for s in it])
    return out


SETUPS = [
    dict(),
    dict(workers=0),
    dict(workers=2),
    dict(workers=2, persistent=True),
    dict(workers=2, loader_epoch=16),
]


@pytest.mark.parametrize("n", [13, 50])  # shorter and longer than a pass (35 samples)
@pytest.mark.parametrize("setup", range(len(SETUPS)))
@pytest.mark.parametrize("with_index", [True, False])
def test_an_epoch_started_in_a_new_process_is_the_uninterrupted_runs(indexed, n, setup, with_index):
    """timm and open_clip restart at epoch k from a model checkpoint, with no loader state, and
    set the epoch: epoch k is the uninterrupted run's, item for item, though with_epoch carries
    the stream from one epoch to the next (every sample of a pass is seen before the next pass
    begins). The passes' lengths come from the index, or from counting the local shards."""
    kw = SETUPS[setup]
    spec = indexed if with_index else indexed.replace("index.json", "shard-{0..4}.tar")
    whole = epochs(lambda: carried(spec, n, **kw), 0, 4)
    for k in (1, 3):
        assert epochs(lambda: carried(spec, n, **kw), k, 1)[0] == whole[k], k
    if "workers" not in kw:
        # The carry: the epochs' items are the passes' one after another.
        flat, every = sum(whole, []), sorted(s["__key__"] for s in webds.WebDataset(indexed))
        assert all(sorted(flat[i : i + 35]) == every for i in range(0, len(flat) - 34, 35))


def test_workers_that_are_not_persistent_go_on_with_the_stream(indexed, tmp_path, caplog):
    """New worker processes every epoch take over the stream where the last epoch's left it
    (their ledgers, through the main process), as persistent workers go on with theirs, with
    or without an index."""
    plain = str(tmp_path / "shard-{0..4}.tar")
    for spec in (indexed, plain):
        fresh_workers = epochs(lambda s=spec: carried(s, 13, workers=2), 0, 4)
        persistent = epochs(lambda s=spec: carried(s, 13, workers=2, persistent=True), 0, 4)
        assert fresh_workers == persistent
    # Where the passes' lengths are unknown (a stage whose count nobody knows, remote shards
    # without an index), a new process at epoch k starts at pass k, and says so.
    unknown = webds.WebDataset(plain, shardshuffle=True, seed=3).select(bool).with_epoch(13)
    unknown.set_epoch(2)
    with caplog.at_level("WARNING", logger="webds"):
        list(unknown)
    assert "index" in caplog.text and "epoch 2" in caplog.text


@pytest.mark.parametrize("workers, persistent", [(None, False), (0, False), (2, False), (2, True)])
def test_resampled_epochs_are_fresh_draws_in_a_new_process_too(
    indexed, tmp_path, workers, persistent
):
    """Resampled shards are one endless pass, so there is no pass to carry on: every epoch of a
    with_epoch pipeline draws afresh from (seed, epoch), and a new process at epoch k draws the
    uninterrupted run's epoch k (webdataset's behaviour with fresh workers)."""
    spec = str(tmp_path / "shard-{0..4}.tar")

    def make():
        ds = webds.WebDataset(spec, resampled=True, seed=3).shuffle(5).with_epoch(13)
        if workers is None:
            return ds
        return webds.WebLoader(
            ds, batch_size=None, num_workers=workers, persistent_workers=persistent
        )

    whole = epochs(make, 0, 4)
    assert len({tuple(e) for e in whole}) == 4  # each epoch its own draw
    for k in (1, 3):
        assert epochs(make, k, 1)[0] == whole[k]


def test_a_plain_dataloaders_new_workers_start_each_epoch_at_its_pass(indexed):
    """Under a plain torch DataLoader whose workers are not persistent, each epoch's new
    workers start at pass k, as webdataset's do: getting to where the carried epoch starts
    would read and drop up to a pass every epoch (a WebLoader hands its workers their stream)."""
    from torch.utils.data import DataLoader

    def make(persistent=False):
        ds = webds.WebDataset(indexed, shardshuffle=True, seed=3).shuffle(5).with_epoch(13)
        return ds, DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)

    ds, loader = make()
    got = []
    for e in range(3):
        ds.set_epoch(e)
        got.append(sorted(s["__key__"] for s in loader))
    for e in range(3):
        ds, loader = make()
        ds.set_epoch(e)
        assert sorted(s["__key__"] for s in loader) == got[e]  # a new process: the same
    web = epochs(lambda: carried(indexed, 13, workers=2), 0, 3)
    assert [sorted(x) for x in web] != got  # (the WebLoader's carry differs)


def test_local_shards_are_counted_as_the_tar_stage_reads_them(indexed, tmp_path):
    from webds.shards.counts import count_local_samples

    urls = [str(tmp_path / f"shard-{i}.tar") for i in range(5)]
    stage = webds.tarfile_to_samples()
    assert count_local_samples(urls, stage) == dict(zip(urls, SIZES))
    # Only the samples the stage keeps: select_files that keeps no member of some samples.
    none_of_3 = webds.tarfile_to_samples(select_files=lambda name: not name.startswith("s0-000003"))
    assert count_local_samples(urls[:1], none_of_3) == {urls[0]: SIZES[0] - 1}
    assert count_local_samples(["http://127.0.0.1:9/a.tar"], stage) is None  # not read
    cut = tmp_path / "cut.tar"
    cut.write_bytes((tmp_path / "shard-2.tar").read_bytes()[:1500])
    assert count_local_samples([str(cut)], stage) is None  # damaged: unknown, said


@pytest.mark.parametrize("with_index", [True, False])
@pytest.mark.parametrize("workers", [None, 2])
def test_an_epoch_of_batches_started_in_a_new_process(indexed, with_index, workers):
    """One step off the test above: with_epoch counting batches (batched before it, partial
    batches at each pass's end), with and without an index."""
    spec = indexed if with_index else indexed.replace("index.json", "shard-{0..4}.tar")

    def make():
        ds = webds.WebDataset(spec, shardshuffle=True, seed=3).shuffle(5)
        ds = ds.to_tuple("__key__").batched(3).with_epoch(5)
        if workers is None:
            return ds
        return webds.WebLoader(ds, batch_size=None, num_workers=workers)

    whole = []
    it = make()
    for e in range(4):
        it.set_epoch(e)
        whole.append([list(b[0]) for b in it])
    for k in (1, 3):
        fresh = make()
        fresh.set_epoch(k)
        assert [list(b[0]) for b in fresh] == whole[k], k
