"""``WebLoader(..., threads=N)``: the dataset's per-sample stages (decode, map, map_tuple) run in
N threads in the process that runs them (this one, or each worker), with the stage-level
``threads=`` guarantees: the same items in the same order as without threads, errors through
the handlers, and resume in the same order."""

from __future__ import annotations

import random
import threading
import warnings

import pytest
from conftest import write_tar
from test_resume_order import (  # noqa: F401 (data: a fixture)
    check,
    data,
    flat,
    random_stages,
    same_entropy,
)
from test_threads import failing, spec  # noqa: F401 (spec: a fixture)

import webds
from webds.errors import ArgumentError


def tagged(sample):
    """The key, and the name of the thread that ran this map."""
    return sample["__key__"], threading.current_thread().name


def keys_and_threads(loader):
    items = [x for batch in loader for x in batch]
    return [k for k, _ in items], {name for _, name in items}


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 2])
def test_the_stages_run_in_a_pool_with_the_same_items_in_order(spec, workers):  # noqa: F811
    def make(**kw):
        ds = webds.WebDataset(spec, shardshuffle=True, seed=3).shuffle(6).map(tagged).listed(4)
        return webds.WebLoader(ds, batch_size=None, num_workers=workers, **kw)

    plain, plain_threads = keys_and_threads(make())
    pooled, pooled_threads = keys_and_threads(make(threads=2))
    assert pooled == plain and len(plain) == 13 + 9 + 17
    assert all(not name.startswith("webds-") for name in plain_threads)
    assert pooled_threads and all(name.startswith("webds-map") for name in pooled_threads)


def test_a_stage_given_its_own_threads_keeps_them(spec):  # noqa: F811
    ds = webds.WebDataset(spec).map(tagged, threads=0).map(lambda x: x).listed(5)
    keys, names = keys_and_threads(webds.WebLoader(ds, batch_size=None, threads=3))
    assert names == {threading.current_thread().name} and len(keys) == 39
    # given by position too: map(f, handler, threads)
    ds = webds.WebDataset(spec).map(tagged, webds.reraise_exception, 0).listed(5)
    keys, names = keys_and_threads(webds.WebLoader(ds, batch_size=None, threads=3))
    assert names == {threading.current_thread().name} and len(keys) == 39


def test_decode_and_map_tuple_take_the_loaders_threads(tmp_path):
    from conftest import write_tar

    members = []
    for i in range(10):
        members += [(f"{i:04d}.json", b'{"n": %d}' % i), (f"{i:04d}.cls", str(i).encode())]
    path = write_tar(tmp_path / "j.tar", members)
    seen = []

    def note(x):
        seen.append(threading.current_thread().name)
        return x

    def decoder(key, raw):
        seen.append(threading.current_thread().name)
        return None  # the next handler decodes it

    ds = webds.WebDataset(str(path)).decode(decoder).to_tuple("json", "cls").map_tuple(note, None)
    got = list(webds.WebLoader(ds, batch_size=None, threads=2))
    assert [tuple(x) for x in got] == [({"n": i}, i) for i in range(10)]
    assert {n.rsplit("_", 1)[0] for n in seen} == {"webds-decode", "webds-map_tuple"}


@pytest.mark.parametrize(
    "handler", [webds.ignore_and_continue, webds.warn_and_continue, webds.reraise_exception]
)
def test_errors_go_through_the_handlers_as_without_threads(spec, handler):  # noqa: F811
    def run(**kw):
        ds = webds.WebDataset(spec).map(failing, handler=handler)
        got, error = [], None
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            try:
                for x in webds.WebLoader(ds, batch_size=None, **kw):
                    got.append(x)
            except ValueError as exn:
                error = str(exn)
        return got, error

    assert run(threads=3) == run()
    if handler is webds.reraise_exception:
        assert run()[1] == "bad s0-000003" and len(run()[0]) == 3


def test_bad_thread_counts_and_datasets_are_refused(spec):  # noqa: F811
    ds = webds.WebDataset(spec)
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ArgumentError, match="WebLoader: threads"):
            webds.WebLoader(ds, batch_size=None, threads=bad)
    with pytest.raises(ArgumentError, match="not one: give its stages threads="):
        webds.WebLoader(list(range(5)), batch_size=None, threads=2)
    assert list(webds.WebLoader(list(range(5)), batch_size=None, threads=None)) == [0, 1, 2, 3, 4]


