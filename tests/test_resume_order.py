"""The same batches in the same order after a resume, on the same topology.

A run stopped after k items and resumed from its ``state_dict()`` in a new pipeline must give the
rest of the epoch exactly as the uninterrupted run did (not only the same samples), and the epochs
after it too: the stages' buffers are put back as they were. Property tests over random pipelines
drawn from every stage kind that holds or drops items, with 0-2 DataLoader workers, persistent or
not, with or without an index, seeded or not, ``with_epoch``, and rebatching in the main process;
stop points include the first and the last batch.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import random
from typing import Any, Callable, List

import pytest
from conftest import sample_members, write_tar
from rank_forker import end_as_forked_workers_end

import webds
from webds.shards.index import ShardIndex

SIZES = [13, 7, 11, 9]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(brace spec, index path) of 4 shards of 13, 7, 11 and 9 samples."""
    root = tmp_path_factory.mktemp("order")
    urls = [
        str(write_tar(root / f"s-{k}.tar", sample_members(n, prefix=f"s{k}-")))
        for k, n in enumerate(SIZES)
    ]
    ShardIndex.build(urls).save(str(root / "index.json"))
    return str(root / "s-{0..3}.tar"), str(root / "index.json")


def flat(x: Any) -> List[str]:
    """The sample keys in an item (a sample, a list of them, nested lists)."""
    if isinstance(x, dict):
        return [x["__key__"]]
    if isinstance(x, (list, tuple)):
        return [k for y in x for k in flat(y)]
    return [str(x)]


@webds.stage
def one_late(src, *, ledger=None):
    """A user stage that holds one item (docs/architecture.md's example)."""
    src = iter(src)
    slot = ledger.slot() if ledger is not None else None
    held: list = []
    if slot is not None and ledger.resuming:
        yield from slot.restore(src)
        held, src = slot.captured, slot.rest(src)
    for item in src:
        held.append(item)
        if slot is not None:
            slot.hold(ledger.current)
        if len(held) > 1:
            if slot is not None:
                slot.take_first()
            yield held.pop(0)
    while held:
        if slot is not None:
            slot.take_first()
        yield held.pop(0)


def _fails_on_fives(sample: dict) -> dict:
    if int(sample["cls"]) % 5 == 3:
        raise ValueError("a sample this map cannot take")
    return sample


