"""webdataset 1.x helpers (utils, extradatasets) in webds.compat.legacy."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from webds.compat.legacy import (
    MockDataset,
    ObsoleteException,
    PipelineStage,
    compute_sample_weights,
    deprecated,
    guess_batchsize,
    identity,
    is_iterable,
    lookup_sym,
    make_seed,
    obsolete,
    pytorch_worker_info,
    pytorch_worker_seed,
    repeatedly,
    repeatedly0,
    safe_eval,
    with_epoch,
    with_length,
)
from webds.errors import ArgumentError, WebdsError
from webds.pipeline import DataPipeline
from webds.stages.batching import batched
from webds.stages.filters import map as map_stage


class Doubler(PipelineStage):
    """A stage written webdataset's way, with run()."""

    def run(self, src):
        for x in src:
            yield 2 * x


class Adder(PipelineStage):
    """A stage written the extradatasets way, with invoke()."""

    def __init__(self, k):
        self.k = k

    def invoke(self, src):
        return (x + self.k for x in src)


class Source(PipelineStage):
    def run(self):
        return iter(range(3))


def test_pipeline_stage_run_and_invoke_in_datapipeline():
    assert list(DataPipeline(range(4), Doubler())) == [0, 2, 4, 6]
    assert list(DataPipeline(range(4), Adder(10))) == [10, 11, 12, 13]
    assert list(DataPipeline(range(3), Doubler(), Adder(1))) == [1, 3, 5]
    assert list(DataPipeline(Source(), Doubler())) == [0, 2, 4]
    # Both entry points work when called directly, too.
    assert list(Adder(1).run([1])) == [2] and list(Doubler().invoke([1])) == [2]
    with pytest.raises(NotImplementedError, match="neither run"):
        PipelineStage()([1])


def test_make_seed_is_stable_across_processes():
    args = ("shard-000.tar", 3, 7)
    here = make_seed(*args)
    assert 0 <= here < 2**31
    assert here == make_seed(*args) and here != make_seed("shard-001.tar", 3, 7)
    code = "from webds.compat.legacy import make_seed; print(make_seed('shard-000.tar', 3, 7))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == here


