"""``webds proc``: real shell commands (tr, gzip, sh) on real shards, in-process through
``webds.cli.main`` and as subprocesses in pipes; outputs checked with GNU tar and tarfile."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from clitools import WEBDS, cli_env, run_shell, run_webds, tar_contents, tar_members, tar_names
from conftest import sample_members, write_tar

from webds.cli import main

FAIL_ON_2 = 'if [ "$KEY" = a_000002 ]; then echo "no good: $KEY" >&2; exit 3; fi'
TR = "tr a-z A-Z < sample.txt > sample.txt.new && mv sample.txt.new sample.txt"


@pytest.fixture
def gnu_shard(tmp_path: Path) -> Path:
    """A shard made by GNU tar from files on disk: 4 samples with txt and cls."""
    src = tmp_path / "src"
    src.mkdir()
    names = []
    for i in range(4):
        (src / f"k{i}.txt").write_text(f"hello sample {i}\n")
        (src / f"k{i}.cls").write_text(str(i))
        names += [f"k{i}.cls", f"k{i}.txt"]
    subprocess.run(["tar", "cf", str(tmp_path / "gnu.tar"), *names], cwd=src, check=True)
    return tmp_path / "gnu.tar"


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    """A shard by Python's tarfile: 6 samples a_000000..a_000005 with txt and cls."""
    return write_tar(tmp_path / "a.tar", sample_members(6, prefix="a_"))


