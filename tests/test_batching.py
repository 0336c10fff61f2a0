"""webds.stages.batching: batched / unbatched, listed / unlisted and default_collation_fn."""

from __future__ import annotations

import functools
import importlib
import json
import pickle

import numpy as np
import pytest
import torch

import webds
from webds.errors import ArgumentError, SampleError
from webds.stages import batching as B

# webdataset's module name webds.filters (an alias module), where its code finds batched & co.
F = importlib.import_module("webds.filters")


def run(stage, items):
    return list(stage(items))


def collate_first(batch):
    return batch[0]


# -- batching --------------------------------------------------------------------------------------


def tuple_samples(n):
    return [
        (torch.full((2, 3), float(i)), np.arange(4) + i, i, float(i) / 2, f"s{i}", b"b", True)
        for i in range(n)
    ]


def assert_same(a, b):
    assert type(a) is type(b) or (isinstance(a, (int, float)) and isinstance(b, np.generic))
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_batched_tuples_collate_by_column_and_round_trip():
    samples = tuple_samples(10)
    batches = run(B.batched(4), samples)
    assert [len(b[2]) for b in batches] == [4, 4, 2]
    first = batches[0]
    assert isinstance(first, tuple)
    assert isinstance(first[0], torch.Tensor) and first[0].shape == (4, 2, 3)
    assert isinstance(first[1], np.ndarray) and first[1].shape == (4, 4)
    assert isinstance(first[2], np.ndarray) and first[2].tolist() == [0, 1, 2, 3]
    assert first[3].dtype == np.float64 and first[6].dtype == np.bool_
    assert first[4] == ["s0", "s1", "s2", "s3"] and first[5] == [b"b"] * 4
    back = run(B.unbatched(), batches)
    assert len(back) == 10
    for a, b in zip(samples, back):
        assert_same(a, b)
    assert [len(b[2]) for b in run(B.batched(4, partial=False), samples)] == [4, 4]


def test_batched_dicts_with_nested_dicts_round_trip():
    samples = [
        {
            "__key__": f"k{i}",
            "img": torch.rand(3, 4),
            "meta": {"size": i, "tags": {"t": np.ones(2) * i}, "name": f"n{i}"},
        }
        for i in range(5)
    ]
    # webdataset's shape by default: a column of dicts stays a list of dicts.
    batches = run(B.batched(3), samples)
    assert batches[0]["img"].shape == (3, 3, 4)
    assert [m["name"] for m in batches[0]["meta"]] == ["n0", "n1", "n2"]
    back = run(B.unbatched(), batches)
    assert len(back) == 5
    for a, b in zip(samples, back):
        assert_same(a, b)
    # combine_dicts: collated field by field, and back.
    collate = functools.partial(B.default_collation_fn, combine_dicts=True)
    batches = run(B.batched(3, collation_fn=collate), samples)
    assert batches[0]["__key__"] == ["k0", "k1", "k2"]
    assert batches[0]["img"].shape == (3, 3, 4)
    assert batches[0]["meta"]["size"].tolist() == [0, 1, 2]
    assert batches[0]["meta"]["tags"]["t"].shape == (3, 2)
    assert batches[1]["meta"]["name"] == ["n3", "n4"]
    back = run(B.unbatched(), batches)
    assert len(back) == 5
    for a, b in zip(samples, back):
        assert_same(a, b)


def test_json_metadata_in_tuples_batches_as_webdataset_does(tmp_path):
    # open_clip-style code: metadata[i]["filename"] after to_tuple(..., "json").batched(n).
    import webdataset
    from conftest import write_tar

    members = []
    for i in range(6):
        members.append((f"{i:03d}.cls", str(i % 3).encode()))
        members.append((f"{i:03d}.json", json.dumps({"filename": f"f{i}.jpg", "w": i}).encode()))
    write_tar(tmp_path / "a.tar", members)

    def batches(lib):
        ds = lib.WebDataset(str(tmp_path / "a.tar"), shardshuffle=False)
        return list(ds.decode().to_tuple("cls", "json").batched(4))

    ours, theirs = batches(webds), batches(webdataset)
    assert [m["filename"] for m in ours[0][1]] == [m["filename"] for m in theirs[0][1]]
    assert type(ours[0][1]) is type(theirs[0][1]) is list
    assert [len(b[1]) for b in ours] == [len(b[1]) for b in theirs] == [4, 2]


def test_batched_lists_options_and_errors():
    assert run(B.batched(2, collation_fn=None), range(5)) == [[0, 1], [2, 3], [4]]
    assert run(B.batched(2, collate_first), range(5)) == [0, 2, 4]
    assert run(B.batched(2), [[1, "a"], [2, "b"]]) == [
        [pytest.approx(np.array([1, 2])), ["a", "b"]]
    ]
    out = B.default_collation_fn([(torch.zeros(2), 1), (torch.ones(2), 2)], False, False)
    assert isinstance(out[0], list) and out[1] == [1, 2]
    single = B.default_collation_fn([torch.zeros(2), torch.ones(2)])
    assert single.shape == (2, 2)
    with pytest.raises(ArgumentError, match="batchsize must be at least 1"):
        run(B.batched(0), range(3))
    with pytest.raises(ArgumentError, match="at least one sample"):
        B.default_collation_fn([])


