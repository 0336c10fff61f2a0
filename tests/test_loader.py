"""WebLoader with real DataLoader worker processes."""

from __future__ import annotations

import collections
import inspect

import pytest
from conftest import sample_members, write_tar
from test_batchmemory import same

from webds.errors import ShardReadError
from webds.fluent import WebDataset
from webds.loader import WebLoader

N_SHARDS, PER_SHARD = 6, 25


@pytest.fixture
def shards(tmp_path):
    for s in range(N_SHARDS):
        write_tar(tmp_path / f"d-{s}.tar", sample_members(PER_SHARD, prefix=f"s{s}-"))
    return str(tmp_path / f"d-{{0..{N_SHARDS - 1}}}.tar")


ALL_KEYS = sorted(f"s{s}-{i:06d}" for s in range(N_SHARDS) for i in range(PER_SHARD))


def loader_keys(loader):
    out = []
    for batch in loader:
        out.extend(batch[0] if isinstance(batch, (tuple, list)) else [batch["__key__"]])
    return out


def test_two_workers_every_sample_once_per_epoch(shards):
    ds = WebDataset(shards, shardshuffle=True, seed=1).to_tuple("__key__", "cls").batched(7)
    loader = WebLoader(ds, batch_size=None, num_workers=2)
    epochs = [loader_keys(loader) for _ in range(2)]
    for keys in epochs:
        assert sorted(keys) == ALL_KEYS
        assert not [k for k, c in collections.Counter(keys).items() if c > 1]
    assert epochs[0] != epochs[1], "shard order should change between epochs"


def test_persistent_workers_still_reshuffle(shards):
    ds = WebDataset(shards, shardshuffle=True, seed=1).to_tuple("__key__", "cls").batched(5)
    loader = WebLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    epochs = [loader_keys(loader) for _ in range(3)]
    assert all(sorted(k) == ALL_KEYS for k in epochs)
    assert len({tuple(k) for k in epochs}) > 1


def test_rebatching_after_workers(shards):
    ds = WebDataset(shards).to_tuple("__key__", "cls").batched(4)
    loader = WebLoader(ds, batch_size=None, num_workers=2)
    loader = loader.unbatched().shuffle(50, seed=0).batched(16)
    batches = list(loader)
    sizes = [len(b[0]) for b in batches]
    assert sizes == [16] * (len(ALL_KEYS) // 16) + [len(ALL_KEYS) % 16]
    assert sorted(k for b in batches for k in b[0]) == ALL_KEYS


def test_with_epoch_and_length(shards):
    ds = WebDataset(shards, resampled=True, seed=0).to_tuple("__key__", "cls").batched(5)
    loader = WebLoader(ds, batch_size=None, num_workers=2).with_epoch(9).with_length(9)
    assert len(loader) == 9
    assert len(list(loader)) == 9
    assert len(list(loader)) == 9


def test_fewer_shards_than_workers(tmp_path):
    write_tar(tmp_path / "one.tar", sample_members(10))
    ds = WebDataset(str(tmp_path / "one.tar")).to_tuple("__key__", "cls")
    keys = [k for k, _ in WebLoader(ds, batch_size=None, num_workers=2)]
    assert sorted(keys) == [f"{i:06d}" for i in range(10)]


def test_worker_error_reaches_main_process_typed(tmp_path):
    path = write_tar(tmp_path / "bad.tar", sample_members(10))
    path.write_bytes(path.read_bytes()[:1500])
    loader = WebLoader(WebDataset(str(path)), batch_size=None, num_workers=1)
    with pytest.raises(ShardReadError) as info:
        list(loader)
    assert "bad.tar" in str(info.value)


def webds_state_at_epoch_end(src):
    """A last stage: after the epoch's items, one more item saying how much webds state this
    worker process holds (objects of webds types and generators of webds code still alive)."""
    import gc
    import os
    import pickle

    from torch.utils.data import get_worker_info

    yield from src
    gc.collect()
    objects = generators = 0
    for obj in gc.get_objects():
        if str(getattr(type(obj), "__module__", "")).startswith("webds"):
            objects += 1
        elif inspect.isgenerator(obj) and "webds" in obj.gi_code.co_filename:
            generators += 1
    dataset = pickle.dumps(get_worker_info().dataset)
    yield ("state", os.getpid(), objects, generators, len(dataset))


def test_persistent_workers_keep_no_state_per_epoch(shards):
    ds = WebDataset(shards, shardshuffle=True, seed=1).to_tuple("__key__", "cls").batched(5)
    ds = ds.compose(webds_state_at_epoch_end)
    loader = WebLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    states = collections.defaultdict(list)
    for _ in range(5):
        keys = []
        for item in loader:
            if item[0] == "state":
                states[item[1]].append(tuple(item[2:]))
            else:
                keys.extend(item[0])
        assert sorted(keys) == ALL_KEYS
    assert len(states) == 2, "the same two workers every epoch"
    for per_epoch in states.values():
        assert len(per_epoch) == 5
        # The first epoch may load what is loaded once; after it, nothing may pile up.
        assert len(set(per_epoch[1:])) == 1, per_epoch


@pytest.mark.parametrize(
    "workers,persistent,stopped,indexed",
    [
        (2, False, "with_epoch", False),
        (2, True, "with_epoch", False),
        (1, False, "with_epoch", True),
        (3, True, "with_epoch", True),
        (2, False, "abandoned", False),
        (3, True, "abandoned", True),
    ],
)
def test_a_dropped_loader_stops_its_workers_when_collected(
    tmp_path, workers, persistent, stopped, indexed, monkeypatch
):
    """A loader dropped while its workers run (a with_epoch loader stopped mid-stream, an
    epoch's iterator abandoned) may be a reference cycle (a stream's generators hold it):
    collected, its workers must be told to stop while the iterator's queues still work. Told
    after the collector closed them, each worker saw the stop only at its 5-second poll: each
    worker counts the stop (None) its index queue brought it, in a counter shared with this
    process, and every worker must have had one."""
    import gc
    import multiprocessing
    import weakref

    from torch.utils.data._utils import worker as torch_worker

    told = multiprocessing.get_context("fork").Value("i", 0)
    real_loop = torch_worker._worker_loop

    def loop(kind, dataset, index_queue, *args, **kw):  # (in the worker, forked after this)
        real_get = index_queue.get

        def get(*a, **k):
            r = real_get(*a, **k)
            if r is None:
                with told.get_lock():
                    told.value += 1
            return r

        index_queue.get = get
        return real_loop(kind, dataset, index_queue, *args, **kw)

    monkeypatch.setattr(torch_worker, "_worker_loop", loop)

    from test_resume import shards

    spec = shards(tmp_path, [10, 10, 10], index=indexed)
    ds = WebDataset(spec).shuffle(5)
    loader = WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent)
    if stopped == "with_epoch":
        loader = loader.with_epoch(7)
        assert len(list(loader)) == 7
        it = None
    else:
        it = iter(loader)
        next(it)
    procs = list(loader.pipeline[0]._reading._workers)
    assert len(procs) == workers and all(w.is_alive() for w in procs)
    collected = weakref.ref(loader)
    del loader, it
    gc.collect()
    assert collected() is None and not any(w.is_alive() for w in procs)
    assert told.value == workers  # each worker was told, none left to its poll


