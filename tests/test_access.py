"""Random access: ``ShardListDataset(index)[i]`` is the sample the stream yields at place ``i``,
whoever wrote the shards (webds, tarfile PAX as webdataset writes, GNU tar format, the peer
implementation's shards), in threads and DataLoader workers; bad indices, stale indexes,
compressed and remote shards are refused, saying why."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import write_tar

import webds
from webds.errors import ArgumentError, ShardReadError
from webds.shards.index import ShardIndex
from webds.tar.offsets import sample_offsets


def streamed(spec: Any) -> List[Dict[str, Any]]:
    return list(webds.WebDataset(spec, shardshuffle=False, empty_check=False))


def indexed(tmp_path: Path, urls: List[str]) -> str:
    path = tmp_path / "index.json"
    ShardIndex.build(urls).save(str(path))
    return str(path)


def tarfile_shard(path: Path, members: List[Any], fmt: int, rng: random.Random) -> None:
    """A shard written by Python's tarfile (PAX with float mtimes is what webdataset writes)."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1795639586 + rng.random() if fmt == tarfile.PAX_FORMAT else 1795639586
            tf.addfile(info, io.BytesIO(data))


def random_members(rng: random.Random, shard: int, long_names: bool) -> List[Any]:
    """Samples of 1-3 members, with now and then a meta member, a dotless name, a long name
    or a folder in the key: every grouping rule the stream applies."""
    members = []
    for j in range(rng.randint(0, 25)):
        key = f"s{shard}-{j:04d}"
        if rng.random() < 0.2:
            key = f"dir/sub.d/{key}" + ("x" * rng.choice([0, 120 if long_names else 0]))
        for ext in rng.sample(["txt", "cls", "seg.png", "json"], rng.randint(1, 3)):
            members.append((f"{key}.{ext}", rng.randbytes(rng.choice([0, 1, 511, 512, 3000]))))
        if rng.random() < 0.1:
            members.append(("__meta__", b"{}"))
        if rng.random() < 0.1:
            members.append((f"s{shard}-README", b"no extension"))
    return members


#: The writers random shards come from: webds's test writer, tarfile PAX and GNU formats.
FORMATS = (None, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT)


def random_shards(
    tmp_path: Path, rng: random.Random, count: int, formats: Any = FORMATS
) -> List[str]:
    """``count`` shards of :func:`random_members`, each by a writer drawn from ``formats``."""
    urls = []
    for k in range(count):
        path = tmp_path / f"shard-{k}.tar"
        fmt = rng.choice(formats)
        members = random_members(rng, k, long_names=fmt is not None)
        if fmt is None:
            write_tar(path, members)
        else:
            tarfile_shard(path, members, fmt, rng)
        urls.append(str(path))
    return urls


@pytest.mark.parametrize("case", range(10))
def test_every_sample_by_index_equals_the_streamed_one(tmp_path, case):
    rng = random.Random(case)
    fmt = FORMATS[case % 3]
    urls = random_shards(tmp_path, rng, rng.randint(1, 5), formats=[fmt])
    ds = webds.ShardListDataset(indexed(tmp_path, urls), open_files=rng.choice([1, 2, 64]))
    want = streamed(urls)
    assert len(ds) == len(want)
    order = list(range(len(want)))
    rng.shuffle(order)
    for i in order:
        assert ds[i] == want[i]
    if want:
        assert ds[-1] == want[-1] and ds[-len(want)] == want[0]


@pytest.mark.parametrize("case", range(6))
def test_large_samples_equal_the_streamed_ones(tmp_path, case):
    """Samples of fields on both sides of the sizes a reader might treat apart (a header block,
    a page, 8 KiB, tens of KB), large fields first, last or between small ones, PAX and GNU
    long-name headers among them."""
    rng = random.Random(100 + case)
    fmt = FORMATS[case % 3]
    sizes = [0, 1, 511, 512, 4096, 7680, 8191, 8192, 8193, 8704, 16391, 30000]
    urls = []
    for k in range(2):
        members = []
        for j in range(rng.randint(1, 12)):
            key = f"s{k}-{j:04d}" + ("y" * rng.choice([0, 120 if fmt is not None else 0]))
            for ext in rng.sample(["txt", "cls", "jpg", "seg.png", "json"], rng.randint(1, 4)):
                members.append((f"{key}.{ext}", rng.randbytes(rng.choice(sizes))))
        path = tmp_path / f"shard-{k}.tar"
        if fmt is None:
            write_tar(path, members)
        else:
            tarfile_shard(path, members, fmt, rng)
        urls.append(str(path))
    ds = webds.ShardListDataset(indexed(tmp_path, urls))
    want = streamed(urls)
    assert len(ds) == len(want) and any(
        sum(len(v) for v in w.values() if isinstance(v, bytes)) > 8192 for w in want
    )
    order = list(range(len(want)))
    rng.shuffle(order)
    for i in order:
        assert ds[i] == want[i]


