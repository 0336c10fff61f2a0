"""Per-sample stages in a pool of threads (``map``, ``map_tuple``, ``decode`` with ``threads=N``):
results in input order, errors through the handlers as in the serial stage, ``None`` dropped,
at most ``2 * N`` items read ahead, really concurrent, exact resume with the items in flight,
and the same inside DataLoader workers."""

from __future__ import annotations

import io
import random
import threading
import time
import warnings
from collections import Counter

import pytest
from conftest import sample_members, write_tar
from test_resume import assert_exact, flat, shards

import webds
from webds.errors import ArgumentError


@pytest.fixture
def spec(tmp_path):
    return shards(tmp_path, [13, 9, 17])


def jittered(sample):
    """The key, after a pause that makes later items finish first in a pool."""
    n = int(sample["__key__"][-6:])
    time.sleep(0.001 * ((7 * n) % 5))
    return sample["__key__"]


def keyed(sample):
    """(key,): batches of these are ([keys],), which the resume helpers read whole."""
    return (jittered(sample),)


def test_results_come_in_input_order(spec):
    serial = list(webds.WebDataset(spec).map(jittered))
    for n in (1, 2, 5):
        assert list(webds.WebDataset(spec).map(jittered, threads=n)) == serial


def test_one_thread_equals_the_serial_map(spec):
    def f(sample):
        return {"txt": sample["txt"].upper()}  # no __key__: map copies it over

    serial = list(webds.WebDataset(spec).map(f))
    assert list(webds.WebDataset(spec).map(f, threads=1)) == serial
    assert serial[0]["__key__"] == "s0-000000"


def test_none_drops_the_sample_like_map(spec):
    def odd_only(sample):
        return sample if int(sample["cls"]) % 2 else None

    serial = flat(list(webds.WebDataset(spec).map(odd_only)))
    assert flat(list(webds.WebDataset(spec).map(odd_only, threads=3))) == serial
    assert len(serial) == 6 + 4 + 8


def failing(sample):
    if int(sample["cls"]) % 4 == 3:
        raise ValueError(f"bad {sample['__key__']}")
    return sample["__key__"]


@pytest.mark.parametrize(
    "handler", [webds.ignore_and_continue, webds.warn_and_continue, webds.ignore_and_stop]
)
def test_errors_go_through_the_handler_as_in_the_serial_map(spec, handler):
    with warnings.catch_warnings(record=True) as serial_warnings:
        warnings.simplefilter("always")
        serial = list(webds.WebDataset(spec).map(failing, handler=handler))
    with warnings.catch_warnings(record=True) as pooled_warnings:
        warnings.simplefilter("always")
        pooled = list(webds.WebDataset(spec).map(failing, handler=handler, threads=3))
    assert pooled == serial
    assert [str(w.message) for w in pooled_warnings] == [str(w.message) for w in serial_warnings]
    if handler is webds.warn_and_continue:
        assert len(pooled_warnings) == 3 + 2 + 4
        assert "bad s0-000003" in str(pooled_warnings[0].message)


def test_an_error_raises_with_where_it_happened(spec):
    it = iter(webds.WebDataset(spec).map(failing, threads=2))
    assert [next(it) for _ in range(3)] == ["s0-000000", "s0-000001", "s0-000002"]
    with pytest.raises(ValueError, match="bad s0-000003") as info:
        next(it)
    assert any("s0-000003" in n and "shard-0.tar" in n for n in info.value.__notes__)


def test_at_most_twice_the_threads_in_flight_and_really_concurrent(tmp_path):
    url = str(
        write_tar(tmp_path / "a.tar", sample_members(39))
    )  # a multiple of the threads (the barrier)
    threads = 3
    barrier = threading.Barrier(threads, timeout=10)
    read = [0]

    def counted(src):
        for sample in src:
            read[0] += 1
            yield sample

    def together(sample):
        barrier.wait()  # breaks (an error) unless `threads` calls run at the same time
        return sample["__key__"]

    ds = webds.WebDataset(url).compose(counted).map(together, threads=threads)
    ahead = []
    out = []
    for key in ds:
        out.append(key)
        ahead.append(read[0] - len(out))
    assert out == [f"{i:06d}" for i in range(39)]
    assert max(ahead) == 2 * threads - 1  # read but not yet yielded, while the loop has one


def test_closing_early_stops_the_threads(spec):
    def named(sample):
        return threading.current_thread().name

    it = iter(webds.WebDataset(spec).map(named, threads=4))
    assert next(it).startswith("webds-map")
    it.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("webds-map")]


def test_bad_thread_counts_are_refused(spec):
    for bad in (-1, "2", 1.5, True):
        with pytest.raises(ArgumentError, match="threads"):
            list(webds.WebDataset(spec).map(jittered, threads=bad))


