"""The saved state is typed (webds.base.saved): one reader, one writer, a version, and clear
errors for a malformed state; a WebLoader speaks to its pipeline only through its source."""

from __future__ import annotations

import copy
import json
import pickle
import re

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
        (lambda s: s.update(version=4), "version 4, .*reads versions 2 and 3.*upgrade"),
        (lambda s: s.update(version=1), r"version 1 .*webds 0\.1.*never released.*set_epoch\(0\)"),
        (lambda s: s.update(workers=[1, 2]), r"state\['workers'\] is \[1, 2\], not a dict"),
        (lambda s: s.update(workers={"x": {}}), r"state\['workers'\]\['x'\]"),
        (lambda s: s.update(entropy=["a"]), r"state\['entropy'\]\[0\] is 'a', not an int"),
        (lambda s: s.update(config=[1]), r"state\['config'\] is \[1\], not a dict"),
        (lambda s: s.update(items="many"), r"state\['items'\] is 'many', not an int"),
        (lambda s: s.update(ledger=[1]), r"state\['ledger'\] is \[1\], not a dict"),
        (lambda s: s["ledger"].update(partial={"a": 1}), r"state\['ledger'\]\['partial'\]\['a'\]"),
        (lambda s: s["ledger"].update(complete=[[0]]), r"state\['ledger'\]\['complete'\]\[0\]"),
        (lambda s: s["ledger"].update(complete="x"), r"state\['ledger'\]\['complete'\] is 'x'"),
        (
            lambda s: s["ledger"].update(slots={"1": {"ids": [], "draws": "x"}}),
            r"state\['ledger'\]\['slots'\]\['1'\]\['draws'\] is 'x', not an int",
        ),
        (lambda s: s.update(epoch=None), r"state\['epoch'\] is None, not an int"),
        (lambda s: s.update(stream=None), r"state\['stream'\] is missing"),  # (a ledger without)
        (lambda s: s.update(ledger=None), r"state\['ledger'\] is None, not the ledger of the pass"),
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


# -- every field is needed (issue 54, item 9) ----------------------------------------------------


def fields(d: dict, path: tuple = ()):
    """The path of every field of a saved state, a record's and each worker's; not the keys of
    the maps of data (the configuration, which a loaded state is compared with, and the
    ledger's shards and slots by number: their records' fields are paths here)."""
    for key, value in d.items():
        here = path + (key,)
        if key != "config" and path[-1:] not in (("partial",), ("slots",)):
            yield here
        if isinstance(value, dict) and key != "config":
            yield from fields(value, here)


def named(path: tuple) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


def without(state: dict, path: tuple) -> dict:
    out = copy.deepcopy(state)
    d = out
    for key in path[:-1]:
        d = d[key]
    del d[path[-1]]
    return out


def real_states(spec: str):
    """(a fresh pipeline like it, a state taken mid-pass) of a plain pipeline and of a
    WebLoader with 2 workers and stages that hold samples in the main process."""

    def plain():
        return webds.WebDataset(spec, shardshuffle=True, seed=1).shuffle(5, seed=2).batched(3)

    def loader():
        inner = webds.WebDataset(spec, shardshuffle=True, seed=1).shuffle(4, seed=2)
        out = webds.WebLoader(inner, batch_size=2, num_workers=2)
        return out.unbatched().shuffle(3, seed=3).batched(4)

    for make, n in ((plain, 4), (loader, 3)):
        x = make()
        it = iter(x)
        for _ in range(n):
            next(it)
        state = json.loads(json.dumps(x.state_dict()))
        del it
        x.close() if hasattr(x, "close") else None
        yield make, state


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_state_missing_any_field_is_refused_naming_it(spec):
    seen = set()
    for make, state in real_states(spec):
        paths = list(fields(state))
        assert len(paths) > 20
        for path in paths:
            seen.add(path[-1])
            broken = without(state, path)
            says = re.escape(f"{named(path)} is missing")
            with pytest.raises(ArgumentError, match=says):
                read_state(broken)
            with pytest.raises(ArgumentError, match=says):
                make().load_state_dict(broken)
        make().load_state_dict(state)  # (whole, it loads)
    # Each record's fields are reached, the workers' and the ledger's included.
    assert {"epoch", "ledger", "complete", "held_after", "ids", "draws", "next_worker"} <= seen
    assert {"0", "1", "workers", "stream", "last", "problem", "unordered"} <= seen


def test_a_field_of_the_wrong_type_is_refused_naming_it(spec):
    for _, state in real_states(spec):
        for path in fields(state):
            if path[-1] in ("last", "seed", "problem", "unordered", "next_worker", "ids"):
                continue  # (any id, None, or None allowed)
            if path[-1] in ("0", "1"):
                continue  # (a worker's stream may be None: it sent nothing yet)
            broken = without(state, path)
            d = broken
            for key in path[:-1]:
                d = d[key]
            d[path[-1]] = "x"
            with pytest.raises(ArgumentError, match=re.escape(f"{named(path)} is 'x', not")):
                read_state(broken)


def test_a_version_2_state_may_leave_out_its_empty_fields(spec):
    # Version 2 (before every field was written) left out the empty ones; those still load.
    ds = webds.WebDataset(spec, shardshuffle=False).shuffle(5, seed=2)
    it = iter(ds)
    head = [next(it)["__key__"] for _ in range(6)]
    state = ds.state_dict()
    rest = [x["__key__"] for x in it]
    old = dict(state, version=2)
    for key in ("next_worker", "workers"):
        del old[key]
    del old["ledger"]["held_after"], old["ledger"]["unordered"]
    again = webds.WebDataset(spec, shardshuffle=False).shuffle(5, seed=2)
    again.load_state_dict(old)
    assert head + [x["__key__"] for x in again] == head + rest
    # ... but not those it always wrote.
    with pytest.raises(ArgumentError, match=re.escape("state['ledger']['complete'] is missing")):
        read_state(without(old, ("ledger", "complete")))
    with pytest.raises(ArgumentError, match=re.escape("state['stream'] is missing")):
        read_state(without(old, ("stream",)))
