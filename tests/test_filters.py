"""The user-facing stages in webds.stages.filters and webds.stages.fields."""

from __future__ import annotations

import io
import logging
import os
import pickle
import random
import subprocess
import sys
import tarfile
import warnings
from collections import Counter
from pathlib import Path

import pytest
from conftest import Tracked, sample_members, write_tar
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from webds.base.handlers import ignore_and_continue, ignore_and_stop, warn_and_continue
from webds.errors import ArgumentError, SampleError
from webds.fluent import WebDataset
from webds.pipeline import DataPipeline
from webds.shards import derive_seed, split_by_worker
from webds.stages import batching as B
from webds.stages import fields as FD
from webds.stages import filters as F
from webds.stages.decode import decode

# -- helpers ---------------------------------------------------------------------------------------


def samples_from_tar(path: Path):
    """Group the members of a real tar file into webds-style sample dicts (key = name before
    the first dot), reading it with Python's tarfile, independently of webds's reader."""
    current = None
    with tarfile.open(path) as tf:
        for member in tf:
            key, ext = member.name.split(".", 1)
            if current is None or current["__key__"] != key:
                if current is not None:
                    yield current
                current = {"__key__": key, "__url__": str(path)}
            current[ext] = tf.extractfile(member).read()
    if current is not None:
        yield current


def run(stage, items):
    return list(stage(items))


def square(x):
    return x * x


def add_one(x):
    return x + 1


def is_even(x):
    return x % 2 == 0


def none_for_odd(x):
    return x if x % 2 == 0 else None


def fail_on_three(x):
    if x == 3:
        raise KeyError("three")
    return x


def lookup_extra(key, suffix=""):
    return {"extra": key + suffix}


@pytest.fixture
def tar_samples(tmp_path):
    path = write_tar(tmp_path / "shard-000.tar", sample_members(10, ("jpg", "cls", "json")))
    return list(samples_from_tar(path))


# -- shuffle ---------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    items=st.lists(st.integers(0, 5), max_size=60),
    bufsize=st.integers(-2, 25),
    initial=st.integers(-2, 30),
    seed=st.integers(0, 2**40),
)
def test_shuffle_is_a_permutation(items, bufsize, initial, seed):
    out = run(F.shuffle(bufsize, initial, seed=seed), iter(items))
    assert Counter(out) == Counter(items)


@pytest.mark.parametrize("bufsize,initial", [(1, 1), (5, 1), (16, 8), (16, 100), (50, 0)])
def test_shuffle_buffer_never_exceeds_bufsize(bufsize, initial):
    src = Tracked(500)
    out = []
    ahead = []
    for item in F.shuffle(bufsize, initial, seed=0)(src):
        out.append(item)
        # Items pulled from upstream but not yet handed downstream are in the buffer.
        ahead.append(src.pulled - len(out))
    assert sorted(out) == list(range(500))
    assert max(ahead) <= bufsize - 1 or (bufsize == 1 and max(ahead) == 0)
    assert max(ahead) == bufsize - 1  # and the buffer is actually used in full


def test_shuffle_fills_to_initial_before_the_first_output():
    src = Tracked(100)
    it = F.shuffle(50, 20, seed=0)(src)
    next(it)
    assert src.pulled == 20
    # An initial larger than the buffer is capped at the buffer size.
    src = Tracked(100)
    next(F.shuffle(8, 1000, seed=0)(src))
    assert src.pulled == 8


def test_shuffle_accepts_any_iterable_and_zero_bufsize_passes_through():
    assert sorted(run(F.shuffle(10, seed=1), list(range(30)))) == list(range(30))
    assert run(F.shuffle(0), range(30)) == list(range(30))
    assert run(F.shuffle(-1), range(30)) == list(range(30))
    assert run(F.shuffle(1, seed=3), range(30)) == list(range(30))  # a one-item buffer
    assert run(F.shuffle(10, seed=1), []) == []


def test_shuffle_actually_shuffles():
    out = run(F.shuffle(100, seed=0), range(1000))
    assert out != list(range(1000))
    # A buffer of 100 moves items by up to a few hundred places, not more than the stream.
    assert sum(a != b for a, b in zip(out, range(1000))) > 900


