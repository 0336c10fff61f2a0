"""Reading shards from real S3 (moto), GCS (the emulator) and HTTP servers on loopback.

The same shards, read locally and remotely, must give exactly the same samples; failures must be
OpenErrors that say what is wrong (which bucket, which object, which credentials).
"""

from __future__ import annotations

import importlib
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple
from urllib.parse import urlparse

import pytest
from conftest import sample_members, write_tar

from webds.compat import gopen
from webds.errors import OpenError
from webds.fluent import WebDataset
from webds.io.remote import REMOTE_BLOCK_SIZE
from webds.io.urls import open_url
from webds.loader import WebLoader

NAMES = [f"shard-{i:03d}.tar" for i in range(3)]
PATTERN = "shard-{000..002}.tar"


def _members(shard: int, n: int) -> List[Tuple[str, bytes]]:
    rng = random.Random(shard)
    out = []
    for name, data in sample_members(n, exts=("txt", "cls"), prefix=f"s{shard}-"):
        out.append((name, data))
        if name.endswith(".cls"):
            # A binary field of uneven size, some well past one 512-byte tar block.
            size = rng.choice([0, 1, 511, 513, 5000, 70_000])
            out.append((name[:-4] + ".bin", rng.randbytes(size)))
    return out


def _gnu_tar(path: Path, members: List[Tuple[str, bytes]]) -> None:
    src = path.parent / (path.name + ".d")
    src.mkdir()
    for name, data in members:
        (src / name).write_bytes(data)
    names = [name for name, _ in members]
    subprocess.run(["tar", "--format=gnu", "-cf", str(path), "-C", str(src), *names], check=True)
    shutil.rmtree(src)


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, bytes]:
    """Three shards (Python tarfile ustar, GNU tar, pax) as {name: bytes}."""
    folder = tmp_path_factory.mktemp("shards")
    write_tar(folder / NAMES[0], _members(0, 7))
    if shutil.which("tar"):
        _gnu_tar(folder / NAMES[1], _members(1, 6))
    else:
        write_tar(folder / NAMES[1], _members(1, 6))
    import tarfile

    write_tar(folder / NAMES[2], _members(2, 8), format=tarfile.PAX_FORMAT)
    return {name: (folder / name).read_bytes() for name in NAMES}


@pytest.fixture(scope="module")
def expected(local_shards: Dict[str, bytes], tmp_path_factory: pytest.TempPathFactory) -> list:
    """The sample sequence read from local files."""
    folder = tmp_path_factory.mktemp("local")
    for name, data in local_shards.items():
        (folder / name).write_bytes(data)
    return content(WebDataset(str(folder / PATTERN)))


def content(samples: Any) -> List[Tuple[str, Dict[str, bytes]]]:
    """(key, fields) of each sample, without the fields that name where it came from."""
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in samples]


class Store:
    """One remote store behind one interface: ``url``, ``put``, ``storage_options``."""

    def __init__(self, kind: str, server: Any) -> None:
        self.kind = kind
        self.server = server
        self.storage_options: Dict[str, Any] = getattr(server, "storage_options", {})

    def url(self, name: str) -> str:
        return self.server.url(name)

    def put(self, name: str, data: bytes) -> str:
        return self.server.put(name, data)

    def upload(self, shards: Dict[str, bytes]) -> str:
        """Store every shard; return the brace pattern naming them all."""
        for name, data in shards.items():
            self.put(name, data)
        return self.url(PATTERN).replace("%7B", "{").replace("%7D", "}")


@pytest.fixture(params=["s3", "gcs", "http"])
def store(request: pytest.FixtureRequest) -> Store:
    fixture = {"s3": "s3", "gcs": "gcs", "http": "http_server"}[request.param]
    return Store(request.param, request.getfixturevalue(fixture))


@pytest.fixture(params=["s3", "gcs"])
def bucket_store(request: pytest.FixtureRequest) -> Store:
    return Store(request.param, request.getfixturevalue(request.param))