def test_map_tuple_and_decode_take_threads(tmp_path):
    from PIL import Image

    members = []
    for i in range(12):
        buf = io.BytesIO()
        Image.new("RGB", (8 + i, 6), (i * 20, 0, 0)).save(buf, format="PNG")
        members += [(f"{i:03d}.png", buf.getvalue()), (f"{i:03d}.cls", str(i).encode())]
    url = str(write_tar(tmp_path / "img.tar", members))

    def make(threads):
        return (
            webds.WebDataset(url)
            .decode("rgb8", threads=threads)
            .to_tuple("png", "cls")
            .map_tuple(lambda a: a.shape, lambda c: c * 10, threads=threads)
        )

    serial = list(make(0))
    assert serial[3] == ((6, 11, 3), 30)
    assert list(make(3)) == serial


# -- resume ---------------------------------------------------------------------------------------


def test_resume_is_exact_with_items_in_flight(spec):
    def make():
        return webds.WebDataset(spec).map(jittered, threads=3)

    for k in (1, 4, 20, 38):
        assert_exact(make, k)


def test_resume_is_exact_with_drops_errors_shuffle_and_batches(spec):
    def odd_only(sample):
        return sample if int(sample["cls"]) % 2 else None

    makers = [
        lambda: webds.WebDataset(spec).map(odd_only, threads=2).map(lambda s: s["__key__"]),
        lambda: (
            webds.WebDataset(spec, shardshuffle=True, seed=5)
            .map(failing, handler=webds.ignore_and_continue, threads=3)
            .shuffle(6, seed=2)
        ),
        lambda: webds.WebDataset(spec).shuffle(5, seed=1).map(keyed, threads=4).batched(4),
        lambda: webds.WebDataset(spec).batched(3).map(lambda b: (b["__key__"],), threads=2),
    ]
    for make in makers:
        for k in (1, 3, 7):
            assert_exact(make, k)


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_is_exact_in_dataloader_workers(spec, workers):
    def make():
        ds = webds.WebDataset(spec, shardshuffle=True, seed=4).map(keyed, threads=3)
        return webds.WebLoader(ds.batched(4), batch_size=None, num_workers=workers)

    for k in (1, 5):
        assert_exact(make, k)


def test_in_dataloader_workers_each_sample_once(spec):
    ds = webds.WebDataset(spec).map(keyed, threads=2).batched(5)
    loader = webds.WebLoader(ds, batch_size=None, num_workers=2)
    got = flat(list(loader))
    assert Counter(got) == Counter(flat(list(webds.WebDataset(spec).map(jittered))))
    assert len(got) == 13 + 9 + 17


def test_a_random_augment_stays_per_sample_deterministic(spec):
    # Seeded per sample (not from one shared generator), a random fn gives the same results in
    # a pool as serially, whatever the threads' timing.
    def augment(sample):
        rng = random.Random(sample["__key__"])
        time.sleep(0.001 * rng.random())
        return sample["__key__"], rng.random()

    serial = list(webds.WebDataset(spec).map(augment))
    assert list(webds.WebDataset(spec).map(augment, threads=4)) == serial


@pytest.mark.parametrize("threads", [0, 1, 2, 4])
def test_an_upstream_error_comes_after_every_item_read_before_it(tmp_path, threads):
    # A shard cut inside a member: the samples read before the cut are yielded, whatever the
    # thread count, then the error (the results in flight were cancelled before: issue 36).
    path = write_tar(tmp_path / "cut.tar", sample_members(12, exts=("bin", "cls")))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])
    ds = webds.WebDataset(str(path), shardshuffle=False).map(
        lambda s: s["__key__"], threads=threads
    )
    keys = []
    with pytest.raises(webds.ShardReadError):
        for key in ds:
            keys.append(key)
    serial = []
    with pytest.raises(webds.ShardReadError):
        for s in webds.WebDataset(str(path), shardshuffle=False):
            serial.append(s["__key__"])
    assert keys == serial and len(serial) >= 5


@pytest.mark.parametrize("threads", [0, 4])
def test_a_missing_shard_comes_after_the_samples_before_it(tmp_path, http_server, threads):
    good = http_server.put("a.tar", write_tar(tmp_path / "a.tar", sample_members(20)).read_bytes())
    urls = [good, http_server.url("missing.tar")]
    ds = webds.WebDataset(urls, shardshuffle=False).map(lambda s: s["__key__"], threads=threads)
    keys = []
    with pytest.raises(webds.NotFoundError):
        for key in ds:
            keys.append(key)
    assert len(keys) == 20
