"""Mid-epoch resume is exact: what was read before the checkpoint plus what a new pipeline reads
after loading the state is exactly one uninterrupted epoch (each sample once), whatever the
stages drop, buffer, batch or reorder, seeded or not, with or without an index or DataLoader
workers; and what cannot be resumed exactly is refused, saying why.

Each case builds a pipeline, takes ``state_dict()`` after ``k`` items, lets that same pipeline
run on (the uninterrupted epoch), then loads the state (through JSON) into a new pipeline built
the same way and compares. Samples that sat in a shuffle buffer at the checkpoint are read again
and may come in another order, so epochs are compared as multisets of sample keys.
"""

from __future__ import annotations

import itertools
import json
import random
import zlib
from collections import Counter
from typing import Any, Callable, List

import pytest
from conftest import sample_members, write_tar

import webds
from webds.errors import ResumeError
from webds.shards.index import ShardIndex


def keys_of(item: Any) -> List[str]:
    """The sample keys in an item: a sample, a batch of samples, a tuple (key first), a key."""
    if isinstance(item, str):
        return [item]
    if isinstance(item, dict):
        key = item["__key__"]
        return [key] if isinstance(key, str) else list(key)
    if isinstance(item, (tuple, list)):
        first = item[0]
        return [first] if isinstance(first, str) else list(first)
    raise AssertionError(f"no key in {item!r}")


def flat(items: List[Any]) -> List[str]:
    return [k for item in items for k in keys_of(item)]


def shards(tmp_path, sizes, index=False):
    """Shards of the given sizes (keys s{i}-{j:06d}); their brace spec, or their index file."""
    for i, n in enumerate(sizes):
        write_tar(tmp_path / f"shard-{i}.tar", sample_members(n, prefix=f"s{i}-"))
    spec = str(tmp_path / f"shard-{{0..{len(sizes) - 1}}}.tar")
    if not index:
        return spec
    path = tmp_path / "index.json"
    ShardIndex.build(spec).save(str(path))
    return str(path)


def interrupt(make: Callable[[], Any], k: int):
    """(items before the checkpoint, the state, the uninterrupted epoch, the epoch after it)."""
    a = make()
    it = iter(a)
    before = list(itertools.islice(it, k))
    state = json.loads(json.dumps(a.state_dict()))  # a state survives JSON
    whole = before + list(it)
    return before, state, whole, list(a)


def resume(make: Callable[[], Any], state: Any):
    """(the rest of the interrupted epoch, the epoch after it) from a new pipeline."""
    b = make()
    b.load_state_dict(state)
    return list(b), list(b)


def assert_exact(make: Callable[[], Any], k: int) -> None:
    before, state, whole, after_whole = interrupt(make, k)
    rest, after = resume(make, state)
    assert Counter(flat(before + rest)) == Counter(flat(whole))
    assert flat(after) == flat(after_whole)  # and the next epoch is exactly as it would be


def key_hash(key: str) -> int:
    return zlib.crc32(key.encode())


# -- the cases that used to repeat or lose samples -----------------------------------------------


def test_with_epoch_in_loader_workers(tmp_path):
    spec = shards(tmp_path, [10, 10, 10, 10])

    def make():
        ds = webds.WebDataset(spec, shardshuffle=True, seed=1).with_epoch(20)
        return webds.WebLoader(ds.map(lambda s: s["__key__"]), batch_size=None, num_workers=2)

    for k in (6, 25, 40):
        assert_exact(make, k)


@pytest.mark.parametrize("index", [False, True])
def test_unseeded_shuffle_rsample_and_mix(tmp_path, monkeypatch, index):
    monkeypatch.delenv("WDS_SEED", raising=False)
    spec = shards(tmp_path, [10, 10, 10, 10], index=index)
    other = str(write_tar(tmp_path / "b.tar", sample_members(30, prefix="b")))
    makers = [
        lambda: webds.WebDataset(spec).shuffle(10),
        lambda: webds.WebDataset(spec).rsample(0.6),
        lambda: webds.WebDataset(spec).shuffle(5).rsample(0.5).shuffle(7),
        lambda: webds.WebDataset(spec).mix(webds.WebDataset(other).shuffle(5), longest=True),
    ]
    for make in makers:
        for k in (1, 6, 11):
            assert_exact(make, k)