# ---------------------------------------------------------------------------------------------
# The same samples as from local files


def test_samples_match_local_with_storage_options(store, local_shards, expected):
    url = store.upload(local_shards)
    samples = list(WebDataset(url, storage_options=store.storage_options))
    assert content(samples) == expected
    assert [s["__url__"] for s in samples[:1]] == [store.url(NAMES[0])]


def test_samples_match_local_configured_by_environment(bucket_store, local_shards, expected):
    # The fixtures set AWS_* / STORAGE_EMULATOR_HOST: no storage_options at all.
    url = bucket_store.upload(local_shards)
    assert content(WebDataset(url)) == expected


def test_samples_match_local_through_two_loader_workers(store, local_shards, expected):
    url = store.upload(local_shards)
    ds = WebDataset(url, storage_options=store.storage_options)
    got = content(WebLoader(ds, batch_size=None, num_workers=2))
    # Workers interleave shards; each shard's samples keep their order, none is lost or doubled.
    assert sorted(got, key=lambda kv: kv[0]) == sorted(expected, key=lambda kv: kv[0])
    for shard in range(3):
        mine = [kv for kv in got if kv[0].startswith(f"s{shard}-")]
        assert mine == [kv for kv in expected if kv[0].startswith(f"s{shard}-")]


def test_open_url_and_gopen_read_whole_objects(store, local_shards):
    store.put(NAMES[2], local_shards[NAMES[2]])
    url = store.url(NAMES[2])
    with open_url(url, "rb", **store.storage_options) as stream:
        chunks = []
        while True:
            chunk = stream.read(1000)  # small reads, as the tar reader does
            if not chunk:
                break
            chunks.append(chunk)
    assert b"".join(chunks) == local_shards[NAMES[2]]
    with gopen(url, **store.storage_options) as stream:
        assert stream.read() == local_shards[NAMES[2]]


def test_reads_default_to_one_stream_or_readahead_in_large_blocks(store):
    # Backends that can stream an object from an offset in one request (s3, gs, http) do; the
    # others read ahead in large blocks.
    store.put("a.bin", b"x" * 10_000)
    with open_url(store.url("a.bin"), **store.storage_options) as stream:
        current = stream.current
        if type(current).__name__ == "RangedStream":
            assert urlparse(store.url("a.bin")).scheme in ("s3", "gs", "http")
            assert current.size == 10_000
        else:
            assert type(current.cache).__name__ == "ReadAheadCache"
            assert current.blocksize == REMOTE_BLOCK_SIZE
        assert stream.read() == b"x" * 10_000


def test_open_options_in_storage_options_reach_the_open(store):
    store.put("a.bin", b"y" * 10_000)
    options = dict(store.storage_options, block_size=4096, cache_type="bytes")
    with open_url(store.url("a.bin"), **options) as stream:
        assert stream.current.blocksize == 4096
        assert type(stream.current.cache).__name__ == "BytesCache"
        assert stream.read() == b"y" * 10_000


def test_filesystem_defaults_chosen_by_the_caller_are_kept(s3):
    s3.put("a.bin", b"z" * 10_000)
    options = dict(s3.storage_options, default_block_size=1 << 20, default_cache_type="first")
    with open_url(s3.url("a.bin"), **options) as stream:
        assert stream.current.blocksize == 1 << 20
        assert type(stream.current.cache).__name__ == "FirstChunkCache"


def test_first_sample_arrives_before_the_whole_shard_is_fetched(http_server):
    rng = random.Random(7)
    # 12 MB: the tar reader asks for 1 MiB at a time, plus one read-ahead block.
    members = [(f"{i:04d}.bin", rng.randbytes(100_000)) for i in range(120)]
    path = write_tar(http_server.root / "big.tar", members)
    size = path.stat().st_size
    ds = WebDataset(http_server.url("big.tar"), storage_options={"block_size": 256 * 1024})
    it = iter(ds)
    first = next(it)
    assert first["bin"] == members[0][1]
    fetched = _bytes_requested(http_server.log)
    assert 0 < fetched < size // 4, (fetched, size)
    assert content([first, *it]) == content(WebDataset(str(path)))


