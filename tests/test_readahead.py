"""Read-ahead of remote shards (webds.io.readahead): shards are fetched while another is read,
and nothing else changes: the same samples in the same order, errors at their own shard's place,
exact mid-epoch resume, one request per http shard, the shard cache; stopping early leaves no
thread and no connection behind; the bytes held stay within the budget.

Real HTTP servers on loopback (tests/servers.py), real DataLoader workers.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import pickle
import random
import threading
import time
from collections import Counter
from typing import Any, List

import pytest
import servers
from conftest import sample_members, write_tar
from test_resume import flat, random_pipeline, resume

import webds
from webds.base.handlers import warn_and_continue
from webds.errors import ArgumentError, OpenError, ShardReadError
from webds.io import readahead as ra
from webds.shards.index import ShardIndex

#: Random bytes the members' data is cut from (os.urandom for each member cost more than the
#: reading: 240 MB of it in one test; only the keys and the sizes are compared).
_NOISE = os.urandom(1 << 20)


def noise(n: int, i: int) -> bytes:
    """``n`` random bytes, a different slice of ``_NOISE`` for each ``i``."""
    start = i * 4099 % (len(_NOISE) - n + 1)
    return _NOISE[start : start + n]


def serve_shards(server: Any, sizes: List[int], member_bytes: int = 10) -> List[str]:
    """Shards of the given sample counts on ``server``; their URLs (keys s{i}-{j:06d})."""
    urls = []
    for i, n in enumerate(sizes):
        members = sample_members(n, prefix=f"s{i}-")
        if member_bytes > 10:
            members = [(name, noise(member_bytes, m)) for m, (name, _) in enumerate(members)]
        path = server.root / f"shard-{i}.tar"
        write_tar(path, members)
        urls.append(server.url(path.name))
    return urls


def keys(ds: Any) -> List[str]:
    return [s["__key__"] for s in ds]


def fetched(monkeypatch: Any) -> List[str]:
    """The names of the shards fetched ahead from now on, in the order their fetches start."""
    started: List[str] = []
    real = ra.Fetch.__init__

    def spy(self: Any, name: str, *args: Any) -> None:
        started.append(name)
        real(self, name, *args)

    monkeypatch.setattr(ra.Fetch, "__init__", spy)
    return started


def readahead_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("webds-readahead")]


def wait_for(condition: Any, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def connections_to(port: int) -> int:
    """TCP sockets this process holds to 127.0.0.1:``port``, in any state (from /proc): an
    open connection, and one the server has closed that the client has not (CLOSE_WAIT)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    n = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if state != "0A" and int(remote.split(":")[1], 16) == port and inode in inodes:
                n += 1
    return n