def test_batched_shape_mismatch_names_shapes_and_suggests_a_fix():
    samples = [
        {"__key__": "a", "__url__": "s.tar", "img": torch.zeros(3, 32, 32)},
        {"__key__": "b", "__url__": "s.tar", "img": torch.zeros(3, 32, 31)},
    ]
    with pytest.raises(SampleError) as info:
        run(B.batched(2), samples)
    msg = str(info.value)
    assert "(3, 32, 32)" in msg and "(3, 32, 31)" in msg and "'img'" in msg
    assert "'b'" in msg and "collation_fn" in msg and "pad" in msg
    with pytest.raises(SampleError, match=r"\(2,\).*\(3,\)"):
        B.default_collation_fn([(np.zeros(2),), (np.zeros(3),)])


def test_batched_dicts_with_different_keys_name_them():
    samples = [{"__key__": "a", "jpg": 1, "cls": 2}, {"__key__": "b", "png": 1, "cls": 2}]
    with pytest.raises(SampleError) as info:
        B.default_collation_fn(samples)
    msg = str(info.value)
    assert "extra ['png']" in msg and "lacks ['jpg']" in msg and "'b'" in msg
    with pytest.raises(SampleError, match="different lengths"):
        B.default_collation_fn([(1, 2), (1,)])


def test_unbatched_errors_and_copies():
    with pytest.raises(SampleError, match="different lengths"):
        run(B.unbatched(), [{"a": torch.zeros(3), "b": [1, 2]}])
    with pytest.raises(SampleError, match="different lengths"):
        run(B.unbatched(), [{"a": [1, 2], "m": {"x": [1, 2], "y": [1]}}])
    with pytest.raises(SampleError, match="0-d tensor"):
        run(B.unbatched(), [(torch.tensor(1.0),)])
    with pytest.raises(SampleError, match="not a batch column"):
        run(B.unbatched(), [{"a": [1, 2], "n": 5}])
    with pytest.raises(SampleError, match="tuple, list or dict"):
        run(B.unbatched(), [5])
    big = torch.zeros(64, 1000)
    item = run(B.unbatched(), [(big,)])[0][0]
    # Each sample owns its memory, so one buffered sample does not pin the whole batch.
    assert item.untyped_storage().nbytes() == 1000 * 4
    assert run(B.unbatched(), [([], [])]) == []


def test_listed_and_unlisted():
    assert run(B.listed(3), range(7)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert run(B.listed(3, partial=False), range(7)) == [[0, 1, 2], [3, 4, 5]]
    assert run(B.unlisted(), run(B.listed(3), range(7))) == list(range(7))
    with pytest.raises(SampleError, match="unlisted expects lists"):
        run(B.unlisted(), [(1, 2)])


def test_collation_keeps_other_columns_as_lists():
    samples = [(None, torch.zeros(2), 1, "a"), (None, np.zeros(2), 2.5, 3)]
    nothing, mixed, numbers, strings = B.default_collation_fn(samples)
    assert nothing == [None, None] and strings == ["a", 3]
    assert isinstance(mixed, list) and len(mixed) == 2  # a tensor and an array are not stacked
    assert numbers.tolist() == [1.0, 2.5]


# -- the module's place in the API -----------------------------------------------------------------

STAGES = [B.batched(4, partial=False), B.listed(4), B.unbatched(), B.unlisted()]


@pytest.mark.parametrize("stage", STAGES, ids=[s.factory.__name__ for s in STAGES])
def test_stages_and_factories_pickle(stage):
    back = pickle.loads(pickle.dumps(stage))
    assert back.factory is stage.factory
    assert pickle.loads(pickle.dumps(stage.factory)) is stage.factory
    items = [(i,) for i in range(9)]
    if stage.factory in (B.unbatched, B.unlisted):
        items = [[(1,), (2,)]] if stage.factory is B.unlisted else [([1, 2],)]
    assert repr(run(back, items)) == repr(run(stage, items))


def test_public_names_come_from_this_module_only():
    for name in B.__all__:
        obj = getattr(B, name)
        assert obj.__doc__, name
        assert getattr(webds, name) is obj
        # webdataset code imports these from webds.filters: served from the alias table, the
        # same object, never a copy held in that module.
        assert getattr(F, name) is obj and name not in vars(F)
    assert webds.WebDataset.batched.__doc__ == B.batched.__doc__


def test_nested_dicts_with_differing_fields_stay_a_list():
    # JSON metadata rarely has one schema: webdataset gives a list of dicts for such a column.
    metas = [{"annotations": [1]}, {}, {"annotations": [2], "extra": 1}]
    images, got = B.default_collation_fn([(np.zeros(2), m) for m in metas])
    assert images.shape == (3, 2)
    assert got == metas
    batch = B.default_collation_fn([{"x": 1, "meta": m} for m in metas])
    assert list(batch["x"]) == [1, 1, 1] and batch["meta"] == metas


def test_top_level_dicts_with_differing_fields_are_an_error():
    with pytest.raises(SampleError, match="different fields"):
        B.default_collation_fn([{"a": 1}, {"b": 2}])


def _shared_flags(batch):
    """Runs where the batch was collated: whether its tensor column lives in shared memory."""
    return batch[0], torch.tensor(batch[0].is_shared())


def test_batches_made_in_workers_are_stacked_into_shared_memory():
    # In a DataLoader worker the tensor column is stacked straight into shared memory (no copy
    # on the way out, and no batch-sized block left on the worker's heap); in the main
    # process it is an ordinary tensor. Values are the same either way.
    samples = [(torch.full((3, 4), float(i)), i) for i in range(8)]
    pipeline = webds.DataPipeline(lambda: iter(samples), B.batched(4), F.map(_shared_flags))
    in_process = list(pipeline)
    assert [flag.item() for _, flag in in_process] == [False, False]
    loader = torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=1)
    in_worker = list(loader)
    assert [flag.item() for _, flag in in_worker] == [True, True]
    for (a, _), (b, _) in zip(in_process, in_worker):
        assert torch.equal(a, b) and a.shape == (4, 3, 4)


