"""webdataset's gopen helpers (Pipe, set_options, gopen_curl, gopen_gsutil, ...): real commands,
a real HTTP server on loopback, and command-line tools stood in by executables on PATH."""

from __future__ import annotations

import io
import os
import shutil
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import sample_members, write_tar
from servers import http_server  # noqa: F401  (fixture)

import webds as wds
from webds.compat import gopen_schemes
from webds.errors import ArgumentError, OpenError, SecureModeError, ShardReadError
from webds.io import security

G = wds.gopen


@pytest.fixture
def shard(tmp_path):
    return write_tar(tmp_path / "a.tar", sample_members(5))


@pytest.fixture
def schemes():
    before = dict(gopen_schemes)
    yield gopen_schemes
    gopen_schemes.clear()
    gopen_schemes.update(before)


def fake_tool(folder: Path, name: str, body: str, monkeypatch) -> Path:
    """An executable ``name`` first on PATH: a shell script that logs its argv, then runs
    ``body``."""
    folder.mkdir(exist_ok=True)
    tool = folder / name
    log = folder / f"{name}.argv"
    tool.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\n{body}\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return log


def keys(url_or_urls):
    return [s["__key__"] for s in wds.WebDataset(url_or_urls, shardshuffle=False)]


# Pipe and set_options


def test_pipe_reads_a_command_as_webdatasets_does(shard):
    for pipe in (
        G.Pipe(["cat", str(shard)], mode="rb"),
        G.Pipe(f"cat '{shard}'", mode="rb", shell=True, bufsize=8192),
    ):
        with pipe as stream:
            assert stream.read() == shard.read_bytes()
        assert pipe.status == 0 and isinstance(pipe, G.Pipe)
    assert G.PIPE == -1  # subprocess.PIPE, as webdataset re-exported it


def test_pipe_as_a_registered_opener_reads_shards(shard, schemes):
    schemes["viacat"] = lambda url, mode, bufsize, **kw: G.Pipe(
        ["cat", url[len("viacat://") :]], mode=mode, bufsize=bufsize
    )
    assert keys(f"viacat://{shard}") == keys(str(shard)) == [f"{i:06d}" for i in range(5)]


def test_pipe_exit_status_is_checked_unless_ignored(monkeypatch):
    with pytest.raises(OSError, match="status 3") as err:
        with G.Pipe("echo oops >&2; exit 3", mode="rb", shell=True) as p:
            p.read()
    assert isinstance(err.value, OpenError) and "oops" in str(err.value)
    monkeypatch.setitem(G.info, "rank", 7)
    p = G.Pipe(["sh", "-c", "exit 3"], mode="rb")
    with pytest.raises(OpenError, match="'rank': 7"):
        p.read()
    for kw in ({"ignore_status": [3]}, {"ignore_errors": True}):
        p = G.Pipe("exit 3", mode="rb", shell=True, **kw)
        assert p.read() == b"" and p.status == 3
        p.close()


def test_pipe_writes(tmp_path):
    out = tmp_path / "out.bin"
    with G.Pipe(f"cat > '{out}'", mode="wb", shell=True) as p:
        p.write(b"x" * 100_000)
    assert out.read_bytes() == b"x" * 100_000
    with pytest.raises(OpenError, match="status 4"):
        with G.Pipe("cat > /dev/null; exit 4", mode="wb", shell=True) as p:
            p.write(b"abc")


def test_pipe_refuses_what_it_cannot_honour():
    with pytest.raises(ArgumentError, match="mode"):
        G.Pipe(["cat"], mode="a")
    with pytest.raises(ArgumentError, match="cwd"):
        G.Pipe(["cat"], mode="rb", cwd="/")


