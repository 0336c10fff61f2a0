"""gopen, gopen_schemes and reader: webdataset's opener and its registry of scheme handlers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import sample_members, write_tar
from torch.utils.data import DataLoader

from webds.base.handlers import warn_and_continue
from webds.compat import gopen, gopen_schemes, reader
from webds.errors import ArgumentError, OpenError
from webds.fluent import WebDataset
from webds.io import urls

ROOT = Path(__file__).resolve().parents[1]


class LocalDirOpener:
    """A real scheme handler: ``localdir://name`` is the file ``name`` under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list = []

    def __call__(self, url, mode="rb", bufsize=8192, **kw):
        self.calls.append((url, mode, bufsize, kw))
        assert url.startswith("localdir://")
        return open(self.root / url[len("localdir://") :], mode)


@pytest.fixture
def scheme(tmp_path):
    """Register ``localdir://`` for the test, and remove it (and anything else added) after."""
    before = dict(gopen_schemes)
    opener = LocalDirOpener(tmp_path)
    gopen_schemes["localdir"] = opener
    yield opener
    gopen_schemes.clear()
    gopen_schemes.update(before)


@pytest.fixture
def shards(tmp_path):
    for s in range(4):
        write_tar(tmp_path / f"shard-{s}.tar", sample_members(6, prefix=f"s{s}-"))
    return tmp_path


