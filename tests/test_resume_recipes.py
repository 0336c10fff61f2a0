"""Stages written from docs/architecture.md alone resume exactly (issue 54, item 8).

A ledger stage keeps its items in a list and their ids in its slot, in step: ``held.pop(0)``
with ``slot.take_first()``, ``held.pop(k)`` with ``slot.take(k)``. The docs' own stages and two
more written only from that page (a window that yields its largest item, a random draw) are
stopped mid-epoch and resumed in every setup: iterated directly, through an index, and in a
WebLoader with 0 and 2 workers, persistent or not. ``take(k)`` used to move the last id into
place k, so the slot drifted from the list: 1 sample repeated and 1 lost, or another order.

The shuffle, which takes its items with ``take_swapped(k)`` (O(1)), keeps its order: the
uninterrupted order and the resumed order of states saved by webds before ``take`` changed
(tests/data/shuffle_order.json, recorded at commit 501a8a8 by ``record()`` below).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from conftest import sample_members, write_tar
from test_resume_contract import doc_examples
from test_resume_order import data, flat  # noqa: F401 (data: the shards, a fixture)

import webds
from webds.base.ledger import Ledger

GOLDEN = Path(__file__).resolve().parent / "data" / "shuffle_order.json"


@webds.stage
def largest_of_three(src, *, ledger=None):
    """The largest of a window of 3 (by a score that puts it anywhere in the window), written
    from the docs: held.pop(k) with slot.take(k)."""
    src = iter(src)
    slot = ledger.slot() if ledger is not None else None
    held: list = []
    if slot is not None and ledger.resuming:
        yield from slot.restore(src)
        held, src = slot.captured, slot.rest(src)

    def largest():
        k = max(range(len(held)), key=lambda n: int(held[n]["cls"]) * 7 % 11)
        if slot is not None:
            slot.take(k)
        return held.pop(k)

    for item in src:
        held.append(item)
        if slot is not None:
            slot.hold(ledger.current)
        if len(held) == 3:
            yield largest()
    while held:
        yield largest()


@webds.stage
def random_draw(src, *, seed=0, ledger=None):
    """A random one of 5 held, drawn as a function of slot.draws, written from the docs."""
    src = iter(src)
    slot = ledger.slot() if ledger is not None else None
    held: list = []
    if slot is not None and ledger.resuming:
        yield from slot.restore(src)
        held, src = slot.captured, slot.rest(src)
    drawn = 0

    def draw():
        nonlocal drawn
        n = slot.draws if slot is not None else drawn
        k = random.Random(f"{seed}/{n}").randrange(len(held))
        drawn += 1
        if slot is not None:
            slot.take(k)
        return held.pop(k)

    for item in src:
        held.append(item)
        if slot is not None:
            slot.hold(ledger.current)
        if len(held) == 5:
            yield draw()
    while held:
        yield draw()


def recipes():
    names = doc_examples()
    return {
        "one_late": names["one_late"],
        "one_of_four": lambda: names["one_of_four"](seed=3),
        "largest_of_three": largest_of_three,
        "random_draw": lambda: random_draw(seed=1),
    }


STAGES = ["one_late", "one_of_four", "largest_of_three", "random_draw"]


def test_take_removes_as_pop_does():
    slot = Ledger().slot(1)
    held = list(range(6))
    for i in held:
        slot.hold(i)
    for k in (1, 3, 0, 2):
        assert slot.take(k) == held.pop(k)
        assert slot.ids == held
    swapped = Ledger().slot(1)
    for i in range(4):
        swapped.hold(i)
    assert swapped.take_swapped(1) == 1 and swapped.ids == [0, 3, 2]
    assert swapped.draws == 1


def test_a_workers_take_is_replayed_in_its_order():
    # The main process keeps a copy of each worker's slot from the operations logged.
    worker = Ledger(track=True)
    slot = worker.slot(2)
    for i in range(7):
        slot.hold(i)
    slot.take(2)
    slot.take_swapped(1, 3)
    slot.take(0)
    slot.take_first()
    mirror = Ledger()
    mirror.apply(worker.take_delta())
    assert mirror.slot(2).ids == slot.ids == [3, 4, 5]
    assert mirror.slot(2).draws == slot.draws == 5


def resumes_exactly(make, points=(0.1, 0.5, 0.8)) -> None:
    """Stopped after each fraction of an epoch's items and resumed in a new pipeline (through
    JSON): the items before and after are the uninterrupted epoch's, in its order."""
    whole = [flat(x) for x in make()]
    assert len(whole) > 10
    for point in points:
        k = max(1, int(point * len(whole)))
        a = make()
        it = iter(a)
        before = [flat(x) for x in itertools.islice(it, k)]
        state = json.loads(json.dumps(a.state_dict()))
        del it
        a.close() if hasattr(a, "close") else None
        b = make()
        b.load_state_dict(state)
        assert before + [flat(x) for x in b] == whole, f"stopped after {k}"
        b.close() if hasattr(b, "close") else None