def _bytes_requested(log: List[Tuple[str, str, Any]]) -> int:
    total = 0
    for method, _, spec in log:
        if method == "GET" and spec:
            start, end = spec.split("=")[1].split("-")
            total += int(end) - int(start) + 1
        elif method == "GET":
            return 1 << 62  # a whole-object GET
    return total


# ---------------------------------------------------------------------------------------------
# Errors that say what to do


def test_missing_object_names_bucket_and_object(bucket_store):
    bucket_store.put("there.tar", b"x")
    url = bucket_store.url("missing.tar")
    with pytest.raises(OpenError) as info:
        open_url(url, **bucket_store.storage_options)
    msg = str(info.value)
    assert info.value.url == url
    assert "not found in bucket" in msg and bucket_store.server.bucket in msg
    assert "missing.tar" in msg


def test_missing_bucket_says_the_bucket_does_not_exist(bucket_store):
    scheme = "s3" if bucket_store.kind == "s3" else "gs"
    url = f"{scheme}://no-such-bucket-webds/a.tar"
    with pytest.raises(OpenError) as info:
        open_url(url, **bucket_store.storage_options)
    assert "bucket 'no-such-bucket-webds' does not exist" in str(info.value)
    assert info.value.url == url


def test_missing_http_object(http_server):
    url = http_server.url("missing.tar")
    with pytest.raises(OpenError, match="not found"):
        open_url(url)


def test_missing_shard_fails_the_pipeline_with_open_error(s3, local_shards):
    s3.put(NAMES[0], local_shards[NAMES[0]])
    ds = WebDataset(s3.url(PATTERN), storage_options=s3.storage_options)
    with pytest.raises(OpenError, match="shard-001.tar"):
        list(ds)


def test_wrong_s3_credentials_are_permission_denied(s3):
    s3.put("a.tar", b"data")
    options = dict(s3.storage_options, key="AKIAWRONGWRONGWRONG1", secret="wrong")
    with s3.enforce_auth():
        with pytest.raises(OpenError) as info:
            open_url(s3.url("a.tar"), **options)
    msg = str(info.value)
    assert (
        "permission denied (HTTP 403)" in msg
        and "AWS_ACCESS_KEY_ID" in msg
        and "access policy" in msg
    )


def test_missing_s3_credentials_say_which_variables_to_set(s3, monkeypatch):
    s3.put("a.tar", b"data")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    options = {"client_kwargs": s3.storage_options["client_kwargs"]}
    with pytest.raises(OpenError) as info:
        open_url(s3.url("a.tar"), **options)
    msg = str(info.value)
    assert "no credentials found for 's3://'" in msg
    assert "AWS_ACCESS_KEY_ID" in msg and "'anon': True" in msg


@pytest.mark.parametrize("status", [401, 403])
def test_http_forbidden_is_permission_denied(flaky_http_server, status):
    flaky_http_server.put("a.tar", b"data")
    flaky_http_server.fail_with(status, times=10)
    with pytest.raises(OpenError, match=f"the server refused access \\(HTTP {status}\\)") as info:
        open_url(flaky_http_server.url("a.tar"))
    # A web server has no bucket or access policy: the message speaks of the server.
    assert "bucket" not in str(info.value) and "Authorization" in str(info.value)


def test_http_server_error_names_the_status(flaky_http_server):
    flaky_http_server.put("a.tar", b"data")
    flaky_http_server.fail_with(503, times=10)
    with pytest.raises(OpenError, match=r"HTTP 503.*after 2 attempts"):
        open_url(flaky_http_server.url("a.tar"), retries=1, retry_backoff=0.01)
    flaky_http_server.fail_with(503, times=0)
    with open_url(flaky_http_server.url("a.tar")) as stream:
        assert stream.read() == b"data"