def one_request_per_connection(monkeypatch: Any) -> None:
    """The test HTTP server closes each connection after its answer: the client pools none, so
    any socket it still holds afterwards is a body it never closed."""
    real = servers._Handler.send_response

    def closing(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        self.send_header("Connection", "close")

    monkeypatch.setattr(servers._Handler, "send_response", closing)


# -- the same samples in the same order ----------------------------------------------------------


def test_one_request_per_http_shard_and_the_same_samples(http_server):
    urls = serve_shards(http_server, [7, 0, 5, 9, 3, 4])
    before = http_server.requests
    got = keys(webds.WebDataset(urls, shardshuffle=False, empty_check=False))
    assert http_server.requests - before == len(urls)  # one GET each, no HEAD
    assert all(method == "GET" for method, _, _ in http_server.log)
    off = keys(webds.WebDataset(urls, shardshuffle=False, readahead=False, empty_check=False))
    assert (
        got == off == [f"s{i}-{j:06d}" for i, n in enumerate([7, 0, 5, 9, 3, 4]) for j in range(n)]
    )


@pytest.mark.parametrize("case", range(12))
def test_random_configurations_read_the_same_samples(http_server, case):
    """Shard counts and sizes, read-ahead depth and budget (down to 1 byte), shard shuffling,
    0 or 2 DataLoader workers: the same keys in the same order as without read-ahead."""
    rng = random.Random(case)
    sizes = [rng.randint(0, 30) for _ in range(rng.randint(1, 9))]
    sizes[0] = max(1, sizes[0])
    urls = serve_shards(http_server, sizes, member_bytes=rng.choice([10, 3000, 70000]))
    depth = rng.choice([1, 2, 3, 4, 5, 6, "auto"])
    budget = rng.choice([1, 4096, 1 << 20, ra.DEFAULT_READAHEAD_BYTES])
    shuffle = rng.random() < 0.5
    workers = rng.choice([0, 2])
    # A far server: "auto" grows the depth while the reader waits for it.
    http_server.latency = rng.choice([0.0, 0.01])

    def run(**kw: Any) -> List[str]:
        ds = webds.WebDataset(urls, shardshuffle=shuffle, seed=case, empty_check=False, **kw)
        if workers == 0:
            return keys(ds)
        loader = webds.WebLoader(ds, batch_size=None, num_workers=workers)
        return keys(loader)

    want = run(readahead=False)
    assert run(readahead=budget, readahead_shards=depth) == want
    assert sorted(want) == sorted(f"s{i}-{j:06d}" for i, n in enumerate(sizes) for j in range(n))


def test_local_shards_are_not_read_ahead_unless_asked(tmp_path, monkeypatch):
    for i in range(3):
        write_tar(tmp_path / f"l-{i}.tar", sample_members(4, prefix=f"l{i}-"))
    spec = str(tmp_path / "l-{0..2}.tar")
    started = fetched(monkeypatch)
    local = webds.WebDataset(spec, shardshuffle=False, stats=True)
    plain = keys(local)
    assert local.stats().readahead_shards == {}  # nothing was fetched ahead
    assert started == []
    assert keys(webds.WebDataset(spec, shardshuffle=False, readahead=True)) == plain
    assert len(started) == 3


# -- errors at their own place -------------------------------------------------------------------


def test_a_shard_that_fails_ahead_raises_in_its_turn(http_server):
    urls = serve_shards(http_server, [5, 5, 5, 5])
    urls[2] = http_server.url("missing.tar")
    ds = webds.WebDataset(urls, shardshuffle=False, readahead_shards=3)
    got: List[str] = []
    with pytest.raises(OpenError) as info:
        for s in ds:
            got.append(s["__key__"])
    assert got == [f"s{i}-{j:06d}" for i in (0, 1) for j in range(5)]  # all before it, first
    assert "missing.tar" in str(info.value)
    # Skipped by a handler: every other shard, in order.
    ds = webds.WebDataset(urls, shardshuffle=False, handler=warn_and_continue)
    assert keys(ds) == [f"s{i}-{j:06d}" for i in (0, 1, 3) for j in range(5)]


def test_a_damaged_shard_read_ahead_yields_its_whole_samples_then_raises(http_server):
    urls = serve_shards(http_server, [4, 6, 4], member_bytes=3000)
    damaged = http_server.root / "shard-1.tar"
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])  # cut in the middle of a member
    got: List[str] = []
    with pytest.raises(ShardReadError) as info:
        for s in webds.WebDataset(urls, shardshuffle=False):
            got.append(s["__key__"])
    assert info.value.url == urls[1]
    assert got[:4] == [f"s0-{j:06d}" for j in range(4)]
    assert all(k.startswith("s1-") for k in got[4:]) and len(got) < 10


def test_a_shard_list_that_fails_raises_after_the_shards_before_it(http_server):
    urls = serve_shards(http_server, [3, 3, 3])

    def listing():
        yield from urls[:2]
        raise RuntimeError("listing failed")

    pipe = webds.DataPipeline(listing, webds.tarfile_to_samples(readahead_shards=4))
    got: List[str] = []
    with pytest.raises(RuntimeError, match="listing failed"):
        for s in pipe:
            got.append(s["__key__"])
    assert got == [f"s{i}-{j:06d}" for i in (0, 1) for j in range(3)]


# -- stopping early --------------------------------------------------------------------------------


