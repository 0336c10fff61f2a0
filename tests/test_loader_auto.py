"""``WebLoader(..., num_workers="auto")``: it measures a throwaway copy of the dataset in this
process (with and without threads) and picks the workers or threads by
:func:`webds.loader.choose_workers`, a pure function of what it measured; the loader then
yields what the same loader with that setting given by hand yields, reports its choice
(``choice``, ``stats()``, a log line), and a loaded state's workers win over a new
measurement."""

from __future__ import annotations

import functools
import json
import logging
import time

import pytest
from conftest import sample_members, write_tar
from hypothesis import given, settings
from hypothesis import strategies as st
from test_resume import shards
from test_resume_order import same_entropy

import webds
from webds.compat.shardsources import DirectoryShardList
from webds.errors import ArgumentError
from webds.loader import LoaderChoice, Measured, choose_workers
from webds.stages import autotune
from webds.stages.autotune import THREADS_GAIN, TRANSFER_SECONDS, WORTH_WORKERS

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture(autouse=True)
def shorter_measurements():
    """Each measurement reads for 0.2 s, each contested run for 0.4 s (0.5 and 1.0 by default):
    these tests' stages are 3 ms of CPU or 20 ms of waiting an item, tens of items in that
    time, and the settings they tell apart are 2x or more apart. (Not with monkeypatch: the
    tests undo theirs midway.)"""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autotune, "MEASURE_SECONDS", 0.2)
        patch.setattr(autotune, "RUN_SECONDS", 0.4)
        yield


@pytest.fixture
def spec(tmp_path):
    return shards(tmp_path, [12] * 4)


def keys(loader):
    with loader:
        return [k for batch in loader for k in batch]


def estimate_stands(monkeypatch):
    """Workers chosen by the estimate (3 ms of CPU an item: workers) are not run against threads:
    for tests where workers are where they start from, not what they check; a contest run on a
    machine whose cores are busy elsewhere may rightly go to the threads."""
    monkeypatch.setattr(webds.loader, "contested", lambda choice: False)


def choose_threads(monkeypatch):
    """No workers, and threads whatever the measurement (a gain of 0 over one thread), on 2
    CPUs."""
    monkeypatch.setattr(autotune, "WORTH_WORKERS", 10**9)
    monkeypatch.setattr(autotune, "THREADS_GAIN", 0.0)
    monkeypatch.setattr(webds.loader, "usable_cpus", lambda: 2)


def burning(spec, seed):
    """A shuffled pipeline of :func:`burn` items in lists of 3, seeded."""
    return webds.WebDataset(spec, shardshuffle=True, seed=seed).shuffle(4).map(burn).listed(3)