def test_set_options_on_pipes_only():
    p = G.Pipe("exit 5", mode="rb", shell=True)
    assert G.set_options(p, timeout=2.5, ignore_status=[5], handler=print)
    assert p.timeout == 2.5 and p.ignore_status == [5] and p.handler is print
    assert not p.ignore_errors and G.set_options(p, ignore_errors=True) and p.ignore_errors
    assert p.read() == b""
    p.close()
    q = wds.gopen("pipe:exit 6")
    assert G.set_options(q, ignore_errors=True)
    assert q.read() == b""
    q.close()
    assert G.set_options(io.BytesIO(b""), timeout=1) is False


# The per-scheme openers


def test_gopen_file_and_gopen_pipe(shard, tmp_path):
    for url in (str(shard), f"file://{shard}"):
        with G.gopen_file(url) as f:
            assert f.read() == shard.read_bytes()
    with G.gopen_file(str(tmp_path / "w.bin"), "wb") as f:
        f.write(b"written")
    assert (tmp_path / "w.bin").read_bytes() == b"written"
    with G.gopen_pipe(f"pipe:cat '{shard}'") as f:
        assert f.read() == shard.read_bytes()
    with pytest.raises(ArgumentError):
        G.gopen_file("s3://bucket/a.tar")
    with pytest.raises(ArgumentError):
        G.gopen_pipe(str(shard))


def test_gopen_curl_reads_from_a_real_server(http_server, shard, schemes):  # noqa: F811
    url = http_server.put("a.tar", shard.read_bytes())
    with G.gopen_curl(url) as stream:
        assert stream.read() == shard.read_bytes()
    schemes["http"] = G.gopen_curl
    assert keys(url) == keys(str(shard))
    with pytest.raises(OpenError, match="status 22") as err:
        with G.gopen_curl(http_server.url("missing.tar")) as stream:
            stream.read()
    assert "curl" in str(err.value)


class _PutHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_PUT(self):  # noqa: N802
        if self.headers.get("Transfer-Encoding") == "chunked":  # curl -T - (size unknown)
            body = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received[self.path] = body
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_gopen_curl_writes_with_put(shard):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PutHandler)
    server.received = {}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/up/a.tar"
        with G.gopen_curl(url, "wb") as out:
            out.write(shard.read_bytes())
        assert server.received["/up/a.tar"] == shard.read_bytes()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "opener, url, read_argv, write_argv",
    [
        ("gopen_gsutil", "gs://b/a.tar", ["cat", "gs://b/a.tar"], ["cp", "-", "gs://b/a.tar"]),
        (
            "gopen_ais",
            "ais://b/a.tar",
            ["get", "ais://b/a.tar", "-"],
            ["put", "-", "ais://b/a.tar"],
        ),
    ],
)
def test_command_openers_run_webdatasets_commands(
    opener, url, read_argv, write_argv, shard, tmp_path, monkeypatch
):
    tool = "gsutil" if opener == "gopen_gsutil" else "ais"
    sink = tmp_path / "sink.bin"
    body = f'if [ "$2" = "-" ] || [ "$1" = "cp" ]; then cat > {sink}; else cat {shard}; fi'
    log = fake_tool(tmp_path / "bin", tool, body, monkeypatch)
    with getattr(G, opener)(url) as stream:
        assert stream.read() == shard.read_bytes()
    assert log.read_text().split() == read_argv
    with getattr(G, opener)(url, "wb") as stream:
        stream.write(b"payload")
    assert log.read_text().split() == write_argv and sink.read_bytes() == b"payload"


def test_command_opener_failure_names_the_command(tmp_path, monkeypatch):
    fake_tool(tmp_path / "bin", "gsutil", "echo 'AccessDenied: 403' >&2; exit 1", monkeypatch)
    with pytest.raises(OpenError, match="AccessDenied") as err:
        with G.gopen_gsutil("gs://b/a.tar") as stream:
            stream.read()
    assert "gsutil cat gs://b/a.tar" in str(err.value) and isinstance(err.value, ShardReadError)