def test_the_peer_implementations_shards(peer_dir, tmp_path):
    urls = [str(peer_dir / name) for name in ("mpdata.tar", "tendata.tar")]
    ds = webds.ShardListDataset(indexed(tmp_path, urls))
    want = streamed(urls)
    assert len(ds) == len(want) > 0
    assert [ds[i] for i in range(len(ds))] == want


def test_offsets_end_with_the_shard_size_and_start_where_samples_start(tmp_path):
    path = tmp_path / "a.tar"
    write_tar(path, [("a.txt", b"1"), ("a.cls", b"2"), ("__meta__", b"m"), ("b.txt", b"3")])
    with open(path, "rb") as f:
        offsets = sample_offsets(f, str(path))
    assert offsets == [0, 3 * 1024, path.stat().st_size]  # 512-byte header + 1 block each


def test_indices_like_a_sequence(tmp_path):
    urls = [str(tmp_path / f"s{k}.tar") for k in range(2)]
    for k, url in enumerate(urls):
        write_tar(Path(url), [(f"k{k}{j}.txt", b"x") for j in range(3)])
    ds = webds.ShardListDataset(indexed(tmp_path, urls), transform=lambda s: s["__key__"])
    assert [ds[i] for i in range(6)] == ["k00", "k01", "k02", "k10", "k11", "k12"]
    assert ds[-1] == "k12"
    np = pytest.importorskip("numpy")
    assert ds[np.int64(4)] == "k11"
    for bad in (6, -7):
        with pytest.raises(IndexError, match="6 samples"):
            ds[bad]
    with pytest.raises(TypeError, match="integers"):
        ds["1"]  # type: ignore[index]


