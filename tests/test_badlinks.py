"""Bad links against real servers on loopback: a server that streams without Content-Length and
closes at a member boundary, one that stalls, one that cuts every response part-way.

Each must end in the whole shard or a ShardReadError that names the url and the knob, in bounded
time; the shard cache must never keep a short copy.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import random
import tarfile
import time
from pathlib import Path
from typing import Any, List, Tuple

import pytest
from conftest import write_tar

import webds
from webds.errors import ArgumentError, ShardReadError
from webds.fluent import WebDataset
from webds.io.retrying import ResumableStream
from webds.io.urls import open_url

FAST = {"retry_backoff": 0.001}


def _members(n: int, size: int, seed: int = 0) -> List[Tuple[str, bytes]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append((f"{i:04d}.bin", rng.randbytes(size)))
        out.append((f"{i:04d}.cls", str(i).encode()))
    return out


def _samples(ds: Any) -> List[Tuple[str, bytes, bytes]]:
    return [(s["__key__"], s["bin"], s["cls"]) for s in ds]


def _member_start(path: Path, index: int) -> int:
    """The byte offset of member ``index``'s header: a member (and sample) boundary."""
    with tarfile.open(path) as tf:
        return tf.getmembers()[index].offset


def _gets(server: Any) -> List[Any]:
    return [rng for method, _, rng in server.log if method == "GET"]


# -- the cache never keeps a short copy -----------------------------------------------------------


def test_cache_refuses_a_body_without_length_cut_at_a_member_boundary(flaky_http_server, tmp_path):
    local = write_tar(tmp_path / "s.tar", _members(40, 1000))
    cut = _member_start(local, 2 * 20)  # right before sample 20: every member before it whole
    url = flaky_http_server.put("s.tar", local.read_bytes())
    flaky_http_server.serve_unsized(cut=cut)
    cache = tmp_path / "cache"
    with pytest.raises(ShardReadError) as info:
        list(WebDataset(url, cache_dir=str(cache)))
    assert info.value.url == url and "not cached" in str(info.value)
    assert "Content-Length" in str(info.value)
    assert os.listdir(cache) == [], "no copy, no temporary file, no lock left"
    # The same server sending the whole shard (still without a length) is cached: it ends with
    # the end-of-archive marker. The next epoch reads the cache alone.
    flaky_http_server.serve_unsized(cut=None)
    expected = _samples(WebDataset(str(local)))
    assert _samples(WebDataset(url, cache_dir=str(cache))) == expected
    assert len(os.listdir(cache)) == 1
    (flaky_http_server.root / "s.tar").unlink()
    assert _samples(WebDataset(url, cache_dir=str(cache))) == expected


@pytest.mark.parametrize(
    "compress", [gzip.compress, bz2.compress, lzma.compress], ids=["gz", "bz2", "xz"]
)
def test_cache_checks_the_end_of_archive_inside_a_compressed_shard(tmp_path, compress):
    # A pipe: command gives no size. A compressed stream that is whole but holds a tar cut at
    # a member boundary is not a complete shard; the whole one is.
    local = write_tar(tmp_path / "s.tar", _members(10, 700))
    data = local.read_bytes()
    short = tmp_path / "short.tar.x"
    short.write_bytes(compress(data[: _member_start(local, 8)]))
    whole = tmp_path / "whole.tar.x"
    whole.write_bytes(compress(data))
    cache = tmp_path / "cache"
    with pytest.raises(ShardReadError, match="end-of-archive marker"):
        list(WebDataset(f"pipe:cat {short}", cache_dir=str(cache)))
    assert os.listdir(cache) == []
    got = _samples(WebDataset(f"pipe:cat {whole}", cache_dir=str(cache)))
    assert got == _samples(WebDataset(str(local)))
    assert len(os.listdir(cache)) == 1


def test_cache_keeps_nothing_shorter_than_the_size_the_caller_gives(http_server, tmp_path):
    from webds.io.cache import ShardCache

    local = write_tar(tmp_path / "s.tar", _members(5, 700))
    url = http_server.put("s.tar", local.read_bytes())
    cache = ShardCache(str(tmp_path / "cache"))
    stream, _ = cache.open(url, nbytes=local.stat().st_size + 512)  # e.g. an index's count
    with pytest.raises(ShardReadError, match=f"of its {local.stat().st_size + 512} bytes"):
        while stream.read(4096):
            pass
    stream.close()
    assert os.listdir(tmp_path / "cache") == []


# -- stalled servers ------------------------------------------------------------------------------