def test_stopping_early_leaves_no_thread_and_no_connection(http_server, monkeypatch):
    """A 1 MB budget holds the 5 shards ahead mid-body: stopping cancels them, and each
    closes its connection: within 2 s (the server drops an idle one only after 10 s) the
    client holds no socket to the server, CLOSE_WAIT included."""
    one_request_per_connection(monkeypatch)
    fetches: List[Any] = []
    real = ra.Fetch.__init__

    def spy(self: Any, *args: Any) -> None:
        fetches.append(self)
        real(self, *args)

    monkeypatch.setattr(ra.Fetch, "__init__", spy)
    urls = serve_shards(http_server, [40] * 8, member_bytes=50_000)  # 2 MB shards
    for _ in range(3):
        it = iter(webds.WebDataset(urls, shardshuffle=False, readahead_shards=5, readahead=1 << 20))
        for _ in range(10):
            next(it)
        assert readahead_threads()
        it.close()
        assert wait_for(lambda: not readahead_threads()), readahead_threads()
        assert any(f.link_seconds is None for f in fetches)  # some were cancelled mid-body
        assert wait_for(lambda: connections_to(http_server.port) == 0, 2.0), connections_to(
            http_server.port
        )
    # with_epoch cuts the stream: the same.
    ds = webds.WebDataset(urls, shardshuffle=False).with_epoch(15)
    assert len(keys(ds)) == 15
    assert wait_for(lambda: not readahead_threads())


def test_stopping_while_a_server_stalls_ends_within_the_read_timeout(flaky_http_server):
    urls = serve_shards(flaky_http_server, [3, 3, 3], member_bytes=100_000)
    flaky_http_server.stall_after(1000, seconds=60, times=3)
    ds = webds.WebDataset(
        urls, shardshuffle=False, storage_options={"read_timeout": 1.0, "retries": 0}
    )
    it = iter(ds)
    with pytest.raises(ShardReadError):
        next(it)  # the first shard stalls: raised after 1 s
    it.close()
    start = time.monotonic()
    assert wait_for(lambda: not readahead_threads(), 10)
    assert time.monotonic() - start < 5


# -- resume, cache, loaders -------------------------------------------------------------------


@pytest.mark.parametrize("case", range(16))
def test_resume_mid_epoch_is_exact_with_read_ahead(http_server, monkeypatch, case):
    """Random pipelines (tests/test_resume.py's) over http shards read ahead: the samples before
    the checkpoint plus those after loading the state are one uninterrupted epoch."""
    monkeypatch.delenv("WDS_SEED", raising=False)
    rng = random.Random(1000 + case)
    sizes = [rng.randint(0, 9) for _ in range(rng.randint(2, 6))]
    sizes[0] = max(sizes[0], 3)
    urls = serve_shards(http_server, sizes, member_bytes=rng.choice([10, 20_000]))
    spec: Any = urls
    index = rng.random() < 0.4
    if index:
        path = http_server.root / "index.json"
        ShardIndex.build(urls).save(str(path))
        spec = str(path)
    seed = rng.choice([None, 7])
    workers = rng.choice([0, 2])
    stages, _, drops = random_pipeline(rng, "", seed)
    depth = rng.choice([1, 2, 3, 4, "auto"])
    http_server.latency = rng.choice([0.0, 0.005])
    config = dict(sizes=sizes, index=index, seed=seed, workers=workers, depth=depth)

    def make() -> Any:
        ds = webds.WebDataset(
            spec, seed=seed, shardshuffle=True, empty_check=False, readahead_shards=depth
        )
        for add in stages:
            ds = add(ds)
        return webds.WebLoader(ds, batch_size=None, num_workers=workers)

    a = make()
    k = rng.randint(0, len(list(a)))
    a.set_epoch(0)
    it = iter(a)
    before = list(itertools.islice(it, k))
    state = json.loads(json.dumps(a.state_dict()))
    whole = before + list(it)
    rest, _ = resume(make, state)
    got, want = flat(before + rest), flat(whole)
    if index and drops:
        assert set(got) == set(want), config
    else:
        assert Counter(got) == Counter(want), config