def test_dataloader_workers_and_threads_read_every_sample_once(tmp_path):
    import torch

    urls = []
    for k in range(4):
        path = tmp_path / f"s{k}.tar"
        write_tar(path, [(f"s{k}-{j:03d}.txt", bytes([j])) for j in range(25)])
        urls.append(str(path))
    ds = webds.ShardListDataset(indexed(tmp_path, urls), open_files=2)
    ds[0]  # descriptors and offsets in the parent, inherited by the forked workers
    loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=True, num_workers=2)
    keys = [s["__key__"] for s in loader]
    assert sorted(keys) == sorted(f"s{k}-{j:03d}" for k in range(4) for j in range(25))
    assert keys != sorted(keys)  # the sampler's order, not the shards'
    got: Dict[int, str] = {}

    def read(start: int) -> None:
        for i in range(start, 100, 4):
            got[i] = ds[i]["__key__"]

    threads = [threading.Thread(target=read, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(100)] == [s["__key__"] for s in streamed(urls)]


def test_a_stale_index_names_the_shard(tmp_path):
    path = tmp_path / "s.tar"
    write_tar(path, [(f"k{j}.txt", b"x") for j in range(5)])
    index = indexed(tmp_path, [str(path)])
    write_tar(path, [(f"k{j}.txt", b"x") for j in range(4)])  # rewritten after indexing
    # The same size (tarfile pads to 10 KiB): the sample no longer where the offsets say.
    with pytest.raises(ShardReadError, match="out of date") as info:
        webds.ShardListDataset(index)[4]
    assert info.value.url == str(path)
    write_tar(path, [(f"k{j}.txt", bytes(20000)) for j in range(4)])
    with pytest.raises(ShardReadError, match="rewritten after indexing") as info:
        webds.ShardListDataset(index)[0]
    assert info.value.url == str(path)
    # An index without offsets or sizes: the count found on the first touch tells.
    bare = ShardIndex([webds.ShardInfo(str(path), 5)])
    with pytest.raises(ShardReadError, match="index says 5") as info:
        webds.ShardListDataset(bare)[0]
    assert info.value.url == str(path)


@pytest.mark.parametrize("size", [5000, 20000])
def test_a_shard_cut_in_place_while_open_is_an_error_not_a_crash(tmp_path, size):
    # Were shards mapped into memory, touching pages a truncation took away would kill the
    # process with SIGBUS. In a subprocess, so that such a crash fails this test alone.
    path = tmp_path / "s.tar"
    write_tar(path, [(f"k{j:03d}.bin", bytes([j]) * size) for j in range(200)])
    index = indexed(tmp_path, [str(path)])
    code = f"""
import os, webds
from webds.errors import ShardReadError
ds = webds.ShardListDataset({index!r})
assert ds[0]["bin"] == bytes({size}) and ds[199]["bin"] == bytes([199]) * {size}
with open({str(path)!r}, "r+b") as f:  # as `cp other.tar s.tar` does to it, in place
    f.truncate(os.path.getsize({str(path)!r}) // 2)
assert ds[3]["bin"] == bytes([3]) * {size}  # what is left is still read
try:
    ds[150]
except ShardReadError as e:
    print("refused:", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "shorter than its offsets say" in out.stdout
    assert str(path) in out.stdout


def test_a_shard_rewritten_in_place_while_threads_read_it_never_crashes(tmp_path):
    """`cp` over a shard in a loop while threads read it: the truncation can land between any
    two instructions of a read (a size check before touching a mapping cannot close that
    window; a mapped file's lost pages kill the process with SIGBUS). Every read either gives
    a sample or raises ShardReadError; the process lives. In a subprocess, so that a crash
    fails this test alone."""
    path = tmp_path / "s.tar"
    write_tar(path, [(f"k{j:03d}.bin", bytes([j]) * 20000) for j in range(60)])
    copy = tmp_path / "copy.tar"
    copy.write_bytes(path.read_bytes())
    index = indexed(tmp_path, [str(path)])
    code = f"""
import shutil, threading, time, webds
from webds.errors import ShardReadError
ds = webds.ShardListDataset({index!r})
ds[0]
stop = time.monotonic() + 1.5
counts = {{"read": 0, "refused": 0}}
def read(seed):
    i = seed
    while time.monotonic() < stop:
        i = (i * 7 + 3) % 60
        try:
            assert ds[i]["bin"] == bytes([i]) * 20000
            counts["read"] += 1
        except ShardReadError:
            counts["refused"] += 1
threads = [threading.Thread(target=read, args=(t,)) for t in range(3)]
for t in threads:
    t.start()
cps = 0
while time.monotonic() < stop:
    shutil.copyfile({str(copy)!r}, {str(path)!r})  # truncates, then writes, in place
    cps += 1
for t in threads:
    t.join()
print("alive", counts["read"], counts["refused"], cps)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    alive, read, refused, cps = out.stdout.split()
    assert alive == "alive" and int(read) > 0 and int(cps) > 10, out.stdout


def test_compressed_shards_are_refused(tmp_path):
    gz = tmp_path / "s.tar.gz"
    write_tar(gz, [("k.txt", b"x")], compress="gz")
    with pytest.raises(ArgumentError, match="uncompressed"):
        webds.ShardListDataset(indexed(tmp_path, [str(gz)]))[0]


# -- offsets in the index --------------------------------------------------------------------


def test_shardwriter_and_webds_index_record_the_offsets(tmp_path, monkeypatch):
    pattern = str(tmp_path / "w-%06d.tar")
    with webds.ShardWriter(pattern, maxcount=7) as sink:
        for i in range(30):
            sink.write({"__key__": f"{i:04d}", "txt": "x" * (i * 37), "cls": i})
    saved = ShardIndex.load(str(tmp_path / "w.index.json"))
    built = ShardIndex.build(str(tmp_path / "w-{000000..000004}.tar"))
    for a, b in zip(saved.shards, built.shards):
        with open(a.url, "rb") as f:
            want = sample_offsets(f, a.url)
        assert list(a.offsets) == list(b.offsets) == want
        assert len(want) == a.samples + 1 and want[-1] == a.bytes
    # Read by the index's offsets: no shard is scanned.
    import webds.shards.access as access

    monkeypatch.setattr(access, "sample_offsets", lambda *a: pytest.fail("scanned"))
    ds = webds.ShardListDataset(str(tmp_path / "w.index.json"))
    assert [ds[i] for i in range(30)] == streamed(str(tmp_path / "w.index.json"))


def test_compressed_shards_have_no_offsets(tmp_path):
    write_tar(tmp_path / "a.tar.gz", [("k.txt", b"x")], compress="gz")
    assert ShardIndex.build(str(tmp_path / "a.tar.gz")).shards[0].offsets is None
    with webds.ShardWriter(str(tmp_path / "z-%06d.tar.gz")) as sink:
        sink.write({"__key__": "a", "txt": "x"})
    assert ShardIndex.load(str(tmp_path / "z.index.json")).shards[0].offsets is None


@pytest.mark.parametrize(
    "offsets, why",
    [([0, 1024], "of 2 numbers"), ([0, 2048, 1024, 10240], "not increasing"),
     ([0, "x", 2048, 10240], "integers"), ([0, 1024, 2048, 9999], "not at its size")],
)  # fmt: skip
def test_bad_offsets_in_an_index_file_are_refused(tmp_path, offsets, why):
    write_tar(tmp_path / "a.tar", [(f"k{j}.txt", b"x") for j in range(3)])
    path = tmp_path / "index.json"
    ShardIndex.build(str(tmp_path / "a.tar")).save(str(path))
    doc = __import__("json").loads(path.read_text())
    doc["shards"][0]["offsets"] = offsets
    path.write_text(__import__("json").dumps(doc))
    with pytest.raises(ArgumentError, match=why):
        ShardIndex.load(str(path))


def test_verify_reports_offsets_that_moved(tmp_path):
    write_tar(tmp_path / "a.tar", [(f"k{j}.txt", b"x") for j in range(3)])
    path = tmp_path / "index.json"
    ShardIndex.build(str(tmp_path / "a.tar")).save(str(path))
    doc = __import__("json").loads(path.read_text())
    doc["shards"][0]["offsets"][1] += 512  # still increasing, no longer a sample's start
    path.write_text(__import__("json").dumps(doc))
    problems = ShardIndex.load(str(path)).verify()
    assert [p.kind for p in problems] == ["offsets"]


# -- chunked samplers ------------------------------------------------------------------------


def chunks_of(ends: List[int], size: int) -> List[range]:
    out, start = [], 0
    for end in ends:
        out += [range(lo, min(lo + size, end)) for lo in range(start, end, size)]
        start = end
    return out


@pytest.mark.parametrize("case", range(8))
def test_chunked_orders_cover_each_sample_once_in_whole_chunks(case):
    rng = random.Random(case)
    ends, total = [], 0
    for _ in range(rng.randint(1, 6)):
        total += rng.randint(0, 40)
        ends.append(total)

    class Sized:  # a ShardListDataset's shape, without shards
        def __init__(self) -> None:
            self.ends = ends

        def __len__(self) -> int:
            return total

    size = rng.randint(1, 12)
    sampler = webds.ChunkedSampler(Sized(), chunksize=size, seed=case)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert sorted(order) == list(range(total))
        for chunk in chunks_of(ends, size):  # each chunk comes whole, in one run
            if len(chunk):
                places = sorted(order.index(i) for i in chunk)
                assert places == list(range(places[0], places[0] + len(chunk)))
        orders.append(order)
    if total > 2 * size:
        assert orders[0] != orders[1] != orders[2]
    again = webds.ChunkedSampler(Sized(), chunksize=size, seed=case)
    again.set_epoch(1)
    assert list(again) == orders[1]
    assert list(webds.ChunkedSampler(Sized(), chunksize=size, shuffle=False)) == list(range(total))


@pytest.mark.parametrize("drop_last", [False, True])
def test_three_ranks_two_workers_read_every_sample_once_per_epoch(tmp_path, drop_last):
    import torch

    urls = []
    for k, n in enumerate([13, 7, 20, 1]):
        path = tmp_path / f"s{k}.tar"
        write_tar(path, [(f"s{k}-{j:03d}.txt", b"x") for j in range(n)])
        urls.append(str(path))
    ds = webds.ShardListDataset(indexed(tmp_path, urls))
    n = len(ds)  # 41: not a multiple of 3
    epochs = []
    for epoch in range(2):
        per_rank = []
        for rank in range(3):
            sampler = webds.DistributedChunkedSampler(
                ds, num_replicas=3, rank=rank, seed=5, drop_last=drop_last, chunksize=4
            )
            sampler.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(
                ds, sampler=sampler, batch_size=None, num_workers=2
            )
            per_rank.append([s["__key__"] for s in loader])
        counts = {len(keys) for keys in per_rank}
        assert counts == {n // 3 if drop_last else -(-n // 3)}  # the same count everywhere
        seen = [k for keys in per_rank for k in keys]
        everything = {s["__key__"] for s in streamed(urls)}
        if drop_last:
            assert len(set(seen)) == len(seen) == n - n % 3
        else:
            assert set(seen) == everything and len(seen) - len(set(seen)) == 3 - n % 3
        epochs.append(per_rank)
    assert epochs[0] != epochs[1]  # a new order every epoch


def test_a_chunked_sampler_resumes_mid_epoch():
    class Sized:
        ends = [30, 55]

        def __len__(self) -> int:
            return 55

    a = webds.DistributedChunkedSampler(Sized(), num_replicas=2, rank=1, seed=3, chunksize=6)
    a.set_epoch(4)
    it = iter(a)
    before = [next(it) for _ in range(11)]
    state = __import__("json").loads(__import__("json").dumps(a.state_dict()))
    rest = list(it)
    b = webds.DistributedChunkedSampler(Sized(), num_replicas=2, rank=1, seed=3, chunksize=6)
    b.load_state_dict(state)
    assert before + list(b) == before + rest
    c = webds.DistributedChunkedSampler(Sized(), num_replicas=2, rank=1, seed=3, chunksize=6)
    c.load_state_dict(state, given=5)  # the loop had consumed fewer than were fetched
    assert before[:5] + list(c) == before + rest
    with pytest.raises(webds.ResumeError, match="seed"):
        webds.ChunkedSampler(Sized(), seed=9).load_state_dict(state)


def test_sampler_arguments_are_checked():
    with pytest.raises(ArgumentError, match="chunksize"):
        webds.ChunkedSampler(range(5), chunksize=0)
    with pytest.raises(ArgumentError, match="rank 3"):
        webds.DistributedChunkedSampler(range(5), num_replicas=3, rank=3)
    with pytest.raises(ArgumentError, match="len"):
        webds.ChunkedSampler(iter([1]))
    assert webds.DistributedChunkedSampler(range(5)).num_replicas == 1  # no process group


# -- remote shards ---------------------------------------------------------------------------


def remote_shards(server: Any, sizes: List[int]) -> List[str]:
    """Shards written by tarfile in PAX format (as webdataset writes them) on ``server``."""
    urls = []
    for k, n in enumerate(sizes):
        name = f"r{k}.tar"
        members = [(f"r{k}-{j:03d}.bin", bytes([j]) * (j * 300)) for j in range(n)]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for member, data in members:
                info = tarfile.TarInfo(member)
                info.size = len(data)
                info.mtime = 1795639586.25
                tf.addfile(info, io.BytesIO(data))
        urls.append(server.put(name, buf.getvalue()))
    return urls


def test_http_shards_one_ranged_request_per_sample(http_server):
    urls = remote_shards(http_server, [9, 4, 12])
    index = ShardIndex.build(urls)  # with offsets
    ds = webds.ShardListDataset(index)
    want = streamed(urls)
    order = list(range(len(want)))
    random.Random(0).shuffle(order)
    before = http_server.requests
    for i in order:
        assert ds[i] == want[i]
    assert http_server.requests - before == len(want)
    ranges = [r for _, _, r in http_server.log[-len(want) :]]
    assert all(r and r.startswith("bytes=") and not r.endswith("-") for r in ranges)
    # No offsets in the index: the shard is read once on its first touch to find them.
    bare = webds.ShardListDataset(
        ShardIndex([webds.ShardInfo(u, n) for u, n in zip(urls, [9, 4, 12])])
    )
    assert [bare[i] for i in order] == [want[i] for i in order]


def test_a_server_that_ignores_ranges_is_named_with_what_to_do(http_server, tmp_path):
    # (A break attempt: the whole shard sent for each sample read as "the shard is shorter than
    # its offsets say ... rebuild the index".)
    urls = remote_shards(http_server, [9, 4])
    index = ShardIndex.build(urls)
    want = streamed(urls)
    http_server.unsized = True  # no Range, no Content-Length: the whole shard for every GET
    try:
        ds = webds.ShardListDataset(index)
        with pytest.raises(webds.errors.OpenError, match="it ignores range requests") as info:
            ds[3]
        assert "cache_dir=" in str(info.value) and urls[0] in str(info.value)
        cached = webds.ShardListDataset(index, cache_dir=str(tmp_path / "cache"))
        assert [cached[i] for i in range(len(want))] == want  # the way it names
    finally:
        http_server.unsized = False


def test_gopen_rewrite_applies_to_the_index_and_every_shard(http_server, tmp_path, monkeypatch):
    # (A break attempt: the index's own URL was checked for existence before any rewrite, and
    # local shards were opened, and remote ones requested, as written.)
    urls = remote_shards(http_server, [6, 3])
    (tmp_path / "data").mkdir()
    local = tmp_path / "data" / "l0.tar"
    write_tar(local, [(f"l{j}.cls", str(j).encode()) for j in range(4)])
    virtual = [
        str(tmp_path / "v" / "l0.tar"),
        *(u.replace(http_server.endpoint, "/web") for u in urls),
    ]
    rules = f"{tmp_path}/v/={tmp_path}/data/;/web/={http_server.endpoint}/"
    monkeypatch.setenv("GOPEN_REWRITE", rules)
    index = ShardIndex.build(virtual)
    index.save(str(tmp_path / "data" / "i.index.json"))
    want = streamed(virtual)
    assert len(want) == 13 and want[0]["__url__"] == virtual[0]
    ds = webds.ShardListDataset(str(tmp_path / "v" / "i.index.json"))
    assert [ds[i] for i in range(len(want))] == want
    assert len(list(webds.WebDataset(str(tmp_path / "v" / "i.index.json")))) == 13


def test_http_shards_through_the_cache(http_server, tmp_path):
    urls = remote_shards(http_server, [9, 4, 12])
    ds = webds.ShardListDataset(ShardIndex.build(urls), cache_dir=str(tmp_path / "cache"))
    want = streamed(urls)
    before = http_server.requests
    assert [ds[i] for i in range(len(want))] == want
    assert http_server.requests - before == 3  # each shard downloaded once, whole
    assert len(list((tmp_path / "cache").iterdir())) == 3
    again = webds.ShardListDataset(ShardIndex.build(urls), cache_dir=str(tmp_path / "cache"))
    before = http_server.requests
    assert again[20] == want[20] and http_server.requests == before  # from the cache


def test_s3_shards_by_ranged_requests(s3):
    urls = remote_shards(s3, [5, 8])
    ds = webds.ShardListDataset(ShardIndex.build(urls))
    want = streamed(urls)
    assert [ds[i] for i in reversed(range(len(want)))] == want[::-1]
    with pytest.raises(webds.OpenError, match="missing.tar"):
        webds.ShardListDataset(ShardIndex([webds.ShardInfo(s3.url("missing.tar"), 2)]))[0]


def test_threads_never_read_through_a_descriptor_closed_under_them(tmp_path):
    """One open file for 8 threads over 4 shards: each read evicts another thread's file; a
    mapping is closed only once no read holds it, so no read sees another file's bytes."""
    urls = []
    for k in range(4):
        path = tmp_path / f"s{k}.tar"
        write_tar(path, [(f"s{k}-{j:03d}.bin", bytes([k]) * (1000 + j)) for j in range(30)])
        urls.append(str(path))
    ds = webds.ShardListDataset(indexed(tmp_path, urls), open_files=1)
    want = streamed(urls)
    errors: List[Any] = []

    def read(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                i = rng.randrange(len(want))
                assert ds[i] == want[i]
        except BaseException as exn:  # reported below, in the test's thread
            errors.append(exn)

    threads = [threading.Thread(target=read, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(ds._files) == 1
    ds.close()


def test_a_wids_index_file(tmp_path):
    """wids's index format: relative URLs against the file's folder (or its "base"), "nsamples",
    "filesize"; ShardListDataset and WebDataset read it."""
    import json

    (tmp_path / "shards").mkdir()
    for k in range(2):
        write_tar(tmp_path / "shards" / f"w{k}.tar", [(f"w{k}-{j}.txt", b"x") for j in range(4)])
    doc = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": "train",
        "shardlist": [
            {"url": "shards/w0.tar", "nsamples": 4,
             "filesize": (tmp_path / "shards" / "w0.tar").stat().st_size},
            {"url": str(tmp_path / "shards" / "w1.tar"), "nsamples": 4},
        ],
    }  # fmt: skip
    path = tmp_path / "wids.json"
    path.write_text(json.dumps(doc))
    ds = webds.ShardListDataset(str(path))
    want = streamed([str(tmp_path / "shards" / f"w{k}.tar") for k in range(2)])
    assert [ds[i] for i in range(8)] == want
    assert [s["__key__"] for s in streamed(str(path))] == [s["__key__"] for s in want]
    doc["base"] = "shards"
    doc["shardlist"][0]["url"] = "w0.tar"
    path.write_text(json.dumps(doc))
    assert ShardIndex.load(str(path)).urls[0] == str(tmp_path / "shards" / "w0.tar")
    doc["shardlist"][1]["nsamples"] = 5  # wrong: found on first touch
    path.write_text(json.dumps(doc))
    with pytest.raises(ShardReadError, match="index says 5"):
        webds.ShardListDataset(str(path))[5]


@pytest.mark.slow
def test_spawned_workers_open_their_own_files(tmp_path):
    """Spawned (not forked) DataLoader workers get the dataset pickled: no descriptors or lock
    travel, each worker opens its own files, and every sample comes once."""
    import torch

    urls = []
    for k in range(3):
        path = tmp_path / f"s{k}.tar"
        write_tar(path, [(f"s{k}-{j:02d}.txt", b"x") for j in range(10)])
        urls.append(str(path))
    ds = webds.ShardListDataset(indexed(tmp_path, urls), open_files=1)
    ds[0]  # a descriptor open in the parent, which must not be pickled
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=1, multiprocessing_context="spawn"
    )
    assert sorted(s["__key__"] for s in loader) == sorted(s["__key__"] for s in streamed(urls))


def mapped(paths) -> int:
    """How many of this process's memory mappings and open descriptors are of ``paths``."""
    targets = {os.path.realpath(p) for p in paths}
    maps = sum(line.split()[-1] in targets for line in open("/proc/self/maps") if "/" in line)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}") in targets
        except OSError:
            pass  # the listing's own descriptor, gone
    return maps + fds


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux /proc")
def test_open_files_bounds_what_stays_mapped_and_close_lets_go_of_everything(tmp_path):
    """At most ``open_files`` shards stay mapped (one descriptor each, the mapping's own) while
    reading across more shards; close() and dropping the dataset unmap them all."""
    urls = []
    for k in range(5):
        path = tmp_path / f"s{k}.tar"
        write_tar(path, [(f"s{k}-{j:03d}.bin", bytes([k]) * 700) for j in range(10)])
        urls.append(str(path))
    ds = webds.ShardListDataset(indexed(tmp_path, urls), open_files=2)
    want = streamed(urls)
    for i in random.Random(1).sample(range(len(want)), len(want)):
        assert ds[i] == want[i]
        assert mapped(urls) <= 2 * 2  # a mapping and its descriptor, per open shard
    assert mapped(urls) > 0
    ds.close()
    assert mapped(urls) == 0
    assert ds[7] == want[7] and mapped(urls) > 0  # reopened on the next access
    del ds
    assert mapped(urls) == 0


@pytest.mark.parametrize("size", [600, 20000])
def test_a_damaged_header_is_named_at_its_offset_in_the_shard(tmp_path, size):
    """A header damaged after indexing: the error names the byte offset in the shard (where
    `dd` or a hex editor finds it), not in the sample's range."""
    path = tmp_path / "s.tar"
    write_tar(path, [(f"k{j}.{ext}", b"x" * size) for j in range(6) for ext in ("a", "b")])
    index = ShardIndex.build([str(path)])
    start = index.shards[0].offsets[3]
    second = start + 512 + (size + 511) // 512 * 512  # sample 3's second member's header
    raw = bytearray(path.read_bytes())
    raw[second + 148 : second + 156] = b"0000000\0"  # its checksum, wrong
    path.write_bytes(bytes(raw))
    ds = webds.ShardListDataset(index)
    with pytest.raises(webds.ShardReadError) as info:
        ds[3]
    assert info.value.offset == second and f"byte offset {second}" in str(info.value)
    assert ds[2]["a"] == b"x" * size