def test_a_loader_with_live_persistent_workers_pickles_without_them(shards):
    """Pickled (or deep-copied) while its persistent workers are alive, mid-epoch or between
    epochs, a WebLoader's copy leaves them behind and starts its own when read: it reads what
    the original reads; the original keeps its workers and its epoch in flight."""
    import copy
    import pickle

    def loader():
        ds = WebDataset(shards, shardshuffle=True, seed=3).to_tuple("__key__", "cls")
        return WebLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)

    original = loader()
    first_epoch = loader_keys(original)
    workers = [w.pid for w in original.loader._iterator._workers]
    it = iter(original)
    head = next(it)[0]
    for clone in (pickle.loads(pickle.dumps(original)), copy.deepcopy(original)):
        assert clone.loader._iterator is None
        assert sorted(loader_keys(clone)) == ALL_KEYS
        clone.close()
    rest = [k for batch in it for k in batch[0]]
    assert sorted(list(head) + rest) == ALL_KEYS
    assert [w.pid for w in original.loader._iterator._workers] == workers
    assert sorted(first_epoch) == ALL_KEYS
    original.close()


class _Point(collections.namedtuple("_Point", "x y")):
    pass


class _Items(list):
    pass


def _random_item(rng, depth=0):
    """A random item of the kinds a loader carries: plain values, numpy values and arrays
    (numbers, strings, objects), tensors, and containers of them (lists, tuples, namedtuples,
    dicts, OrderedDicts, a list subclass, mapping proxies), nested."""
    import types

    import numpy as np
    import torch

    leaves = [
        lambda: rng.randbytes(rng.randint(0, 3)),
        lambda: "s" * rng.randint(0, 2),
        lambda: rng.randint(-5, 5),
        lambda: rng.random(),
        lambda: rng.random() < 0.5,
        lambda: None,
        lambda: complex(1, 2),
        lambda: np.int64(rng.randint(0, 9)),
        lambda: np.float32(0.5),
        lambda: np.str_("x"),
        lambda: np.arange(rng.randint(0, 3)),
        lambda: np.array(["a", "b"]),
        lambda: np.array([b"a"], dtype=object),
        lambda: torch.arange(rng.randint(0, 3)),
    ]
    if depth >= 3 or rng.random() < 0.4:
        return rng.choice(leaves)()
    n = rng.randint(0, 4)
    kind = rng.randrange(7)
    if rng.random() < 0.5:  # all plain values (a batch's keys or bytes)
        parts = [rng.choice(leaves[:7])() for _ in range(n)]
    else:
        parts = [_random_item(rng, depth + 1) for _ in range(n)]
    if kind == 0:
        return parts
    if kind == 1:
        return tuple(parts)
    if kind == 2:
        return _Point(parts[0] if parts else 1, _random_item(rng, depth + 1))
    if kind == 3:
        return {f"k{i}": v for i, v in enumerate(parts)}
    if kind == 4:
        return collections.OrderedDict((f"k{i}", v) for i, v in enumerate(parts))
    if kind == 5:
        return _Items(parts)
    return types.MappingProxyType({f"k{i}": v for i, v in enumerate(parts)})