def test_cache_dir_with_read_ahead(http_server, tmp_path):
    urls = serve_shards(http_server, [6, 6, 6, 6], member_bytes=5000)
    cache = tmp_path / "cache"
    first = keys(webds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache)))
    assert len(list(cache.rglob("*.tar"))) == 4
    requests = http_server.requests
    again = keys(webds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache)))
    assert again == first and http_server.requests == requests  # all from the cache


# -- the budget ------------------------------------------------------------------------------------


class SlowBytes(io.RawIOBase):
    """A stream of ``n`` bytes delivered ``step`` at a time."""

    def __init__(self, n: int, step: int) -> None:
        self.left, self.step = n, step

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        k = min(self.left, self.step, n if n >= 0 else self.step)
        self.left -= k
        return b"x" * k


@pytest.mark.parametrize("budget", [1, 300_000, 3 << 20])
def test_the_bytes_held_stay_within_the_budget(monkeypatch, budget):
    """A slow reader and fast streams: the bytes fetched and not yet read never pass the budget
    plus one read per shard in flight, and the shard being read is never held up by it."""
    peaks: List[int] = []
    real_read = ra.Fetch.read

    def watched(self: Any, n: int) -> bytes:
        peaks.append(self._budget.used)
        return real_read(self, n)

    monkeypatch.setattr(ra.Fetch, "read", watched)
    depth = 3
    items = [(f"shard-{i}", 2_500_000) for i in range(8)]

    def opener(item: Any) -> Any:
        return lambda: (item[0], SlowBytes(item[1], 200_000), None)

    total = 0
    for _, opened in ra.fetch_ahead(
        items, name=lambda it: it[0], opener=opener, ahead=lambda it: True,
        shards=depth, budget=budget,
    ):  # fmt: skip
        _, stream, _ = opened()
        while True:
            data = stream.read(65536)
            if not data:
                break
            total += len(data)
            time.sleep(0.0005)
        stream.close()
    assert total == 8 * 2_500_000
    head = min(budget, ra._HEAD_BYTES)
    assert max(peaks) <= budget + head + (depth + 1) * 200_000
    assert wait_for(lambda: not readahead_threads())


def test_arguments_are_checked():
    for bad in (-1, 1.5, "big"):
        with pytest.raises(ArgumentError, match="readahead"):
            webds.WebDataset("a.tar", readahead=bad)
    for bad in (-1, "big", 2.0, True):
        with pytest.raises(ArgumentError, match="readahead_shards"):
            webds.WebDataset("a.tar", readahead_shards=bad)
    assert ra.check_readahead(None, "auto") == (ra.DEFAULT_READAHEAD_BYTES, "auto", False)
    assert ra.check_readahead(None, 4) == (ra.DEFAULT_READAHEAD_BYTES, 4, False)
    assert ra.check_readahead(False, 4)[1] == 0
    assert ra.check_readahead(True, 2) == (ra.DEFAULT_READAHEAD_BYTES, 2, True)
    assert ra.check_readahead(1000, 2) == (1000, 2, False)


def _child_sees_loop(fs: Any, out: Any) -> None:
    out.put(fs._loop.is_running())  # fs.loop itself refuses to be used after a fork


def test_a_forked_worker_does_not_wait_on_the_parents_fsspec_loop(http_server):
    """fsspec's IO loop thread does not survive fork; the loop inherited must not say it runs,
    or closing each inherited http session in a DataLoader worker waits a second on it."""
    import multiprocessing

    import fsspec

    urls = serve_shards(http_server, [2])
    assert keys(webds.WebDataset(urls)) == ["s0-000000", "s0-000001"]
    fs = fsspec.filesystem("http")
    assert fs.loop.is_running()
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_sees_loop, args=(fs, out))
    child.start()
    assert out.get(timeout=30) is False
    child.join(30)
    assert fs.loop.is_running()  # the parent's is untouched