def test_a_server_that_stalls_after_its_headers_fails_in_bounded_time(flaky_http_server, tmp_path):
    local = write_tar(tmp_path / "s.tar", _members(5, 700))
    url = flaky_http_server.put("s.tar", local.read_bytes())
    flaky_http_server.stall_after(0, seconds=60, times=10)
    options = {"read_timeout": 0.5, "retries": 2, **FAST}
    start = time.monotonic()
    with pytest.raises(ShardReadError) as info:
        list(WebDataset(url, storage_options=options))
    elapsed = time.monotonic() - start
    err = info.value
    assert err.url == url and err.offset == 0
    assert "read_timeout" in str(err) and "after 3 attempts" in str(err), str(err)
    assert len(_gets(flaky_http_server)) == 3
    assert elapsed < 10, f"a stalled server took {elapsed:.1f} s to report, not ~1.5 s"


def test_a_read_that_stalls_mid_body_is_retried_like_a_dropped_one(flaky_http_server, tmp_path):
    local = write_tar(tmp_path / "s.tar", _members(40, 2000))
    url = flaky_http_server.put("s.tar", local.read_bytes())
    flaky_http_server.stall_after(30_000, seconds=60, times=1)
    options = {"read_timeout": 0.5, **FAST}
    got = _samples(WebDataset(url, storage_options=options))
    assert got == _samples(WebDataset(str(local)))
    # One stalled GET, then one that resumes from the first byte not received.
    assert _gets(flaky_http_server) == [None, "bytes=30000-"]


def test_read_timeout_is_checked(http_server):
    url = http_server.put("a.bin", b"x" * 1000)
    for bad in (0, -1, "30"):
        with pytest.raises(ArgumentError, match="read_timeout"):
            open_url(url, read_timeout=bad)
    with open_url(url, read_timeout=None) as stream:  # None: no limit of webds's own
        assert stream.read() == b"x" * 1000


# -- links that drop every connection part-way ----------------------------------------------------