def test_set_epoch_after_resuming(tmp_path):
    index = shards(tmp_path, [7, 3, 11, 5, 9], index=True)

    def make():
        ds = webds.WebDataset(index, shardshuffle=True, seed=3).shuffle(5).batched(4)
        return webds.WebLoader(ds.to_tuple("__key__", "cls"), batch_size=None, num_workers=2)

    before, state, whole, after_whole = interrupt(make, 3)
    loader = make()
    loader.load_state_dict(state)
    seen = []
    for epoch in (0, 1):  # the state is in epoch 0: the loop restarts there
        loader.set_epoch(epoch)
        seen.append(flat(list(loader)))
    loader.set_epoch(2)
    assert Counter(flat(before) + seen[0]) == Counter(flat(whole))
    assert seen[1] == flat(after_whole)
    assert Counter(flat(list(loader))) == Counter(flat(whole))  # epoch 2: all 35 again


def test_a_worker_out_of_shards_at_the_checkpoint(tmp_path):
    spec = shards(tmp_path, [2, 20, 2, 20])  # worker 0 reads 4 samples, worker 1 reads 40

    def make():
        ds = webds.WebDataset(spec).map(lambda s: s["__key__"])
        return webds.WebLoader(ds, batch_size=None, num_workers=2)

    before, state, whole, _ = interrupt(make, 20)
    rest, _ = resume(make, state)
    assert len(whole) == 44 and Counter(before + rest) == Counter(whole)


def test_select_empties_most_of_one_workers_share(tmp_path):
    index = shards(tmp_path, [10, 12, 10, 12], index=True)

    def make():
        ds = webds.WebDataset(index).select(lambda s: not s["__key__"].startswith(("s0", "s1")))
        return webds.WebLoader(ds.map(lambda s: s["__key__"]), batch_size=None, num_workers=2)

    for k in (3, 10, 21):
        assert_exact(make, k)


@pytest.mark.parametrize("index", [False, True])
def test_dropping_stages(tmp_path, index):
    spec = shards(tmp_path, [10, 10, 10, 10], index=index)

    def corrupt_some(sample):
        if key_hash(sample["__key__"]) % 5 == 0:
            sample["cls"] = b"\xff not an int"
        return sample

    makers = [
        lambda: (
            webds.WebDataset(spec, seed=0)
            .shuffle(8)
            .map(lambda s: None if key_hash(s["__key__"]) % 4 == 0 else s)
        ),
        lambda: webds.WebDataset(spec, seed=0).select(lambda s: key_hash(s["__key__"]) % 3),
        lambda: (
            webds.WebDataset(spec, seed=0)
            .map(corrupt_some)
            .shuffle(6)
            .decode(handler=webds.ignore_and_continue)
        ),
    ]
    for make in makers:
        whole = flat(list(make()))
        if index:  # an indexed epoch has its planned count: the last sample repeats for each drop
            whole = list(dict.fromkeys(whole))
        assert 20 < len(whole) < 40
        for k in (2, 11, 19):
            before, state, uninterrupted, _ = interrupt(make, k)
            rest, _ = resume(make, state)
            got = flat(before + rest)
            assert len(got) == len(flat(uninterrupted))
            if index:
                assert set(got) == set(whole)
            else:
                assert Counter(got) == Counter(whole)


def test_dataset_seed_reaches_rsample(tmp_path):
    spec = shards(tmp_path, [10, 10, 10, 10])
    runs = [flat(list(webds.WebDataset(spec, seed=42).rsample(0.5))) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] != flat(list(webds.WebDataset(spec, seed=43).rsample(0.5)))
    for k in (3, 12):
        assert_exact(lambda: webds.WebDataset(spec, seed=42).rsample(0.5), k)


# -- what is refused -------------------------------------------------------------------------------