def _close_in_child(stream: Any, out: Any) -> None:
    start = time.monotonic()
    stream.close()
    out.put(time.monotonic() - start)


def test_a_stream_inherited_by_a_forked_child_is_dropped_there(http_server):
    """A remote stream left open when a DataLoader forks (garbage of an abandoned pipeline,
    collected in the worker) belongs to the parent's event loop, which does not run there:
    closing it in the child returns at once instead of waiting on that loop for ever."""
    import multiprocessing

    from webds.io.urls import open_url

    urls = serve_shards(http_server, [3], member_bytes=100_000)
    stream = open_url(urls[0])
    assert stream.read(512)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_close_in_child, args=(stream, out))
    child.start()
    assert out.get(timeout=30) < 5
    child.join(30)
    assert stream.read(512)  # the parent's stream is untouched
    stream.close()


def test_the_command_line_reads_remote_shards_ahead(http_server, monkeypatch):
    """`webds ls/cat/...` read through the same stage: remote shards are fetched ahead, one GET
    each, with the same samples."""
    from webds.cli.common import read_samples

    urls = serve_shards(http_server, [3, 4, 2])
    started = fetched(monkeypatch)
    before = http_server.requests
    got = [s["__key__"] for s in read_samples(urls)]
    assert got == [f"s{i}-{j:06d}" for i, n in enumerate([3, 4, 2]) for j in range(n)]
    assert started == urls and http_server.requests - before == 3


def test_a_list_of_local_shards_is_taken_one_shard_at_a_time(tmp_path):
    """Nothing is taken ahead from a list of shards that are not read ahead: a source that acts
    when its next item is taken (DirectoryShardList releases the shard before) sees the reader
    finish each shard first, as without read-ahead."""
    for i in range(4):
        write_tar(tmp_path / f"l-{i}.tar", sample_members(3, prefix=f"l{i}-"))
    taken: List[int] = []

    def listing() -> Any:
        for i in range(4):
            taken.append(i)
            yield str(tmp_path / f"l-{i}.tar")

    for sample in webds.DataPipeline(listing, webds.tarfile_to_samples()):
        assert taken[-1] == int(sample["__key__"][1])  # its own shard is the last taken
    assert taken == [0, 1, 2, 3]


# -- readahead_shards="auto": the depth grows while the reader waits on the link -----------------


def test_auto_depth_rule():
    """Little's law: a shard that took f seconds to fetch and r of the reader's own time asks
    for f / r shards in flight, when the reader waited at least AUTO_WAIT_SHARE of that shard's
    time; at most the cap, never fewer than before; a fixed depth never changes."""
    # (fetched, spent, waited) -> shards fetched ahead after it, from 8
    cases = [
        ((1.0, 0.1, 0.05), 19),  # r = 0.05: 20 in flight
        ((1.0, 0.1, 0.009), 8),  # waited under a tenth of its time: keeps up
        ((0.3, 0.1, 0.05), 8),  # 6 in flight would do: never fewer
        ((1.0, 0.011, 0.01), ra.AUTO_MAX_SHARDS),  # 1000 wanted: the cap
        ((0.5, 0.5, 0.5), ra.AUTO_MAX_SHARDS),  # no time of its own at all
    ]
    for (fetched, spent, waited), want in cases:
        depth = ra.Depth(8, grows=True)
        depth.grow(fetched, spent, waited)
        assert depth.shards == want, (fetched, spent, waited)
    depth = ra.Depth(8, grows=True, most=12)
    depth.grow(1.0, 0.1, 0.05)
    assert depth.shards == 12


