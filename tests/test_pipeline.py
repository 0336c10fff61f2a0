"""The engine: stage factories, DataPipeline composition, epochs, length, closing."""

from __future__ import annotations

import inspect
import pickle
import platform

import pytest

from webds.pipeline import DataPipeline, Stage, stage


@stage
def add(src, n=1):
    """Add n to every item."""
    for x in src:
        yield x + n


@stage
def tag_epoch(src, *, epoch=0):
    for x in src:
        yield (epoch, x)


class Source:
    """An iterable that records whether its iterator was closed."""

    def __init__(self, n):
        self.n = n
        self.closed = 0

    def __iter__(self):
        try:
            yield from range(self.n)
        finally:
            self.closed += 1


def test_stage_factory_is_curried_and_documented():
    s = add(5)
    assert isinstance(s, Stage)
    assert list(s(iter([1, 2]))) == [6, 7]
    assert add.__doc__ == "Add n to every item."
    assert str(inspect.signature(add)) == "(n=1)"
    assert repr(s) == "add(5)"
    assert "epoch" not in inspect.signature(tag_epoch).parameters


def test_stage_checks_arguments_at_construction():
    with pytest.raises(TypeError, match="add"):
        add(1, 2, 3)
    with pytest.raises(TypeError):
        add(m=3)


def test_stage_pickles_by_reference():
    s = pickle.loads(pickle.dumps(add(3)))
    assert list(s([1])) == [4]
    assert pickle.loads(pickle.dumps(add)) is add


def test_pipeline_runs_stages_in_order():
    p = DataPipeline(range(3), add(1), None, [add(10), None])
    assert list(p) == [11, 12, 13]
    assert p.stage(0) == range(3)


def test_pipeline_source_may_be_callable():
    assert list(DataPipeline(lambda: iter([1, 2]), add())) == [2, 3]


def test_compose_copies():
    base = DataPipeline(range(3))
    more = base.compose(add(1))
    assert list(base) == [0, 1, 2]
    assert list(more) == [1, 2, 3]


def test_epoch_advances_and_reaches_stages():
    p = DataPipeline(range(2), tag_epoch())
    assert list(p) == [(0, 0), (0, 1)]
    assert list(p) == [(1, 0), (1, 1)]
    p.set_epoch(7)
    assert list(p) == [(7, 0), (7, 1)]
    assert list(p) == [(8, 0), (8, 1)]


def test_with_epoch_continues_across_epochs():
    p = DataPipeline(range(5), tag_epoch()).with_epoch(3)
    first, second = list(p), list(p)
    assert [x for _, x in first] == [0, 1, 2]
    # The stream continues where it stopped, wrapping into a new pass with a new epoch.
    assert second == [(0, 3), (0, 4), (1, 0)]


def test_with_epoch_on_empty_source_stops():
    assert list(DataPipeline([]).with_epoch(10)) == []


def test_repeat():
    p = DataPipeline(range(3)).repeat(2)
    assert list(p) == [0, 1, 2, 0, 1, 2]
    assert list(DataPipeline(range(3)).repeat(nbatches=4)) == [0, 1, 2, 0]


def test_with_length():
    p = DataPipeline(range(3))
    with pytest.raises(TypeError, match="with_length"):
        len(p)
    assert p.with_length(3) is p
    assert len(p) == 3
    assert list(p) == [0, 1, 2]
    q = pickle.loads(pickle.dumps(p))
    assert len(q) == 3


def test_early_stop_closes_source():
    src = Source(100)
    p = DataPipeline(src, add())
    it = iter(p)
    assert next(it) == 1
    it.close()
    assert src.closed == 1


def test_pipeline_with_running_epoch_pickles():
    p = DataPipeline(range(10)).with_epoch(3)
    list(p)
    q = pickle.loads(pickle.dumps(p))
    assert len(list(q)) == 3


def test_bad_source():
    with pytest.raises(ValueError, match="iterable or callable"):
        list(DataPipeline(42))


def test_release_free_heap_where_glibc():
    # Called by every DataLoader worker at the end of its epoch; a no-op without glibc.
    from webds.channel import release_free_heap

    assert release_free_heap() is (platform.libc_ver()[0] == "glibc")
