"""Every stage says what it owes a resume, or the pipeline refuses to save a position mid-pass.

A stage is STATELESS (it passes each item on, or drops it, before it pulls the next) or keeps the
LEDGER (it records what it holds); one that says neither (a user generator, a plain function, a
``pipelinefilter`` stage, a cache stage, the decomposed tar stages) used to resume silently
wrong, losing or repeating samples. Now ``state_dict()`` raises ``ResumeError`` naming it, and
``strict=False`` keeps the approximate path (loading that state then needs ``strict=False`` too).
"""

from __future__ import annotations

import importlib
import itertools
import json
import pickle
import random
import re
import textwrap
from typing import Any, Callable, List

import pytest
from conftest import sample_members, write_tar

import webds
from webds.base.stage import LEDGER, STATELESS, StageFactory, Stateless, resume_kind
from webds.compat.legacy import PipelineStage
from webds.errors import ArgumentError, ResumeError


@pytest.fixture
def spec(tmp_path) -> str:
    """3 shards x 8 samples."""
    for k in range(3):
        write_tar(tmp_path / f"s-{k}.tar", sample_members(8, prefix=f"s{k}-"))
    return str(tmp_path / "s-{0..2}.tar")


def keys(items: List[Any]) -> List[str]:
    return [x["__key__"] for x in items]


# -- stages that hold items, written as users write them ------------------------------------------


def hold3(src):
    """A user generator that holds items three at a time."""
    buf = []
    for x in src:
        buf.append(x)
        if len(buf) == 3:
            yield from buf
            buf = []
    yield from buf


@webds.pipelinefilter
def pairs(src):
    """A webdataset-style stage that holds two items."""
    held = None
    for x in src:
        if held is None:
            held = x
        else:
            yield held
            yield x
            held = None
    if held is not None:
        yield held


def passthrough(src):
    yield from src


@webds.stage(stateless=True)
def tag(src, value):
    for x in src:
        yield dict(x, tag=value)


class Twice(PipelineStage):
    """webdataset's stage-object style."""

    def run(self, src):
        yield from src


def undeclared_pipelines(spec: str) -> List[Callable[[], Any]]:
    """Pipelines each with one stage that does not say what it owes a resume."""
    return [
        lambda: webds.WebDataset(spec, shardshuffle=False).compose(hold3),
        lambda: webds.WebDataset(spec, shardshuffle=False).shuffle(5, seed=1).compose(hold3),
        lambda: webds.DataPipeline(webds.SimpleShardList(spec), webds.tarfile_to_samples(), hold3),
        lambda: webds.WebDataset(spec, shardshuffle=False).compose(pairs()),
        lambda: webds.WebDataset(spec, shardshuffle=False).compose(passthrough),
        lambda: webds.WebDataset(spec, shardshuffle=False).compose(Twice()),
        lambda: webds.DataPipeline(
            webds.SimpleShardList(spec),
            webds.url_opener(),
            webds.tar_file_expander(),
            webds.group_by_keys(),
        ),
        lambda: webds.DataPipeline(
            webds.SimpleShardList(spec),
            webds.resampled(4, seed=0),
            webds.tarfile_to_samples(),
        ),
    ]


@pytest.mark.parametrize("k", [1, 4, 11])
def test_a_stage_that_does_not_say_is_refused_mid_pass(spec, k):
    for i, make in enumerate(undeclared_pipelines(spec)):
        ds = make()
        it = iter(ds)
        list(itertools.islice(it, k))
        with pytest.raises(ResumeError) as info:
            ds.state_dict()
        text = str(info.value)
        assert "cannot save an exact position mid-pass" in text, i
        assert "webds.stateless(fn)" in text and "strict=False" in text, i
        assert "(stage " in text, i  # says where it is


def test_the_refusal_names_the_stage_and_what_to_do(spec):
    ds = webds.WebDataset(spec, shardshuffle=False).compose(hold3)
    it = iter(ds)
    next(it)
    with pytest.raises(ResumeError, match=r"the function hold3 \(stage \d+ of WebDataset\)"):
        ds.state_dict()
    expander = undeclared_pipelines(spec)[6]()
    it = iter(expander)
    next(it)
    with pytest.raises(ResumeError, match="use tarfile_to_samples"):
        expander.state_dict()


@pytest.mark.parametrize("k", [4, 11])
def test_the_memory_cache_is_refused_in_its_replayed_pass(spec, k):
    # Before, the saved ledger was empty here and the resumed pass yielded all 24 again.
    ds = webds.WebDataset(spec, shardshuffle=False).mcached()
    assert len(list(ds)) == 24  # the recording pass
    it = iter(ds)
    list(itertools.islice(it, k))
    with pytest.raises(ResumeError, match="a cache stage replays a recording"):
        ds.state_dict()


def test_lmdb_cache_is_refused_mid_pass(spec, tmp_path):
    pytest.importorskip("lmdb")
    ds = webds.WebDataset(spec, shardshuffle=False).lmdb_cached(str(tmp_path / "c.lmdb"))
    it = iter(ds)
    list(itertools.islice(it, 5))
    with pytest.raises(ResumeError, match="a cache stage"):
        ds.state_dict()