def test_a_link_that_cuts_every_response_still_delivers_the_whole_shard(
    flaky_http_server, tmp_path
):
    local = write_tar(tmp_path / "s.tar", _members(60, 50_000))
    size = local.stat().st_size
    url = flaky_http_server.put("s.tar", local.read_bytes())
    flaky_http_server.cut_after(100_000, times=1000)
    got = _samples(WebDataset(url, storage_options={"retries": 1, **FAST}))
    assert got == _samples(WebDataset(str(local)))
    # Each attempt asks from the first missing byte and delivers its 100 KB: one GET per 100 KB.
    gets = _gets(flaky_http_server)
    assert len(gets) == -(-size // 100_000)
    assert gets == [None] + [f"bytes={n * 100_000}-" for n in range(1, len(gets))]


def test_the_retry_budget_counts_attempts_without_progress(flaky_http_server):
    data = random.Random(3).randbytes(2_000_000)
    url = flaky_http_server.put("a.bin", data)
    # Five responses cut after 100 KB (each makes progress), then cuts before any byte.
    flaky_http_server.cut_each([100_000] * 5 + [0] * 10)
    stream = open_url(url, retries=1, **FAST)
    received = []
    with pytest.raises(ShardReadError) as info:
        while True:
            chunk = stream.read(65536)
            assert chunk, "the stream ended early"
            received.append(chunk)
    assert b"".join(received) == data[:500_000]
    assert info.value.offset == 500_000 and info.value.url == url
    assert "after 2 attempts (1 retry)" in str(info.value)
    # Five retries, each after an attempt that delivered data, although the budget is one: it
    # runs out only on the attempt that delivered nothing after the fifth cut.
    assert stream.retries == 5
    stream.close()


# -- s3 (moto) and gs (the emulator): ranged streams and resume ------------------------------


class _CutEvery:
    """A real stream that raises ConnectionResetError after ``limit`` bytes (a dropped link)."""

    def __init__(self, stream: Any, limit: int) -> None:
        self.stream, self.left, self.size = stream, limit, stream.size

    def read(self, n: int) -> bytes:
        if self.left <= 0:
            raise ConnectionResetError("connection reset by peer (injected)")
        data = self.stream.read(min(n, self.left))
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.stream.close()


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_object_store_reads_resume_with_an_open_ended_range(request, store):
    import fsspec

    from webds.io.ranged import RangedStream, open_ranged

    bucket = request.getfixturevalue(store)
    data = random.Random(4).randbytes(1_000_000)
    url = bucket.put("a.bin", data)
    fs, path = fsspec.core.url_to_fs(url, **bucket.storage_options)
    with open_url(url, **bucket.storage_options) as stream:  # what every read uses
        assert isinstance(stream.current, RangedStream) and stream.read() == data
    with open_ranged(fs, path, 300_000, 5.0) as tail:
        assert tail.size == len(data) and tail.read(-1) == data[300_000:]
    opened = []

    def open_at(offset: int) -> Any:
        opened.append(offset)
        return _CutEvery(open_ranged(fs, path, offset, 5.0), 200_000)

    stream = ResumableStream(open_at, url=url, retries=1, backoff=0.001)
    assert stream.read() == data
    assert opened == [0, 200_000, 400_000, 600_000, 800_000]
    assert stream.retries == 4
    stream.close()


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_an_object_replaced_between_a_cut_and_the_resume_is_never_spliced(request, store):
    # Version A is read, the link drops inside it, version B (same size) replaces it: the resumed
    # request must not return B's bytes after A's (issue 36).
    import fsspec

    from webds.io.ranged import ObjectChanged, open_ranged

    bucket = request.getfixturevalue(store)
    a, b = random.Random(1).randbytes(300_000), random.Random(2).randbytes(300_000)
    url = bucket.put("v.bin", a)
    fs, path = fsspec.core.url_to_fs(url, **bucket.storage_options)
    pin: dict = {}

    def open_at(offset: int) -> Any:
        if offset:
            bucket.put("v.bin", b)  # replaced while the link was down
            fs.invalidate_cache()
        return _CutEvery(open_ranged(fs, path, offset, 5.0, pin), 100_000)

    stream = ResumableStream(open_at, url=url, retries=2, backoff=0.001)
    got = b""
    while len(got) < 100_000:  # (a read may give less than asked: the body comes in pieces)
        got += stream.read(100_000 - len(got))
    assert got == a[:100_000]
    with pytest.raises(ObjectChanged, match="replaced while it was read"):
        stream.read()
    stream.close()


def test_a_versioned_s3_bucket_resumes_the_version_it_began(s3):
    import fsspec

    from webds.io.ranged import open_ranged

    s3.client.put_bucket_versioning(Bucket=s3.bucket, VersioningConfiguration={"Status": "Enabled"})
    a, b = random.Random(1).randbytes(300_000), random.Random(2).randbytes(300_000)
    url = s3.put("w.bin", a)
    fs, path = fsspec.core.url_to_fs(url, **s3.storage_options)
    pin: dict = {}

    def open_at(offset: int) -> Any:
        if offset:
            s3.put("w.bin", b)
        return _CutEvery(open_ranged(fs, path, offset, 5.0, pin), 100_000)

    stream = ResumableStream(open_at, url=url, retries=2, backoff=0.001)
    assert stream.read() == a  # the version the read began with, whole
    assert pin.get("version")
    stream.close()


@pytest.mark.parametrize("dates_only", [False, True])
def test_an_http_object_replaced_during_a_read_stops_it_before_the_splice(
    flaky_http_server, tmp_path, dates_only
):
    # The server sends version A, drops the link inside sample 10, and then serves version B
    # (same size, another ETag): webds yielded A's samples 0-9 and a sample 10 made of both
    # (issue 36). Now the resumed request carries If-Range: the read stops with ObjectChanged.
    from webds.io.ranged import ObjectChanged

    def version(tag: bytes) -> bytes:
        members = [(f"{i:04d}.{ext}", tag * 700) for i in range(20) for ext in ("bin", "cls")]
        return write_tar(tmp_path / "v.tar", members).read_bytes()

    a, b = version(b"A"), version(b"B")
    assert len(a) == len(b)
    # A server without ETags is pinned by its Last-Modified date (a rewrite a second later).
    flaky_http_server.dates_only = dates_only
    url = flaky_http_server.put("v.tar", a)
    if dates_only:
        os.utime(flaky_http_server.root / "v.tar", (1_000_000, 1_000_000))
    whole = list(webds.WebDataset(url, shardshuffle=False))
    offsets = webds.shards.index.ShardIndex.build([url]).shards[0].offsets
    flaky_http_server.cut_after(offsets[10] + 1000)  # inside sample 10
    flaky_http_server.after_cut = lambda: flaky_http_server.put("v.tar", b)
    got = []
    with pytest.raises(ObjectChanged, match="replaced while it was read"):
        for sample in webds.WebDataset(url, shardshuffle=False, readahead=False):
            got.append(sample)
    # Samples 0-8 (sample 9 waits for the key of sample 10, which the cut withheld).
    assert [s["__key__"] for s in got] == [s["__key__"] for s in whole[: len(got)]]
    assert len(got) >= 9
    assert all(s["bin"] == b"A" * 700 for s in got)  # nothing of version B