def stopped_after(loader, batches):
    """The keys of the first ``batches`` items, and the state saved there (through JSON)."""
    it = iter(loader)
    before = [k for _ in range(batches) for k in next(it)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    loader.close()
    return before, state


def burn(sample):
    """About 3 ms of this thread's CPU: a sample worth sending to a worker, and no faster in
    threads (on the process's CPU clock, threads that took turns under the GIL each ended when
    the others' turns added up to 3 ms: under load they measured as fast as the workers, and
    the choice between them was a coin toss); then 3 ms of waiting with the GIL held, which
    threads take in turns and worker processes side by side: where auto runs both for real,
    the workers win whatever else the machine's cores are doing."""
    import ctypes

    end = time.thread_time() + 0.003
    while time.thread_time() < end:
        pass
    ctypes.PyDLL(None).usleep(3000)
    return sample["__key__"]


def test_the_choice_is_a_pure_function_of_the_measurement():
    threshold = WORTH_WORKERS * TRANSFER_SECONDS  # CPU time per item sent
    cheap = Measured(1000, 1.0, 1000 * threshold / 64 * 0.9)
    heavy = Measured(100, 1.0, 100 * threshold / 64 * 1.1)
    assert choose_workers(cheap, 64, 8, None).num_workers == 0
    assert choose_workers(heavy, 64, 8, None).num_workers == 8
    assert choose_workers(heavy, 64, 8, 3).num_workers == 3  # a worker per shard at most
    assert choose_workers(heavy, 1, 8, None).num_workers == 0  # one item at a time: cheap
    assert choose_workers(Measured(0, 0.0, 0.0), 64, 8, None).num_workers == 0
    # Waiting (wall time far above CPU time) is left to read-ahead in one process.
    waiting = Measured(100, 100.0, 100 * threshold / 64 * 0.5)
    assert choose_workers(waiting, 64, 8, None).num_workers == 0
    again = [choose_workers(heavy, 64, 8, 3) for _ in range(3)]
    assert all(c == again[0] for c in again) and isinstance(again[0], LoaderChoice)
    assert "one worker per core (8), at most one per shard (3)" in str(again[0])


def test_cheap_samples_stay_in_this_process_and_nothing_is_lost(spec, caplog):
    def make(workers):
        ds = (
            webds.WebDataset(spec, shardshuffle=True, seed=1).shuffle(5).map(lambda s: s["__key__"])
        )
        return webds.WebLoader(ds.listed(4), batch_size=None, num_workers=workers)

    caplog.set_level(logging.INFO, logger="webds")
    auto = make("auto")
    assert auto.choice is not None and auto.choice.num_workers == 0
    assert auto.loader.num_workers == 0 and auto.choice.measured.items > 0
    assert any("chose num_workers=0" in r.getMessage() for r in caplog.records)
    got = keys(auto)
    assert got == keys(make(0)) and len(got) == 48  # the measured samples come out too


def test_heavy_samples_go_to_workers_and_give_what_those_workers_give(spec):
    def make(workers, **kw):
        ds = webds.WebDataset(spec, shardshuffle=True, seed=2).map(burn).listed(8)
        return webds.WebLoader(ds, batch_size=None, num_workers=workers, stats=True, **kw)

    auto = make("auto")
    chosen = auto.choice.num_workers
    assert chosen >= 1 and chosen == auto.loader.num_workers and auto.loader.persistent_workers
    assert chosen <= 4  # 4 shards
    got = keys(auto)
    assert got == keys(make(chosen, persistent_workers=True)) and len(got) == 48
    assert auto.stats().setting == str(auto.choice) and "loader: num_workers=" in str(auto.stats())


def test_measuring_leaves_the_dataset_as_it_was(spec):
    ds = webds.WebDataset(spec, shardshuffle=True, seed=3).shuffle(7).map(lambda s: s["__key__"])
    before = list(ds)  # epoch 0
    ds.set_epoch(0)
    loader = webds.WebLoader(ds, batch_size=None, num_workers="auto")
    assert ds.epoch == 0
    with loader:
        assert list(loader) == before


def test_a_loaded_state_keeps_the_workers_it_was_saved_with(spec, monkeypatch):
    def make():
        ds = webds.WebDataset(spec, shardshuffle=True, seed=4).map(burn).listed(3)
        return webds.WebLoader(ds, batch_size=None, num_workers="auto")

    estimate_stands(monkeypatch)
    whole = make()
    workers = whole.choice.num_workers
    assert workers >= 1
    expected = keys(whole)
    first = make()
    before, state = stopped_after(first, 5)
    # Measured anew, the next process would choose no workers; the state's workers win.
    monkeypatch.setattr(autotune, "WORTH_WORKERS", 10**9)
    second = make()
    assert second.choice.num_workers == 0
    second.load_state_dict(state)
    assert second.loader.num_workers == workers and second.choice.num_workers == workers
    assert "the loaded state's" in str(second.choice)
    assert before + keys(second) == expected


def test_a_state_saved_without_workers_resumes_without_workers(spec, monkeypatch):
    def make():
        ds = webds.WebDataset(spec, shardshuffle=True, seed=5).map(burn).listed(3)
        return webds.WebLoader(ds, batch_size=None, num_workers="auto")

    monkeypatch.setattr(autotune, "WORTH_WORKERS", 10**9)  # measured: no workers
    whole = make()
    assert whole.choice.num_workers == 0
    expected = keys(whole)
    first = make()
    before, state = stopped_after(first, 4)
    monkeypatch.undo()  # measured anew: workers
    estimate_stands(monkeypatch)
    second = make()
    assert second.choice.num_workers > 0
    second.load_state_dict(state)
    assert second.loader.num_workers == 0 and not second.loader.persistent_workers
    assert before + keys(second) == expected


def test_what_it_cannot_measure_is_refused(tmp_path, spec):
    with pytest.raises(ArgumentError, match="is not one: give num_workers yourself"):
        webds.WebLoader(list(range(10)), batch_size=None, num_workers="auto")
    (tmp_path / "q").mkdir()
    write_tar(tmp_path / "q" / "a.tar", sample_members(3))
    ds = webds.DataPipeline(
        DirectoryShardList(str(tmp_path / "q"), poll=None), webds.tarfile_to_samples()
    )
    with pytest.raises(ArgumentError, match="claims \\(or deletes\\) the files"):
        webds.WebLoader(ds, batch_size=None, num_workers="auto")
    assert (tmp_path / "q" / "a.tar").exists()  # not claimed


def test_a_bare_mix_is_measured_and_read_as_given(tmp_path, spec):
    # (A break attempt: a RandomMix of webds datasets was "not a webds dataset".)
    half = spec.replace("{0..3}", "{0..1}"), spec.replace("{0..3}", "{2..3}")

    def mixed(kind):
        parts = [webds.WebDataset(h, shardshuffle=True, seed=3).map(burn) for h in half]
        return webds.RandomMix(parts, seed=3) if kind == "random" else webds.RoundRobin(parts)

    for kind in ("random", "round"):
        auto = webds.WebLoader(mixed(kind), batch_size=None, num_workers="auto")
        assert isinstance(auto.loader.dataset, (webds.RandomMix, webds.RoundRobin))
        workers = auto.choice.num_workers
        hand = webds.WebLoader(mixed(kind), batch_size=None, num_workers=workers)
        assert sorted(map(str, auto)) == sorted(map(str, hand)) != []
        auto.close()
        hand.close()
    # What is mixed is looked into: a claiming source one mix deep is refused, unclaimed.
    (tmp_path / "q").mkdir()
    write_tar(tmp_path / "q" / "a.tar", sample_members(3))
    claiming = webds.DataPipeline(
        DirectoryShardList(str(tmp_path / "q"), poll=None), webds.tarfile_to_samples()
    )
    mix = webds.RandomMix([webds.WebDataset(spec), claiming], seed=0)
    with pytest.raises(ArgumentError, match="claims \\(or deletes\\) the files"):
        webds.WebLoader(mix, batch_size=None, num_workers="auto")
    assert (tmp_path / "q" / "a.tar").exists()


def test_only_a_plain_shard_list_caps_the_workers_at_one_per_shard(tmp_path, monkeypatch):
    # (no worker starts: the loaders are only made)
    monkeypatch.setattr(webds.loader, "usable_cpus", lambda: 4)
    spec = shards(tmp_path, [12, 12])
    plain = webds.WebDataset(spec).map(burn).listed(8)
    choice = webds.WebLoader(plain, batch_size=None, num_workers="auto").choice
    assert choice.num_workers == 2 and "at most one per shard (2)" in str(choice)
    drawn = webds.WebDataset(spec, resampled=True).map(burn).listed(8).with_epoch(3)
    assert webds.WebLoader(drawn, batch_size=None, num_workers="auto").choice.num_workers == 4
    # With an index the workers share samples, not shards: one per core.
    (tmp_path / "indexed").mkdir()
    index = shards(tmp_path / "indexed", [12, 12], index=True)
    planned = webds.WebDataset(index).map(burn).listed(8)
    assert webds.WebLoader(planned, batch_size=None, num_workers="auto").choice.num_workers == 4


@pytest.mark.parametrize("heavy", [False, True])
def test_an_unseeded_dataset_gives_what_the_chosen_setting_gives(spec, heavy):
    # Unseeded, the shuffles draw from the dataset's own entropy: measuring a copy must not use
    # it up or change it (the two datasets get the same entropy, as a resumed one takes its
    # state's).
    made = same_entropy(
        lambda: (
            webds.WebDataset(spec, shardshuffle=True)
            .shuffle(6)
            .rsample(0.8)
            .map(burn if heavy else (lambda s: s["__key__"]))
            .listed(3)
        )
    )
    auto = webds.WebLoader(made(), batch_size=None, num_workers="auto")
    workers = auto.choice.num_workers
    assert (workers > 0) == heavy
    hand = webds.WebLoader(made(), batch_size=None, num_workers=workers)
    assert keys(auto) == keys(hand) and 0 < len(keys(hand)) < 48


def test_persistent_workers_false_is_kept_and_an_uncopyable_dataset_refused(spec, tmp_path):
    ds = webds.WebDataset(spec).map(burn).listed(8)
    loader = webds.WebLoader(ds, batch_size=None, num_workers="auto", persistent_workers=False)
    assert loader.choice.num_workers > 0 and loader.loader.persistent_workers is False
    assert len(keys(loader)) == 48

    def tagged(handle, sample):
        return sample["__key__"]

    with open(tmp_path / "log.txt", "w") as handle:  # an open file can't be copied
        held = webds.WebDataset(spec).map(functools.partial(tagged, handle))
        with pytest.raises(ArgumentError, match="can't be copied .*give num_workers yourself"):
            webds.WebLoader(held, batch_size=None, num_workers="auto")


def nap(sample):
    """4 ms of waiting, GIL released, no CPU: threads make items faster, workers don't pay."""
    time.sleep(0.004)
    return sample["__key__"]


def rate(measured):
    return measured.items / measured.seconds


def test_threads_are_chosen_where_they_were_measured_faster():
    threshold = WORTH_WORKERS * TRANSFER_SECONDS
    heavy = Measured(100, 1.0, 100 * threshold / 64 * 1.1)  # worth 4 workers
    bar = 4 / (heavy.cpu_per_item + TRANSFER_SECONDS / 64)  # their items/s
    faster = Measured(round(bar * 1.01), 1.0, 1.0)
    slower = Measured(round(bar * 0.95), 1.0, 1.0)
    threads = choose_workers(heavy, 64, 4, None, faster)
    assert (threads.num_workers, threads.threads) == (0, 4)
    assert "num_workers=0, threads=4:" in str(threads) and threads.threaded == faster
    workers = choose_workers(heavy, 64, 4, None, slower)
    assert (workers.num_workers, workers.threads) == (4, 0) and "slower than" in str(workers)
    # Workers not worth it: threads must beat one thread by THREADS_GAIN.
    cheap = Measured(1000, 1.0, 1000 * threshold / 64 * 0.5)
    gain = choose_workers(cheap, 64, 4, None, Measured(round(1000 * THREADS_GAIN) + 1, 1.0, 1.0))
    assert (gain.num_workers, gain.threads) == (0, 4)
    noise = choose_workers(cheap, 64, 4, None, Measured(round(1000 * THREADS_GAIN) - 20, 1.0, 1.0))
    assert (noise.num_workers, noise.threads) == (0, 0)
    # One core: no threads, whatever was measured; nothing measured: none either.
    assert choose_workers(cheap, 64, 1, None, Measured(10**6, 1.0, 1.0)).threads == 0
    assert choose_workers(cheap, 64, 4, None, Measured(0, 0.0, 0.0)).threads == 0


@settings(max_examples=300, deadline=None)
@given(
    items=st.integers(0, 10**4),
    cpu=st.floats(1e-4, 10.0),
    wall=st.floats(1e-3, 10.0),
    threaded_items=st.one_of(st.none(), st.integers(0, 10**5)),
    ipt=st.integers(1, 256),
    cores=st.integers(1, 64),
    shards=st.one_of(st.none(), st.integers(1, 100)),
)
def test_the_choice_over_random_measurements(items, cpu, wall, threaded_items, ipt, cores, shards):
    measured = Measured(items, wall, cpu)
    threaded = None if threaded_items is None else Measured(threaded_items, 1.0, 1.0)
    choice = choose_workers(measured, ipt, cores, shards, threaded)
    plain = choose_workers(measured, ipt, cores, shards)
    assert plain.threads == 0 and plain.threaded is None
    # Workers as the rule says, worked out here: one per core, at most one per shard, where an
    # item sent costs at least WORTH_WORKERS transfers of CPU time.
    worth = items > 0 and cpu / items * ipt >= WORTH_WORKERS * TRANSFER_SECONDS
    per_core = max(1, cores if shards is None else min(cores, shards))
    assert plain.num_workers == (per_core if worth else 0)
    assert choice.num_workers == 0 or choice.threads == 0  # processes or threads, not both
    if choice.threads:
        assert choice.threads == cores > 1 and items > 0 and threaded_items
        # Faster than what it was chosen over: the workers' estimate, or one thread by a margin.
        over = (
            plain.num_workers / (cpu / items + TRANSFER_SECONDS / ipt) if plain.num_workers else 0
        )
        assert rate(threaded) >= max(over, 0 if plain.num_workers else THREADS_GAIN * items / wall)
        # More threaded items per second never turns threads off.
        more = Measured(threaded_items * 2, 1.0, 1.0)
        assert choose_workers(measured, ipt, cores, shards, more).threads == cores
    else:
        assert choice.num_workers == plain.num_workers  # the workers it would pick anyway


def test_waiting_stages_run_in_threads_and_give_what_no_threads_give(spec, caplog, monkeypatch):
    monkeypatch.setattr(webds.loader, "usable_cpus", lambda: 4)

    def make(workers):
        ds = webds.WebDataset(spec, shardshuffle=True, seed=6).shuffle(5).map(nap).listed(4)
        return webds.WebLoader(ds, batch_size=None, num_workers=workers, stats=True)

    caplog.set_level(logging.INFO, logger="webds")
    auto = make("auto")
    assert (auto.choice.num_workers, auto.choice.threads) == (0, 4), str(auto.choice)
    assert auto.loader.num_workers == 0 and auto.loader.dataset.threads == 4
    assert rate(auto.choice.threaded) > THREADS_GAIN * rate(auto.choice.measured)
    assert any("chose num_workers=0, threads=4" in r.getMessage() for r in caplog.records)
    got = keys(auto)
    assert got == keys(make(0)) and len(got) == 48
    assert auto.stats().setting == str(auto.choice)


def test_a_loaded_state_resumes_threads_and_its_workers_win_over_them(spec, monkeypatch):
    def make(**kw):
        return webds.WebLoader(burning(spec, 7), batch_size=None, num_workers="auto", **kw)

    expected = keys(webds.WebLoader(burning(spec, 7), batch_size=None, num_workers=0))
    choose_threads(monkeypatch)
    first = make()
    assert first.choice.threads == 2 and first.loader.dataset.threads == 2
    before, state = stopped_after(first, 4)
    second = make()
    second.load_state_dict(state)  # threads again: the same workers (none)
    assert second.choice.threads == 2
    assert before + keys(second) == expected
    # A state saved by workers: they win, and the threads go.
    monkeypatch.undo()
    estimate_stands(monkeypatch)
    workers = make()
    assert workers.choice.num_workers > 0
    before, state = stopped_after(workers, 4)
    monkeypatch.setattr(autotune, "WORTH_WORKERS", 10**9)
    monkeypatch.setattr(autotune, "THREADS_GAIN", 0.0)
    third = make()
    assert third.choice.threads > 0
    third.load_state_dict(state)
    assert third.loader.num_workers > 0 and third.loader.dataset.threads == 0
    assert third.choice.threads == 0 and "the loaded state's (num_workers=0, threads=" in str(
        third.choice
    )
    got = keys(third)
    assert len(before + got) == 48 and sorted(before + got) == sorted(expected)


def test_a_state_saved_with_threads_resumes_with_them_where_workers_were_measured(
    spec, monkeypatch
):
    # (A break attempt: it resumed with no workers and no threads, the slowest setting.)
    def make():
        return webds.WebLoader(burning(spec, 8), batch_size=None, num_workers="auto")

    expected = keys(webds.WebLoader(burning(spec, 8), batch_size=None, num_workers=0))
    choose_threads(monkeypatch)
    first = make()
    assert (first.choice.num_workers, first.choice.threads) == (0, 2)
    before, state = stopped_after(first, 4)
    assert state["config"]["threads"] == 2
    monkeypatch.undo()  # measured anew: workers
    estimate_stands(monkeypatch)
    second = make()
    assert second.choice.num_workers > 0
    second.load_state_dict(state)
    assert second.loader.num_workers == 0 and second.loader.dataset.threads == 2
    assert second.choice.threads == 2 and "the loaded state's" in str(second.choice)
    assert before + keys(second) == expected


def test_a_state_saved_without_threads_resumes_without_them_where_threads_were_measured(
    spec, monkeypatch
):
    # (A break attempt: the same workers (none) took the new measurement's threads.)
    def make():
        return webds.WebLoader(burning(spec, 8), batch_size=None, num_workers="auto")

    choose_threads(monkeypatch)
    monkeypatch.setattr(autotune, "THREADS_GAIN", 10.0**9)  # threads never gain: none
    first = make()
    assert (first.choice.num_workers, first.choice.threads) == (0, 0)
    before, state = stopped_after(first, 4)
    assert state["config"]["threads"] == 0
    monkeypatch.setattr(autotune, "THREADS_GAIN", 0.0)  # measured anew: threads
    second = make()
    assert second.choice.threads == 2
    second.load_state_dict(state)
    assert second.loader.dataset.threads == 0 and second.choice.threads == 0
    assert "the loaded state's" in str(second.choice)
    hand = webds.WebLoader(burning(spec, 8), batch_size=None, num_workers=0)
    assert before + keys(second) == keys(hand)


def test_threads_are_how_fast_not_what_a_state_must_match(spec):
    def make(threads):
        return webds.WebLoader(burning(spec, 9), batch_size=None, num_workers=0, threads=threads)

    expected = keys(make(2))
    before, state = stopped_after(make(2), 5)
    other = make(3)
    other.load_state_dict(state)  # strict: the threads differ, the items do not
    assert before + keys(other) == expected


def test_threads_given_by_hand_are_kept_and_not_measured(spec):
    ds = webds.WebDataset(spec).map(nap).listed(4)
    loader = webds.WebLoader(ds, batch_size=None, num_workers="auto", threads=3)
    assert loader.choice.threaded is None and loader.choice.threads == 0
    assert loader.loader.num_workers == 0 and loader.loader.dataset.threads == 3
    assert len(keys(loader)) == 48


def test_the_workers_share_is_measured_with_torch_on_one_thread_as_in_a_worker(spec, monkeypatch):
    """In the main process torch may run an intra-op thread per core, which a worker doesn't:
    measured so, a batch's CPU time (threads spinning) and its wall time (two cores) both
    mislead about a worker. The threads are measured as they would run, here."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(webds.loader, "usable_cpus", lambda: 2)
    seen = []

    def note(sample):
        seen.append(torch.get_num_threads())
        return sample["__key__"]

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ds = webds.WebDataset(spec).map(note).listed(4)
        webds.WebLoader(ds, batch_size=None, num_workers="auto")
        assert torch.get_num_threads() == 2  # given back
    finally:
        torch.set_num_threads(before)
    assert set(seen) == {1, 2}  # the worker's share, then the threads


@pytest.mark.parametrize("indexed", [False, True])
def test_threads_it_chose_give_what_those_threads_by_hand_give(tmp_path, monkeypatch, indexed):
    # Unseeded (the measuring copies must not use up the dataset's entropy), with stages that
    # drop samples, with and without an index.
    monkeypatch.setattr(webds.loader, "usable_cpus", lambda: 4)
    spec = shards(tmp_path, [12] * 4, index=indexed)
    made = same_entropy(
        lambda: (
            webds.WebDataset(spec, shardshuffle=True)
            .shuffle(6)
            .rsample(0.8)
            .select(lambda s: not s["__key__"].endswith("3"))
            .map(nap)
            .listed(3)
        )
    )
    auto = webds.WebLoader(made(), batch_size=None, num_workers="auto")
    assert (auto.choice.num_workers, auto.choice.threads) == (0, 4), str(auto.choice)
    hand = webds.WebLoader(made(), batch_size=None, num_workers=0, threads=4)
    got = keys(auto)
    assert got == keys(hand) and 0 < len(got) < 48


# What reading a throwaway copy would do to the world: refused, wherever it sits, before
# anything is read (the epoch then reads what num_workers=0 reads).


def refused(dataset, why):
    with pytest.raises(ArgumentError, match=f"num_workers='auto'.*{why}.*Give num_workers"):
        webds.WebLoader(dataset, batch_size=None, num_workers="auto")


def test_stdin_is_refused_and_left_unread(tmp_path, monkeypatch):
    write_tar(tmp_path / "a.tar", sample_members(50))
    with open(tmp_path / "a.tar") as stdin:
        monkeypatch.setattr("sys.stdin", stdin)
        refused(webds.WebDataset("-"), "'-' is standard input")
        assert stdin.buffer.tell() == 0
        loader = webds.WebLoader(webds.WebDataset("-"), batch_size=None, num_workers=0)
        assert len(list(loader)) == 50


def test_a_pipe_command_is_refused_and_never_run(tmp_path):
    for i in range(2):
        write_tar(tmp_path / f"{i}.tar", sample_members(5, prefix=f"{i}-"))
    runs = tmp_path / "runs"
    spec = f"pipe:echo run >> {runs}; cat {tmp_path}/{{0..1}}.tar"
    refused(webds.WebDataset(spec), "is a command, which would run once more")
    assert not runs.exists()
    loader = webds.WebLoader(webds.WebDataset(spec), batch_size=None, num_workers=0)
    assert len(list(loader)) == 10
    assert runs.read_text().count("run") == 2  # once per shard per epoch


def test_a_url_gopen_rewrite_makes_a_command_is_refused_and_not_run(tmp_path, monkeypatch):
    # (A break attempt: the rewritten URL ran twice, once for the measurement.)
    write_tar(tmp_path / "0.tar", sample_members(5))
    runs = tmp_path / "runs"
    monkeypatch.setenv("GOPEN_REWRITE", f"/data/=pipe:echo run >> {runs} && cat {tmp_path}/")
    refused(
        webds.WebDataset("/data/0.tar"),
        "is a command, which would run once more \\(GOPEN_REWRITE rewrote '/data/0.tar'",
    )
    assert not runs.exists()
    loader = webds.WebLoader(webds.WebDataset("/data/0.tar"), batch_size=None, num_workers=0)
    assert len(list(loader)) == 5 and runs.read_text().count("run") == 1


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("mode", ["unlink", "keep"])
def test_a_claiming_source_is_refused_at_any_depth(tmp_path, depth, mode):
    (tmp_path / "q").mkdir()
    for i in range(3):
        write_tar(tmp_path / "q" / f"{i}.tar", sample_members(20, prefix=f"{i}-"))
    source = DirectoryShardList(str(tmp_path / "q"), poll=None, mode=mode)
    for _ in range(depth):
        source = webds.DataPipeline(source)
    dataset = webds.DataPipeline(source, webds.tarfile_to_samples())
    refused(dataset, "DirectoryShardList claims \\(or deletes\\) the files")
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["0.tar", "1.tar", "2.tar"]
    assert len(list(webds.WebLoader(dataset, batch_size=None, num_workers=0))) == 60


def test_a_claiming_source_inside_a_mix_is_refused(tmp_path, spec):
    (tmp_path / "q").mkdir()
    write_tar(tmp_path / "q" / "a.tar", sample_members(3))
    claimed = webds.DataPipeline(
        DirectoryShardList(str(tmp_path / "q"), poll=None), webds.tarfile_to_samples()
    )
    mix = webds.RoundRobin([webds.WebDataset(spec), claimed])
    refused(webds.DataPipeline(mix), "claims")
    assert (tmp_path / "q" / "a.tar").exists()


def test_a_generator_or_function_source_of_yours_is_refused_and_not_advanced(tmp_path):
    write_tar(tmp_path / "a.tar", sample_members(4))
    made = []

    def urls():
        made.append(1)
        yield {"url": str(tmp_path / "a.tar")}

    generator = urls()
    refused(webds.DataPipeline(generator, webds.tarfile_to_samples()), "not a webds shard list")
    refused(webds.DataPipeline(urls, webds.tarfile_to_samples()), "not a webds shard list")
    assert made == []
    assert len(list(webds.DataPipeline(generator, webds.tarfile_to_samples()))) == 4


def test_a_fifo_is_refused(tmp_path):
    os = pytest.importorskip("os")
    os.mkfifo(tmp_path / "a.tar")
    refused(webds.WebDataset(str(tmp_path / "a.tar")), "not a regular file")


def test_stored_shards_at_any_depth_and_in_a_mix_are_measured(spec):
    nested = webds.DataPipeline(webds.DataPipeline(webds.SimpleShardList(spec)))
    mixed = webds.RoundRobin([webds.WebDataset(spec), webds.WebDataset(spec)])
    for dataset in (
        webds.DataPipeline(nested, webds.tarfile_to_samples()),
        webds.DataPipeline(mixed),
    ):
        loader = webds.WebLoader(dataset, batch_size=None, num_workers="auto")
        assert loader.choice is not None
        loader.close()


# Workers against threads, run for real where the estimate says workers: an estimate of what
# crossing between processes costs was right on one machine and wrong on the next.


def wait_holding_the_gil(sample):
    """20 ms of waiting with the GIL held (a C call through ctypes.PyDLL keeps it): threads
    take turns, worker processes wait side by side."""
    import ctypes

    ctypes.PyDLL(None).usleep(20000)
    return sample["__key__"]


def wait_and_send_16_mib(sample):
    """20 ms of waiting with the GIL released, and a 16 MiB tensor out: threads wait side by
    side as workers do, and workers must also send the tensor."""
    import torch

    time.sleep(0.02)
    return torch.zeros(4 << 20)


def test_a_timeout_of_yours_does_not_bound_the_contest(tmp_path, monkeypatch):
    # (A break attempt: forkserver workers slower to start than timeout=1 failed the
    # constructor.) A timeout no worker can meet: the contest still runs and chooses.
    monkeypatch.setattr(webds.loader, "usable_cpus", lambda: 2)
    monkeypatch.setattr(autotune, "RUN_SECONDS", 0.3)
    spec = shards(tmp_path, [60] * 4)
    held = webds.WebDataset(spec, shardshuffle=False).map(wait_holding_the_gil)
    loader = webds.WebLoader(held, batch_size=None, num_workers="auto", timeout=1e-6)
    assert [r.setting for r in loader.choice.ran] == ["num_workers=2", "threads=2"]
    assert loader.loader.timeout == 1e-6 or loader.choice.num_workers == 0
    loader.close()


def test_the_contest_is_settled_by_running_both(tmp_path, monkeypatch):
    # Waiting, not computing: the outcome holds whatever else the machine's cores are doing.
    monkeypatch.setattr(webds.loader, "usable_cpus", lambda: 2)
    monkeypatch.setattr(autotune, "RUN_SECONDS", 0.3)
    spec = shards(tmp_path, [60] * 4)
    held = webds.WebDataset(spec, shardshuffle=False).map(wait_holding_the_gil)
    loader = webds.WebLoader(held, batch_size=None, num_workers="auto")
    assert loader.choice.num_workers == 2 and loader.choice.threads == 0, loader.choice
    assert "run for real" in loader.choice.reason
    assert [r.setting for r in loader.choice.ran] == ["num_workers=2", "threads=2"]
    loader.close()
    released = webds.WebDataset(spec, shardshuffle=False).map(wait_and_send_16_mib)
    loader = webds.WebLoader(released, batch_size=None, num_workers="auto")
    workers, threads = loader.choice.ran
    assert loader.choice.num_workers == 0, loader.choice
    assert threads.per_second * autotune.THREADS_GAIN >= workers.per_second
    loader.close()


def drawn(sample):
    """A stage that draws from the process's generators, as a user's augmentation does."""
    import random

    import numpy as np
    import torch

    return (sample["__key__"], random.random(), float(np.random.rand()), float(torch.rand(1)))


@pytest.mark.parametrize("heavy", [False, True])
def test_stages_drawing_from_the_global_generators_give_what_the_hand_given_setting_gives(
    spec, heavy
):
    """Measuring runs your stages, and its DataLoaders draw their workers' seeds from torch's
    generator: after the same seeding, auto yields what the chosen setting given by hand does,
    and leaves the generators where they were."""
    import random

    import numpy as np
    import torch

    def run(workers):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        ds = webds.WebDataset(spec, shardshuffle=False)
        if heavy:
            ds = ds.map(lambda s: (burn(s), s)[1])
        ds = ds.map(drawn).listed(8)
        loader = webds.WebLoader(ds, batch_size=None, num_workers=workers)
        after = (random.random(), float(np.random.rand()), float(torch.rand(1)))
        with loader:
            return list(loader), after, loader.choice

    auto, auto_after, choice = run("auto")
    hand, hand_after, _ = run(choice.num_workers)
    # heavy: both settings were run for real, worker processes and all (whichever won)
    assert bool(choice.ran) == heavy or choice.num_workers > 0
    assert auto == hand and auto_after == hand_after


def test_options_for_workers_only_are_dropped_where_auto_chose_none(spec):
    """prefetch_factor, multiprocessing_context and timeout are valid with num_workers="auto"
    whatever it chooses (DataLoader refuses them without workers)."""
    ds = webds.WebDataset(spec, shardshuffle=False).map(lambda s: s["__key__"]).listed(3)
    loader = webds.WebLoader(
        ds,
        batch_size=None,
        num_workers="auto",
        prefetch_factor=4,
        multiprocessing_context="spawn",
        timeout=60,
    )
    assert loader.choice.num_workers == 0 and len(keys(loader)) == 48