def test_tr_as_subprocess_compared_with_gnu_tar(tmp_path: Path, gnu_shard: Path) -> None:
    out = run_webds("proc", "gnu.tar", "-o", "up.tar", "-c", TR, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "proc: 4 samples in, 4 out -> up.tar" in out.stderr
    assert tar_names(tmp_path / "up.tar") == [
        f"k{i}.{ext}" for i in range(4) for ext in ("cls", "txt")
    ]
    dest = tmp_path / "x"
    tar_contents(tmp_path / "up.tar", dest)
    for i in range(4):
        assert (dest / f"k{i}.txt").read_text() == f"HELLO SAMPLE {i}\n"
        assert (dest / f"k{i}.cls").read_text() == str(i)  # untouched fields pass through


def test_gzip_makes_a_new_field(tmp_path: Path, shard: Path) -> None:
    assert main(["proc", str(shard), "-o", str(tmp_path / "gz.tar"), "-c", "gzip sample.txt"]) == 0
    names = tar_names(tmp_path / "gz.tar")
    assert names[:2] == ["a_000000.cls", "a_000000.txt.gz"]
    assert len(names) == 12 and not any(n.endswith(".txt") for n in names)
    got = dict(tar_members(tmp_path / "gz.tar"))
    assert gzip.decompress(got["a_000003.txt.gz"]) == b"sample a_000003 txt"


def test_files_removed_added_and_key_in_env(tmp_path: Path, shard: Path) -> None:
    command = 'rm sample.cls; printf %s "$KEY" > sample.key; mkdir sample.dir; echo x > other'
    assert main(["proc", str(shard), "-o", str(tmp_path / "o.tar"), "-c", command, "-q"]) == 0
    got = dict(tar_members(tmp_path / "o.tar"))
    assert sorted(got)[:2] == ["a_000000.key", "a_000000.txt"]
    assert len(got) == 12  # no cls, no folder, no file outside sample.*
    assert got["a_000004.key"] == b"a_000004"


def test_failure_stops_and_leaves_no_output(
    tmp_path: Path, shard: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "o.tar"
    status = main(["proc", str(shard), "-o", str(out), "-c", FAIL_ON_2 + "; " + TR])
    err = capsys.readouterr().err
    assert status == 1
    assert f"webds proc: sample 'a_000002' in shard '{shard}': command failed: exit status 3" in err
    assert "  | no good: a_000002" in err
    assert f"nothing was written to {out}" in err
    assert not out.exists()
    assert os.listdir(tmp_path) == ["a.tar"]  # no temporary file either


def test_keep_going_skips_counts_and_fails(
    tmp_path: Path, shard: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "o.tar"
    status = main(["proc", str(shard), "-o", str(out), "-c", FAIL_ON_2, "--keep-going", "-p", "3"])
    err = capsys.readouterr().err
    assert status == 1
    assert "sample 'a_000002'" in err and "exit status 3" in err
    assert "6 samples in, 5 out, 1 failed and left out" in err
    assert [n for n in tar_names(tmp_path / "o.tar") if n.endswith(".cls")] == [
        f"a_00000{i}.cls" for i in (0, 1, 3, 4, 5)
    ]


def test_no_output_file_and_timeout_are_failures(
    tmp_path: Path, shard: Path, capsys: pytest.CaptureFixture
) -> None:
    command = 'case "$KEY" in a_000001) rm sample.*;; a_000004) sleep 30;; esac'
    out = tmp_path / "o.tar"
    status = main(
        ["proc", str(shard), "-o", str(out), "-c", command, "--keep-going", "--timeout", "0.5"]
    )
    err = capsys.readouterr().err
    assert status == 1
    assert "sample 'a_000001'" in err and "left no sample.* file" in err
    assert "sample 'a_000004'" in err and "timed out after 0.5 s" in err
    assert "6 samples in, 4 out, 2 failed" in err
    assert len(dict(tar_members(out))) == 8


def test_parallel_runs_p_at_once_and_keeps_order(tmp_path: Path) -> None:
    src = write_tar(tmp_path / "in.tar", sample_members(10, prefix="p_"))
    started = tmp_path / "started"
    started.mkdir()
    # Each command waits until 4 commands have started: sequential runs would time out. Earlier
    # keys sleep longer, so they finish last.
    command = (
        f"touch {started}/$KEY; n=0; while [ $(ls {started} | wc -l) -lt 4 ]; do "
        "n=$((n+1)); [ $n -gt 200 ] && exit 9; sleep 0.05; done; "
        'sleep 0.$((4 - 1${KEY#p_} % 4)); echo "$KEY" > sample.seen'
    )
    status = main(["proc", str(src), "-o", str(tmp_path / "o.tar"), "-c", command, "-p", "4"])
    assert status == 0
    names = tar_names(tmp_path / "o.tar")
    assert names == [f"p_{i:06d}.{ext}" for i in range(10) for ext in ("cls", "seen", "txt")]


def test_first_failure_ends_the_commands_still_running(tmp_path: Path, shard: Path) -> None:
    done = tmp_path / "done"
    done.mkdir()
    command = f'[ "$KEY" = a_000000 ] && exit 5; sleep 20; touch {done}/$KEY'
    assert main(["proc", str(shard), "-o", str(tmp_path / "o.tar"), "-c", command, "-p", "4"]) == 1
    assert os.listdir(done) == []  # the sleeping commands were killed, not waited for
    assert not (tmp_path / "o.tar").exists()


def test_pipe_stdin_to_stdout(tmp_path: Path, gnu_shard: Path) -> None:
    line = f"{WEBDS} proc - -o - -c 'gzip sample.txt' < gnu.tar | tar tf -"
    out = run_shell(line, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"k{i}.{ext}" for i in range(4) for ext in ("cls", "txt.gz")]


def test_pipe_failure_makes_the_stream_unreadable(tmp_path: Path, shard: Path) -> None:
    line = f"{WEBDS} proc - -o - -c '{FAIL_ON_2}' < a.tar | tar tf -; echo \"${{PIPESTATUS[*]}}\""
    out = run_shell(line, cwd=tmp_path)
    lines = out.stdout.splitlines()
    # GNU tar lists what came before the failure, then reports the truncated member.
    assert lines[:4] == ["a_000000.cls", "a_000000.txt", "a_000001.cls", "a_000001.txt"]
    assert lines[-1] == "1 2"  # proc exit 1, tar exit 2
    err = out.stderr
    assert "sample 'a_000002' in shard '-'" in err and "Unexpected EOF" in err


def test_shard_to_shard_skips_complete_and_redoes_failed(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    # capfd: the worker processes report failed samples on file descriptor 2.
    capsys = capfd
    data = tmp_path / "in"
    data.mkdir()
    for i in range(3):
        write_tar(data / f"s-{i}.tar", sample_members(3, prefix="a_" if i == 1 else f"b{i}_"))
    out = tmp_path / "out"
    # Shard s-1 holds the failing key a_000002 (3 samples: a_000000..a_000002).
    first = main(["proc", f"{data}/", "-o", f"{out}/", "-c", FAIL_ON_2 + "; " + TR, "-w", "2"])
    err = capsys.readouterr().err
    assert first == 1
    assert f"webds proc: shard '{data}/s-1.tar' failed" in err and "no good: a_000002" in err
    assert "2 shards written, 1 failed; 6 samples in, 6 out" in err
    assert sorted(os.listdir(out)) == ["s-0.tar", "s-2.tar"]
    before = {n: (out / n).stat() for n in os.listdir(out)}

    # The rerun does only the missing shard; --keep-going leaves the failing sample out.
    second = main(["proc", f"{data}/", "-o", f"{out}/", "-c", FAIL_ON_2, "--keep-going"])
    err = capsys.readouterr().err
    assert second == 1
    assert "sample 'a_000002'" in err
    assert (
        "1 shards written, 2 skipped (output already complete); 3 samples in, 2 out, "
        "1 failed and left out"
    ) in err
    for name, stat in before.items():
        after = (out / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert tar_names(tmp_path / "out/s-1.tar") == [
        "a_000000.cls",
        "a_000000.txt",
        "a_000001.cls",
        "a_000001.txt",
    ]
    assert dict(tar_members(out / "s-0.tar"))["b0_000001.txt"] == b"SAMPLE B0_000001 TXT"

    # Everything is there now: nothing to do.
    assert main(["proc", f"{data}/", "-o", f"{out}/{{name}}", "-c", "exit 1", "-q"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_dask_local_matches_local_processes(tmp_path: Path) -> None:
    pytest.importorskip("distributed", reason="dask distributed is not installed")
    data = tmp_path / "in"
    data.mkdir()
    for i in range(3):
        write_tar(data / f"s-{i}.tar", sample_members(4, prefix=f"b{i}_"))
    local = run_webds("proc", "in/", "-o", "local/{stem}.tar", "-c", TR, "-q", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    dask = run_webds(
        "proc",
        "in/",
        "-o",
        "dask/{index}.tar",
        "-c",
        TR,
        "--dask",
        "local",
        "-w",
        "2",
        cwd=tmp_path,
    )
    assert dask.returncode == 0, dask.stderr
    assert "proc: 3 shards written; 12 samples in, 12 out -> dask/{index}.tar" in dask.stderr
    assert "Scheduler" not in dask.stderr and "Nanny" not in dask.stderr  # Dask's INFO logs
    for i in range(3):
        assert (tmp_path / f"dask/{i}.tar").read_bytes() == (
            tmp_path / f"local/s-{i}.tar"
        ).read_bytes()


def test_dask_scheduler_unreachable(tmp_path: Path, shard: Path) -> None:
    pytest.importorskip("distributed", reason="dask distributed is not installed")
    e = cli_env()
    e["DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT"] = "1s"
    port = _closed_port()
    out = run_webds(
        "proc",
        "a.tar",
        "-o",
        "o/",
        "-c",
        "true",
        "--dask",
        f"tcp://127.0.0.1:{port}",
        cwd=tmp_path,
        env=e,
    )
    assert out.returncode == 1
    assert out.stderr.startswith(
        f"webds proc: error: cannot connect to the Dask scheduler 'tcp://127.0.0.1:{port}'"
    )
    assert not (tmp_path / "o").exists()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_dask_missing_says_what_to_install(
    tmp_path: Path, shard: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if not installed
    status = main(["proc", str(shard), "-o", f"{tmp_path}/o/", "-c", "true", "--dask", "local"])
    assert status == 2
    assert "pip install 'webds[dask]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, status, message",
    [
        (["a.tar", "-o", "o.tar", "-c", "true", "--dask", "local"], 2, "--dask needs one output"),
        (["a.tar", "-o", "o.tar", "-c", "true", "-w", "2"], 2, "--workers needs one output"),
        (["-", "-o", "o/", "-c", "true"], 2, "'-' (stdin) needs a single output"),
        (["missing.tar", "-o", "o.tar", "-c", "true"], 1, "no such file"),
        (["a.tar", "-o", "o/{shard}.tar", "-c", "true"], 2, "can be {name}, {stem} and {index}"),
    ],
)
def test_bad_arguments_and_inputs(
    tmp_path: Path, shard: Path, capsys, monkeypatch, argv: List[str], status: int, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["proc", *argv]) == status
    err = capsys.readouterr().err
    assert err.startswith("webds proc: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["a.tar"]


def test_truncated_input_fails_without_output(tmp_path: Path, shard: Path) -> None:
    shard.write_bytes(shard.read_bytes()[:3000])
    out = run_webds("proc", "a.tar", "-o", "o.tar", "-c", TR, cwd=tmp_path)
    assert out.returncode == 1
    assert "webds proc: error: shard is truncated" in out.stderr
    assert not (tmp_path / "o.tar").exists()


def test_help_has_an_example_and_bad_options_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["proc", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "example:" in text and "--keep-going" in text and "sample.<ext>" in text
    for bad in (["-p", "0"], ["--timeout", "-1"]):
        with pytest.raises(SystemExit) as info:
            main(["proc", "a.tar", "-o", "o.tar", "-c", "true", *bad])
        assert info.value.code == 2