def test_auto_depth_measures_each_shard(monkeypatch):
    """Each hand-over judges the shard the reader just finished: its fetch time, and the
    reader's time and waits (a fake clock); the first has nothing to judge; a fixed depth never
    measures."""
    clock = [100.0]
    monkeypatch.setattr(ra.time, "perf_counter", lambda: clock[0])
    budget = ra._Budget(1000)

    class Fetched:
        link_seconds = 2.0

    depth = ra.Depth(2, grows=True)
    depth.handed_over(budget, None)  # the first shard starts
    clock[0] += 1.0
    budget.waited += 0.5  # the reader waited half its time on it
    depth.handed_over(budget, Fetched())
    assert depth.shards == 3  # 2 s to fetch, 0.5 s to read: 4 in flight
    clock[0] += 1.0
    budget.waited += 0.05  # under a tenth: no change however slow the fetch
    Fetched.link_seconds = 100.0
    depth.handed_over(budget, Fetched())
    assert depth.shards == 3
    clock[0] += 1.0
    budget.waited += 0.5
    unfinished = Fetched()
    unfinished.link_seconds = None  # abandoned, or cut: nothing to judge
    depth.handed_over(budget, unfinished)
    assert depth.shards == 3
    fixed = ra.Depth(2)
    for _ in range(3):
        clock[0] += 1.0
        budget.waited += 1.0
        fixed.handed_over(budget, Fetched())
    assert fixed.shards == 2


@pytest.mark.parametrize("room", [True, False])
def test_auto_counts_waits_only_with_room_in_the_budget(room):
    """A wait while the shards ahead had filled the budget is the budget's, not the link's:
    more shards in flight would not help, so it is not counted."""
    budget = ra._Budget(100)
    budget.used = 50 if room else 100
    done = threading.Event()

    def finish() -> None:
        # The reader holds the lock until its wait releases it: this runs during the wait.
        with budget.cond:
            time.sleep(0.05)
            done.set()
            budget.cond.notify_all()

    with budget.cond:
        threading.Thread(target=finish).start()
        budget.wait(done.is_set)
    assert (budget.waited >= 0.05) if room else budget.waited == 0.0


#: A far server's time to the first byte: long against the reader's own time on a small shard
#: even where the machine's cores are busy elsewhere (the depth grows to the ratio of the two;
#: at 50 ms, a reader slowed by other work saw too small a ratio to grow past 8, 1 run in 3).
FAR = 0.15


def grown_on_a_far_server(http_server):
    """60 small shards behind FAR to the first byte, read once by a WebDataset with
    ``stats=True`` (the same samples as without read-ahead): (urls, their keys, the dataset,
    the depth it grew to, more than 8)."""
    urls = serve_shards(http_server, [2] * 60)
    want = keys(webds.WebDataset(urls, shardshuffle=False, readahead=False))
    http_server.latency = FAR
    ds = webds.WebDataset(urls, shardshuffle=False, stats=True)
    assert keys(ds) == want
    grown = ds.stats().readahead_shards["main"]
    assert 8 < grown <= ra.AUTO_MAX_SHARDS
    return urls, want, ds, grown


def test_auto_depth_grows_on_a_far_server_and_reads_the_same(http_server):
    """60 small shards behind FAR to the first byte: by default more than 8 shards are
    fetched at once (the server sees it), stats() reports the depth, and the samples and their
    order are those of a read without read-ahead; readahead_shards=8 stays at 9 connections."""
    urls, want, ds, grown = grown_on_a_far_server(http_server)
    assert http_server.most_in_flight > 9
    assert f"shards fetched ahead: {grown} (main)" in str(ds.stats())
    http_server.most_in_flight = 0
    fixed = webds.WebDataset(urls, shardshuffle=False, readahead_shards=8, stats=True)
    assert keys(fixed) == want
    assert fixed.stats().readahead_shards == {"main": 8}
    assert http_server.most_in_flight <= 9
    assert wait_for(lambda: not readahead_threads())


def test_auto_depth_in_workers(http_server):
    """Each DataLoader worker grows its own read-ahead; a WebLoader's stats() names each."""
    urls = serve_shards(http_server, [2] * 60)
    want = keys(webds.WebDataset(urls, shardshuffle=False, readahead=False))
    http_server.latency = FAR
    ds = webds.WebDataset(urls, shardshuffle=False)
    loader = webds.WebLoader(ds, batch_size=None, num_workers=2, stats=True)
    assert sorted(keys(loader)) == sorted(want)
    depths = loader.stats().readahead_shards
    assert set(depths) == {"worker 0", "worker 1"}
    assert all(8 <= d <= ra.AUTO_MAX_SHARDS for d in depths.values())
    assert max(depths.values()) > 8
    assert loader.stats().as_dict()["readahead_shards"] == depths