def test_unreachable_server_says_cannot_connect(http_server):
    url = http_server.url("a.tar")
    http_server.stop()
    # Refused connections are retried with backoff (tests/test_retry.py): kept short here.
    with pytest.raises(OpenError, match="cannot connect.*after 6 attempts"):
        open_url(url, retry_backoff=0.001)


def test_http_cannot_be_written(http_server):
    with pytest.raises(OpenError, match="does not support writing"):
        open_url(http_server.url("out.tar"), "wb")


@pytest.mark.parametrize(
    "url, modules, extra",
    [
        ("s3://b/a.tar", ["s3fs"], "webds[s3]"),
        ("gs://b/a.tar", ["gcsfs"], "webds[gcs]"),
        ("https://host/a.tar", ["aiohttp", "fsspec.implementations.http"], "webds[http]"),
    ],
)
def test_absent_backend_names_the_extra(monkeypatch, url, modules, extra):
    registry = importlib.import_module("fsspec.registry")._registry
    # The backend's import fails exactly as when the package is not installed.
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
    scheme = url.split(":")[0]
    monkeypatch.delitem(registry, scheme, raising=False)
    with pytest.raises(OpenError) as info:
        open_url(url)
    assert f"pip install '{extra}'" in str(info.value)
    assert info.value.url == url


def test_backend_not_installed_here_gives_fsspec_hint():
    pytest.importorskip("fsspec")
    try:
        import adlfs  # noqa: F401

        pytest.skip("adlfs is installed here")
    except ImportError:
        pass
    with pytest.raises(OpenError, match="no fsspec backend installed for 'abfs://'.*adlfs"):
        open_url("abfs://container/a.tar")


def test_unknown_scheme():
    with pytest.raises(OpenError, match="unknown URL scheme 'nosuchproto://'"):
        open_url("nosuchproto://x/a.tar")


# ---------------------------------------------------------------------------------------------
# The shard cache over S3


def test_cache_fills_then_serves_an_epoch_after_the_objects_are_gone(
    s3, local_shards, expected, tmp_path
):
    url = Store("s3", s3).upload(local_shards)
    cache = tmp_path / "cache"
    ds = WebDataset(url, storage_options=s3.storage_options, cache_dir=str(cache))
    assert content(ds) == expected
    cached = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
    assert len(cached) == 3 and all(name.endswith(tuple(NAMES)) for name in cached)
    for name in NAMES:
        s3.delete(name)
    assert s3.list() == []
    with pytest.raises(OpenError):
        open_url(s3.url(NAMES[0]), **s3.storage_options)
    assert content(ds) == expected  # the second epoch, from the cache alone
    again = WebDataset(url, storage_options=s3.storage_options, cache_dir=str(cache))
    assert content(again) == expected


def test_unknown_storage_option_is_named(s3):
    s3.put("a.tar", b"data")
    with pytest.raises(OpenError, match="does not accept one of the storage_options.*bogus"):
        open_url(s3.url("a.tar"), bogus=3)


def test_streamed_read_resumes_with_ranges_after_cuts(flaky_http_server, tmp_path):
    # The first request streams the whole object; after a cut the read resumes from the byte
    # offset reached with range requests, and no sample is lost or repeated.
    local = write_tar(tmp_path / "s.tar", sample_members(300, prefix="c"))
    url = flaky_http_server.put("s.tar", local.read_bytes())
    expected = [(s["__key__"], s["txt"]) for s in WebDataset(str(local))]
    flaky_http_server.cut_after(7000, times=2)
    got = [
        (s["__key__"], s["txt"]) for s in WebDataset(url, storage_options={"retry_backoff": 0.01})
    ]
    assert got == expected
    gets = [entry for entry in flaky_http_server.log if entry[0] == "GET"]
    assert gets[0][2] is None, "the first read is one streaming request, not a range"
    assert any(rng and not rng.startswith("bytes=0-") for _, _, rng in gets[1:]), gets