def test_refused_resumes_say_why(tmp_path):
    spec = shards(tmp_path, [10, 10])
    before, state, _, _ = interrupt(lambda: webds.WebDataset(spec).slice(15), 4)
    with pytest.raises(ResumeError, match=r"slice\(15,\).*with_epoch"):
        webds.WebDataset(spec).slice(15).load_state_dict(state)
    rest, _ = resume(lambda: webds.WebDataset(spec).slice(15), dict(state, problem=None))
    assert len(rest) == 15  # a state without its problem resumes, and the slice counts again

    _, state, _, _ = interrupt(lambda: webds.WebDataset(spec, seed=1).shuffle(5), 4)
    with pytest.raises(ResumeError, match="seed: saved 1, now 2"):
        webds.WebDataset(spec, seed=2).shuffle(5).load_state_dict(state)
    with pytest.raises(ResumeError, match="stages"):
        webds.WebDataset(spec, seed=1).shuffle(5).select(bool).load_state_dict(state)
    # Version 1 (webds 0.1, never released) counted items: refused, even with strict=False.
    old = {"version": 1, "epoch": 3, "consumed": 4, "config": {}}
    for strict in (True, False):
        with pytest.raises(ResumeError, match=r"version 1 .*never released.*set_epoch\(3\)"):
            webds.WebDataset(spec).load_state_dict(old, strict=strict)


@pytest.mark.parametrize("shuffled", [False, True])
def test_decomposed_tar_stages_are_refused(tmp_path, shuffled):
    # Refused when the position is saved (it used to be at load, and only when a buffer held
    # two items of one shard; unshuffled, the rest of the shard being read was lost).
    spec = shards(tmp_path, [10, 10])

    def make():
        return webds.DataPipeline(
            webds.SimpleShardList(spec),
            webds.url_opener(),
            webds.tar_file_expander(),
            webds.group_by_keys(),
            webds.shuffle(5, seed=0) if shuffled else None,
        )

    with pytest.raises(ResumeError, match="tarfile_to_samples"):
        interrupt(make, 4)
    a = make()
    it = iter(a)
    list(itertools.islice(it, 4))
    with pytest.raises(ResumeError, match="tarfile_to_samples"):
        make().load_state_dict(a.state_dict(strict=False))


# -- property: random pipelines --------------------------------------------------------------------


