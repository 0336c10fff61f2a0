"""open_url: local files, atomic writes, stdin, pipe: commands and fsspec URLs."""

from __future__ import annotations

import importlib.util
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
from conftest import group_alive

from webds.errors import ArgumentError, OpenError, WebdsError
from webds.io.pipes import PipeStream
from webds.io.streams import AtomicFile
from webds.io.urls import local_path, open_url


def test_local_path_rules(tmp_path):
    assert local_path("data/a.tar") == "data/a.tar"
    assert local_path(tmp_path / "a.tar") == str(tmp_path / "a.tar")
    assert local_path("file:///d/a.tar") == "/d/a.tar"
    assert local_path("s3://bucket/a.tar") is None
    assert local_path("pipe:cat a.tar") is None
    assert local_path("-") is None


def test_read_local_and_file_url(tmp_path):
    p = tmp_path / "x.bin"
    p.write_bytes(b"abc" * 1000)
    for url in (str(p), p, f"file://{p}"):
        with open_url(url) as f:
            assert f.read() == b"abc" * 1000


def test_missing_file_names_url(tmp_path):
    url = str(tmp_path / "nope-000.tar")
    with pytest.raises(OpenError) as info:
        open_url(url)
    assert info.value.url == url
    assert "no such file" in str(info.value)
    assert isinstance(info.value, IOError) and isinstance(info.value, WebdsError)


def test_directory_is_an_error(tmp_path):
    with pytest.raises(OpenError, match="is a directory"):
        open_url(str(tmp_path))


def test_bad_mode_and_url():
    with pytest.raises(ArgumentError):
        open_url("x.tar", "r")
    with pytest.raises(ArgumentError):
        open_url("")


def test_atomic_write_commits_on_close(tmp_path):
    final = tmp_path / "out.tar"
    f = open_url(str(final), "wb")
    assert isinstance(f, AtomicFile)
    f.write(b"hello")
    assert not final.exists(), "the final name must not appear before close()"
    temp = f.temp_path
    assert os.path.basename(temp).startswith(".")
    f.close()
    assert final.read_bytes() == b"hello"
    assert not os.path.exists(temp)
    assert os.listdir(tmp_path) == ["out.tar"]


def test_atomic_write_discarded_on_exception(tmp_path):
    final = tmp_path / "out.tar"
    with pytest.raises(RuntimeError):
        with open_url(str(final), "wb") as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_atomic_write_never_replaces_with_partial(tmp_path):
    final = tmp_path / "out.tar"
    final.write_bytes(b"old complete shard")
    f = open_url(str(final), "wb")
    f.write(b"new but unfinished")
    f.discard()
    assert final.read_bytes() == b"old complete shard"
    assert os.listdir(tmp_path) == ["out.tar"]


def test_atomic_write_gc_without_close_does_not_commit(tmp_path):
    final = tmp_path / "out.tar"
    f = open_url(str(final), "wb")
    f.write(b"data")
    del f
    assert os.listdir(tmp_path) == []


def test_write_into_missing_directory(tmp_path):
    with pytest.raises(OpenError, match="no such directory"):
        open_url(str(tmp_path / "missing" / "a.tar"), "wb")


def test_stdin_and_stdout(tmp_path):
    code = (
        "import sys; from webds.io.urls import open_url\n"
        "f = open_url('-'); data = f.read(); f.close()\n"
        "assert not sys.stdin.closed\n"
        "g = open_url('-', 'wb'); g.write(data[::-1]); g.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=b"abcdef", capture_output=True, check=True
    )
    assert out.stdout == b"fedcba"


def test_pipe_read():
    with open_url("pipe:printf 'a%.0s' $(seq 100000)") as f:
        assert f.read() == b"a" * 100000


def test_pipe_failure_names_command_and_stderr():
    f = open_url("pipe:echo partial; echo 'access denied for bucket' >&2; exit 7")
    assert f.read(8) == b"partial\n"
    with pytest.raises(OpenError) as info:
        f.read(10)
    msg = str(info.value)
    assert "status 7" in msg and "access denied for bucket" in msg
    assert info.value.url.startswith("pipe:echo partial")
    f.close()