def test_shuffle_same_seed_and_epoch_gives_the_same_order():
    a = run(F.shuffle(20, seed=7), range(200))
    b = run(F.shuffle(20, seed=7), range(200))
    stage = F.shuffle(20, seed=7)
    c = run(pickle.loads(pickle.dumps(stage)), range(200))
    assert a == b == c
    assert run(F.shuffle(20, seed=8), range(200)) != a
    # A str seed (as WDS_SEED would give) means the same as the int.
    assert run(F.shuffle(20, seed="7"), range(200)) == a


def test_shuffle_order_differs_by_epoch_and_repeats_for_the_same_epoch():
    stage = F.shuffle(50, seed=0)
    orders = []
    for epoch in (0, 1, 2, 1):
        stage.set_epoch(epoch)
        orders.append(run(stage, range(300)))
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert orders[1] == orders[3]


def test_shuffle_reshuffles_every_pipeline_epoch():
    pipe = DataPipeline(range(200), F.shuffle(50, seed=3))
    first, second = list(pipe), list(pipe)
    assert first != second and sorted(first) == sorted(second) == list(range(200))
    pipe.set_epoch(0)
    assert list(pipe) == first


def test_shuffle_differs_across_workers_and_ranks(monkeypatch):
    # worker_info documents that RANK/WORLD_SIZE and WORKER/NUM_WORKERS override torch's view.
    orders = {}
    for rank, worker in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("WORKER", str(worker))
        monkeypatch.setenv("NUM_WORKERS", "2")
        orders[rank, worker] = run(F.shuffle(30, seed=11), range(200))
        assert orders[rank, worker] == run(F.shuffle(30, seed=11), range(200))
    assert len({tuple(o) for o in orders.values()}) == 4


def test_shuffle_without_seed_uses_fresh_entropy():
    # Equal orders of 200 items by chance: about 1 in 10^300.
    assert run(F.shuffle(50), range(200)) != run(F.shuffle(50), range(200))


def test_shuffle_with_rng_uses_it():
    a = run(F.shuffle(10, rng=random.Random(5)), range(100))
    b = run(F.shuffle(10, rng=random.Random(5)), range(100))
    assert a == b and sorted(a) == list(range(100))


def test_shuffle_order_is_pinned():
    # The order for a (seed, epoch) is a promise to users who reproduce runs: it must not change
    # between releases, machines or Python processes. Changing this value breaks that promise.
    assert run(F.shuffle(5, initial=5, seed=42), range(12)) == GOLDEN_SHUFFLE


GOLDEN_SHUFFLE = [2, 4, 6, 1, 0, 5, 10, 11, 8, 7, 3, 9]


def test_shuffle_order_does_not_depend_on_the_process_hash_seed():
    code = (
        "from webds import filters as F; print(list(F.shuffle(5, initial=5, seed=42)(range(12))))"
    )
    root = Path(__file__).resolve().parent.parent
    outs = set()
    for hashseed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed, PYTHONPATH=str(root))
        for var in ("RANK", "WORLD_SIZE", "WORKER", "NUM_WORKERS"):
            env.pop(var, None)
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(proc.stdout.strip())
    assert outs == {str(GOLDEN_SHUFFLE)}


def test_seeded_shuffle_quality():
    # Over many seeds, the first output is uniform over the `initial` items buffered before it
    # (chi-square, 9 degrees of freedom, p = 0.001 cutoff), and item 0 lands in many places.
    counts = Counter()
    landing = Counter()
    trials = 2000
    for seed in range(trials):
        out = run(F.shuffle(10, initial=10, seed=seed), range(40))
        counts[out[0]] += 1
        landing[out.index(0)] += 1
    assert set(counts) <= set(range(10))
    expected = trials / 10
    chi2 = sum((counts[i] - expected) ** 2 / expected for i in range(10))
    assert chi2 < 27.88, counts
    assert len(landing) >= 10


def test_shuffle_argument_errors_are_clear():
    with pytest.raises(ArgumentError, match="bufsize must be an integer, got 'big'"):
        run(F.shuffle("big"), range(3))
    with pytest.raises(ArgumentError, match="rng or seed, not both"):
        run(F.shuffle(10, rng=random.Random(), seed=1), range(3))
    with pytest.raises(ArgumentError, match="seed must be an integer"):
        run(F.shuffle(10, seed="abc"), range(3))
    with pytest.raises(TypeError, match="shuffle"):
        F.shuffle(10, bogus=1)


