"""``webds split``, ``cat`` and ``sort`` on tars written by GNU tar, Python's tarfile and webds,
checked with GNU ``tar`` listings and contents, in-process and as real subprocesses in a pipe."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from clitools import cli_env, run_webds, tar_contents, tar_members, tar_names, webds_command
from conftest import sample_members, write_tar

from webds.cli import main
from webds.cli.sort import MERGE_FANIN
from webds.tar.samples import tarfile_samples
from webds.writer import TarWriter


def lines(stderr: str) -> List[str]:
    """stderr lines as a terminal would show them (progress bars redraw with carriage returns)."""
    return [line.rsplit("\r", 1)[-1] for line in stderr.split("\n") if line.rsplit("\r", 1)[-1]]


def keys_of(names: List[str]) -> List[str]:
    """Sample keys in order (consecutive members of one sample counted once)."""
    keys: List[str] = []
    for name in names:
        key = name[: name.find(".", name.rfind("/") + 1)]
        if not keys or keys[-1] != key:
            keys.append(key)
    return keys


@pytest.fixture
def inputs(tmp_path: Path) -> Dict[str, Path]:
    """Three shards from three writers (GNU tar, Python tarfile gzipped, webds), fields of each
    sample in sorted order (as the webds writer writes them), plus a long GNU name."""
    src = tmp_path / "src"
    names = []
    long_dir = "deep/" + "d" * 120
    for i in range(4):
        for ext, data in (("cls", str(i % 2)), ("txt", f"gnu {i}")):
            key = f"{long_dir}/g{i:03d}" if i == 3 else f"g{i:03d}"
            path = src / f"{key}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(data)
            names.append(f"{key}.{ext}")
    gnu = tmp_path / "gnu.tar"
    subprocess.run(["tar", "cf", str(gnu), "--format=gnu", "-C", str(src), *names], check=True)
    py = write_tar(tmp_path / "py.tar.gz", sample_members(5, ("cls", "txt"), "p"), compress="gz")
    wd = tmp_path / "wd.tar"
    with TarWriter(str(wd)) as writer:
        for i in range(3):
            writer.write({"__key__": f"w{i:03d}", "json": {"label": i}, "txt": f"webds {i}"})
    return {"gnu": gnu, "py": py, "wd": wd}


ALL_KEYS = (
    ["g000", "g001", "g002", "deep/" + "d" * 120 + "/g003"]
    + [f"p{i:06d}" for i in range(5)]
    + [f"w{i:03d}" for i in range(3)]
)


def listing(inputs: Dict[str, Path]) -> List[str]:
    """What GNU tar lists for the three inputs, one after the other."""
    return sum((tar_names(inputs[k]) for k in ("gnu", "py", "wd")), [])


def test_cat_to_redirected_stdout_subprocess(tmp_path: Path, inputs: Dict[str, Path]) -> None:
    with open(tmp_path / "all.tar", "wb") as out:
        done = run_webds("cat", "gnu.tar", "py.tar.gz", "wd.tar", cwd=tmp_path, stdout=out)
    assert done.returncode == 0, done.stderr
    assert lines(done.stderr)[-1] == ("wrote 12 samples from 3 shard(s) to standard output")
    names = tar_names(tmp_path / "all.tar")
    assert names == listing(inputs)
    assert keys_of(names) == ALL_KEYS
    got = tar_contents(tmp_path / "all.tar", tmp_path / "x")
    want: Dict[str, bytes] = {}
    for name in ("gnu", "py", "wd"):
        want.update(tar_contents(inputs[name], tmp_path / f"x-{name}"))
    assert got == want and len(got) == 24


def test_cat_pipe_into_split_subprocesses(tmp_path: Path, inputs: Dict[str, Path]) -> None:
    (tmp_path / "out").mkdir()
    cat = subprocess.Popen(
        webds_command("cat", "gnu.tar", "py.tar.gz", "wd.tar", "-q"),
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    split = subprocess.Popen(
        webds_command("split", "-", "-o", "out/x-%04d.tar", "--maxcount", "5"),
        cwd=tmp_path,
        env=cli_env(),
        stdin=cat.stdout,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert cat.stdout is not None
    cat.stdout.close()  # split holds the only read end: cat sees EPIPE if split dies
    split_out, split_err = split.communicate(timeout=120)
    cat_err = cat.stderr.read() if cat.stderr else b""
    assert cat.wait(timeout=120) == 0, cat_err
    assert split.returncode == 0, split_err
    assert split_out == b"" and cat_err == b""
    assert lines(split_err.decode())[-4:] == [
        "out/x-0000.tar: 5 samples",
        "out/x-0001.tar: 5 samples",
        "out/x-0002.tar: 2 samples",
        "split 12 samples into out/x-0000.tar .. out/x-0002.tar (3 shards); index out/x.index.json",
    ]
    shards = sorted((tmp_path / "out").glob("x-*.tar"))
    assert [p.name for p in shards] == ["x-0000.tar", "x-0001.tar", "x-0002.tar"]
    assert sum((tar_names(p) for p in shards), []) == listing(inputs)
    assert [len(keys_of(tar_names(p))) for p in shards] == [5, 5, 2]
    index = json.loads((tmp_path / "out" / "x.index.json").read_text())
    assert [(s["url"], s["samples"]) for s in index["shards"]] == [
        ("x-0000.tar", 5),
        ("x-0001.tar", 5),
        ("x-0002.tar", 2),
    ]
    assert index["shards"][0]["bytes"] == shards[0].stat().st_size


def test_split_options(tmp_path: Path, inputs: Dict[str, Path], monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["split", "py.tar.gz", "wd.tar", "-q", "-o", "s-%02d.tar.gz", "--maxcount", "3"]
    assert main([*argv, "--start", "7", "--no-index"]) == 0
    made = sorted(p.name for p in tmp_path.glob("s-*"))
    assert made == ["s-07.tar.gz", "s-08.tar.gz", "s-09.tar.gz"]
    assert not list(tmp_path.glob("*.index.json"))
    # gzip by name; GNU tar reads them back
    assert tar_names(tmp_path / "s-08.tar.gz") == [
        "p000003.cls",
        "p000003.txt",
        "p000004.cls",
        "p000004.txt",
        "w000.json",
        "w000.txt",
    ]
    # --maxsize counts member bytes: each webds sample here holds 19 bytes.
    assert main(["split", "wd.tar", "-q", "-o", "m-%d.tar", "--maxsize", "15"]) == 0
    assert [keys_of(tar_names(tmp_path / f"m-{i}.tar")) for i in range(3)] == [
        ["w000"],
        ["w001"],
        ["w002"],
    ]
    assert json.loads((tmp_path / "m.index.json").read_text())["samples"] == 3


def test_split_creates_the_missing_output_folder(tmp_path: Path, inputs, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["split", "wd.tar", "-q", "-o", "new/dir/s-%02d.tar", "--maxcount", "2"]) == 0
    assert sorted(os.listdir(tmp_path / "new" / "dir")) == ["s-00.tar", "s-01.tar", "s.index.json"]
    assert keys_of(tar_names(tmp_path / "new" / "dir" / "s-01.tar")) == ["w002"]


def test_split_bad_pattern_and_arguments(tmp_path: Path, inputs, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["split", "wd.tar", "-o", "out.tar"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "webds split: error: output pattern 'out.tar' has no field for the shard number; use "
        "one such as 'out-%06d.tar' (write a literal '%' as '%%')\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["split", "wd.tar", "-o", "o-%d.tar", "--maxsize", "lots"])
    assert exit_info.value.code == 2
    assert "expected a size in bytes" in capsys.readouterr().err
    assert not list(tmp_path.glob("o-*")) and not list(tmp_path.glob("out*"))


def test_cat_keeps_member_names_exactly(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    members = [
        ("a.JPG", b"\xff\xd8"),
        ("a._meta", b"\xff\x00binary note"),  # binary meta fields are copied too
        ("a.seg.PNG", b"png"),
        ("dir.v2/b.Cls", b"7"),
    ]
    write_tar(tmp_path / "mixed.tar", members)
    assert main(["cat", "mixed.tar", "-q", "-o", "out.tar"]) == 0
    assert tar_names(tmp_path / "out.tar") == ["a.JPG", "a._meta", "a.seg.PNG", "dir.v2/b.Cls"]
    assert tar_contents(tmp_path / "out.tar", tmp_path / "x") == dict(members)


def test_cat_shuffle_count_and_seed(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    write_tar(tmp_path / "a.tar", sample_members(40, ("cls", "txt")))
    orders = {}
    for seed in ("1", "2"):
        for run in range(2):
            out = f"s{seed}-{run}.tar"
            assert main(["cat", "a.tar", "--shuffle", "10", "--seed", seed, "-q", "-o", out]) == 0
            orders[seed, run] = keys_of(tar_names(tmp_path / out))
    assert orders["1", 0] == orders["1", 1]  # reproducible
    assert orders["1", 0] != orders["2", 0]
    assert sorted(orders["1", 0]) == [f"{i:06d}" for i in range(40)]
    assert orders["1", 0] != sorted(orders["1", 0])
    # Fields stay with their sample.
    for sample in tarfile_samples([{"url": "s1-0.tar"}]):
        assert sample["txt"] == f"sample {sample['__key__']} txt".encode()
    argv = ["cat", "a.tar", "--shuffle", "10", "--seed", "1", "--count", "7", "-o", "c.tar"]
    assert main(argv) == 0
    assert keys_of(tar_names(tmp_path / "c.tar")) == orders["1", 0][:7]
    assert lines(capsys.readouterr().err)[-1] == "wrote 7 samples from 1 shard(s) to c.tar"
    assert main(["cat", "a.tar", "--count", "100", "-o", "all.tar"]) == 0
    assert "--count 100: the inputs hold only 40 samples" in capsys.readouterr().err


def test_cat_parallel_round_robin(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for prefix, n in (("a", 2), ("b", 3), ("c", 1), ("d", 2)):
        write_tar(tmp_path / f"{prefix}.tar", sample_members(n, ("cls",), prefix))
    shards = ["a.tar", "b.tar", "c.tar", "d.tar"]
    assert main(["cat", *shards, "--parallel", "2", "-q", "-o", "p.tar"]) == 0
    # Two slots, one sample from each in turn; a finished shard hands its slot to the next.
    assert keys_of(tar_names(tmp_path / "p.tar")) == [
        "a000000",
        "b000000",
        "a000001",
        "b000001",
        "c000000",
        "b000002",
        "d000000",
        "d000001",
    ]
    assert main(["cat", *shards, "--parallel", "8", "-q", "-o", "p8.tar"]) == 0
    assert keys_of(tar_names(tmp_path / "p8.tar")) == [
        "a000000",
        "b000000",
        "c000000",
        "d000000",
        "a000001",
        "b000001",
        "d000001",
        "b000002",
    ]
    # Stopping early ends the reading threads (the command returns).
    assert main(["cat", *shards, "--parallel", "3", "--count", "2", "-q", "-o", "p2.tar"]) == 0
    assert keys_of(tar_names(tmp_path / "p2.tar")) == ["a000000", "b000000"]
    assert [t.name for t in threading.enumerate() if t.name.startswith("webds-cat")] == []


def sort_input(tmp_path: Path) -> Path:
    """Samples with a json label of mixed types (and missing), a cls, keys not in order."""
    labels = [3, "cat", None, 1.5, 3, "ant", 10, {"x": 1}, -2, 3]
    path = tmp_path / "mixed.tar"
    with TarWriter(str(path)) as writer:
        for i, label in enumerate(labels):
            sample = {"__key__": f"k{(7 * i) % 10}", "cls": i % 3, "txt": f"n{i}"}
            if label is not None:
                sample["json"] = {"label": label}
            writer.write(sample)
    return path


def sorted_keys(tmp_path: Path, *args: str) -> List[str]:
    out = tmp_path / "sorted.tar"
    assert main(["sort", "mixed.tar", "-q", "-o", str(out), *args]) == 0
    return keys_of(tar_names(out))


def test_sort_by_key_and_fields(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    sort_input(tmp_path)
    # keys: i -> k{7i mod 10}: k0 k7 k4 k1 k8 k5 k2 k9 k6 k3
    assert sorted_keys(tmp_path) == [f"k{i}" for i in range(10)]
    assert sorted_keys(tmp_path, "--reverse") == [f"k{i}" for i in reversed(range(10))]
    # cls = i % 3; stable within equal values (input order)
    assert sorted_keys(tmp_path, "--by", "cls") == [
        "k0", "k1", "k2", "k3",  # i = 0 3 6 9
        "k7", "k8", "k9",  # i = 1 4 7
        "k4", "k5", "k6",  # i = 2 5 8
    ]  # fmt: skip
    # json.label: numbers, then text, then other JSON; missing last, no TypeError.
    by_label = [
        "k6",  # -2
        "k1",  # 1.5
        "k0", "k8", "k3",  # 3, 3, 3 in input order
        "k2",  # 10
        "k5",  # "ant"
        "k7",  # "cat"
        "k9",  # {"x": 1}
        "k4",  # missing
    ]  # fmt: skip
    assert sorted_keys(tmp_path, "--by", "json.label") == by_label
    reverse = sorted_keys(tmp_path, "--by", "json.label", "--reverse")
    assert reverse == ["k9", "k7", "k5", "k2", "k0", "k8", "k3", "k1", "k6", "k4"]
    # A field no sample has: every value missing, so the input order stays.
    input_order = [f"k{i}" for i in (0, 7, 4, 1, 8, 5, 2, 9, 6, 3)]
    assert sorted_keys(tmp_path, "--by", "nothing") == input_order


def test_sort_numeric_orders_digits_naturally(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    keys = ["img10", "img9", "10", "img1", "9", "007", "img1b"]
    write_tar(tmp_path / "mixed.tar", [(f"{k}.txt", k.encode()) for k in keys])
    assert sorted_keys(tmp_path) == ["007", "10", "9", "img1", "img10", "img1b", "img9"]
    assert sorted_keys(tmp_path, "--numeric") == [
        "007", "9", "10", "img1", "img1b", "img9", "img10",
    ]  # fmt: skip
    assert sorted_keys(tmp_path, "--by", "txt", "-n", "-r") == [
        "img10", "img9", "img1b", "img1", "10", "9", "007",
    ]  # fmt: skip


def test_sort_spills_runs_and_merges_stably(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    n = 2 * MERGE_FANIN + 10  # one run per sample with --memory 1: two levels of merging
    members: List[Tuple[str, bytes]] = []
    for i in range(n):
        key = f"s{(37 * i) % n:05d}"
        members += [(f"{key}.cls", str(i % 4).encode()), (f"{key}.txt", f"{i}".encode())]
    write_tar(tmp_path / "big.tar", members)
    # Two shards with one key each, so that sorting by key makes them neighbours.
    write_tar(tmp_path / "dup1.tar", [("s00003.cls", b"1"), ("s00003.txt", b"dup one")])
    write_tar(tmp_path / "dup2.tar", [("s00003.cls", b"2"), ("s00003.txt", b"dup two")])
    spill = tmp_path / "spill"
    spill.mkdir()
    for by in ("key", "cls"):
        args = ["sort", "big.tar", "dup1.tar", "dup2.tar", "--by", by]
        assert main([*args, "-q", "-o", f"mem-{by}.tar"]) == 0
        assert main([*args, "--memory", "1", "-o", f"disk-{by}.tar", "--tmpdir", "spill"]) == 0
        err = capsys.readouterr().err
        assert f"({n + 2} sorted runs spilled to disk and merged)" in err
        assert (tmp_path / f"mem-{by}.tar").read_bytes() == (
            tmp_path / f"disk-{by}.tar"
        ).read_bytes()
        assert list(spill.iterdir()) == []  # the spill folder is removed
        # A run size that is not one sample: spills next to the output.
        assert main([*args, "--memory", "20k", "-o", f"mid-{by}.tar"]) == 0
        assert "sorted runs spilled" in capsys.readouterr().err
        assert (tmp_path / f"mid-{by}.tar").read_bytes() == (
            tmp_path / f"mem-{by}.tar"
        ).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    names = tar_names(tmp_path / "disk-key.tar")
    keys = keys_of(names)
    assert keys == sorted(keys) and len(names) == 2 * (n + 2)
    contents = tar_contents(tmp_path / "disk-cls.tar", tmp_path / "x")
    assert len(contents) == 2 * n  # the two s00003 duplicates overwrite on extraction
    # Stable: equal cls values keep input order (the txt field holds the input position).
    order = [
        (int(s["cls"]), s["txt"])
        for s in _raw_samples(tmp_path / "disk-cls.tar")
        if not s["txt"].startswith(b"dup")
    ]
    by_cls = collections.defaultdict(list)
    for cls, txt in order:
        by_cls[cls].append(int(txt))
    assert [c for c, _ in order] == sorted(c for c, _ in order)
    assert all(v == sorted(v) for v in by_cls.values())
    # The neighbours with one key are kept as two samples, and the user is warned.
    dups = [s for s in _raw_samples(tmp_path / "disk-key.tar") if s["__key__"] == "s00003"]
    assert [s["txt"] for s in dups][-2:] == [b"dup one", b"dup two"]


def _raw_samples(path: Path) -> List[dict]:
    """Samples split at every '.cls' member (a reader would merge same-key neighbours)."""
    out: List[dict] = []
    for name, data in tar_members(path):
        key, ext = name.split(".", 1)
        if ext == "cls" or not out:
            out.append({"__key__": key})
        out[-1][ext] = data
    return out


def test_missing_and_truncated_inputs(
    tmp_path: Path, inputs: Dict[str, Path], monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    good = inputs["wd"].read_bytes()
    (tmp_path / "cut.tar").write_bytes(good[:1700])
    runs = [
        ["cat", "wd.tar", "cut.tar", "-o", "out.tar"],
        ["cat", "wd.tar", "cut.tar", "--parallel", "2", "-o", "out.tar"],
        ["sort", "cut.tar", "wd.tar", "-o", "out.tar"],
        ["sort", "cut.tar", "--memory", "1", "-o", "out.tar"],
        ["split", "wd.tar", "cut.tar", "-o", "out-%d.tar"],
    ]
    for argv in runs:
        assert main([*argv, "-q"]) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith(f"webds {argv[0]}: error: shard is truncated"), err
        assert "[shard 'cut.tar'" in err and len(err.splitlines()) == 1
        assert not (tmp_path / "out.tar").exists() and not list(tmp_path.glob("out-*"))
    for argv in (
        ["cat", "nope.tar", "-q", "-o", "x.tar"],
        ["sort", "nope.tar", "-q", "-o", "x.tar"],
    ):
        assert main(argv) == 1
        assert capsys.readouterr().err.startswith(
            f"webds {argv[0]}: error: no such file 'nope.tar'"
        )
    assert main(["cat", "missing-*.tar", "-o", "out.tar"]) == 2
    assert "found no files matching" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cut.tar",
        "gnu.tar",
        "py.tar.gz",
        "src",
        "wd.tar",
    ]


def test_errors_as_subprocesses_and_terminal_refusal(tmp_path: Path, inputs) -> None:
    (tmp_path / "cut.tar").write_bytes(inputs["gnu"].read_bytes()[:2000])
    done = run_webds("cat", "gnu.tar", "cut.tar", "-q", "-o", "out.tar", cwd=tmp_path, text=True)
    assert done.returncode == 1
    assert done.stderr.startswith("webds cat: error: shard is truncated")
    assert "'cut.tar'" in done.stderr and "Traceback" not in done.stderr
    master, slave = os.openpty()
    try:
        for cmd in ("cat", "sort"):
            done = run_webds(cmd, "wd.tar", cwd=tmp_path, stdout=slave, text=True)
            assert done.returncode == 2
            assert done.stderr == (
                f"webds {cmd}: error: refusing to write a tar archive to the terminal; give -o "
                "FILE, or redirect or pipe standard output\n"
            )
    finally:
        os.close(slave)
        os.close(master)
    for cmd in ("split", "cat", "sort"):
        out = run_webds(cmd, "--help", cwd=tmp_path, text=True)
        assert out.returncode == 0
        assert "example:" in out.stdout and f"webds {cmd} " in out.stdout


def test_count_stops_a_pipe_input_early(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    # Bigger than the reader's 1 MiB chunks, so the samples arrive before the command ends.
    write_tar(tmp_path / "a.tar", [(f"{i:06d}.bin", bytes([i]) * 400_000) for i in range(8)])
    # The command would run for a minute after the tar: stopping early must end it, not wait.
    source = "pipe:cat a.tar; sleep 60"
    assert main(["cat", source, "--count", "2", "-q", "-o", "two.tar"]) == 0
    assert keys_of(tar_names(tmp_path / "two.tar")) == ["000000", "000001"]
    argv = ["cat", source, "a.tar", "--parallel", "2", "--count", "3", "-q", "-o", "p.tar"]
    assert main(argv) == 0
    assert tar_names(tmp_path / "p.tar") == ["000000.bin", "000000.bin", "000001.bin"]


def test_stopping_interleave_ends_a_command_that_keeps_its_output_open(tmp_path: Path) -> None:
    # The thread reading this shard has read the whole tar and waits for its output to end,
    # which `sleep 60` keeps open: closing the iterator ends the command instead of waiting
    # (it used to wait for the thread's 30 s join timeout).
    import time

    from webds.cli.common import read_samples
    from webds.cli.reshard import interleave_shards

    # Bigger than the reader's 1 MiB chunks, so the samples arrive before the command ends.
    path = write_tar(tmp_path / "a.tar", [(f"{i:06d}.bin", bytes([i]) * 400_000) for i in range(8)])
    size = path.stat().st_size
    waiting = threading.Event()

    class Watched:
        """The command's stream: a read for more than the rest of the tar ends only when the
        command's output does (or after the pipe's 60 s idle limit)."""

        def __init__(self, stream):
            self.stream, self.seen = stream, 0

        def read(self, n=-1):
            if n < 0 or self.seen + n > size:
                waiting.set()
            data = self.stream.read(n)
            self.seen += len(data)
            return data

        def __getattr__(self, name):
            return getattr(self.stream, name)

    def read(shards):
        (shard,) = shards
        if shard["url"].startswith("pipe:"):  # the plain file's thread reads to its end at once
            shard = dict(shard, stream=Watched(shard["stream"]))
        return read_samples([shard])

    it = interleave_shards([f"pipe:cat {path}; sleep 60", str(path)], 2, read=read)
    assert [next(it)["__key__"] for _ in range(3)] == ["000000", "000000", "000001"]
    assert waiting.wait(30), "the pipe's thread never came to wait on the command"
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 10
