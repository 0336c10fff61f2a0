"""pipe: commands read as shards: the exit status is never missed, and nothing hangs.

Real shell commands, real tar files. The tar reader stops at the end-of-archive marker, often
before the command has exited: closing the stream must still wait (bounded) for its status.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
from conftest import group_alive

from webds import DataPipeline, SimpleShardList, TarWriter, tarfile_to_samples
from webds import errors as webds_errors
from webds.errors import OpenError, ShardReadError
from webds.io.pipes import PipeStream
from webds.io.streams import abandon_stream
from webds.io.urls import open_url


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "t.tar"
    with TarWriter(str(path)) as w:
        for i in range(10):
            w.write({"__key__": f"{i:04d}", "txt": "x" * 700})
    return path


def _samples(url_or_stream):
    if isinstance(url_or_stream, str):
        return iter(DataPipeline(SimpleShardList([url_or_stream]), tarfile_to_samples()))
    # An opened stream, as a shard descriptor carries it, for bounds other than the defaults.
    return tarfile_to_samples()(iter([{"url": "pipe:test", "stream": url_or_stream}]))


def _keys(url_or_stream) -> list:
    return [s["__key__"] for s in _samples(url_or_stream)]


def _running(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` still runs. A zombie does not: it has ended, and
    only waits for its parent to collect its status (an orphan's is init's, which may take a
    second or two in a container); where there is no /proc, any process counts."""
    if not os.path.isdir("/proc/self"):
        return group_alive(pgid)
    if not group_alive(pgid):
        return False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # it has just gone
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _gone(pgid: int) -> bool:
    deadline = time.monotonic() + 10
    while _running(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _running(pgid)


@pytest.mark.parametrize(
    "tail",
    [
        "exit 3",  # exits at once: the reader may still be at the marker, or not
        "sleep 0.05; exit 3",  # exits just after the reader reached the marker
        "exec >&-; sleep 0.3; exit 3",  # ends its output first, fails later
    ],
)
def test_failing_command_after_a_whole_archive_raises_every_time(shard, tail):
    command = f"cat {shard}; {tail}"
    for _ in range(10):
        with pytest.raises(ShardReadError) as info:
            _keys(f"pipe:{command}")
        assert isinstance(info.value, OpenError)  # as documented before: both catch it
        assert "status 3" in str(info.value) and command in str(info.value)


def test_failing_command_names_its_stderr(shard):
    with pytest.raises(OpenError, match="quota exceeded"):
        _keys(f"pipe:cat {shard}; echo 'quota exceeded' >&2; exec >&-; sleep 0.2; exit 1")


def test_succeeding_command_reads_all_samples(shard):
    # A guard (it passes before the change too): waiting for the status costs no sample.
    for _ in range(5):
        assert _keys(f"pipe:cat {shard}") == [f"{i:04d}" for i in range(10)]
    assert _keys(f"pipe:cat {shard}; sleep 0.2; exit 0") == [f"{i:04d}" for i in range(10)]


def test_close_waits_for_a_command_still_writing_and_checks_its_status():
    # The reader stops early but closes (it saw what it considers the whole shard): the rest of
    # the output (3 MB, more than a pipe holds) is read and dropped, and the failure reported.
    f = open_url("pipe:printf data; head -c 3000000 /dev/zero; exit 5")
    assert f.read(4) == b"data"
    with pytest.raises(OpenError, match="status 5"):
        f.close()
    assert f.closed


def test_close_ends_a_command_that_does_not_finish_within_the_bound():
    # Silent and not exiting after the reader stopped: ended within the bound; its status is
    # unknown, which is an error (the command's verdict on the data is missing).
    f = PipeStream("printf abc; sleep 60", drain_seconds=0.5)
    assert f.read(3) == b"abc"
    pgid = f.proc.pid
    start = time.monotonic()
    with pytest.raises(ShardReadError, match="still running 0.5 s after it last wrote"):
        f.close()
    assert time.monotonic() - start < 5
    assert f.closed and _gone(pgid)


def test_close_bounds_what_it_reads_of_endless_output(caplog):
    f = PipeStream("yes", drain_bytes=1 << 20)
    f.read(10)
    with caplog.at_level(logging.WARNING, logger="webds"):
        f.close()
    assert "still writing" in caplog.text
    assert _gone(f.proc.pid)


def test_end_of_output_waits_for_the_status_within_the_bound():
    # The output ends but the command lingers: read() at the end must not wait for it for good.
    f = PipeStream("printf abc; exec >&-; sleep 20", drain_seconds=0.5)
    start = time.monotonic()
    assert f.read(3) == b"abc"
    with pytest.raises(ShardReadError, match="still running 0.5 s after its output ended"):
        f.read()
    assert time.monotonic() - start < 10
    f.close()
    assert _gone(f.proc.pid)


def test_command_that_keeps_its_output_open_after_the_archive_is_ended(shard):
    # A shard, then silence with the output still open: the reader gets every sample, then an
    # error within the bounds (not a hang), and the command is gone. Whether the reader looks
    # past the end-of-archive marker (idle bound) or closes at it (drain bound), it is an error.
    stream = PipeStream(f"cat {shard}; sleep 60", idle_seconds=1, drain_seconds=1)
    keys = []
    start = time.monotonic()
    with pytest.raises(ShardReadError, match="sleep 60"):
        for sample in _samples(stream):
            keys.append(sample["__key__"])
    assert time.monotonic() - start < 30
    # The reader may hold the last sample back when its shard ends in an error.
    assert len(keys) >= 9 and keys == [f"{i:04d}" for i in range(len(keys))]
    assert _gone(stream.proc.pid)


def test_stalled_command_mid_shard_is_ended(shard):
    stream = PipeStream(f"head -c 3000 {shard}; sleep 60", idle_seconds=1)
    with pytest.raises(ShardReadError, match="wrote nothing"):
        _keys(stream)
    assert _gone(stream.proc.pid)


def test_abandon_is_an_early_stop_on_purpose(shard):
    # A planned stop (part of a shard, the consumer broke off): no wait, no status check.
    f = open_url(f"pipe:cat {shard}; sleep 30; exit 3")
    assert len(f.read(1024)) == 1024
    pgid = f.proc.pid
    start = time.monotonic()
    abandon_stream(f)
    assert time.monotonic() - start < 5
    assert f.closed and _gone(pgid)
    f.close()  # closing again does nothing


def test_abandon_stream_closes_other_streams(shard):
    f = open(shard, "rb")
    abandon_stream(f)
    assert f.closed


def test_leaving_a_with_block_on_an_error_keeps_that_error():
    with pytest.raises(KeyError):
        with open_url("pipe:echo x; exit 3") as f:
            f.read(1)
            deadline = time.monotonic() + 30
            while f.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            raise KeyError("the caller's own error")
    assert f.closed


def test_readers_that_stop_early_end_the_command_at_once(shard, caplog):
    """A consumer that breaks off, or a planned part of a shard, ends the command without
    draining its output or waiting for it (nor a warning that it was still writing)."""
    url = f"pipe:cat {shard}; yes | head -c 100000000"  # 100 MB more after the shard
    for read in (
        lambda: next(_samples(url)),
        lambda: list(
            tarfile_to_samples()(iter([{"url": url, "start": 0, "stop": 3, "samples": 10}]))
        ),
    ):
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="webds"):
            read()
        assert time.monotonic() - start < 1.0
        assert "still writing" not in caplog.text


def test_read_timeout_bounds_a_silent_command(shard):
    """storage_options' read_timeout, which bounds remote reads, bounds a command's silences."""
    start = time.monotonic()
    with pytest.raises(ShardReadError, match="wrote nothing for 0.5 s"):
        f = open_url("pipe:sleep 30", "rb", read_timeout=0.5)
        try:
            f.read(10)
        finally:
            abandon_stream(f)
    assert time.monotonic() - start < 5
    with pytest.raises(webds_errors.ArgumentError):
        open_url("pipe:true", "rb", read_timeout=-1)