def test_detshuffle_is_the_same_in_every_worker_and_follows_the_epoch(monkeypatch):
    orders = set()
    for worker in range(3):
        monkeypatch.setenv("WORKER", str(worker))
        monkeypatch.setenv("NUM_WORKERS", "3")
        orders.add(tuple(run(F.detshuffle(20, seed=1), range(100))))
    assert len(orders) == 1
    stage = F.detshuffle(20, seed=1)
    stage.set_epoch(1)
    assert tuple(run(stage, range(100))) not in orders
    # webdataset's epoch= is the counter before the first epoch: epoch=4 starts at epoch 5.
    offset = F.detshuffle(20, 100, 1, 4)
    stage.set_epoch(5)
    assert run(offset, range(100)) == run(stage, range(100))
    assert run(F.detshuffle(20, seed=1, epoch=4), range(100)) == run(offset, range(100))
    assert sorted(run(offset, range(100))) == list(range(100))


def test_detshuffle_signature_and_errors():
    import inspect

    params = list(inspect.signature(F.detshuffle).parameters.values())
    assert [(p.name, p.default) for p in params] == [
        ("bufsize", 1000),
        ("initial", 100),
        ("seed", 0),
        ("epoch", -1),
    ]
    with pytest.raises(ArgumentError, match="detshuffle needs an integer seed"):
        run(F.detshuffle(10, seed=None), range(3))
    with pytest.raises(TypeError, match="detshuffle"):
        F.detshuffle(10, rng=1)


def test_rsample_is_seeded_and_leaves_the_global_random_alone():
    random.seed(1)
    state = random.getstate()
    a = run(F.rsample(0.3, seed=5), range(10000))
    assert random.getstate() == state
    assert a == run(F.rsample(0.3, seed=5), range(10000))
    assert 2700 < len(a) < 3300
    assert run(F.rsample(0.0), range(100)) == []
    assert run(F.rsample(1.0), range(100)) == list(range(100))
    stage = F.rsample(0.5, seed=5)
    stage.set_epoch(1)
    assert run(stage, range(1000)) != run(F.rsample(0.5, seed=5), range(1000))
    with pytest.raises(ArgumentError, match="probability"):
        run(F.rsample(1.5), range(3))


# -- select, slice, map ----------------------------------------------------------------------------


def test_select_and_slice():
    assert run(F.select(is_even), range(10)) == [0, 2, 4, 6, 8]
    assert run(F.slice(3), range(10)) == [0, 1, 2]
    assert run(F.slice(2, 8), range(10)) == [2, 3, 4, 5, 6, 7]
    assert run(F.slice(1, None, 3), range(10)) == [1, 4, 7]
    src = Tracked(1000)
    assert run(F.slice(5), src) == [0, 1, 2, 3, 4]
    assert src.pulled == 5  # stops reading upstream
    with pytest.raises(ArgumentError, match="slice"):
        run(F.slice(-1), range(3))
    with pytest.raises(ArgumentError, match="1 to 3 arguments"):
        run(F.slice(), range(3))
    with pytest.raises(ArgumentError, match="predicate must be callable"):
        run(F.select(3), range(3))


def test_map_transforms_and_drops_none_with_a_count(caplog):
    assert run(F.map(square), range(4)) == [0, 1, 4, 9]
    with caplog.at_level(logging.DEBUG, logger="webds"):
        assert run(F.map(none_for_odd), range(6)) == [0, 2, 4]
    assert "returned None for 3 item(s)" in caplog.text


def test_map_copies_key_and_url_to_dict_results():
    samples = [{"__key__": "a", "__url__": "u.tar", "x": 1}]
    out = run(F.map(lambda s: {"y": s["x"] + 1}), samples)
    assert out == [{"y": 2, "__key__": "a", "__url__": "u.tar"}]
    out = run(F.map(lambda s: {"__key__": "b", "y": 1}), samples)
    assert out == [{"__key__": "b", "y": 1}]
    assert run(F.map(lambda s: (s["x"],)), samples) == [(1,)]