def test_auto_depth_stays_when_the_reader_is_the_bound(http_server, monkeypatch):
    """A training loop slower than the link: the reader never waits after the first shard (it
    takes each sample only once every fetch started has ended), so 8 shards ahead stay enough
    however fast it reads the bytes already there."""
    started = []
    real = ra.Fetch.__init__

    def spy(self: Any, *args: Any) -> None:
        started.append(self)
        real(self, *args)

    monkeypatch.setattr(ra.Fetch, "__init__", spy)
    urls = serve_shards(http_server, [2] * 24)
    http_server.latency = 0.02
    ds = webds.WebDataset(urls, shardshuffle=False, stats=True)
    got = []
    it = iter(ds)
    while True:
        # the training step: as long as the link needs for every shard in flight
        assert wait_for(lambda: all(f.link_seconds is not None for f in started))
        sample = next(it, None)
        if sample is None:
            break
        got.append(sample["__key__"])
    assert got == [f"s{i}-{j:06d}" for i in range(24) for j in range(2)]
    assert ds.stats().readahead_shards == {"main": 8}
    assert http_server.most_in_flight <= 9


def test_auto_depth_grown_errors_come_in_their_turn(http_server):
    """Grown past 8 on a far server, a missing shard 30 places down the list still raises only
    when the reader gets to it, after every sample before it."""
    urls = serve_shards(http_server, [2] * 40)
    urls[30] = http_server.url("missing.tar")
    http_server.latency = FAR
    ds = webds.WebDataset(urls, shardshuffle=False, stats=True)
    got: List[str] = []
    with pytest.raises(OpenError) as info:
        for s in ds:
            got.append(s["__key__"])
    assert "missing.tar" in str(info.value)
    assert got == [f"s{i}-{j:06d}" for i in range(30) for j in range(2)]
    assert ds.stats().readahead_shards["main"] > 8
    assert wait_for(lambda: not readahead_threads())


def test_auto_depth_grown_stopping_early_leaves_nothing_behind(http_server, monkeypatch):
    """Stopped with up to 33 shards in flight: every thread ends, and each cancelled body
    closes its connection: within 2 s (the server drops an idle one only after 10 s) the
    client holds no socket to the server, CLOSE_WAIT included."""
    one_request_per_connection(monkeypatch)
    fetches: List[Any] = []
    real = ra.Fetch.__init__

    def spy(self: Any, *args: Any) -> None:
        fetches.append(self)
        real(self, *args)

    monkeypatch.setattr(ra.Fetch, "__init__", spy)
    urls = serve_shards(http_server, [20] * 60, member_bytes=100_000)  # 4 MB shards
    http_server.latency = FAR
    ds = webds.WebDataset(urls, shardshuffle=False, stats=True)
    it = iter(ds)
    for _ in range(50):
        next(it)
    assert ds.stats().readahead_shards["main"] > 8
    # More fetches started than 8 ahead allow (how many are still running now depends on the
    # machine's load: the ones cancelled mid-body are counted below).
    assert len(fetches) > 9
    it.close()
    assert wait_for(lambda: not readahead_threads()), readahead_threads()
    assert any(f.link_seconds is None for f in fetches)  # some were cancelled mid-body
    assert wait_for(lambda: connections_to(http_server.port) == 0, 2.0), connections_to(
        http_server.port
    )