def test_registry_is_the_one_in_urls_and_starts_empty():
    assert gopen_schemes is urls.SCHEMES
    code = (
        "import webds.compat as c, webds.io.urls as u\nprint(len(c.gopen_schemes), len(u.SCHEMES))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["0", "0"]


def test_gopen_local_file_url_and_pipe(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"hello world")
    with gopen(str(path)) as f:
        assert f.read() == b"hello world"
    with gopen(path.as_uri(), "rb") as f:
        assert f.read() == b"hello world"
    with gopen(f"pipe:cat {path}") as f:
        assert f.read() == b"hello world"
    with reader(str(path)) as f:
        assert f.read(5) == b"hello"


def test_gopen_write_local_and_pipe(tmp_path):
    with gopen(str(tmp_path / "out.bin"), "wb") as f:
        f.write(b"abc")
    assert (tmp_path / "out.bin").read_bytes() == b"abc"
    with gopen(f"pipe:cat > {tmp_path / 'piped.bin'}", "wb") as f:
        f.write(b"def")
    assert (tmp_path / "piped.bin").read_bytes() == b"def"


def test_gopen_stdin():
    code = (
        "import sys; from webds.compat import gopen; sys.stdout.write(gopen('-').read().decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        input="from stdin",
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "from stdin"


def test_gopen_unregistered_scheme_goes_to_fsspec():
    with gopen("memory://gopen-test/a.bin", "wb") as f:
        f.write(b"in memory")
    with gopen("memory://gopen-test/a.bin") as f:
        assert f.read() == b"in memory"


def test_gopen_bad_mode():
    with pytest.raises(ArgumentError, match="mode"):
        gopen("x.tar", "r")


def test_registered_handler_gets_url_mode_bufsize_and_options(scheme, tmp_path):
    (tmp_path / "a.bin").write_bytes(b"payload")
    with gopen("localdir://a.bin", bufsize=123, token="t") as f:
        assert f.read() == b"payload"
    assert scheme.calls == [("localdir://a.bin", "rb", 123, {"token": "t"})]
    with urls.open_url("localdir://a.bin") as f:
        assert f.read() == b"payload"
    assert scheme.calls[-1] == ("localdir://a.bin", "rb", urls.DEFAULT_BUFSIZE, {})


def test_registered_handler_writes(scheme, tmp_path):
    with gopen("localdir://w.bin", "wb") as f:
        f.write(b"written")
    assert (tmp_path / "w.bin").read_bytes() == b"written"


def test_webdataset_reads_a_registered_scheme(scheme, shards):
    ds = WebDataset("localdir://shard-{0..3}.tar", storage_options={"token": "t"})
    samples = list(ds)
    assert [s["__key__"] for s in samples] == [f"s{s}-{i:06d}" for s in range(4) for i in range(6)]
    assert samples[0]["__url__"] == "localdir://shard-0.tar"
    assert samples[0]["txt"] == b"sample s0-000000 txt"
    assert {c[0] for c in scheme.calls} == {f"localdir://shard-{s}.tar" for s in range(4)}
    assert all(c[3] == {"token": "t"} for c in scheme.calls)


def test_registered_scheme_in_dataloader_workers(scheme, shards):
    ds = WebDataset("localdir://shard-{0..3}.tar").to_tuple("__key__", "cls")
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    keys = [k for k, _ in loader]
    assert sorted(keys) == [f"s{s}-{i:06d}" for s in range(4) for i in range(6)]
    # The opens happened in the workers, not here.
    assert scheme.calls == []


def test_registered_handler_comes_before_builtin_rules(tmp_path):
    seen = []

    def fake_pipe(url, mode, bufsize, **kw):
        seen.append(url)
        return open(tmp_path / "p.bin", mode)

    (tmp_path / "p.bin").write_bytes(b"not from a shell")
    before = dict(gopen_schemes)
    gopen_schemes["pipe"] = fake_pipe
    try:
        with gopen("pipe:exit 1") as f:
            assert f.read() == b"not from a shell"
    finally:
        gopen_schemes.clear()
        gopen_schemes.update(before)
    assert seen == ["pipe:exit 1"]


def test_default_handler_is_for_remote_schemes_only(tmp_path):
    seen = []

    def fallback(url, mode, bufsize, **kw):
        seen.append(url)
        return open(tmp_path / "d.bin", mode)

    (tmp_path / "d.bin").write_bytes(b"default")
    before = dict(gopen_schemes)
    gopen_schemes["__default__"] = fallback
    try:
        with gopen("anything://bucket/k") as f:
            assert f.read() == b"default"
        with gopen(str(tmp_path / "d.bin")) as f:  # a local path keeps the local rule
            f.read()
        with gopen(f"pipe:cat {tmp_path / 'd.bin'}") as f:
            f.read()
    finally:
        gopen_schemes.clear()
        gopen_schemes.update(before)
    assert seen == ["anything://bucket/k"]


def test_failing_handler_is_an_open_error_and_handlers_can_skip(scheme, shards):
    os.unlink(shards / "shard-1.tar")
    with pytest.raises(OpenError) as info:
        with gopen("localdir://shard-1.tar"):
            pass
    assert info.value.url == "localdir://shard-1.tar"
    assert "LocalDirOpener" in str(info.value) and "FileNotFoundError" in str(info.value)
    ds = WebDataset("localdir://shard-{0..3}.tar", handler=warn_and_continue)
    with pytest.warns(UserWarning):
        keys = [s["__key__"] for s in ds]
    assert len(keys) == 18 and not any(k.startswith("s1-") for k in keys)


def test_handler_returning_no_stream_or_not_callable(tmp_path):
    before = dict(gopen_schemes)
    try:
        gopen_schemes["nothing"] = lambda url, mode, bufsize, **kw: None
        with pytest.raises(OpenError, match="no read"):
            gopen("nothing://x")
        gopen_schemes["broken"] = "not a function"
        with pytest.raises(ArgumentError, match="not callable"):
            gopen("broken://x")
    finally:
        gopen_schemes.clear()
        gopen_schemes.update(before)


def test_url_scheme():
    assert urls.url_scheme("S3://b/k") == "s3"
    assert urls.url_scheme("pipe:cat x") == "pipe"
    assert urls.url_scheme("data/a.tar") is None
    assert urls.url_scheme("C:\\data\\a.tar") is None
    assert urls.url_scheme("-") is None
