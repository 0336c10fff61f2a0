"""A saved state's values are checked, not only its shape (webds.base.saved, webds.counting):
each out of its range is refused naming its path, before it can hang a resume, read passes
without end or lose samples; and a WebLoader whose workers all found no samples raises
NoSamplesError, as one process does."""

from __future__ import annotations

import copy
import json
import re

import pytest
from conftest import sample_members, write_tar

import webds
from webds.errors import ArgumentError, NoSamplesError


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(a maker of the pipeline, its state after 30 of its 100 samples)."""
    folder = tmp_path_factory.mktemp("values")
    for k in range(4):
        write_tar(folder / f"s-{k}.tar", sample_members(25, prefix=f"s{k}-"))
    spec = str(folder / "s-{0..3}.tar")

    def make():
        return webds.WebDataset(spec, shardshuffle=False, seed=1).shuffle(10, seed=2)

    ds = make()
    it = iter(ds)
    for _ in range(30):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["ledger"]["partial"] and state["ledger"]["slots"]  # (the cases reach these)
    return make, state


def _slot(s):
    return next(iter(s["ledger"]["slots"].values()))


def _slot_path(s):
    return f"state['ledger']['slots'][{next(iter(s['ledger']['slots']))!r}]"


CASES = [
    # (what changes, the path named)
    (lambda s: _slot(s).update(draws=10**15), lambda s: _slot_path(s) + "['draws']"),
    (lambda s: _slot(s).update(draws=-1), lambda s: _slot_path(s) + "['draws']"),
    (lambda s: s.update(epoch=10**15), "state['stream']"),  # (an endless read)
    (lambda s: s.update(epoch=2), "state['stream']"),  # (passes 0 to 2: 270 items)
    (lambda s: s.update(stream=-7), "state['stream']"),
    (lambda s: s.update(epoch=-7), "state['epoch']"),
    (lambda s: s.update(epoch=1.0), "state['epoch']"),
    (lambda s: s.update(items=-1), "state['items']"),
    (lambda s: s.update(rank=1), "state['rank']"),
    (lambda s: s.update(world_size=0), "state['world_size']"),
    (lambda s: s.update(next_worker=3), "state['next_worker']"),
    (lambda s: s["ledger"]["partial"].update({"1": 10**15}), "state['ledger']['partial']['1']"),
    (lambda s: s["ledger"]["partial"].update({"-1": 3}), "state['ledger']['partial']['-1']"),
    (lambda s: _slot(s).update(ids=["a"] * 9), lambda s: _slot_path(s) + "['ids'][0]"),
    (lambda s: _slot(s).update(ids=[-1] * 9), lambda s: _slot_path(s) + "['ids'][0]"),
    (lambda s: _slot(s).update(ids=[1 << 70] * 9), lambda s: _slot_path(s) + "['ids'][0]"),
    (lambda s: s["ledger"].update(held_after=["x"]), "state['ledger']['held_after'][0]"),
    (lambda s: s["ledger"].update(complete=[[0, 1.5]]), "state['ledger']['complete'][0][1]"),
    (lambda s: s["ledger"].update(complete=[[0, 2], [1, 3]]), "state['ledger']['complete'][1]"),
    (lambda s: s["ledger"].update(complete=[[0, 2], [0, 2]]), "state['ledger']['complete'][1]"),
    (lambda s: s["ledger"].update(complete=[[2, 2]]), "state['ledger']['complete'][0]"),
    (lambda s: s["ledger"].update(complete=[[0, 1 << 40]]), "state['ledger']['complete'][0]"),
    (lambda s: s.update(last={}), "state['last']"),
    (lambda s: s.update(entropy=[]), "state['entropy']"),
    (lambda s: s["ledger"].update(holes=[-1]), "state['ledger']['holes'][0]"),
]


@pytest.mark.parametrize("n", range(len(CASES)))
def test_a_value_out_of_its_range_is_refused_naming_it(data, n):
    make, state = data
    change, path = CASES[n]
    broken = copy.deepcopy(state)
    change(broken)
    path = path(broken) if callable(path) else path
    with pytest.raises(ArgumentError, match=re.escape(path)):
        make().load_state_dict(broken)


def keys(ds) -> list:
    return [x["__key__"] for x in ds]


def test_the_untouched_state_and_a_later_epoch_still_resume(data):
    make, state = data
    again = make()
    again.load_state_dict(copy.deepcopy(state))
    assert len(keys(again)) == 70
    later = dict(copy.deepcopy(state), epoch=2, stream=2)  # resuming a later epoch is legitimate
    again = make()
    again.load_state_dict(later)
    assert len(keys(again)) == 70 and again.epoch == 3


def test_a_partial_count_beyond_its_shard_is_refused_when_read(data):
    # Within a sample number's range, so only the shard can say: it has 25 samples.
    make, state = data
    broken = copy.deepcopy(state)
    broken["ledger"]["partial"]["1"] = 1000
    again = make()
    again.load_state_dict(broken)
    says = re.escape("state['ledger']['partial']['1'] is 1000") + ".* has 25"
    with pytest.raises(ArgumentError, match=says):
        keys(again)
    fine = copy.deepcopy(state)
    fine["ledger"]["partial"]["1"] = 24  # (its last sample: it was all read)
    again = make()
    again.load_state_dict(fine)
    assert len(keys(again)) == 59  # (its 11 unread samples were consumed, as the state says)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_worker_finding_no_samples_raises_no_samples_error(tmp_path):
    for k in range(1, 4):
        (tmp_path / f"junk{k}.tar").write_bytes(bytes(range(256)) * 20)
    (tmp_path / "junk4.tar").write_bytes(b"")  # an empty shard too
    spec = str(tmp_path / "junk{1..4}.tar")
    ds = webds.WebDataset(spec, handler=webds.warn_and_continue, shardshuffle=False)
    with pytest.raises(NoSamplesError, match="in each of 2 workers"):
        list(webds.WebLoader(ds, batch_size=None, num_workers=2))
    with pytest.raises(NoSamplesError, match="no samples found"):
        list(webds.WebLoader(ds.batched(2), batch_size=None, num_workers=2))
    missing = webds.WebDataset(str(tmp_path / "nope{1..2}.tar"), handler=webds.warn_and_continue)
    with pytest.raises(NoSamplesError, match="no samples found"):
        list(webds.WebLoader(missing.with_epoch(4), batch_size=2, num_workers=2))


def test_a_worker_without_shards_while_another_reads_is_no_error(tmp_path):
    write_tar(tmp_path / "one.tar", sample_members(5))
    ds = webds.WebDataset(str(tmp_path / "one.tar"), shardshuffle=False)
    assert len(list(webds.WebLoader(ds, batch_size=None, num_workers=2))) == 5