def test_a_growing_depth_stays_within_the_budget(monkeypatch):
    """The depth grows by one at every hand-over, up to 6: the bytes held stay within the
    budget plus one read per shard in flight at the most depth, and every byte arrives."""
    peaks: List[int] = []
    real_read = ra.Fetch.read

    def watched(self: Any, n: int) -> bytes:
        peaks.append(self._budget.used)
        return real_read(self, n)

    class Growing(ra.Depth):
        def handed_over(self, budget: Any, last: Any) -> None:
            self.shards = min(self.most, self.shards + 1)

    monkeypatch.setattr(ra.Fetch, "read", watched)
    depth = Growing(1, grows=True, most=6)
    budget = 300_000
    items = [(f"shard-{i}", 1_000_000) for i in range(12)]

    def opener(item: Any) -> Any:
        return lambda: (item[0], SlowBytes(item[1], 200_000), None)

    total = 0
    for _, opened in ra.fetch_ahead(
        items, name=lambda it: it[0], opener=opener, ahead=lambda it: True,
        shards=depth, budget=budget,
    ):  # fmt: skip
        _, stream, _ = opened()
        while True:
            data = stream.read(65536)
            if not data:
                break
            total += len(data)
            time.sleep(0.0005)
        stream.close()
    assert total == 12 * 1_000_000 and depth.shards == 6
    assert max(peaks) <= budget + min(budget, ra._HEAD_BYTES) + (6 + 1) * 200_000
    assert wait_for(lambda: not readahead_threads())


def read_counting_the_start(http_server, samples):
    """The keys of ``samples`` read through, and the most shards in flight on the server up
    to the first one."""
    http_server.most_in_flight = 0
    it = iter(samples)
    first = next(it)["__key__"]
    at_start = http_server.most_in_flight
    return [first] + [s["__key__"] for s in it], at_start


def test_auto_depth_learned_in_one_pass_starts_the_next(http_server):
    """A WebDataset's later passes start at the depth its first grew to, so only the first
    ramps up: right after a later pass's first sample, more than 9 shards are in flight, and
    so in a copy of it (a DataLoader worker's); a fresh dataset starts at 8. The samples and
    their order stay those of a read without read-ahead."""
    urls, want, ds, grown = grown_on_a_far_server(http_server)
    fresh = webds.WebDataset(urls, shardshuffle=False)
    copy = pickle.loads(pickle.dumps(ds))
    for dataset, deep in ((fresh, False), (ds, True), (copy, True)):
        assert wait_for(lambda: not readahead_threads())
        got, in_flight = read_counting_the_start(http_server, dataset)
        assert got == want
        assert (in_flight > 9) if deep else (in_flight <= 9), (deep, in_flight)
    assert ds.stats().readahead_shards["main"] >= grown


def test_auto_depth_learned_by_a_persistent_worker_starts_its_next_epoch(http_server):
    """A persistent DataLoader worker keeps its dataset copy's learned depth: its second epoch
    starts with more than 9 shards in flight; the samples stay the same."""
    urls = serve_shards(http_server, [2] * 60)
    want = sorted(keys(webds.WebDataset(urls, shardshuffle=False, readahead=False)))
    http_server.latency = FAR
    ds = webds.WebDataset(urls, shardshuffle=False)
    loader = webds.WebLoader(ds, batch_size=None, num_workers=1, persistent_workers=True)
    assert sorted(s["__key__"] for s in loader) == want
    assert http_server.most_in_flight > 9
    assert wait_for(lambda: http_server.in_flight == 0)
    got, in_flight = read_counting_the_start(http_server, loader)
    assert sorted(got) == want
    assert in_flight > 9


def test_auto_depth_grows_in_a_pipeline_of_the_bare_stages(http_server):
    """tarfile_to_samples() on its own (not in a WebDataset) grows its depth within a pass
    too; each of its passes starts at 8 (it keeps nothing), the samples the same."""
    urls = serve_shards(http_server, [2] * 60)
    want = keys(webds.WebDataset(urls, shardshuffle=False, readahead=False))
    http_server.latency = FAR
    pipeline = webds.DataPipeline(webds.SimpleShardList(urls), webds.tarfile_to_samples())
    for _ in range(2):
        assert wait_for(lambda: not readahead_threads())
        got, at_start = read_counting_the_start(http_server, pipeline)
        assert got == want
        assert at_start <= 9 < http_server.most_in_flight