def test_map_handlers(caplog):
    with pytest.raises(KeyError) as info:
        run(F.map(fail_on_three), range(5))
    assert info.value.args == ("three",)  # the user's own exception, unchanged
    with pytest.raises(KeyError) as info:
        run(F.map(lambda s: fail_on_three(s["v"])), [{"__key__": "k3", "__url__": "s.tar", "v": 3}])
    assert any("'k3'" in note and "'s.tar'" in note for note in info.value.__notes__)
    with caplog.at_level(logging.WARNING, logger="webds"):
        assert run(F.map(fail_on_three, handler=ignore_and_continue), range(6)) == [0, 1, 2, 4, 5]
    assert "skipped 1 item(s)" in caplog.text and "KeyError" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="webds"):
        assert run(F.map(fail_on_three, handler=ignore_and_stop), range(6)) == [0, 1, 2]
    assert "and stopped" in caplog.text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(F.map(fail_on_three, handler=warn_and_continue), range(5)) == [0, 1, 2, 4]
    assert any("three" in str(w.message) for w in caught)
    with pytest.raises(ArgumentError, match="map: f must be callable"):
        run(F.map("nope"), range(3))


def test_map_dict_and_map_tuple():
    sample = {"__key__": "a", "x": 2, "y": 3}
    out = run(FD.map_dict(x=square, y=add_one), [sample])
    assert out == [{"__key__": "a", "x": 4, "y": 4}]
    assert sample == {"__key__": "a", "x": 2, "y": 3}  # input untouched
    with pytest.raises(SampleError, match="no field 'z'") as info:
        run(FD.map_dict(z=square), [{"__key__": "k9", "__url__": "s.tar", "x": 1}])
    assert "k9" in str(info.value) and "s.tar" in str(info.value)
    assert run(FD.map_dict(handler=ignore_and_continue, z=square), [sample, {"z": 3}]) == [{"z": 9}]

    assert run(FD.map_tuple(square, None), [(2, 3, 4)]) == [(4, 3, 4)]
    assert run(FD.map_tuple(square, add_one, add_one), [(2,)]) == [(4,)]
    assert run(FD.map_tuple(square), [[3, "x"]]) == [(9, "x")]
    with pytest.raises(SampleError, match="map_tuple needs tuple samples"):
        run(FD.map_tuple(square), [{"__key__": "a"}])
    out = run(FD.map_tuple(fail_on_three, handler=ignore_and_continue), [(1,), (3,), (5,)])
    assert out == [(1,), (5,)]
    with pytest.raises(ArgumentError, match="argument 1 must be callable"):
        run(FD.map_tuple(None, 5), [(1, 2)])


@pytest.mark.parametrize(
    "make",
    [
        lambda: F.map("nope"),
        lambda: FD.map_dict(x=3),
        lambda: FD.map_tuple(square, 5),
        lambda: FD.rename(image=3),
        lambda: FD.to_tuple(),
        lambda: decode(42),
    ],
    ids=["map", "map_dict", "map_tuple", "rename", "to_tuple", "decode"],
)
def test_argument_errors_come_no_later_than_the_first_item(make):
    stage = make()  # building the stage only binds the arguments
    src = Tracked(10)
    with pytest.raises(ArgumentError):
        next(iter(stage(src)))
    assert src.pulled == 0


# -- rename, to_tuple, extract_keys, rename_keys, associate ----------------------------------------


def test_rename(tar_samples, caplog):
    out = run(FD.rename(image="png;jpg", label="cls"), tar_samples)
    assert out[0]["image"] == tar_samples[0]["jpg"] and out[0]["label"] == b"0"
    assert set(out[0]) == {"__key__", "__url__", "image", "label", "json"}
    out = run(FD.rename(keep=False, image="jpg", label="cls"), tar_samples)
    assert set(out[0]) == {"image", "label"}
    with pytest.raises(SampleError) as info:
        run(FD.rename(image="png"), tar_samples)
    msg = str(info.value)
    assert "'png'" in msg and "'jpg'" in msg and "000000" in msg and "shard-000.tar" in msg
    mixed = [{"__key__": "a", "png": 1}, {"__key__": "b", "gif": 2}]
    with caplog.at_level(logging.WARNING, logger="webds"):
        assert run(FD.rename(handler=ignore_and_continue, image="png"), mixed) == [
            {"__key__": "a", "image": 1}
        ]
    assert "rename skipped 1 item(s)" in caplog.text
    with pytest.raises(ArgumentError, match="rename"):
        run(FD.rename(image=3), mixed)