def test_stats_see_the_threaded_stages(spec):  # noqa: F811
    ds = webds.WebDataset(spec).map(lambda s: s["__key__"]).listed(4)
    loader = webds.WebLoader(ds, batch_size=None, threads=2, stats=True)
    assert sum(len(b) for b in loader) == 39
    assert "map" in str(loader.stats())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("case", range(6))
def test_random_loaders_with_threads_resume_in_the_same_order(data, case):  # noqa: F811
    # Every stage kind, 0-2 workers, index or not, with_epoch or not: a loader with threads
    # gives the items of the loader without, in its order, and resumes in that order.
    url_spec, index = data
    rng = random.Random(2000 + case)
    stages = random_stages(rng)
    workers = rng.choice([0, 1, 2])
    batch = rng.randint(1, 4)
    url = index if rng.random() < 0.5 else url_spec
    epoch = rng.choice([None, 3, 9])
    threads = rng.choice([1, 2, 3])
    seed = rng.choice([None, 7])
    # Unseeded, each dataset draws its own entropy: these two draw the same (see same_entropy).
    dataset = same_entropy(lambda: webds.WebDataset(url, shardshuffle=True, seed=seed))

    def make(threads=threads):
        ds = dataset()
        for f in stages:
            ds = f(ds)
        ds = ds.map(lambda x: x)  # a map without threads of its own, at least
        loader = webds.WebLoader(
            ds.listed(batch), batch_size=None, num_workers=workers, threads=threads
        )
        return loader.with_epoch(epoch) if epoch else loader

    def items(loader):
        with loader:  # its workers stop at the end, not when collected
            return [flat(x) for x in loader]

    assert items(make()) == items(make(threads=None))
    check(make, rng)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("seed", [None, 4])
def test_random_crops_are_the_same_pixels_with_threads(tmp_path, workers, seed):
    # The fused crop decoder draws each crop from (seed, epoch, rank, worker, url, key): the
    # loader's threads must not change one pixel, seeded or not, with workers or not.
    import io

    import torch
    from PIL import Image

    for k in range(2):
        members = []
        for i in range(6):
            image = Image.new("RGB", (96 + 8 * i, 64), (40 * i, 255 - 30 * i, 17 * k))
            image.paste((200, 10, 90), (i * 5, 3, i * 5 + 30, 40))
            out = io.BytesIO()
            image.save(out, "JPEG", quality=90)
            members += [(f"{k}{i:03d}.jpg", out.getvalue()), (f"{k}{i:03d}.cls", b"%d" % i)]
        write_tar(tmp_path / f"c-{k}.tar", members)
    dataset = same_entropy(
        lambda: (
            webds.WebDataset(str(tmp_path / "c-{0..1}.tar"), shardshuffle=True, seed=seed)
            .decode(webds.RandomResizedCropDecoder(32, output="torch"))
            .to_tuple("jpg", "cls")
            .batched(4)
        )
    )

    def batches(**kw):
        with webds.WebLoader(dataset(), batch_size=None, num_workers=workers, **kw) as loader:
            return [(images, labels.tolist()) for images, labels in loader for _ in [0]]

    plain, pooled = batches(), batches(threads=2)
    assert [labels for _, labels in pooled] == [labels for _, labels in plain]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(pooled, plain))
    assert sum(len(labels) for _, labels in plain) == 12


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("persistent", [False, True])
def test_close_stops_the_workers_mid_epoch(spec, persistent):  # noqa: F811
    """The loader's own workers (not whatever children earlier tests left): alive mid-epoch,
    all ended once close() returns."""
    ds = webds.WebDataset(spec).map(lambda s: s["__key__"]).listed(2)
    loader = webds.WebLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
    it = iter(loader)
    next(it)
    procs = list(loader.pipeline[0]._reading._workers)
    assert len(procs) == 2 and all(w.is_alive() for w in procs)
    loader.close()
    assert not any(w.is_alive() for w in procs)
    del it
