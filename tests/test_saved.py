"""The saved state is typed (webds.base.saved): one reader, one writer, a version, and clear
errors for a malformed state; a WebLoader speaks to its pipeline only through its source."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
from conftest import sample_members, write_tar

import webds
from webds.base.saved import (
    VERSION,
    LedgerState,
    PipelineState,
    SlotState,
    StreamState,
    read_state,
    read_states,
)
from webds.channel import StreamKeeper
from webds.errors import ArgumentError
from webds.loader import LoaderSource
from webds.pipeline import DataPipeline


@pytest.fixture
def spec(tmp_path) -> str:
    for k in range(3):
        write_tar(tmp_path / f"s-{k}.tar", sample_members(8, prefix=f"s{k}-"))
    return str(tmp_path / "s-{0..2}.tar")


def mid_pass_states(spec: str):
    """States taken mid-pass: a dataset's own (with shuffle slots), and a WebLoader's with
    workers, a shuffle and a batching in the main process."""
    ds = webds.WebDataset(spec, shardshuffle=True, seed=1).shuffle(5, seed=2).batched(3)
    it = iter(ds)
    for _ in range(4):
        next(it)
    yield "dataset", ds.state_dict()
    for workers in (0, 2):
        inner = webds.WebDataset(spec, shardshuffle=True, seed=1).shuffle(4, seed=2)
        loader = webds.WebLoader(inner, batch_size=2, num_workers=workers)
        loader = loader.unbatched().shuffle(3, seed=3).batched(4)
        it = iter(loader)
        for _ in range(3):
            next(it)
        yield f"loader{workers}", loader.state_dict()


def test_the_writer_and_the_reader_agree_through_json_and_pickle(spec):
    seen = set()
    for name, saved in mid_pass_states(spec):
        state = read_state(saved)
        assert state.version == VERSION and state.in_progress
        assert state.to_dict() == saved, name  # the writer writes what the reader read
        assert read_state(json.loads(json.dumps(saved))).to_dict() == saved
        assert read_state(pickle.loads(pickle.dumps(saved))) == state
        if state.workers is not None:
            seen.add("workers")
            assert all(isinstance(w, StreamState) for w in state.workers.values())
            assert any(w.ledger is not None and w.ledger.slots for w in state.workers.values())
        if state.ledger is not None and state.ledger.slots:
            seen.add("slots")
            assert all(isinstance(s, SlotState) for s in state.ledger.slots.values())
    assert seen == {"workers", "slots"}  # the cases above reach both


def test_a_typed_state_loads_as_its_dict_does(spec):
    def make():
        return webds.WebDataset(spec, shardshuffle=True, seed=1).shuffle(5, seed=2)

    ds = make()
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(7)]
    saved = ds.state_dict()
    rest = [x["__key__"] for x in it]
    for given in (saved, read_state(saved), json.loads(json.dumps(saved))):
        again = make()
        again.load_state_dict(copy.deepcopy(given) if isinstance(given, dict) else given)
        assert [x["__key__"] for x in again] == rest
    assert len(head) + len(rest) == 24


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda s: s.pop("version"), "not a webds pipeline state"),
        (lambda s: s.update(version=3), "version 3, and this webds reads version 2 .*upgrade"),
        (lambda s: s.update(version=1), r"version 1 .*webds 0\.1.*never released.*set_epoch\(0\)"),
        (lambda s: s.update(workers=[1, 2]), "'workers'"),
        (lambda s: s.update(workers={"x": {}}), "'workers'"),
        (lambda s: s.update(entropy=["a"]), "'entropy'"),
        (lambda s: s.update(config=[1]), "'config'"),
        (lambda s: s.update(items="many"), "'items'"),
        (lambda s: s.update(ledger=[1]), "the ledger"),
        (lambda s: s["ledger"].update(partial={"a": 1}), "the ledger"),
        (lambda s: s["ledger"].update(complete=[[0]]), "the ledger"),
        (lambda s: s["ledger"].update(slots={"1": {"draws": "x"}}), "the ledger"),
    ],
)
def test_a_malformed_state_says_which_field(spec, change, says):
    ds = webds.WebDataset(spec, shardshuffle=False).shuffle(5, seed=2)
    it = iter(ds)
    next(it)
    saved = ds.state_dict()
    change(saved)
    with pytest.raises(ArgumentError, match=says):
        read_state(saved)
    with pytest.raises(ArgumentError, match=says):
        webds.WebDataset(spec, shardshuffle=False).shuffle(5, seed=2).load_state_dict(saved)


def test_every_ranks_list_is_read_state_by_state():
    one = PipelineState(3, 5, rank=1, world_size=2).to_dict()
    states = read_states([PipelineState(3, 4, world_size=2).to_dict(), one])
    assert [s.rank for s in states] == [0, 1] and states[1].items == 5
    with pytest.raises(ArgumentError, match="empty list"):
        read_states([])
    with pytest.raises(ArgumentError, match="not a webds pipeline state"):
        read_states([one, "x"])


def test_the_ledger_record_keeps_runs_and_slots():
    ledger = LedgerState({0, 1, 2, 7}, {3: 4}, {5 << 32 | 1}, {2: SlotState([1, [2, 3]], 9)})
    d = ledger.to_dict()
    assert d["complete"] == [[0, 3], [7, 8]] and d["partial"] == {"3": 4}
    assert LedgerState.from_dict(json.loads(json.dumps(d))) == ledger
    complete, partial, holes = ledger.reads()
    assert holes == {5 << 32 | 1, 1, 2, 3}  # what the slots held is read again too


def test_a_webloader_overrides_none_of_the_pipelines_internals():
    # The WebLoader is a pipeline over a LoaderSource (the DataLoader and the worker channel):
    # it speaks to the pipeline through the source's StreamKeeper methods only.
    internals = {
        n
        for n, f in vars(DataPipeline).items()
        if n.startswith("_") and not n.startswith("__") and callable(f)
    }
    assert {"_state", "_source_items", "_one_pass", "_epoch_done", "_counted_source"} <= internals
    overridden = internals & set(vars(webds.WebLoader))
    assert overridden == set()
    assert issubclass(LoaderSource, StreamKeeper)
    assert not any(n.startswith("_") and not n.startswith("__") for n in vars(StreamKeeper))


def test_expanding_stages_are_declared_and_checked():
    assert webds.tarfile_to_samples.expands and not webds.shuffle.expands

    def no_ledger(src):
        yield from src

    with pytest.raises(ArgumentError, match="ledger parameter"):
        webds.stage(expands=True)(no_ledger)