@pytest.mark.parametrize("name", STAGES)
@pytest.mark.parametrize("through", ["shards", "index"])
def test_a_stage_from_the_docs_resumes_exactly(data, name, through):  # noqa: F811
    spec, index = data
    stage = recipes()[name]

    def make():
        ds = webds.WebDataset(index if through == "index" else spec, shardshuffle=True, seed=2)
        return ds.compose(stage()).listed(2)

    resumes_exactly(make)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("where", ["workers", "main"])
def test_the_stages_from_the_docs_resume_exactly_in_a_loader(data, workers, persistent, where):  # noqa: F811
    spec, index = data
    made = recipes()

    def make():
        if where == "workers":  # the stages in the DataLoader's workers
            ds = webds.WebDataset(index, shardshuffle=True, seed=2)
            for name in STAGES:
                ds = ds.compose(made[name]())
            return webds.WebLoader(
                ds.listed(2), batch_size=None, num_workers=workers, persistent_workers=persistent
            )
        loader = webds.WebLoader(  # the same stages in the main process, after the DataLoader
            webds.WebDataset(spec, shardshuffle=True, seed=2).listed(2),
            batch_size=None,
            num_workers=workers,
            persistent_workers=persistent,
        ).unlisted()
        for name in STAGES:
            loader = loader.compose(made[name]())
        return loader.listed(3)

    resumes_exactly(make, (0.4,))


# -- the shuffle keeps its order -------------------------------------------------------------


def shards(root: Path) -> str:
    for k, n in enumerate([13, 7, 11, 9]):
        write_tar(root / f"s-{k}.tar", sample_members(n, prefix=f"s{k}-"))
    return str(root / "s-{0..3}.tar")


def shuffles(spec: str):
    """(name, make) of the pipelines whose order the golden file keeps."""
    for seed in (0, 1, 7):
        yield (
            f"dataset-{seed}",
            lambda seed=seed: (
                webds.WebDataset(spec, shardshuffle=True, seed=seed).shuffle(6, seed=seed).listed(2)
            ),
        )
    for workers in (0, 2):
        yield (
            f"loader-{workers}",
            lambda workers=workers: (
                webds.WebLoader(
                    webds.WebDataset(spec, shardshuffle=True, seed=4).shuffle(5, seed=5).listed(2),
                    batch_size=None,
                    num_workers=workers,
                )
                .unlisted()
                .shuffle(4, seed=9)
                .listed(3)
            ),
        )


def record(folder: Path) -> dict:
    """What the golden file holds, by this webds: each pipeline's epoch, and a state saved
    after 5 items with the rest it resumes to."""
    spec = shards(folder)
    out = {}
    for name, make in shuffles(spec):
        whole = [flat(x) for x in make()]
        a = make()
        it = iter(a)
        before = [flat(x) for x in itertools.islice(it, 5)]
        state = json.loads(json.dumps(a.state_dict()))
        del it
        b = make()
        b.load_state_dict(state)
        rest = [flat(x) for x in b]
        assert before + rest == whole
        out[name] = {"whole": whole, "state": state, "rest": rest}
    return out


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_the_shuffle_keeps_its_order_and_resumes_old_states_as_before(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    spec = shards(tmp_path)
    for name, make in shuffles(spec):
        kept = golden[name]
        assert [flat(x) for x in make()] == kept["whole"], name
        b = make()
        b.load_state_dict(kept["state"])  # saved before take(k) changed (version 2)
        it = iter(b)
        assert [flat(x) for x in itertools.islice(it, 3)] == kept["rest"][:3], name
        again = json.loads(json.dumps(b.state_dict()))  # and saved again, by this webds
        del it
        c = make()
        c.load_state_dict(again)
        assert [flat(x) for x in c] == kept["rest"][3:], name


if __name__ == "__main__":  # python tests/test_resume_recipes.py: write the golden file anew
    import sys
    import tempfile

    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(record(Path(tempfile.mkdtemp())), sort_keys=True) + "\n")
    sys.exit(0)
