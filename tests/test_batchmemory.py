"""Reused memory for big batches (webds.stages.batching.BatchMemory): ``batched()`` stacks big
tensor and array columns into blocks given back by earlier batches, and a block is given back
only when its batch and every view of it are gone. Batches and views a training loop keeps are
never overwritten, whatever it keeps, in one process, with threads and in DataLoader workers;
blocks are really reused when batches are dropped."""

from __future__ import annotations

import collections.abc
import functools
import gc
import pickle
import random
import threading

import numpy as np
import pytest
import torch
from conftest import write_tar

import webds
from webds.stages import batching as B

MIB = 1 << 20

DTYPES = [torch.float32, torch.uint8, torch.int64, torch.bool, torch.float16, torch.bfloat16]
NP_DTYPES = [np.float32, np.uint8, np.int16, np.float64]


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """torch's own kernels (stack, clone, equal) on one thread: on a loaded two-core machine two
    intra-op threads made each small stack ten times slower. Batch memory does not depend on it
    (workers run one thread anyway)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def collections_of_this_modules_objects():
    """The gc.collect() calls of these tests look at the objects made since this module began:
    what was alive before (the session's modules, every test file's) is set aside with
    gc.freeze(), after one collection, so each collect here is quick (it was 0.1 s or more).
    At the end, the value patterns are let go too."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    _period.cache_clear()


@functools.cache
def _period(n, dtype, period):
    """``arange(n + period) % period`` as ``dtype``, computed once: its ``n`` values from ``s``
    on are ``(arange(n) + s) % period``, for every ``s`` under ``period``."""
    if isinstance(dtype, torch.dtype):
        base = torch.arange(n + period, dtype=torch.int64) % period
        return base.bool() if dtype == torch.bool else base.to(dtype)
    pattern = (np.arange(n + period) % period).astype(dtype)
    pattern.setflags(write=False)
    return pattern


def values(i, shape, dtype):
    """Sample ``i``'s tensor: distinct in every element, derived from ``i``:
    ``(arange(n) + 7 * i) % 200`` (``% 2`` for bool) as ``dtype``, shaped. A read-only view of a
    cached pattern: :func:`fields` gives samples a copy."""
    n = int(np.prod(shape))
    period = 2 if dtype == torch.bool else 200
    start = 7 * i % period
    return _period(n, dtype, period)[start : start + n].reshape(shape)


def array_values(i, shape, dtype):
    """``(arange(n) + 3 * i) % 100`` as ``dtype``, shaped (a view of a cached pattern)."""
    n = int(np.prod(shape))
    start = 3 * i % 100
    return _period(n, np.dtype(dtype), 100)[start : start + n].reshape(shape)


def fields(sample, shape, dtype, ashape, adtype):
    i = int(sample["__key__"][1:])
    t, a = values(i, shape, dtype).clone(), array_values(i, ashape, adtype).copy()
    return {"i": i, "t": t, "a": a}