def test_to_tuple(tar_samples):
    out = run(FD.to_tuple("png;jpg", "cls"), tar_samples)
    assert out[3] == (b"sample 000003 jpg", b"3")
    assert run(FD.to_tuple("png;jpg cls"), tar_samples) == out
    assert run(FD.to_tuple("cls"), tar_samples)[0] == (b"0",)
    assert run(FD.to_tuple("cls", "txt", missing_is_error=False), tar_samples)[0] == (b"0", None)
    # As in webdataset, a missing field is None, and a None an error while none_is_error holds.
    strict_none = FD.to_tuple("cls", "txt", missing_is_error=False, none_is_error=True)
    with pytest.raises(SampleError, match="no field 'txt'.*none_is_error=False"):
        run(strict_none, tar_samples)
    with pytest.raises(SampleError, match="'cls' is None"):
        run(strict_none, [{"__key__": "a", "cls": None}])
    with pytest.raises(SampleError) as info:
        run(FD.to_tuple("png;gif", "cls"), tar_samples)
    msg = str(info.value)
    assert "'png' or 'gif'" in msg and "'jpg', 'cls', 'json'" in msg
    assert "000000" in msg and "shard-000.tar" in msg and "missing_is_error=False" in msg
    nones = [{"__key__": "a", "cls": None}]
    with pytest.raises(SampleError, match="is None"):
        run(FD.to_tuple("cls"), nones)
    assert run(FD.to_tuple("cls", none_is_error=False), nones) == [(None,)]
    bad = [{"__key__": "a", "cls": 1}, {"__key__": "b"}, {"__key__": "c", "cls": 3}]
    assert run(FD.to_tuple("cls", handler=ignore_and_continue), bad) == [(1,), (3,)]
    with pytest.raises(ArgumentError, match="at least one field"):
        run(FD.to_tuple(), bad)
    with pytest.raises(SampleError, match="needs dict samples"):
        run(FD.to_tuple("cls"), [(1, 2)])


def test_to_tuple_takes_a_list_of_alternatives_as_webdataset_does(tmp_path):
    """clip_benchmark's ``.to_tuple(["webp", "png", "jpg", "jpeg"], "cls")``: a list (or tuple)
    is the first present, side by side with webdataset 1.0.2's to_tuple, for every
    missing_is_error / none_is_error setting, on samples with one, none, or a None field."""
    wd = pytest.importorskip("webdataset")
    samples = [
        {"__key__": "a", "png": b"P", "jpg": b"J", "cls": b"0"},
        {"__key__": "b", "jpeg": b"E", "cls": b"1"},
        {"__key__": "c", "cls": b"2"},  # no image
        {"__key__": "d", "webp": None, "png": b"P", "cls": b"3"},  # a present None
        {"__key__": "e", "jpg": b"J", "cls": None},
    ]
    for fields in [
        (["webp", "png", "jpg", "jpeg"], "cls"),
        (("jpeg", "jpg"), ["cls"]),
        ("webp;png;jpg;jpeg", "cls"),
        (["png"],),
    ]:
        for kw in [{}, {"missing_is_error": False}, {"none_is_error": False}]:
            for more in [{}, {"none_is_error": True}]:
                options = {**kw, **more}
                for sample in samples:
                    want = got = None
                    try:
                        want = list(wd.filters._to_tuple([dict(sample)], *fields, **options))
                    except ValueError as exn:
                        want = type(exn)
                    try:
                        got = run(FD.to_tuple(*fields, **options), [dict(sample)])
                    except SampleError:
                        got = ValueError  # a SampleError is a ValueError, as webdataset raised
                    assert got == want, (fields, options, sample["__key__"])
    # The fluent method, derived from the same stage, takes a list too.
    path = write_tar(tmp_path / "s.tar", sample_members(3, ("jpeg", "cls")))
    dataset = WebDataset(str(path), shardshuffle=False)
    images = dataset.to_tuple(["webp", "png", "jpg", "jpeg"], "cls")
    assert [cls for _, cls in images] == [b"0", b"1", b"2"]
    with pytest.raises(ArgumentError, match=r"lists of them like \['jpg', 'png'\]"):
        run(FD.to_tuple([], "cls"), samples)
    with pytest.raises(ArgumentError, match="non-empty strings"):
        run(FD.to_tuple(["jpg", 3]), samples)