def random_stages(rng: random.Random) -> List[Callable[[Any], Any]]:
    """Stages over samples, maybe grouped into lists and split again."""
    out: List[Callable[[Any], Any]] = []
    grouped = False
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(
            ["shuffle", "shuffle", "select", "map_none", "rsample", "threads", "list", "late"]
            + ["skip"]
        )
        if kind == "shuffle":
            n = rng.randint(1, 9)
            out.append(lambda d, n=n: d.shuffle(n, initial=max(1, n // 2)))
        elif kind == "rsample":
            out.append(lambda d: d.rsample(0.7))
        elif kind == "late":
            out.append(lambda d: d.compose(one_late()))
        elif kind == "list" and not grouped:
            b = rng.randint(1, 4)
            out.append(lambda d, b=b: d.listed(b))
            grouped = True
        elif kind == "list":
            out.append(lambda d: d.unlisted())
            grouped = False
        elif grouped:
            continue  # the sample stages below take samples
        elif kind == "select":
            out.append(lambda d: d.select(lambda s: int(s["cls"]) % 3 != 1))
        elif kind == "map_none":
            out.append(lambda d: d.map(lambda s: None if int(s["cls"]) % 4 == 2 else s))
        elif kind == "skip":  # a handler that skips the samples a map fails on
            out.append(lambda d: d.map(_fails_on_fives, handler=webds.ignore_and_continue))
        else:
            out.append(lambda d: d.map(lambda s: dict(s, seen=1), threads=2))
    return out


def stop_points(rng: random.Random, n: int) -> List[int]:
    """The first item, the last, and one between."""
    return sorted({1, n, rng.randint(1, n)})


def same_entropy(make: Callable[[], Any]) -> Callable[[], Any]:
    """``make``, whose unseeded pipelines draw the same entropy every time (as a resumed
    pipeline takes its state's): the uninterrupted runs then agree with each other."""
    entropy = [p._entropy for p in webds.counting.random_parts(make())]

    def made() -> Any:
        x = make()
        for part, value in zip(webds.counting.random_parts(x), entropy):
            part._entropy = value
        return x

    return made


def check(make: Callable[[], Any], rng: random.Random, epochs: int = 2, one: int = -1) -> None:
    """Stopped at the first item, the last and one between (``one`` >= 0: only the first, the
    last or one between, by ``one % 3``), and resumed in a new pipeline: the rest of the epoch
    and the epochs after are the uninterrupted run's, item for item."""
    make = same_entropy(make)
    whole = make()
    runs = [[flat(x) for x in whole] for _ in range(epochs)]
    whole.close()  # its workers (with_epoch carries its stream on) stop now, not when collected
    if not runs[0]:
        return
    points = stop_points(rng, len(runs[0]))
    if one >= 0:
        n = len(runs[0])
        points = [[1, n, rng.randint(1, n)][one % 3]]
    for k in points:
        a = make()
        it = iter(a)
        before = [flat(x) for x in itertools.islice(it, k)]
        state = json.loads(json.dumps(a.state_dict()))
        del it
        a.close()
        b = make()
        b.load_state_dict(state)
        resumed = [[flat(x) for x in b] for _ in range(epochs)]
        b.close()
        assert before + resumed[0] == runs[0], f"epoch 0, stopped after {k}"
        assert resumed[1:] == runs[1:], f"the epochs after, stopped after {k}"


@pytest.mark.parametrize("case", range(30))
def test_random_pipelines_resume_in_the_same_order(data, case):
    spec, index = data
    rng = random.Random(case)
    stages = random_stages(rng)
    url = index if rng.random() < 0.5 else spec
    seed = rng.choice([None, 7])

    def make():
        ds = webds.WebDataset(url, shardshuffle=True, seed=seed)
        for f in stages:
            ds = f(ds)
        return ds.listed(rng_batch)

    rng_batch = rng.randint(1, 4)
    check(make, rng)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("case", range(9))
def test_random_loaders_resume_in_the_same_order(data, case):
    spec, index = data
    rng = random.Random(1000 + case)
    stages = random_stages(rng)
    workers = rng.choice([0, 1, 2])
    persistent = workers > 0 and rng.random() < 0.5
    batch = rng.randint(1, 4)
    url = index if rng.random() < 0.5 else spec
    seed = rng.choice([None, 7])
    epoch = rng.choice([None, 3, 9])  # with_epoch inside a pass, or across passes
    rebatch = rng.random() < 0.4  # stages in the main process that hold samples

    def make():
        ds = webds.WebDataset(url, shardshuffle=True, seed=seed)
        for f in stages:
            ds = f(ds)
        loader = webds.WebLoader(
            ds.listed(batch), batch_size=None, num_workers=workers, persistent_workers=persistent
        )
        if rebatch:
            loader = loader.unlisted().shuffle(5).listed(3)
        return loader.with_epoch(epoch) if epoch else loader

    check(make, rng, one=case)  # (worker processes are slow to start: one stop per case)


@pytest.mark.slow
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_a_loader_that_batches_in_the_workers_and_rebatches(data, workers, persistent):
    # The DataLoader batches samples (batch_size=3) and the main process rebatches them.
    spec, _ = data

    def make():
        ds = webds.WebDataset(spec, shardshuffle=True, seed=3).shuffle(6)
        loader = webds.WebLoader(
            ds, batch_size=3, num_workers=workers, persistent_workers=persistent
        )
        return loader.unbatched().shuffle(4).batched(5, collation_fn=list)

    check(make, random.Random(workers))


def test_a_stage_held_item_comes_back_to_its_place(data):
    # Two shuffles, a threaded map between them and a user stage: each buffer is put back.
    spec, _ = data

    def make():
        return (
            webds.WebDataset(spec, shardshuffle=True, seed=1)
            .shuffle(5)
            .map(lambda s: dict(s, seen=1), threads=2)
            .compose(one_late())
            .shuffle(7)
            .listed(2)
        )

    made = make()
    total = len(list(made))
    for k in range(1, total + 1):
        a = make()
        it = iter(a)
        before = [flat(x) for x in itertools.islice(it, k)]
        state = a.state_dict()
        assert state["ledger"]["slots"] or k == total  # buffers were saved, in order
        b = make()
        b.load_state_dict(json.loads(json.dumps(state)))
        assert before + [flat(x) for x in b] == [flat(x) for x in make()], k
        assert state["ledger"]["unordered"] is None


def test_shuffle_keeps_its_orders(data):
    # Resuming needs the count of draws, not another generator: seeded orders are unchanged.
    import random as stdlib_random

    from webds.stages.filters import _randbelow, _skip_words

    for n in (1, 2, 3, 7, 100, 65537, 2**31 + 5):
        a, b = stdlib_random.Random(5), stdlib_random.Random(5)
        words = 0
        for _ in range(300):
            r, w = _randbelow(b, n)
            assert r == a.randrange(n)
            words += w
        c = stdlib_random.Random(5)
        _skip_words(c, words)
        assert c.random() == a.random() == b.random()


@pytest.mark.parametrize("case", range(6))
def test_mixes_and_plain_sources_resume_in_the_same_order(data, case):
    # Sources that are not shards (a RandomMix, RoundRobin, a list of samples) with buffers
    # after them: the held items were lost before (read again, then taken for consumed).
    spec, index = data
    rng = random.Random(case)
    shards = spec.replace("{0..3}", "{%d..%d}")

    def make():
        a = webds.WebDataset(shards % (0, 1), shardshuffle=True, seed=3).shuffle(4)
        b = webds.WebDataset(shards % (2, 3), shardshuffle=True, seed=3).shuffle(3)
        if case % 3 == 0:
            source = webds.RandomMix([a, b], [1, 2], seed=5)
        elif case % 3 == 1:
            source = webds.RoundRobin([a, b], longest=True)
        else:
            source = [{"__key__": f"k{i}", "cls": i} for i in range(37)]
        return webds.FluidWrapper(source).shuffle(3).compose(one_late()).listed(2)

    check(make, rng)


def _keep_most(sample: dict) -> bool:
    return int(sample["cls"]) % 3 != 1


if getattr(multiprocessing.current_process(), "_inheriting", False):
    # Imported while a spawned DataLoader worker unpickles its dataset (which holds _keep_most):
    # the worker ends as a forked one does, not tearing torch's modules down (0.5 s of CPU each).
    end_as_forked_workers_end()


@pytest.mark.slow
@pytest.mark.parametrize("context", ["spawn"])
def test_spawned_workers_resume_in_the_same_order(data, context):
    # Workers started by spawn (PAD and Restored cross a pickle of their own), rebatching in
    # the main process, a stage that drops samples.
    spec, index = data

    def make():
        ds = webds.WebDataset(index, shardshuffle=True, seed=4).select(_keep_most).shuffle(5)
        loader = webds.WebLoader(
            ds.listed(2), batch_size=None, num_workers=2, multiprocessing_context=context
        )
        return loader.unlisted().shuffle(4).listed(3)

    check(make, random.Random(8), epochs=1, one=2)  # (spawning is slow: one stop point)


def test_remote_shards_resume_in_the_same_order(data, http_server):
    # Shards over HTTP, read ahead while one is read: held samples come back from the server.
    spec, _ = data
    urls = []
    for k in range(4):
        with open(spec.replace("{0..3}", str(k)), "rb") as f:
            urls.append(http_server.put(f"s-{k}.tar", f.read()))

    def make():
        return webds.WebDataset(urls, shardshuffle=True, seed=2).shuffle(6).listed(2)

    check(make, random.Random(3))
