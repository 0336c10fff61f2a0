"""webdataset names without a home of their own: FluidInterface, FluidWrapper, pipelinefilter,
pytorch_weights_only."""

from __future__ import annotations

import collections
import io

import pytest
import torch

import webds as wds
from webds.errors import DecodeError


def _add(data, n=1):
    for x in data:
        yield x + n


add = wds.pipelinefilter(_add)  # webdataset's way of making a curried stage


def test_pipelinefilter_makes_a_curried_stage():
    assert list(wds.DataPipeline(range(3), add(10))) == [10, 11, 12]
    assert list(wds.FluidWrapper(range(3)).compose(add())) == [1, 2, 3]


def test_fluid_wrapper_chains_stages():
    ds = wds.FluidWrapper([{"a": i, "b": -i} for i in range(5)]).to_tuple("a", "b").batched(2)
    got = list(ds)
    assert [list(a) for a, _ in got] == [[0, 1], [2, 3], [4]]
    assert isinstance(ds, wds.FluidWrapper) and isinstance(ds, torch.utils.data.IterableDataset)


def test_fluid_interface_on_a_custom_pipeline():
    class Numbers(wds.DataPipeline, wds.FluidInterface):
        def __init__(self, n):
            super().__init__(range(n))

    ds = Numbers(10).select(lambda x: x % 2 == 0).map(lambda x: x * 10).slice(3)
    assert list(ds) == [0, 20, 40]
    assert isinstance(ds, Numbers)
    assert wds.FluidInterface is wds.FluentMixin


Point = collections.namedtuple("Point", "x y")


def test_pytorch_weights_only_is_the_safe_default():
    assert wds.pytorch_weights_only is True
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2), "p": Point(1, 2)}, buf)
    sample = {"__key__": "k", "__url__": "u.tar", "pth": buf.getvalue()}
    # A pickled Python class is refused by weights-only loading, so arbitrary code can't run...
    with pytest.raises(DecodeError):
        list(wds.decode()([dict(sample)]))
    # ...unless the caller trusts the data and says so.
    (out,) = list(wds.decode(weights_only=False)([dict(sample)]))
    assert out["pth"]["p"] == Point(1, 2)
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3)}, buf)
    (out,) = list(wds.decode()([{"__key__": "k", "pth": buf.getvalue()}]))
    assert torch.equal(out["pth"]["w"], torch.arange(3))