def test_at_an_epochs_end_every_pipeline_can_save(spec):
    for make in undeclared_pipelines(spec):
        ds = make()
        assert ds.state_dict()["items"] == 0  # before the first pass
        list(ds)
        state = json.loads(json.dumps(ds.state_dict()))
        assert state["epoch"] == 1 and state["items"] == 0
        again = make()
        again.load_state_dict(state)
        assert keys(list(again)) == keys(list(ds))  # the next epoch, in the same order


def test_strict_false_keeps_the_approximate_path(spec):
    ds = webds.WebDataset(spec, shardshuffle=False).compose(hold3)
    it = iter(ds)
    list(itertools.islice(it, 4))
    state = json.loads(json.dumps(ds.state_dict(strict=False)))
    assert "hold3" in state["problem"]
    with pytest.raises(ResumeError, match="hold3"):
        webds.WebDataset(spec, shardshuffle=False).compose(hold3).load_state_dict(state)
    again = webds.WebDataset(spec, shardshuffle=False).compose(hold3)
    again.load_state_dict(state, strict=False)
    rest = list(again)
    assert 0 < len(rest) <= 20  # approximately the rest: what hold3 held may be lost


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_refuses_for_its_workers_stages_and_its_own(spec, workers):
    dataset = webds.WebDataset(spec, shardshuffle=False).compose(hold3).batched(2)
    loader = webds.WebLoader(dataset, batch_size=None, num_workers=workers)
    it = iter(loader)
    next(it)
    with pytest.raises(ResumeError, match=r"hold3 \(stage \d+ of WebLoader's WebDataset\)"):
        loader.state_dict()
    del it
    clean = webds.WebDataset(spec, shardshuffle=False).batched(2)
    loader = webds.WebLoader(clean, batch_size=None, num_workers=workers).compose(hold3)
    it = iter(loader)
    next(it)
    with pytest.raises(ResumeError, match=r"hold3 \(stage \d+ of WebLoader\)"):
        loader.state_dict()
    del it


def test_a_mix_refuses_for_its_datasets_stages(spec):
    a = webds.WebDataset(spec, shardshuffle=False, seed=0).compose(hold3)
    b = webds.WebDataset(spec, shardshuffle=False, seed=0)
    mix = webds.RandomMix([a, b], seed=0)
    ds = webds.FluidWrapper(mix)
    it = iter(ds)
    list(itertools.islice(it, 5))
    with pytest.raises(ResumeError, match="hold3"):
        ds.state_dict()


# -- declared stages resume exactly -------------------------------------------------------------


def checkpoint_and_resume(make: Callable[[], Any], k: int):
    """(the items an uninterrupted epoch yields, the items before k and after a resume)."""
    whole = keys(list(make()))
    a = make()
    it = iter(a)
    before = keys(list(itertools.islice(it, k)))
    state = json.loads(json.dumps(a.state_dict()))
    b = make()
    b.load_state_dict(state)
    return whole, before + keys(list(b))


@pytest.mark.parametrize("k", [1, 4, 11, 23])
def test_declared_stateless_stages_resume_exactly(spec, k):
    def drop_odd(src):
        for x in src:
            if int(x["cls"]) % 2 == 0:
                yield x

    makes = [
        lambda: webds.WebDataset(spec, shardshuffle=False).compose(webds.stateless(passthrough)),
        lambda: webds.WebDataset(spec, shardshuffle=False).compose(webds.stateless(drop_odd)),
        lambda: webds.WebDataset(spec, shardshuffle=True, seed=2).compose(tag(7)),
        lambda: webds.DataPipeline(
            webds.SimpleShardList(spec),
            webds.stateless(passthrough),
            webds.tarfile_to_samples(),
            webds.stateless(passthrough),
        ),
    ]
    for make in makes:
        whole, resumed = checkpoint_and_resume(make, k)
        if k < len(whole):
            assert resumed == whole


def test_stateless_declarations_are_checked():
    with pytest.raises(ArgumentError, match="is a @stage"):
        webds.stateless(webds.shuffle(4))
    with pytest.raises(ArgumentError, match="takes a ledger"):

        @webds.stage(stateless=True)
        def holds(src, *, ledger=None):
            yield from src

    with pytest.raises(ArgumentError, match="takes a stage function"):
        webds.stateless(42)
    assert webds.stateless(webds.stateless(passthrough)).fn is passthrough
    assert resume_kind(tag(1)) == STATELESS and resume_kind(webds.shuffle(3)) == LEDGER
    assert resume_kind(hold3) is None and resume_kind(pairs()) is None


def test_declared_functions_pickle(spec):
    # Module-level @stateless functions pickle by name, others by their function.
    assert pickle.loads(pickle.dumps(webds.split_by_worker)) is webds.split_by_worker
    wrapped = pickle.loads(pickle.dumps(webds.stateless(passthrough)))
    assert isinstance(wrapped, Stateless) and wrapped.fn is passthrough
    dataset = webds.WebDataset(spec, shardshuffle=False).compose(webds.stateless(passthrough))
    loader = webds.WebLoader(dataset.batched(4), batch_size=None, num_workers=2)
    assert sum(len(b["__key__"]) for b in loader) == 24