def test_a_stalled_command_is_ended(tmp_path, monkeypatch):
    fake_tool(tmp_path / "bin", "ais", "sleep 30", monkeypatch)
    monkeypatch.setattr("webds.io.pipes.PIPE_IDLE_SECONDS", 0.5)
    stream = G.Pipe(["ais", "get", "x", "-"], mode="rb")
    stream.idle_seconds = 0.5
    with pytest.raises(ShardReadError, match="wrote nothing"):
        stream.read()


def test_gopen_htgs_reads_the_public_object_over_https(tmp_path, monkeypatch):
    log = fake_tool(tmp_path / "bin", "curl", "printf data", monkeypatch)
    with G.gopen_htgs("htgs://bucket/dir/a.tar") as stream:
        assert stream.read() == b"data"
    assert log.read_text().split()[-1] == "https://storage.googleapis.com/bucket/dir/a.tar"
    with pytest.raises(ArgumentError, match="not supported"):
        G.gopen_htgs("htgs://bucket/a.tar", "wb")


def test_gopen_hf_without_huggingface_hub_says_what_to_install():
    try:
        import huggingface_hub  # noqa: F401

        pytest.skip("huggingface_hub is installed")
    except ImportError:
        pass
    with pytest.raises(OpenError, match="pip install huggingface_hub"):
        G.gopen_hf("hf://datasets/x/y/a.tar")


def test_gopen_error_is_an_open_error_and_a_value_error(schemes, tmp_path):
    with pytest.raises(ValueError) as err:
        G.gopen_error("nope://x/a.tar")
    assert isinstance(err.value, OpenError) and "gopen_schemes" in str(err.value)
    schemes["nope"] = G.gopen_error
    with pytest.raises(OpenError, match="nope://x/a.tar"):
        keys("nope://x/a.tar")


def test_secure_mode_refuses_every_command_opener(monkeypatch, shard):
    monkeypatch.setattr(security, "enforce_security", True)
    for call in (
        lambda: G.gopen_pipe(f"pipe:cat {shard}"),
        lambda: G.gopen_curl("http://127.0.0.1:1/a.tar"),
        lambda: G.gopen_gsutil("gs://b/a.tar"),
        lambda: G.gopen_ais("ais://b/a.tar"),
        lambda: G.gopen_htgs("htgs://b/a.tar"),
    ):
        with pytest.raises(SecureModeError):
            call()


def test_add_length_method_as_webdatasets():
    import webdataset

    class Sized:
        size = 4

        def __iter__(self):
            return iter(range(self.size))

    for add in (wds.pipeline.add_length_method, webdataset.pipeline.add_length_method):
        obj = add(Sized())
        assert len(obj) == 4 and list(obj) == [0, 1, 2, 3]
        assert type(obj).__name__ == "Sized_Length"
        assert isinstance(obj, __import__("torch").utils.data.IterableDataset)
    pipeline = wds.DataPipeline([1, 2, 3])
    pipeline.size = 3
    assert len(wds.pipeline.add_length_method(pipeline)) == 3

    class Plain(__import__("torch").utils.data.IterableDataset):
        size = 9

        def __iter__(self):
            return iter(())

    assert len(wds.pipeline.add_length_method(Plain())) == 9


def test_use_ais_for_reads_those_schemes_with_ais(tmp_path, shard, monkeypatch):
    # USE_AIS_FOR is read at import, as webdataset reads it: a fresh interpreter.
    import subprocess
    import sys

    log = fake_tool(tmp_path / "bin", "ais", f"cat {shard}", monkeypatch)
    code = (
        "import webds as wds; "
        "print(sorted(s['__key__'] for s in wds.WebDataset('s3://bucket/a.tar'))); "
        "print(sorted(k for k in wds.gopen_schemes))"
    )
    env = {**os.environ, "USE_AIS_FOR": "s3:gs", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == str([f"{i:06d}" for i in range(5)])
    assert out[1] == "['gs', 's3']"
    assert log.read_text().split() == ["get", "s3://bucket/a.tar", "-"]