def test_extract_keys():
    sample = {"__key__": "k", "a.jpg": 1, "b.txt": 2, "cls": 3}
    assert run(FD.extract_keys("*.jpg", "cls"), [sample]) == [(1, 3)]
    assert run(FD.extract_keys("*.png;*.jpg", "*.txt"), [sample]) == [(1, 2)]
    # Patterns are also tried against "." + key, so "*.cls" finds the field "cls".
    assert run(FD.extract_keys("*.cls"), [sample]) == [(3,)]
    with pytest.raises(SampleError, match="no field matches"):
        run(FD.extract_keys("*.png"), [sample])
    assert run(FD.extract_keys("*.png", "cls", ignore_missing=True), [sample]) == [(3,)]
    with pytest.raises(SampleError, match="all match"):
        run(FD.extract_keys("*.*"), [sample])
    assert run(FD.extract_keys("*.jpg;*.txt", duplicate_is_error=False), [sample]) == [(1,)]


def test_rename_keys():
    sample = {"__key__": "k", "dir/A.JPG": 1, "b.txt": 2, "c.cls": 3}
    assert run(FD.rename_keys(("image", "*.jpg"), label="*.cls"), [sample]) == [
        {"image": 1, "label": 3}
    ]
    out = run(FD.rename_keys(image="*.jpg", keep_unselected=True), [sample])
    assert out == [{"__key__": "k", "image": 1, "b.txt": 2, "c.cls": 3}]
    # Later rules win.
    assert run(FD.rename_keys(("x", "*"), ("y", "*.txt"), must_match=False), [{"b.txt": 2}]) == [
        {"y": 2}
    ]
    with pytest.raises(SampleError, match=r"patterns \['\*.png'\] match no field"):
        run(FD.rename_keys(image="*.jpg", other="*.png"), [sample])
    with pytest.raises(SampleError, match="more than one field is renamed to 'x'"):
        run(FD.rename_keys(x="*.*"), [sample])
    out = run(FD.rename_keys(x="*.*", duplicate_is_error=False), [sample])
    assert out == [{"x": 1}]
    with pytest.raises(ArgumentError, match="pairs"):
        run(FD.rename_keys("image"), [sample])


def test_associate():
    samples = [{"__key__": "a", "v": 1}, {"__key__": "b", "v": 2}]
    assert run(FD.associate({"a": {"w": 10}}), samples) == [
        {"__key__": "a", "v": 1, "w": 10},
        {"__key__": "b", "v": 2},
    ]
    assert run(FD.associate(lookup_extra, suffix="!"), samples)[1]["extra"] == "b!"
    assert samples[0] == {"__key__": "a", "v": 1}
    with pytest.raises(SampleError, match="no __key__"):
        run(FD.associate({}), [{"v": 1}])


def test_info_and_log_keys(tmp_path, capsys):
    buf = io.StringIO()
    samples = [{"__key__": str(i), "cls": i} for i in range(10)]
    assert run(F.info(stream=buf, n=2, name="here"), samples) == samples
    text = buf.getvalue()
    assert text.count("--- here") == 2 and "cls 1" in text
    buf = io.StringIO()
    run(F.info("{__key__}:{cls}", n=1, every=4, stream=buf), samples)
    assert buf.getvalue().split() == ["0:0", "3:3", "7:7"]
    buf = io.StringIO()
    run(F.info("keys", n=1, stream=buf), samples)
    assert buf.getvalue().split() == ["__key__", "cls"]
    buf = io.StringIO()
    run(F.info("{} {}", n=1, stream=buf), [(1, 2)])
    assert buf.getvalue() == "1 2\n"
    run(F.info(n=1), samples)  # stderr, looked up at call time so capsys sees it
    assert "cls 0" in capsys.readouterr().err

    logfile = tmp_path / "keys.log"
    assert run(F.log_keys(str(logfile)), samples[:3]) == samples[:3]
    run(F.log_keys(str(logfile)), samples[3:4])
    lines = [line.split("\t") for line in logfile.read_text().splitlines()]
    assert [line[3] for line in lines] == ["0", "1", "2", "3"]
    assert [line[0] for line in lines] == ["0", "1", "2", "0"]
    assert run(F.log_keys(), samples) == samples