def shards(tmp_path, n, per=10):
    for s in range(-(-n // per)):
        members = [(f"s{k:05d}.txt", b"x") for k in range(s * per, min(n, (s + 1) * per))]
        write_tar(tmp_path / f"m-{s:03d}.tar", members)
    return sorted(str(p) for p in tmp_path.glob("m-*.tar"))


def check(batch, shape, dtype, ashape, adtype):
    labels = batch["i"].tolist()
    assert batch["t"].shape == (len(labels), *shape) and batch["t"].dtype == dtype
    # (A DataLoader makes the array column a tensor.)
    arrays = np.asarray(batch["a"])
    assert arrays.shape == (len(labels), *ashape) and arrays.dtype == adtype
    for row, i in enumerate(labels):
        assert torch.equal(batch["t"][row], values(i, shape, dtype)), f"sample {i} changed"
        assert np.array_equal(arrays[row], array_values(i, ashape, adtype))


def keep_some(batches, rng, kept):
    """The loop of a training run that keeps, at random, whole batches, a row of a column
    (a view), a slice of the array column, or nothing; checks all it kept as it goes on."""
    for batch in batches:
        what = rng.choice(["batch", "row", "slice", "nothing", "nothing"])
        if what == "batch":
            kept.append(("batch", batch))
        elif what == "row":
            j = rng.randrange(len(batch["i"]))
            kept.append(("row", (int(batch["i"][j]), batch["t"][j])))
        elif what == "slice":
            kept.append(("slice", (batch["i"][:2].tolist(), batch["a"][:2])))
        del batch
        if rng.random() < 0.3:
            gc.collect()


def check_kept(kept, shape, dtype, ashape, adtype):
    for what, thing in kept:
        if what == "batch":
            check(thing, shape, dtype, ashape, adtype)
        elif what == "row":
            i, row = thing
            assert torch.equal(row, values(i, shape, dtype)), f"a kept row of sample {i} changed"
        else:
            labels, rows = thing
            for i, row in zip(labels, rows):
                assert np.array_equal(np.asarray(row), array_values(i, ashape, adtype))


def two_passes(loader, rng, kept, shape, dtype, ashape, adtype):
    """Two passes of :func:`keep_some` over ``loader``, what was kept checked after each; the
    samples' numbers seen."""
    seen = []

    def counted(batches):
        for batch in batches:
            seen.extend(batch["i"].tolist())
            yield batch

    for _ in range(2):
        keep_some(counted(loader), rng, kept)
        check_kept(kept, shape, dtype, ashape, adtype)
    return seen


def config(seed):
    rng = random.Random(seed)
    dtype = rng.choice(DTYPES)
    adtype = rng.choice(NP_DTYPES)
    size = torch.empty(0, dtype=dtype).element_size()
    batch = rng.choice([4, 8, 9])  # 4 batches or more a pass: room to give some back
    # The tensor column over the reuse threshold (batchmemory.REUSED_BYTES) in every batch but
    # maybe the last; the array column under it or over it.
    per_sample = 300 * 1024
    shape = (2, per_sample // size // 2)
    ashape = (rng.choice([1000, 40_000]),)
    n = rng.choice([29, 37])
    return rng, shape, dtype, ashape, adtype, batch, n


def blocks_reused(monkeypatch):
    """From now on, how many stacks went into a block given back by an earlier batch."""
    reused = [0]
    real = B.BatchMemory.take

    def take(self, nbytes):
        made = self.made
        block = real(self, nbytes)
        reused[0] += self.made == made
        return block

    monkeypatch.setattr(B.BatchMemory, "take", take)
    return reused


def dataset(urls, shape, dtype, ashape, adtype, batch):
    make = functools.partial(fields, shape=shape, dtype=dtype, ashape=ashape, adtype=adtype)
    return webds.WebDataset(urls, shardshuffle=False).map(make).batched(batch)


@pytest.mark.parametrize("seed", range(10))
def test_what_the_loop_keeps_is_never_overwritten_in_one_process(tmp_path, seed, monkeypatch):
    """Every seed reuses blocks (not vacuous): its tensor column goes into blocks that
    earlier batches of the same pass gave back."""
    rng, shape, dtype, ashape, adtype, batch, n = config(seed)
    ds = dataset(shards(tmp_path, n), shape, dtype, ashape, adtype, batch)
    reused = blocks_reused(monkeypatch)
    kept = []
    keep_some(ds, rng, kept)
    check_kept(kept, shape, dtype, ashape, adtype)
    # A second pass, keeping more: still nothing kept changes.
    keep_some(ds, rng, kept)
    check_kept(kept, shape, dtype, ashape, adtype)
    assert reused[0] > 0


@pytest.mark.parametrize(
    "seed,loader",
    [
        (100, dict(num_workers=2)),
        (101, dict(num_workers=2, batch_buffers=False)),
        (102, dict(num_workers=1, persistent_workers=True)),
        (103, dict(num_workers=0)),
        (104, dict(num_workers=0, threads=2)),
    ],
)
def test_what_the_loop_keeps_is_never_overwritten_through_a_webloader(tmp_path, seed, loader):
    rng, _, _, _, _, batch, n = config(seed)
    shape, dtype, ashape, adtype = (2, 100_000), torch.float32, (40_000,), np.float64
    ds = dataset(shards(tmp_path, n), shape, dtype, ashape, adtype, batch)
    wl = webds.WebLoader(ds, batch_size=None, **loader)
    kept = []
    for _ in range(2):
        keep_some(wl, rng, kept)
        check_kept(kept, shape, dtype, ashape, adtype)
    assert len([k for k in kept if k[0] == "batch"]) > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_made_again_after_the_loader_and_shuffled_are_never_overwritten(tmp_path, workers):
    # Rebatching in the main process (from the workers' reused buffers into this process's
    # reused blocks), batches held in a shuffle buffer, the loop keeping some of what it gets.
    shape, dtype, ashape, adtype = (2, 40_000), torch.float32, (40_000,), np.float64
    ds = dataset(shards(tmp_path, 90), shape, dtype, ashape, adtype, 4)
    wl = webds.WebLoader(ds, batch_size=None, num_workers=workers)
    rebatched = wl.unbatched().shuffle(20, seed=1).batched(7).shuffle(3, seed=2)
    kept = []
    seen = two_passes(rebatched, random.Random(workers), kept, shape, dtype, ashape, adtype)
    assert sorted(seen) == sorted(list(range(90)) * 2) and any(k[0] == "batch" for k in kept)


def test_batches_freed_on_other_threads_are_reused_safely(tmp_path):
    # A training loop that hands each batch to another thread, which checks it and lets it go
    # (as a pin-memory thread does): blocks come back on that thread, while the next batch is
    # being stacked on this one.
    shape, dtype, ashape, adtype = (2, 70_000), torch.float32, (30_000,), np.float32
    ds = dataset(shards(tmp_path, 120), shape, dtype, ashape, adtype, 6)
    errors = []

    def consume(batch, kept_row):
        try:
            check(batch, shape, dtype, ashape, adtype)
            i, row = kept_row
            assert torch.equal(row, values(i, shape, dtype))
        except BaseException as e:  # whatever it is, the test sees it
            errors.append(e)

    threads = []
    for batch in ds:
        t = threading.Thread(target=consume, args=(batch, (int(batch["i"][0]), batch["t"][0])))
        t.start()
        threads.append(t)
        del batch
    for t in threads:
        t.join()
    assert not errors


def test_blocks_are_reused_when_batches_are_dropped(tmp_path):
    shape = (2, 64 * 1024)
    urls = shards(tmp_path, 120)
    ds = dataset(urls, shape, torch.float32, (40_000,), np.float32, 8)
    tensors, arrays = set(), set()
    for batch in ds:
        tensors.add(batch["t"].data_ptr())
        arrays.add(batch["a"].ctypes.data)
        assert batch["t"].data_ptr() % 64 == 0 and batch["a"].ctypes.data % 64 == 0
    # 15 batches in two or three blocks per column: the one held while the next is stacked.
    assert len(tensors) <= 3 and len(arrays) <= 3
    # Kept batches each get their own block.
    kept = list(ds)
    assert len({b["t"].data_ptr() for b in kept}) == len(kept) == 15


def test_batch_memory_keeps_a_few_free_blocks():
    memory = B.BatchMemory(keep=2)
    leases = [memory.take(2 * MIB) for _ in range(5)]
    assert memory.made == 5 and len({a.ctypes.data for a in leases}) == 5
    assert all(a.nbytes == 2 * MIB and a.ctypes.data % (2 << 20) == 0 for a in leases)
    view = torch.from_numpy(leases[0])[10:20]  # a view keeps its block taken
    view.fill_(9)
    del leases
    gc.collect()
    again = [memory.take(MIB) for _ in range(3)]
    # Two blocks came back and are reused (a smaller stack fits a bigger block); the third
    # take makes a new one, and the view still holds its own.
    assert memory.made == 6
    assert all(int(v) == 9 for v in view)
    del again


def test_a_process_forked_while_another_thread_holds_the_lock_does_not_wait_for_it():
    """A DataLoader worker forked while a thread of the loader's process (its pin thread, the
    training loop) gives a batch back inherits the lock held: in the child, taking and giving
    back go on (a child that waited would be ended by its alarm, not exit with 0)."""
    import os
    import signal

    memory = B.BatchMemory(keep=2)
    held = memory.take(2 * MIB)
    with memory._lock:  # as another thread would hold it at the fork
        pid = os.fork()
        if pid == 0:  # the child: its only thread never took the lock
            signal.alarm(10)
            try:
                again = memory.take(2 * MIB)
                del again
                gc.collect()
                memory.release()
                os._exit(0)
            except BaseException:
                os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    del held


def test_small_odd_and_gradient_stacks_are_stacked_as_torch_does():
    memory = B.BatchMemory()
    big = [torch.ones(300_000) for _ in range(2)]
    # Mixed dtypes promote as torch.stack does.
    mixed = B._stack_tensors([torch.ones(300_000, dtype=torch.uint8), big[0]], memory)
    assert mixed.dtype == torch.float32
    # Gradients flow through a stack in the main process.
    leaf = torch.ones(300_000, requires_grad=True)
    stacked = B._stack_tensors([leaf, leaf * 2], memory)
    stacked.sum().backward()
    assert leaf.grad is not None and float(leaf.grad[0]) == 3.0

    # A subclass keeps its type.
    class Tagged(torch.Tensor):
        pass

    tagged = [torch.ones(300_000).as_subclass(Tagged) for _ in range(2)]
    assert type(B._stack_tensors(tagged, memory)) is Tagged
    # Small stacks and object arrays are left to the allocator.
    assert memory.made == 0
    B._stack_tensors(big, memory)
    B._stack_arrays([np.ones(200_000), np.ones(200_000)], memory)
    B._stack_arrays([np.array([object()] * 300_000)] * 2, memory)
    assert memory.made == 2


def _where_stacked(batch):
    return batch["t"], torch.tensor(batch["t"].is_shared())


def test_workers_stack_in_plain_memory_only_when_the_loader_copies_batches(tmp_path):
    # With batch buffers, the WebLoader copies each batch into a reused shared buffer: the
    # worker stacks into a reused plain block. Without them (or with pin_memory) the batch
    # leaves through torch's shared memory, so it is stacked straight into it.
    urls = shards(tmp_path, 24)
    ds = dataset(urls, (2, 100_000), torch.float32, (1000,), np.float32, 8).map(_where_stacked)
    packed = list(webds.WebLoader(ds, batch_size=None, num_workers=1))
    unpacked = list(webds.WebLoader(ds, batch_size=None, num_workers=1, batch_buffers=False))
    assert [bool(s) for _, s in packed] == [False] * 3
    assert [bool(s) for _, s in unpacked] == [True] * 3
    for (a, _), (b, _) in zip(packed, unpacked):
        assert torch.equal(a, b)


def test_torch_batches_in_a_worker_go_to_reused_memory_only_when_the_loader_copies_them(
    tmp_path, monkeypatch
):
    """The same rule for a WebLoader's ``batch_size=`` (torch's default_collate): in a worker,
    big stacks go into the pass's reused plain memory only where the batch is then copied into
    the loader's shared buffers; without the buffers torch's own stacking puts them straight
    into shared memory; in this process, always into reused memory. The same batches."""
    import os

    from webds import channel as channel_module

    log = tmp_path / "into.log"
    real = channel_module.default_collate_into

    def recording(memory):
        collate = real(memory)

        def into(batch):
            with open(log, "a") as f:  # (workers are forked: the patch goes with them)
                f.write(f"{os.getpid()}\n")
            return collate(batch)

        return into

    monkeypatch.setattr(channel_module, "default_collate_into", recording)
    make = functools.partial(
        fields, shape=(2, 100_000), dtype=torch.float32, ashape=(1000,), adtype=np.float32
    )
    ds = webds.WebDataset(shards(tmp_path, 24), shardshuffle=False).map(make)
    got = {}
    for name, kw in (
        ("packed", dict(num_workers=1)),
        ("unpacked", dict(num_workers=1, batch_buffers=False)),
        ("here", dict(num_workers=0)),
    ):
        log.write_text("")
        got[name] = [b["t"].clone() for b in webds.WebLoader(ds, batch_size=8, **kw)]
        got[name + " pids"] = log.read_text().split()
    assert len(got["packed pids"]) == 3 and str(os.getpid()) not in got["packed pids"]
    assert got["unpacked pids"] == []
    assert got["here pids"] == [str(os.getpid())] * 3
    for a, b, c in zip(got["packed"], got["unpacked"], got["here"]):
        assert torch.equal(a, b) and torch.equal(a, c)


def recorded_memories(monkeypatch):
    """The BatchMemory of each batching pass, in the order the passes made them."""
    made = []

    def memory():
        made.append(B.BatchMemory())
        return made[-1]

    monkeypatch.setattr(B, "_batch_memory", memory)
    return made


def test_a_pass_keeps_no_free_block_after_it_ends(tmp_path, monkeypatch):
    # A persistent worker idles between epochs: the pass's free blocks are let go at its end,
    # and a block given back later (the last batch, still held) is not kept.
    made = recorded_memories(monkeypatch)
    ds = dataset(shards(tmp_path, 40), (2, 100_000), torch.float32, (1000,), np.float32, 8)
    last = None
    for batch in ds:
        last = batch
    (memory,) = made
    assert memory.made >= 2 and memory._free == []
    del batch, last
    gc.collect()
    assert memory._free == []
    # Without the release, the blocks of the last batches would be kept for the next pass.
    again = B.BatchMemory()
    lease = again.take(2 * MIB)
    del lease
    assert len(again._free) == 1
    again.release()
    assert again._free == []


# -- torch's default_collate in a WebLoader (batch_size=) -------------------------------------


def unbatched_dataset(urls, shape, dtype, ashape, adtype):
    make = functools.partial(fields, shape=shape, dtype=dtype, ashape=ashape, adtype=adtype)
    return webds.WebDataset(urls, shardshuffle=False).map(make)


@pytest.mark.parametrize(
    "seed,loader",
    [
        (200, dict(num_workers=2)),
        (201, dict(num_workers=2, batch_buffers=False)),
        (209, dict(num_workers=0)),  # (a seed whose loop keeps whole batches)
        (203, dict(num_workers=0, threads=2)),
        (204, dict(num_workers=1, persistent_workers=True, drop_last=True)),
    ],
)
def test_torch_batches_the_loop_keeps_are_never_overwritten(tmp_path, seed, loader):
    # WebLoader(batch_size=...): torch's default_collate, its big stacks in reused memory.
    rng, _, _, _, _, batch, n = config(seed)
    shape, dtype, ashape, adtype = (2, 100_000), torch.float32, (40_000,), np.float64
    ds = unbatched_dataset(shards(tmp_path, n), shape, dtype, ashape, adtype)
    wl = webds.WebLoader(ds, batch_size=batch, **loader)
    kept = []
    seen = two_passes(wl, rng, kept, shape, dtype, ashape, adtype)
    expected = n - n % batch if loader.get("drop_last") and loader["num_workers"] <= 1 else n
    assert len(seen) == 2 * expected and any(k[0] == "batch" for k in kept)


class Items(torch.utils.data.IterableDataset):
    """Samples of every kind torch's default_collate tells apart, big and small."""

    def __iter__(self):
        for i in range(12):
            yield {
                "big": torch.full((300, 300), float(i)),
                "big_int": torch.arange(300_000, dtype=torch.int64) + i,
                "small": torch.tensor([i, i + 1]),
                "array": np.full((200, 400), i, dtype=np.float64),
                "small_array": np.arange(3) + i,
                "scalar": np.float32(i) / 2,
                "n": i,
                "x": i / 3,
                "s": f"s{i}",
                "b": b"b%d" % i,
                "pair": (torch.full((600, 600), float(i)), [i, str(i)]),
                "nested": {"t": torch.ones(400, 700) * i, "k": i},
            }


def same(a, b):
    """The same types all the way down, equal values (tensors and arrays: equal dtypes, shapes
    and elements; mappings: the same keys in the same order)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    elif isinstance(a, collections.abc.Mapping):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("workers", [0, 1])
def test_torch_batches_are_default_collates(workers):
    # Every kind of field comes out as torch's own default_collate makes it, values and types.
    pipeline = webds.DataPipeline(Items())
    ours = list(webds.WebLoader(pipeline, batch_size=5, num_workers=workers))
    theirs = list(torch.utils.data.DataLoader(Items(), batch_size=5, num_workers=workers))
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        same(a, b)


def test_a_collate_fn_of_yours_is_called_as_it_is(tmp_path):
    calls = []

    def collate(samples):
        calls.append(len(samples))
        return [s["i"] for s in samples]

    ds = unbatched_dataset(shards(tmp_path, 20), (2, 100_000), torch.float32, (10,), np.float32)
    got = list(webds.WebLoader(ds, batch_size=8, collate_fn=collate, num_workers=0))
    assert got == [list(range(8)), list(range(8, 16)), list(range(16, 20))] and calls == [8, 8, 4]


def test_a_dataset_pickles_in_the_middle_of_a_pass(tmp_path):
    # Its channel holds the pass's memory (a lock): a copy made then gets none.
    ds = unbatched_dataset(shards(tmp_path, 20), (2, 100_000), torch.float32, (10,), np.float32)
    wl = webds.WebLoader(ds, batch_size=4, num_workers=0)
    it = iter(wl)
    next(it)
    assert ds.channel.batch_memory is not None
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.channel.batch_memory is None
    rest = list(it)
    assert len(rest) == 4 and ds.channel.batch_memory is None


def test_torch_batches_reuse_blocks_in_this_process(tmp_path):
    ds = unbatched_dataset(shards(tmp_path, 96), (2, 100_000), torch.float32, (10,), np.float32)
    pointers = {b["t"].data_ptr() for b in webds.WebLoader(ds, batch_size=8, num_workers=0)}
    assert len(pointers) <= 3  # 12 batches
    # The memory of a pass is let go at its end.
    assert ds.channel.batch_memory is None


# -- one step off: resumes, passes stopped early, views through numpy ---------------------------


@pytest.mark.parametrize("workers,torch_batches", [(0, False), (2, False), (0, True), (2, True)])
def test_a_resumed_loader_gives_the_rest_in_reused_memory_and_keeps_what_came_before(
    tmp_path, workers, torch_batches
):
    # Batches held from before a checkpoint stay as they were while the resumed loader (in
    # this process or its workers) stacks the rest; together they are every sample once.
    shape, dtype, ashape, adtype = (2, 100_000), torch.float32, (40_000,), np.float64
    urls = shards(tmp_path, 60)

    def make():
        if torch_batches:
            ds = unbatched_dataset(urls, shape, dtype, ashape, adtype)
            return webds.WebLoader(ds, batch_size=4, num_workers=workers)
        ds = dataset(urls, shape, dtype, ashape, adtype, 4)
        return webds.WebLoader(ds, batch_size=None, num_workers=workers)

    first = make()
    it = iter(first)
    before = [next(it) for _ in range(5)]
    state = first.state_dict()
    del it
    second = make()
    second.load_state_dict(state)
    rest = list(second)
    for batch in before + rest:
        check(batch, shape, dtype, ashape, adtype)
    seen = sorted(i for b in before + rest for i in b["i"].tolist())
    assert seen == list(range(60))


def test_a_pass_stopped_early_lets_its_memory_go(tmp_path, monkeypatch):
    made = recorded_memories(monkeypatch)
    urls = shards(tmp_path, 40)
    ds = dataset(urls, (2, 100_000), torch.float32, (1000,), np.float32, 4)
    it = iter(ds)
    kept = [next(it), next(it), next(it)]
    it.close()  # the training loop breaks out
    (memory,) = made
    assert memory._released and memory._free == []
    check_kept([("batch", b) for b in kept], (2, 100_000), torch.float32, (1000,), np.float32)
    # A WebLoader's torch-collated pass stopped early too.
    unbatched = unbatched_dataset(urls, (2, 100_000), torch.float32, (10,), np.float32)
    it = iter(webds.WebLoader(unbatched, batch_size=4, num_workers=0))
    next(it)
    held = unbatched.channel.batch_memory
    assert held is not None and not held._released
    it.close()
    assert held._released and unbatched.channel.batch_memory is None


def test_numpy_views_of_kept_tensor_batches_are_never_overwritten(tmp_path):
    # .numpy() and np.asarray() of a batch's tensor column, and slices of those, keep its block.
    shape = (2, 100_000)
    ds = dataset(shards(tmp_path, 48), shape, torch.float32, (1000,), np.float32, 4)
    kept = []
    for batch in ds:
        i = int(batch["i"][1])
        kept.append((i, batch["t"].numpy()[1]))
        kept.append((i, np.asarray(batch["t"])[1, :, ::7]))
        del batch
        gc.collect()
    for i, view in kept:
        whole = values(i, shape, torch.float32).numpy()
        assert np.array_equal(view, whole if view.shape == whole.shape else whole[:, ::7])