# -- every stage webds ships says what it owes ----------------------------------------------------

#: The stages webds ships that hold items without numbering them: refused mid-pass, with a hint.
REFUSED = {"tar_file_expander", "group_by_keys", "resampled"}


def shipped_stages():
    modules = [
        "webds",
        "webds.filters",
        "webds.compat.tariterators",
        "webds.shardlists",
        "webds.tariterators",
        "webds.pipeline",
    ]
    seen = {}
    for name in modules:
        mod = importlib.import_module(name)
        for attr in dir(mod):
            try:
                value = getattr(mod, attr)
            except Exception:  # a lazy name whose extra is missing
                continue
            if isinstance(value, (StageFactory, Stateless)):
                seen[id(value)] = (f"{name}.{attr}", value)
    return list(seen.values())


def test_every_shipped_stage_says_what_it_owes():
    found = shipped_stages()
    assert len(found) >= 25
    for name, value in found:
        kind = STATELESS if isinstance(value, Stateless) else value.resume
        if name.rsplit(".", 1)[1] in REFUSED:
            assert kind is None, name
        else:
            assert kind in (STATELESS, LEDGER), name
    plain = {"split_by_node", "split_by_worker", "single_node_only", "non_empty"}
    assert plain <= {name.rsplit(".", 1)[1] for name, v in found if isinstance(v, Stateless)}


# -- property: random pipelines of declared and undeclared stages ---------------------------------


def random_stages(rng: random.Random):
    """(stages to compose, whether one of them does not say what it owes)."""
    kinds = ["shuffle", "select", "map", "stateless", "hold3", "pairs", "tag", "rename"]
    out, undeclared = [], False
    for _ in range(rng.randint(0, 4)):
        kind = rng.choice(kinds)
        if kind == "shuffle":
            out.append(webds.shuffle(rng.randint(1, 6), seed=rng.randint(0, 9)))
        elif kind == "select":
            out.append(webds.select(lambda s: int(s["cls"]) % 3 != 0))
        elif kind == "map":
            out.append(webds.map(lambda s: s))
        elif kind == "stateless":
            out.append(webds.stateless(passthrough))
        elif kind == "tag":
            out.append(tag(1))
        elif kind == "rename":
            out.append(webds.map_dict(cls=lambda v: v))
        else:
            out.append(hold3 if kind == "hold3" else pairs())
            undeclared = True
    return out, undeclared


@pytest.mark.parametrize("case", range(12))
def test_random_pipelines_refuse_exactly_when_a_stage_does_not_say(spec, case):
    rng = random.Random(case)
    stages, undeclared = random_stages(rng)
    ds = webds.WebDataset(spec, shardshuffle=rng.random() < 0.5, seed=case).compose(*stages)
    total = len(list(ds))
    ds = webds.WebDataset(spec, shardshuffle=False, seed=case).compose(*stages)
    it = iter(ds)
    k = rng.randint(1, max(1, total - 1)) if total > 1 else 0
    list(itertools.islice(it, k))
    if undeclared and k > 0:
        with pytest.raises(ResumeError):
            ds.state_dict()
        assert ds.state_dict(strict=False)["problem"]
    else:
        ds.state_dict()  # no refusal


# -- docs/architecture.md's examples ----------------------------------------------------------


def doc_examples() -> dict:
    """The python blocks of docs/architecture.md's "A resumable stage", run; their names."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    section = text.split("## A resumable stage", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    names: dict = {"webds": webds}
    for block in blocks[1:]:
        exec(textwrap.dedent(block), names)
    first = textwrap.dedent(blocks[0]).split("\ndataset =")[0]  # the definition, not its use
    exec(first, names)
    return names


@pytest.mark.parametrize("k", range(1, 24, 2))
def test_the_documented_stages_resume_exactly(spec, k):
    names = doc_examples()
    one_late, only_labelled = names["one_late"], names["only_labelled"]
    one_of_four = names["one_of_four"]
    assert resume_kind(one_late()) == LEDGER and resume_kind(only_labelled()) == STATELESS
    assert resume_kind(one_of_four()) == LEDGER

    def make():
        ds = webds.WebDataset(spec, shardshuffle=False).compose(only_labelled(), one_late())
        return ds.shuffle(4, seed=3).compose(one_of_four(seed=5))

    whole, resumed = checkpoint_and_resume(make, k)
    assert resumed == whole  # the same items in the same order


def test_the_documented_ledger_stage_is_lost_without_its_ledger(spec):
    # The same stage without the ledger calls: refused, where it used to lose a sample.
    def make():
        return webds.WebDataset(spec, shardshuffle=False).compose(pairs())

    a = make()
    it = iter(a)
    list(itertools.islice(it, 11))
    with pytest.raises(ResumeError):
        a.state_dict()