# -- a whole pipeline ------------------------------------------------------------------------------


def test_a_real_shard_through_a_pipeline(tmp_path):
    path = write_tar(tmp_path / "s.tar", sample_members(20, ("txt", "cls")))
    pipe = DataPipeline(
        tuple(samples_from_tar(path)),
        F.shuffle(8, seed=0),
        FD.map_dict(cls=lambda b: int(b)),
        FD.to_tuple("txt", "cls"),
        B.batched(6),
        B.unbatched(),
    )
    out = list(pipe)
    assert sorted(int(c) for _, c in out) == list(range(20))
    assert all(t == f"sample {int(c):06d} txt".encode() for t, c in out)


# -- helpers ---------------------------------------------------------------------------------------


def test_helpers():
    assert FD.getfirst({"a": 1, "b": 2}, "c;b;a") == 2
    assert FD.getfirst({"a": 1}, ["x", "a"]) == 1
    assert FD.getfirst({"a": 1}, "x", default=5, missing_is_error=False) == 5
    with pytest.raises(SampleError, match="no field 'x' or 'y'.*'a'"):
        FD.getfirst({"__key__": "k", "a": 1}, "x;y")
    assert FD.transform_with((1, 2, 3), [add_one, None]) == [2, 2, 3]
    assert FD.transform_with((1, 2), None) == (1, 2)
    with pytest.raises(ArgumentError):
        FD.transform_with((1,), [add_one, add_one])
    assert FD.parse_field_spec("jpg;png cls") == [["jpg", "png"], ["cls"]]
    assert FD.parse_field_spec(["a", "b;c"]) == [["a"], ["b", "c"]]
    assert F.identity(x := object()) is x
    buf = list(range(10))
    rng = random.Random(0)
    picked = [F.pick(buf, rng) for _ in range(10)]
    assert sorted(picked) == list(range(10)) and buf == []
    assert F.derive_seed is derive_seed


# -- pickling and DataLoader workers ---------------------------------------------------------------

STAGES = [
    F.shuffle(10, seed=1),
    F.shuffle(10, rng=random.Random(3)),
    F.detshuffle(10, seed=2, epoch=3),
    F.rsample(0.5, seed=1),
    F.select(is_even),
    F.slice(2, 8),
    F.map(square),
    FD.map_dict(x=square),
    FD.map_tuple(square, None),
    FD.rename(a="x;y", keep=False),
    FD.to_tuple("x", "y"),
    FD.extract_keys("*.x"),
    FD.rename_keys(("a", "*.x")),
    FD.associate({"k": {}}),
    F.info(n=0),
    F.log_keys(),
]


@pytest.mark.parametrize("stage", STAGES, ids=[s.factory.__name__ for s in STAGES])
def test_stages_and_factories_pickle(stage):
    back = pickle.loads(pickle.dumps(stage))
    assert back.factory is stage.factory
    assert pickle.loads(pickle.dumps(stage.factory)) is stage.factory
    assert len(back.args) == len(stage.args) and back.kwargs.keys() == stage.kwargs.keys()
    assert type(back(iter([]))) is type(stage(iter([])))


def test_pickled_stages_behave_the_same():
    for stage, items in [
        (F.shuffle(10, seed=1), range(50)),
        (F.shuffle(10, rng=random.Random(3)), range(50)),
        (F.detshuffle(10, seed=2, epoch=3), range(50)),
        (F.rsample(0.5, seed=1), range(50)),
        (F.map(square), range(5)),
    ]:
        clone = pickle.loads(pickle.dumps(stage))
        a, b = run(stage, items), run(clone, items)
        assert repr(a) == repr(b)


def test_factories_are_all_exported_and_documented():
    for module in (F, FD):
        for name in module.__all__:
            obj = getattr(module, name)
            assert obj.__doc__, name


def test_dataloader_workers_shuffle_their_own_shards():
    # Real worker processes (spawn, so the pipeline crosses by pickle): each worker shuffles its
    # share with its own seed, and the same seed gives the same result on a second run.
    pipe = DataPipeline(range(40), split_by_worker, F.shuffle(10, seed=5), F.map(square))
    loader = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    first = list(loader)
    assert sorted(first) == sorted(i * i for i in range(40))
    assert (
        list(DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
        == first
    )