def test_pipe_failure_detected_at_close():
    # The reader stops before EOF (as a tar reader does after the end-of-archive marker),
    # but the command already failed: close() must still report it.
    f = open_url("pipe:echo data; exit 4")
    assert f.read(4) == b"data"
    deadline = time.monotonic() + 60  # it exits at once; a loaded machine may take a while
    while f.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OpenError, match="status 4"):
        f.close()
    assert f.closed


def test_pipe_early_close_kills_whole_group():
    f = open_url("pipe:yes | cat | cat")
    assert isinstance(f, PipeStream)
    assert f.read(10) == b"y\ny\ny\ny\ny\n"
    pgid = f.proc.pid
    assert group_alive(pgid)
    f.close()  # stopping early is not an error
    deadline = time.time() + 10
    while group_alive(pgid) and time.time() < deadline:
        time.sleep(0.05)
    assert not group_alive(pgid), "processes of the pipe outlived the stream"


def test_pipe_write(tmp_path):
    out = tmp_path / "o.bin"
    with open_url(f"pipe:cat > {out}", "wb") as f:
        f.write(b"x" * 100000)
    assert out.read_bytes() == b"x" * 100000


def test_pipe_write_failure():
    f = open_url("pipe:cat > /nonexistent-dir/x", "wb")
    with pytest.raises(OpenError, match="exited with status"):
        f.write(b"x" * (1 << 20))
        f.close()


def test_pipe_empty_command():
    with pytest.raises(ArgumentError):
        open_url("pipe:   ")


def test_pipe_stream_does_not_leak_on_gc():
    f = open_url("pipe:sleep 30")
    pgid = f.proc.pid
    del f
    deadline = time.time() + 10
    while group_alive(pgid) and time.time() < deadline:
        time.sleep(0.05)
    assert not group_alive(pgid)


def test_fsspec_memory_roundtrip():
    with open_url("memory://webds-test/a.bin", "wb") as f:
        f.write(b"remote bytes")
    with open_url("memory://webds-test/a.bin") as f:
        assert f.read() == b"remote bytes"


def test_fsspec_not_found():
    with pytest.raises(OpenError, match="not found"):
        open_url("memory://webds-test/does-not-exist.tar")


def test_unknown_scheme():
    with pytest.raises(OpenError, match="unknown URL scheme"):
        open_url("nosuchproto://x/y.tar")


def test_missing_backend_says_what_to_install():
    from fsspec.registry import known_implementations

    for scheme, spec in known_implementations.items():  # noqa: B007 (used after the loop)
        module = spec["class"].split(".")[0]
        if "err" in spec and importlib.util.find_spec(module) is None:
            break
    else:
        pytest.skip("every fsspec backend is installed")
    with pytest.raises(OpenError, match="no fsspec backend installed") as info:
        open_url(f"{scheme}://bucket/a.tar")
    assert info.value.url == f"{scheme}://bucket/a.tar"


def test_sigpipe_status_from_reader_side_is_not_an_error():
    # A command killed by SIGPIPE after we stopped reading must not be reported as a failure.
    f = open_url("pipe:yes")
    assert f.read(3) == b"y\ny"
    os.killpg(f.proc.pid, signal.SIGPIPE)
    assert f.proc.wait() == -signal.SIGPIPE  # the status close() is about to judge
    f.close()  # raises if it takes the status for a failure
    assert f.closed


def test_writing_to_a_device_or_fifo_writes_through(tmp_path):
    # Renaming a temporary file over /dev/null would turn the device into a plain file.
    before = os.stat(os.devnull)
    with open_url(os.devnull, "wb") as f:
        f.write(b"x" * 1000)
    after = os.stat(os.devnull)
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino
    assert not [p for p in os.listdir(os.path.dirname(os.devnull)) if ".tmp-" in p]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    with open_url(str(fifo), "wb") as f:
        f.write(b"through the fifo")
    assert reader.communicate(timeout=30)[0] == b"through the fifo"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