def test_items_are_converted_as_torch_converts_them():
    """A ``batch_size=None`` loader's conversion of each item (webds.channel.converted) gives
    what torch's ``default_convert`` gives, type for type, on random nested items; a list it
    gives is a new one, as torch's is."""
    import random

    from torch.utils.data import default_convert

    from webds.channel import converted

    rng = random.Random(11)
    fast = 0
    for _ in range(2000):
        item = _random_item(rng)
        got, want = converted(item), default_convert(item)
        same(got, want)
        if type(item) in (list, tuple) and {type(x) for x in item} <= {bytes, str, int}:
            fast += 1
        if type(item) is list:
            assert got is not item
    assert fast > 100  # the shortcut was taken


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_batches_reads_alike_with_torch_own_conversion(shards, workers, monkeypatch):
    """``WebLoader(dataset.batched(n), batch_size=None)`` (webdataset's pattern) gives the
    batches torch's own ``default_convert`` gives, through workers or not (and converts them
    with webds's: not a comparison of torch with itself)."""
    from torch.utils.data import default_convert

    calls = converter_calls(monkeypatch)

    def batches(**kw):
        ds = WebDataset(shards, shardshuffle=False).to_tuple("__key__", "cls").batched(7)
        return list(WebLoader(ds, batch_size=None, num_workers=workers, **kw))

    ours = batches()
    assert calls.value >= len(ours)  # each batch went through webds's converter...
    calls.value = 0
    torchs = batches(collate_fn=lambda x: default_convert(x))
    assert calls.value == 0  # ... and none of torch's
    assert len(ours) == len(torchs) > 1
    for a, b in zip(ours, torchs):
        same(a, b)


def converter_calls(monkeypatch):
    """From now on, the calls of webds's converter (channel.converted), counted in this process
    and in the DataLoader workers forked from it (a shared counter)."""
    import multiprocessing

    from webds import channel

    calls = multiprocessing.get_context("fork").Value("i", 0)
    real = channel.converted

    def counted(x):
        with calls.get_lock():
            calls.value += 1
        return real(x)

    monkeypatch.setattr(channel, "converted", counted)
    return calls


@pytest.mark.parametrize("buffers", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_dict_samples_one_by_one_read_alike_with_torch_own_conversion(
    shards, workers, buffers, monkeypatch
):
    """One step off the above: samples one by one (``batch_size=None``, no batching in the
    dataset) as dicts holding bytes, str, ints, a numpy array and a list of values, with or
    without the batch buffers, through workers or not: what torch's ``default_convert`` gives."""
    import numpy as np
    from torch.utils.data import default_convert

    def fields(sample):
        i = int(sample["__key__"][-6:])
        return {**sample, "n": i, "a": np.arange(i % 5), "l": [i, str(i), b"x"]}

    def items(**kw):
        ds = WebDataset(shards, shardshuffle=False).map(fields)
        loader = WebLoader(ds, batch_size=None, num_workers=workers, batch_buffers=buffers, **kw)
        return sorted(loader, key=lambda s: s["__key__"])

    calls = converter_calls(monkeypatch)
    ours = items()
    assert calls.value >= len(ALL_KEYS)  # each sample went through webds's converter
    torchs = items(collate_fn=lambda x: default_convert(x))
    assert len(ours) == len(ALL_KEYS) == len(torchs)
    for a, b in zip(ours, torchs):
        same(a, b)


def test_a_loader_with_workers_of_an_epoch_in_flight_pickles_without_them(shards):
    """One step off the persistent case: workers that live for one epoch only, pickled while
    it is read: the copy reads an epoch of its own, the original the rest of its epoch."""
    import pickle

    ds = WebDataset(shards, shardshuffle=True, seed=3).to_tuple("__key__", "cls")
    original = WebLoader(ds, batch_size=4, num_workers=2)
    it = iter(original)
    head = next(it)[0]
    clone = pickle.loads(pickle.dumps(original))
    assert clone.loader._iterator is None
    assert sorted(loader_keys(clone)) == ALL_KEYS
    clone.close()
    rest = [k for batch in it for k in batch[0]]
    assert sorted(list(head) + rest) == ALL_KEYS
    original.close()