def test_worker_info_and_seed(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("WORKER", "3")
    monkeypatch.setenv("NUM_WORKERS", "5")
    rank, world, worker, nworkers = pytorch_worker_info()
    assert (rank, world, worker, nworkers) == (2, 4, 3, 5)
    assert pytorch_worker_seed() == 2003
    monkeypatch.setenv("NUM_WORKERS", "2000")
    monkeypatch.setenv("WORKER", "1500")
    assert pytorch_worker_seed() == 2 * 2000 + 1500


class _WorkerSeeds(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield (pytorch_worker_seed(), tuple(pytorch_worker_info()))


def test_worker_seed_in_real_dataloader_workers():
    got = sorted(DataLoader(_WorkerSeeds(), batch_size=None, num_workers=2))
    assert got == [[0, [0, 1, 0, 2]], [1, [0, 1, 1, 2]]]  # the loader turns tuples into lists


def test_is_iterable_and_identity():
    assert is_iterable([1]) and is_iterable(iter(())) and is_iterable({"a": 1})
    assert not is_iterable("abc") and not is_iterable(b"abc") and not is_iterable(3)
    obj = object()
    assert identity(obj) is obj


def test_safe_eval_parses_literals_and_never_evaluates(tmp_path):
    assert safe_eval("3") == 3
    assert safe_eval("True") is True
    assert safe_eval("2", "[{}, 4]") == [2, 4]
    assert safe_eval("'a'", "{{'k': {}}}") == {"k": "a"}
    marker = tmp_path / "pwned"
    for evil in [
        f"open({str(marker)!r}, 'w')",
        "__import__('os').system('true')",
        "abc",
        "1 + 1",
    ]:
        with pytest.raises(ArgumentError):
            safe_eval(evil)
    assert not marker.exists()
    with pytest.raises(ValueError):  # webdataset raised ValueError; ArgumentError is one
        safe_eval("x y")


def test_lookup_sym():
    assert lookup_sym("Doubler", ["os", __name__]) is Doubler
    assert lookup_sym("batched", [".filters"]) is batched  # webdataset's module name
    assert lookup_sym("no_such_name", ["os", ".filters"]) is None


def test_guess_batchsize_shapes():
    assert guess_batchsize((torch.zeros(5, 3), torch.zeros(5))) == 5
    assert guess_batchsize([np.zeros((7, 2)), [1] * 7]) == 7
    assert guess_batchsize({"__key__": ["a"] * 4, "jpg": torch.zeros(4, 2)}) == 4
    assert guess_batchsize([{"a": 1, "b": 2}, {"a": 3, "b": 4}, {"a": 5, "b": 6}]) == 3
    assert guess_batchsize(torch.zeros(6, 2)) == 6
    with pytest.raises(ArgumentError):
        guess_batchsize({"cls": 3})


def test_repeatedly_counts_epochs_batches_and_samples():
    data = [(torch.zeros(4),), (torch.zeros(4),), (torch.zeros(2),)]  # 10 samples per pass
    assert len(list(repeatedly(data, nepochs=3))) == 9
    assert len(list(repeatedly(data, nbatches=7))) == 7
    # guess_batchsize: 4 + 4 + 2 + 4 + 4 = 18 >= 15 after five batches.
    assert len(list(repeatedly(data, nsamples=15))) == 5
    # batchsize is honoured (webdataset ignored it): an int, or a function.
    assert len(list(repeatedly(data, nsamples=15, batchsize=1))) == 15
    assert len(list(repeatedly(data, nsamples=15, batchsize=lambda b: 5))) == 3
    # An empty source ends instead of spinning forever; an iterator runs out after one pass.
    assert list(repeatedly([], nsamples=10)) == []
    assert list(repeatedly(iter([1, 2]), batchsize=1)) == [1, 2]


def test_repeatedly0():
    assert list(repeatedly0([1, 2, 3], nepochs=2, nbatches=2)) == [1, 2, 1, 2]
    assert list(repeatedly0([1, 2], nepochs=3)) == [1, 2] * 3
    assert list(repeatedly0([])) == []


def test_deprecated_and_obsolete(monkeypatch):
    @deprecated
    def old(x):
        return x + 1

    @deprecated("use new()")
    def older(x):
        return x + 2

    with pytest.warns(DeprecationWarning, match="old is deprecated"):
        assert old(1) == 2
    with pytest.warns(DeprecationWarning, match="use new"):
        assert older(1) == 3

    @obsolete(reason="gone")
    def gone():
        return 42

    @obsolete
    def gone2():
        return 43

    monkeypatch.delenv("ALLOW_OBSOLETE", raising=False)
    with pytest.raises(ObsoleteException, match="ALLOW_OBSOLETE=1") as info:
        gone()
    assert isinstance(info.value, WebdsError) and "gone" in str(info.value)
    with pytest.raises(ObsoleteException):
        gone2()
    monkeypatch.setenv("ALLOW_OBSOLETE", "1")
    with pytest.warns(DeprecationWarning):
        assert gone() == 42


def test_compute_sample_weights():
    w = compute_sample_weights([(100, 1.0), (50, 1.0), (10, 5.0)])
    np.testing.assert_allclose(w, [1.0, 0.5, 0.5])
    with pytest.raises(ArgumentError):
        compute_sample_weights([])


def test_mock_dataset():
    ds = MockDataset({"x": 1}, 4)
    assert len(ds) == 4 and list(ds) == [{"x": 1}] * 4 and list(ds) == [{"x": 1}] * 4
    assert len(list(DataLoader(ds, batch_size=None))) == 4


def test_with_epoch_continues_across_epochs_and_pickles():
    ds = with_epoch(list(range(10)), 4)
    assert len(ds) == 4
    assert [list(ds) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    ds.set_epoch(3)  # lists have no set_epoch; nothing breaks
    clone = pickle.loads(pickle.dumps(ds))
    assert list(clone) == [0, 1, 2, 3]  # a copy starts its own stream
    assert list(ds) == [2, 3, 4, 5]  # and the original is not disturbed
    longer = with_epoch(range(3), 7)
    assert list(longer) == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ArgumentError, match="yields nothing"):
        list(with_epoch([], 2))
    # In a DataLoader with workers, each worker gives exactly `length` items.
    assert len(list(DataLoader(with_epoch(range(100), 5), batch_size=None, num_workers=2))) == 10


def test_with_length_declares_len_and_forwards_epoch():
    inner = DataPipeline(range(5), map_stage(lambda x: x * 10))
    ds = with_length(inner, 123)
    assert len(ds) == 123 and list(ds) == [0, 10, 20, 30, 40]
    ds.set_epoch(9)
    assert inner.epoch == 9
    clone = pickle.loads(pickle.dumps(with_length([1, 2], 2)))
    assert len(clone) == 2 and list(clone) == [1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = DataLoader(with_length(list(range(6)), 6), batch_size=None, num_workers=0)
        assert len(loader) == 6