def random_pipeline(rng: random.Random, spec: str, seed: Any):
    """A random stage list over samples, then maybe batching, unbatching, reshuffling; whether
    its items are batches, and whether it may drop samples."""
    stages: List[Callable[[Any], Any]] = []
    drops = False
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(["shuffle", "select", "map_none", "rsample"])
        drops |= kind != "shuffle"
        if kind == "shuffle":
            n = rng.randint(1, 9)
            stages.append(lambda d, n=n: d.shuffle(n, initial=max(1, n // 2)))
        elif kind == "select":
            m = rng.randint(2, 5)
            stages.append(lambda d, m=m: d.select(lambda s: key_hash(s["__key__"]) % m))
        elif kind == "map_none":
            m = rng.randint(2, 5)
            stages.append(
                lambda d, m=m: d.map(lambda s: None if key_hash(s["__key__"]) % m == 0 else s)
            )
        else:
            p = rng.choice([0.3, 0.7])
            stages.append(lambda d, p=p: d.rsample(p))
    batch = rng.choice([None, 2, 3])
    batches = bool(batch)
    if batch:
        stages.append(lambda d: d.to_tuple("__key__", "cls").batched(batch))
        if rng.random() < 0.5:
            stages.append(lambda d: d.unbatched())
            batches = False
            if rng.random() < 0.5:
                n = rng.randint(2, 6)
                stages.append(lambda d, n=n: d.shuffle(n).batched(2))
                batches = True
    return stages, batches, drops


@pytest.mark.parametrize("case", range(48))
def test_random_pipelines_resume_exactly(tmp_path, monkeypatch, case):
    monkeypatch.delenv("WDS_SEED", raising=False)
    rng = random.Random(case)
    sizes = [rng.randint(0, 9) for _ in range(rng.randint(2, 5))]
    sizes[0] = max(sizes[0], 3)
    index = rng.random() < 0.5
    spec = shards(tmp_path, sizes, index=index)
    seed = rng.choice([None, 7])
    workers = rng.choice([0, 0, 1, 2])
    with_epoch = rng.choice([None, None, 5, 13])
    if with_epoch:
        # Workers that are not persistent start each epoch's stream afresh, so with_epoch's
        # carried stream is tested in one process here, and in workers (without a buffer,
        # where every epoch is the same one) by test_with_epoch_in_loader_workers. Seeded, so
        # that a second pipeline can say what the first pass holds.
        workers, seed = 0, 7
    stages, batches, drops = random_pipeline(rng, spec, seed)
    shuffle_shards = rng.random() < 0.5
    config = dict(sizes=sizes, index=index, seed=seed, workers=workers, with_epoch=with_epoch)

    def make():
        ds = webds.WebDataset(spec, seed=seed, shardshuffle=shuffle_shards, empty_check=False)
        for add in stages:
            ds = add(ds)
        if with_epoch:
            ds = ds.with_epoch(with_epoch)
        if workers == 0 and rng_loader:
            return ds
        loader = webds.WebLoader(
            ds, batch_size=None, num_workers=workers, persistent_workers=persistent
        )
        if main_stages:  # stages after the workers, in the main process
            loader = loader.unbatched().shuffle(4).batched(3) if batches else loader.shuffle(4)
        return loader

    rng_loader = rng.random() < 0.5
    main_stages = not with_epoch and rng.random() < 0.4
    config.update(main_stages=main_stages and not (workers == 0 and rng_loader))
    persistent = workers > 0 and rng.random() < 0.5
    config.update(persistent=persistent)
    if with_epoch is None:
        a = make()
        k = rng.randint(0, len(list(a)))  # this pipeline's epoch 0 (unseeded: its own draw)
        a.set_epoch(0)
        it = iter(a)
        before = list(itertools.islice(it, k))
        state = json.loads(json.dumps(a.state_dict()))
        whole = before + list(it)
        after_whole = list(a)
        rest, after = resume(make, state)
        got, want = flat(before + rest), flat(whole)
        if index and drops:
            # An indexed epoch keeps its planned count: each dropped sample is made up by
            # repeating the stream's last item, which may be another one after a resume.
            assert set(got) == set(want), config
        else:
            assert Counter(got) == Counter(want), config
        assert flat(after) == flat(after_whole), config
        return
    passes = webds.WebDataset(spec, seed=seed, shardshuffle=shuffle_shards, empty_check=False)
    for add in stages:
        passes = add(passes)
    first_pass = list(passes)
    one_pass = Counter(flat(first_pass))
    if index and drops:
        # One indexed pass is padded to its planned count by repeating its last item; the
        # stream that with_epoch cuts is not: the pass proper is its distinct samples.
        one_pass = Counter(set(one_pass))
    # One process: with_epoch cuts one endless stream into epochs. The first pass over the data
    # (each kept sample once) must come out whole, wherever in it the checkpoint was.
    at = rng.randint(0, len(first_pass))  # the checkpoint's place in the stream
    a = make()
    before = sum((list(a) for _ in range(at // with_epoch)), [])
    it = iter(a)
    before += [next(it) for _ in range(at % with_epoch)]
    state = json.loads(json.dumps(a.state_dict()))
    del it
    b = make()
    b.load_state_dict(state)
    stream = flat(before)
    while len(stream) < sum(one_pass.values()):
        stream += flat(list(b))
    assert Counter(stream[: sum(one_pass.values())]) == one_pass, config


# -- the index, len() and the writer --------------------------------------------------------------


def test_a_second_writer_session_extends_the_index(tmp_path):
    pattern = str(tmp_path / "train-%06d.tar")

    def write(start, first, n):
        with webds.ShardWriter(pattern, maxcount=10, start_shard=start) as sink:
            for i in range(first, first + n):
                sink.write({"__key__": f"k{i:04d}", "cls": i})

    write(0, 0, 20)  # shards 0 and 1
    write(2, 20, 20)  # continues the numbering: shards 2 and 3
    index = str(tmp_path / "train.index.json")
    assert len(webds.ShardIndex.load(index)) == 4
    assert sorted(s["__key__"] for s in webds.WebDataset(index)) == [f"k{i:04d}" for i in range(40)]
    spec = str(tmp_path / "train-{000000..000003}.tar")
    assert len(webds.WebDataset(spec, index=index)) == 40
    write(1, 100, 5)  # shard 1 written again, shorter: its entry is replaced, the others kept
    loaded = webds.ShardIndex.load(index)
    assert loaded.counts == [10, 5, 10, 10] and len(webds.WebDataset(index)) == 35
    (tmp_path / "bad.index.json").write_text("not an index")
    with pytest.raises(webds.ArgumentError, match="not one it can extend"):
        webds.ShardWriter(pattern, index=str(tmp_path / "bad.index.json"))


def test_len_counts_repeat(tmp_path):
    index = shards(tmp_path, [7, 3, 11, 5, 9], index=True)
    for ds, n in [
        (webds.WebDataset(index).repeat(2), 70),
        (webds.WebDataset(index).batched(4).repeat(2), 18),
        (webds.WebDataset(index).batched(4).repeat(2).unbatched(), 70),
        (webds.WebDataset(index).repeat(2, nbatches=50), 50),
    ]:
        assert len(ds) == n == sum(1 for _ in ds)
    with pytest.raises(TypeError, match="repeats forever"):
        len(webds.WebDataset(index).repeat())
    loader = webds.WebLoader(webds.WebDataset(index).batched(4).repeat(2), batch_size=None)
    assert len(loader) == 18 == len(list(loader))


def test_select_and_rename_files_with_an_index(tmp_path):
    members = []
    for j in range(6):
        members += [(f"k{j}.txt", b"t"), (f"k{j}.cls", str(j).encode())]
        if j % 2:
            members.append((f"k{j}.jpg", b"j"))
    write_tar(tmp_path / "a.tar", members)
    index = tmp_path / "index.json"
    ShardIndex.build(str(tmp_path / "a.tar")).save(str(index))
    jpgs = webds.WebDataset(str(index), select_files=lambda n: n.endswith(".jpg"))
    got = [s["__key__"] for s in jpgs]  # samples without a jpg: none (the count is the plan's)
    assert got[:3] == ["k1", "k3", "k5"] and set(got) == {"k1", "k3", "k5"} and len(got) == 6
    renamed = webds.WebDataset(str(index), rename_files=lambda n: n.replace(".txt", ".text"))
    got = list(renamed)
    assert len(got) == 6 and all("text" in s and "txt" not in s for s in got)
    # Split between two ranks by sample number, as the index counts them.
    seen = []
    for rank in range(2):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RANK", str(rank))
            mp.setenv("WORLD_SIZE", "2")
            seen += [
                s["__key__"]
                for s in webds.WebDataset(str(index), select_files=lambda n: ".jpg" in n)
            ]
    # Each rank's planned count is kept by repeating its last sample (see docs/distributed.md).
    assert len(seen) == 6 and set(seen) == {"k1", "k3", "k5"}


def test_fields_that_differ_only_in_case_are_refused_when_written(tmp_path):
    with webds.TarWriter(str(tmp_path / "a.tar")) as sink:
        with pytest.raises(webds.EncodeError, match="'TXT' and 'txt' differ only in case"):
            sink.write({"__key__": "a", "txt": "x", "TXT": "y"})
        sink.write({"__key__": "b", "TXT": "y", "cls": 1})  # capitals alone are fine
    assert [s["txt"] for s in webds.WebDataset(str(tmp_path / "a.tar"))] == [b"y"]


@pytest.mark.parametrize("workers,index", [(0, True), (2, False)])
def test_with_epoch_on_the_loader_resumes_its_stream(tmp_path, workers, index):
    # The loader's epochs cut one DataLoader pass: a checkpoint at or between its epochs must
    # keep what every worker read, and the first pass must come out whole.
    spec = shards(tmp_path, [7, 3, 11, 5, 9], index=index)

    def make():
        ds = webds.WebDataset(spec, shardshuffle=True, seed=3).shuffle(4)
        loader = webds.WebLoader(
            ds.to_tuple("__key__", "cls"), batch_size=None, num_workers=workers
        )
        return loader.with_epoch(13)

    for at in (5, 13, 26, 30):
        a = make()
        before = sum((flat(list(a)) for _ in range(at // 13)), [])
        it = iter(a)
        before += flat(list(itertools.islice(it, at % 13)))
        state = json.loads(json.dumps(a.state_dict()))
        del it
        a.close()
        b = make()
        b.load_state_dict(state)
        stream = before + sum((flat(list(b)) for _ in range(3)), [])
        b.close()
        assert sorted(stream[:35]) == sorted(
            f"s{i}-{j:06d}" for i, n in enumerate([7, 3, 11, 5, 9]) for j in range(n)
        ), at
