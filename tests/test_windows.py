"""A planned read that starts inside a shard, and a resumed one, enter the shard at the index's
sample offsets (a local seek, one range request) instead of reading what they skip, and yield
exactly what reading from the start yields: for random shards from several writers and random
splits among ranks and workers; over HTTP, S3 and the shard cache; falling back to reading from
the start where a server ignores ranges; and saying so when the index no longer matches."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
from conftest import sample_members, write_tar
from test_access import random_shards

import webds
from webds.errors import ShardReadError
from webds.shards.index import ShardIndex
from webds.shards.plan import plan_worker
from webds.tar import samples
from webds.tar.samples import tarfile_samples
from webds.tar.windows import window, window_opener


def read_plan(index: ShardIndex, offsets: bool, **where: Any) -> List[Dict[str, Any]]:
    """What one worker of one rank reads of ``index``, with or without the offsets."""
    plan = plan_worker(index.counts, index.urls, **where)
    descriptors = [
        seg.descriptor(
            index.shards[seg.shard].samples, index.shards[seg.shard].offsets if offsets else None
        )
        for seg in plan.segments
    ]
    assert len(descriptors) == len(plan.segments)
    return list(tarfile_samples(descriptors, readahead=False))


@pytest.mark.parametrize("case", range(12))
def test_entering_at_the_offsets_reads_what_reading_from_the_start_reads(tmp_path, case):
    rng = random.Random(case)
    index = ShardIndex.build(random_shards(tmp_path, rng, rng.randint(1, 4)))
    assert all(s.offsets is not None for s in index.shards)
    world = rng.choice([1, 2, 3, 5])
    workers = rng.choice([1, 2, 3])
    config = dict(
        seed=rng.choice([None, 3]),
        epoch=rng.randint(0, 3),
        world_size=world,
        num_workers=workers,
        balance=rng.choice(["pad", "drop"]),
        granule=rng.choice([1, 2, 4]),
    )
    entered = 0
    for rank, worker in itertools.product(range(world), range(workers)):
        where = dict(config, rank=rank, worker=worker)
        want = read_plan(index, offsets=False, **where)
        assert read_plan(index, offsets=True, **where) == want, where
        plan = plan_worker(index.counts, index.urls, **where)
        for seg in plan.segments:
            d = seg.descriptor(index.shards[seg.shard].samples, index.shards[seg.shard].offsets)
            entered += window(d, seg.start) is not None
    if world * workers > 1 and index.total > world * workers:
        # Not a vacuous comparison: some reads started inside a shard, or ended before its end.
        assert entered or all(c == 0 for c in index.counts)


def test_the_peer_implementations_shards_entered_mid_shard(peer_dir, tmp_path):
    index = ShardIndex.build([str(peer_dir / n) for n in ("mpdata.tar", "tendata.tar")])
    where = dict(seed=None, epoch=0, world_size=3, num_workers=2, balance="pad", granule=1)
    for rank, worker in itertools.product(range(3), range(2)):
        w = dict(where, rank=rank, worker=worker)
        assert read_plan(index, True, **w) == read_plan(index, False, **w)


def indexed_dataset(tmp_path: Path, sizes: List[int], name: str = "index.json") -> str:
    urls = []
    for i, n in enumerate(sizes):
        path = tmp_path / f"shard-{i}.tar"
        write_tar(path, sample_members(n, prefix=f"s{i}-"))
        urls.append(str(path))
    index = tmp_path / name
    ShardIndex.build(urls).save(str(index))
    return str(index)


def keys(items: List[Any]) -> List[str]:
    return [s["__key__"] for s in items]


# -- remote: one range request at the sample's offset --------------------------------------------


def ranged_index(server: Any, tmp_path: Path, sizes: List[int]) -> ShardIndex:
    """Shards on ``server`` (anything with ``put(name, data) -> url``), indexed by their URLs."""
    local = ShardIndex.load(indexed_dataset(tmp_path, sizes))
    urls = [server.put(f"r-{i}.tar", Path(s.url).read_bytes()) for i, s in enumerate(local)]
    index = ShardIndex.build(urls)
    assert [s.offsets for s in index] == [s.offsets for s in local]
    return index


def segment_reads(index: ShardIndex, start: int, stop: int, **options: Any) -> List[Any]:
    d = {"url": index.urls[0], "start": start, "stop": stop, "samples": index.counts[0]}
    d["offsets"] = index.shards[0].offsets
    return list(tarfile_samples([d], **options))


def test_http_a_segment_is_one_range_request_at_its_first_sample(http_server, tmp_path):
    index = ranged_index(http_server, tmp_path, [40])
    offsets = index.shards[0].offsets
    whole = list(webds.WebDataset(index.urls, shardshuffle=False))
    http_server.log.clear()
    assert segment_reads(index, 17, 23) == whole[17:23]
    gets = [r for r in http_server.log if r[0] == "GET"]
    # One range request, one sample early: the reader checks that sample 17 starts where the
    # index says (a rewritten shard of the same size must not give half a sample).
    assert [r[2] for r in gets] == [f"bytes={offsets[16]}-"]


def test_http_a_server_that_ignores_ranges_is_read_from_the_start(flaky_http_server, tmp_path):
    index = ranged_index(flaky_http_server, tmp_path, [30])
    whole = list(webds.WebDataset(index.urls, shardshuffle=False))
    flaky_http_server.serve_unsized()  # answers every GET with the whole body, ranges ignored
    assert segment_reads(index, 11, 29) == whole[11:29]
    assert segment_reads(index, 11, 30, readahead=False) == whole[11:30]


def test_s3_a_segment_is_read_from_its_first_sample(s3, tmp_path):
    index = ranged_index(s3, tmp_path, [25])
    whole = list(webds.WebDataset(index.urls, shardshuffle=False))
    assert segment_reads(index, 9, 14) == whole[9:14]
    assert segment_reads(index, 24, 25) == whole[24:25]


def test_gcs_a_segment_is_read_from_its_first_sample(gcs, tmp_path):
    index = ranged_index(gcs, tmp_path, [25])
    whole = list(webds.WebDataset(index.urls, shardshuffle=False))
    assert segment_reads(index, 9, 14) == whole[9:14]
    assert segment_reads(index, 20, 25, readahead=False) == whole[20:25]


def test_ranks_and_workers_over_http_read_every_sample_once(http_server, tmp_path, monkeypatch):
    index = ranged_index(http_server, tmp_path, [13, 7, 21])
    path = tmp_path / "remote-index.json"
    index.save(str(path))
    want = keys(webds.WebDataset(index.urls, shardshuffle=False))
    got: List[str] = []
    http_server.log.clear()
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        ds = webds.WebDataset(str(path), balance="drop", shardshuffle=False)
        loader = webds.WebLoader(ds, batch_size=None, num_workers=2)
        got += keys(list(loader))
    assert sorted(got) == sorted(want[: 3 * (41 // 3)])  # "drop" leaves out the last 2
    ranged = [r for r in http_server.log if r[0] == "GET" and r[2]]
    assert ranged, "no read entered a shard at an offset"


# -- the shard cache: the copy is entered by a seek ----------------------------------------------


def test_a_cached_copy_is_entered_at_the_offsets(http_server, tmp_path, monkeypatch):
    index = ranged_index(http_server, tmp_path, [10, 16])
    path = tmp_path / "remote-index.json"
    index.save(str(path))
    cache = tmp_path / "cache"
    want = sorted(keys(webds.WebDataset(index.urls)))
    entered: List[bool] = []  # for each read entered at an offset: was it the cached copy?

    def spy(shard: Any, win: Any, options: Any) -> Any:
        entered.append("stream" in shard)
        return window_opener(shard, win, options)

    monkeypatch.setattr(samples, "window_opener", spy)
    epochs = []
    for _ in range(2):  # the first fills the cache, the second reads the copies
        out = []
        http_server.log.clear()
        for rank in range(2):  # rank 0: shard 0 and 3 of shard 1; rank 1: the rest of shard 1
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", "2")
            ds = webds.WebDataset(str(path), shardshuffle=False, cache_dir=str(cache))
            out += keys(list(ds))
        epochs.append(sorted(out))
    assert epochs[0] == epochs[1] == want
    assert not [r for r in http_server.log if r[0] == "GET"]  # the second read the copies
    # Shard 1 was entered at its offsets in the cached copy: by rank 1 in the first epoch (rank
    # 0's read of its first 3 samples cached it whole), by both ranks in the second.
    assert entered == [True, True, True]


# -- resume: consumed samples are skipped by seeking ----------------------------------------------


def test_a_resume_enters_a_half_read_shard_after_its_consumed_samples(http_server, tmp_path):
    index = ranged_index(http_server, tmp_path, [30, 30])
    path = tmp_path / "remote-index.json"
    index.save(str(path))

    def make() -> Any:
        return webds.WebDataset(str(path), readahead=False)

    a = make()
    it = iter(a)
    before = [next(it) for _ in range(12)]
    state = json.loads(json.dumps(a.state_dict()))
    del it
    http_server.log.clear()
    b = make()
    b.load_state_dict(state)
    rest = list(b)
    assert keys(before + rest) == keys(list(make()))
    gets = [r for r in http_server.log if r[0] == "GET"]
    # (one sample early: the reader checks that sample 12 starts where the index says)
    assert gets[0][1].endswith("r-0.tar") and gets[0][2] == f"bytes={index.shards[0].offsets[11]}-"


@pytest.mark.parametrize("case", range(8))
def test_random_resumes_with_a_shuffle_buffer_are_exact(tmp_path, case):
    rng = random.Random(case)
    spec = indexed_dataset(tmp_path, [rng.randint(1, 30) for _ in range(rng.randint(1, 4))])
    buffer = rng.choice([0, 3, 10])
    workers = rng.choice([0, 2])
    shuffle_shards = rng.random() < 0.5

    def make() -> Any:
        ds = webds.WebDataset(spec, seed=5, shardshuffle=shuffle_shards)
        ds = ds.shuffle(buffer) if buffer else ds
        return webds.WebLoader(ds, batch_size=None, num_workers=workers) if workers else ds

    total = len(list(make()))
    k = rng.randint(0, total)
    a = make()
    it = iter(a)
    before = list(itertools.islice(it, k))
    state = json.loads(json.dumps(a.state_dict()))
    whole = before + list(it)
    b = make()
    b.load_state_dict(state)
    assert Counter(keys(before + list(b))) == Counter(keys(whole))


# -- an index that no longer matches ------------------------------------------------------------


def test_a_rewritten_shard_of_another_size_is_an_out_of_date_index(tmp_path):
    spec = indexed_dataset(tmp_path, [20])
    write_tar(tmp_path / "shard-0.tar", sample_members(80, prefix="s0-"))
    d = ShardIndex.load(spec).shards[0]
    desc = {"url": d.url, "start": 5, "stop": 10, "samples": 20, "offsets": d.offsets}
    with pytest.raises(ShardReadError, match="out of date") as e:
        list(tarfile_samples([desc]))
    assert "shard-0.tar" in str(e.value) and "bytes but the index says" in str(e.value)


def test_a_rewritten_shard_of_the_same_size_is_an_out_of_date_index(tmp_path):
    spec = indexed_dataset(tmp_path, [20])
    d = ShardIndex.load(spec).shards[0]
    path = Path(d.url)
    data = bytearray(path.read_bytes())
    at = d.offsets[7]
    data[at : at + 512] = bytes(512)[:0] + b"x" * 512  # the header sample 7 starts with, gone
    path.write_bytes(bytes(data))
    desc = {"url": d.url, "start": 7, "stop": 9, "samples": 20, "offsets": d.offsets}
    with pytest.raises(ShardReadError, match="out of date") as e:
        list(tarfile_samples([desc]))
    assert f"no tar header at byte {at}, where sample 7 starts" in str(e.value)


def test_sources_that_cannot_seek_are_read_from_the_start(tmp_path):
    spec = indexed_dataset(tmp_path, [15])
    d = ShardIndex.load(spec).shards[0]
    whole = list(webds.WebDataset(d.url, shardshuffle=False))
    piped = {"url": f"pipe:cat {d.url}", "start": 4, "stop": 8, "samples": 15}
    piped["offsets"] = d.offsets
    assert window(piped, 4) is None
    got = list(tarfile_samples([piped]))
    assert keys(got) == keys(whole[4:8])
    assert [{k: v for k, v in s.items() if k != "__url__"} for s in got] == [
        {k: v for k, v in s.items() if k not in ("__url__", "__local_path__")} for s in whole[4:8]
    ]


def test_no_window_without_offsets_or_without_anything_to_skip(tmp_path):
    spec = indexed_dataset(tmp_path, [10])
    d = ShardIndex.load(spec).shards[0]
    base: Dict[str, Optional[Any]] = {"url": d.url, "samples": 10, "start": 0, "stop": 10}
    assert window(dict(base, offsets=d.offsets), 0) is None  # the whole shard
    assert window(dict(base), 3) is None  # no offsets
    assert window(dict(base, offsets=d.offsets[:-1]), 3) is None  # not this shard's
    w = window(dict(base, offsets=d.offsets, stop=6), 3)
    # Samples 3-5, entered one sample early and left one late (see the boundary checks).
    assert w is not None and (w.first, w.offset, w.end, w.size) == (
        2,
        d.offsets[2],
        d.offsets[7],
        d.offsets[10],
    )
    w = window(dict(base, offsets=d.offsets, stop=10), 3)
    assert w is not None and (w.first, w.end) == (2, d.offsets[10])  # the shard's last sample


@pytest.mark.parametrize("case", range(4))
def test_entering_with_select_and_rename_files(tmp_path, case):
    # The index counts samples before select_files/rename_files; a read entered at an offset
    # must number and filter them exactly as a read from the start does.
    rng = random.Random(100 + case)
    index = ShardIndex.build(random_shards(tmp_path, rng, rng.randint(1, 3)))
    keep = {"txt", "meta"} if case % 2 else {"cls"}

    def select(name: str) -> bool:
        return name.rsplit(".", 1)[-1] in keep

    def rename(name: str) -> str:
        return name.replace(".json", ".meta")

    where = dict(seed=None, epoch=0, world_size=3, num_workers=2, balance="pad", granule=1)
    for rank, worker in itertools.product(range(3), range(2)):
        plan = plan_worker(index.counts, index.urls, rank=rank, worker=worker, **where)

        def read(offsets: bool, plan: Any = plan) -> List[Dict[str, Any]]:
            descriptors = [
                seg.descriptor(
                    index.shards[seg.shard].samples,
                    index.shards[seg.shard].offsets if offsets else None,
                )
                for seg in plan.segments
            ]
            return list(
                tarfile_samples(
                    descriptors, select_files=select, rename_files=rename, readahead=False
                )
            )

        assert read(True) == read(False), (rank, worker)


def rewritten_same_size(tmp_path) -> Tuple[str, List[Dict[str, bytes]]]:
    """A shard indexed, then rewritten with the same size and other sample sizes, so that the
    index's offset of sample 5 points at the header of ``k5.cls``, its second member (issue 36):
    (the index's path, the samples the shard now holds)."""

    def write(sizes: List[int]) -> List[Dict[str, bytes]]:
        samples = [{"bin": bytes([i]) * n, "cls": str(i).encode()} for i, n in enumerate(sizes)]
        members = [(f"k{i}.{ext}", s[ext]) for i, s in enumerate(samples) for ext in ("bin", "cls")]
        write_tar(tmp_path / "s.tar", members)
        return samples

    sizes = [8192] * 5 + [1024] * 5
    write(sizes)
    ShardIndex.build([str(tmp_path / "s.tar")]).save(str(tmp_path / "index.json"))
    before = (tmp_path / "s.tar").stat().st_size
    moved = 512 + 1024  # k5.bin's header and data: k5.cls now starts where k5 started
    now = write(sizes[:4] + [8192 - moved] + sizes[5:9] + [1024 + moved])
    assert (tmp_path / "s.tar").stat().st_size == before
    return str(tmp_path / "index.json"), now


def test_a_same_size_rewrite_is_an_out_of_date_index_never_half_a_sample(tmp_path):
    spec, now = rewritten_same_size(tmp_path)
    d = ShardIndex.load(spec).shards[0]
    raised = 0
    for start in range(10):
        for stop in range(start + 1, 11):
            desc = {"url": d.url, "start": start, "stop": stop, "samples": 10, "offsets": d.offsets}
            try:
                got = list(tarfile_samples([desc]))
            except ShardReadError as exn:
                assert "out of date" in str(exn)
                raised += 1
                continue
            # What a segment yields is whole samples of the shard as it is now.
            assert [{"bin": s["bin"], "cls": s["cls"]} for s in got] == now[start:stop]
    assert raised
    desc = {"url": d.url, "start": 5, "stop": 10, "samples": 10, "offsets": d.offsets}
    with pytest.raises(ShardReadError, match="sample 5 starts at byte"):
        list(tarfile_samples([desc]))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_same_size_rewrite_never_gives_a_loader_half_a_sample(tmp_path, workers):
    # One worker reads the whole shard from its start: whole samples. Two enter it at the
    # index's offsets: the out-of-date index error (it was k5 with cls only, no error).
    spec, now = rewritten_same_size(tmp_path)
    ds = webds.WebDataset(spec, shardshuffle=False).batched(2, collation_fn=list)
    loader = webds.WebLoader(ds, batch_size=None, num_workers=workers)

    def read() -> List[Any]:
        got = [s for batch in loader for s in batch]
        assert all(set(s) >= {"bin", "cls"} for s in got)  # never one member of a sample
        return got

    if workers == 0:
        assert [{"bin": s["bin"], "cls": s["cls"]} for s in read()] == now
    else:
        with pytest.raises(Exception, match="out of date"):
            read()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_same_size_rewrite_never_gives_a_rank_half_a_sample(tmp_path, monkeypatch, rank):
    # Each of 2 ranks (as torchrun sets RANK and WORLD_SIZE) reads its half of the shard through
    # the index's offsets: the out-of-date index error, never k5 with cls only.
    spec, _ = rewritten_same_size(tmp_path)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = webds.WebDataset(spec, shardshuffle=False, balance="pad")
    got: List[Any] = []
    with pytest.raises(ShardReadError, match="out of date"):
        for sample in ds:
            got.append(sample)
    assert all(set(s) >= {"bin", "cls"} for s in got)