def test_columns_of_numbers_are_told_by_type_as_by_the_number_class():
    """A column becomes an array when every value is a number (or numpy bool) that is not a
    tensor or array: told at once by type for the common kinds, asked of ``numbers.Number``
    otherwise; random columns of every kind, alike or mixed, collate as that rule says."""
    import enum
    import fractions
    import random

    class Level(enum.IntEnum):
        LOW = 1

    class MyInt(int):
        pass

    kinds = [1, 2.5, True, 1 + 2j, np.int64(3), np.int32(4), np.float32(0.5), np.float64(1.5),
             np.bool_(False), np.uint8(7), np.float16(2), Level.LOW, MyInt(5),
             fractions.Fraction(1, 3), torch.tensor(1), np.array(2), "3", b"4", None]  # fmt: skip
    rng = random.Random(0)
    for _ in range(400):
        pick = rng.sample(kinds, rng.randint(1, 3))
        values = [rng.choice(pick) for _ in range(rng.randint(1, 8))]
        numbers_ = all(B._is_scalar(v) for v in values)
        assert B._all_scalars(values) == numbers_, values
        (got,) = B.default_collation_fn([(v,) for v in values])
        if numbers_:
            assert isinstance(got, np.ndarray) and got.tolist() == np.array(values).tolist()
        elif not all(isinstance(v, (np.ndarray, torch.Tensor)) for v in values):  # (stacked)
            assert isinstance(got, list) and len(got) == len(values)
            assert all(a is b for a, b in zip(got, values))


def _odd(sample, first):
    """Whether ``sample`` cannot be batched with ``first``, the batch's first sample."""
    import collections.abc

    if isinstance(first, collections.abc.Mapping):
        return not isinstance(sample, collections.abc.Mapping) or sample.keys() != first.keys()
    if isinstance(first, (tuple, list)):
        return not isinstance(sample, (tuple, list)) or len(sample) != len(first)
    return False  # (a batch of other things is one column)


def test_random_batches_with_an_odd_sample_are_refused_at_that_sample():
    """Batches of tuples, lists, namedtuples and mappings of every kind (dicts, mapping proxies,
    UserDicts), now and then one sample of another kind, length or set of fields: collated
    when all alike, else refused naming the first odd sample, as sample by sample."""
    import collections
    import random
    import types

    Pair = collections.namedtuple("Pair", "a b")
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        if rng.random() < 0.5:
            make = rng.choice([tuple, list, lambda xs: Pair(*xs)])
            batch = [make([i, f"s{i}"]) for i in range(n)]
        else:
            make = rng.choice([dict, types.MappingProxyType, collections.UserDict])
            batch = [make({"x": i, "y": f"s{i}"}) for i in range(n)]
        odd = None
        if rng.random() < 0.6:
            odd = rng.randrange(n)
            batch[odd] = rng.choice([(1,), [1, 2, 3], {"x": 1}, {"x": 1, "z": 2}, 5, "ab",
                                     (1, "a"), {"x": 1, "y": "a"}])  # fmt: skip
        want = next((i for i, s in enumerate(batch) if _odd(s, batch[0])), None)
        if want is None:
            B.default_collation_fn(batch)
            continue
        with pytest.raises(SampleError) as info:
            B.default_collation_fn(batch)
        assert f"#{want}" in str(info.value) or f"sample #{want}" in str(info.value), (batch, want)
