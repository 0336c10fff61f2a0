"""``webds index`` and ``webds verify``, run as real subprocesses (``python -m webds.cli``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import List

import pytest
from clitools import run_webds
from conftest import sample_members, write_tar

from webds.shards.index import FORMAT, ShardIndex

#: ``webds ...`` as a subprocess; index and verify print text.
webds = functools.partial(run_webds, text=True)


@pytest.fixture
def shards(tmp_path: Path) -> List[Path]:
    data = tmp_path / "data"
    data.mkdir()
    paths = [write_tar(data / f"train-{i:03d}.tar", sample_members(3 + i)) for i in range(3)]
    paths.append(write_tar(data / "extra.tar.gz", sample_members(2), compress="gz"))
    return paths


def test_index_writes_relative_urls_and_reports(tmp_path: Path, shards: List[Path]) -> None:
    out = webds(
        "index", "data/train-{000..002}.tar", "data/*.gz", "-o", "data/i.json", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "indexed 4 shards, 14 samples -> data/i.json\n"
    doc = json.loads((tmp_path / "data" / "i.json").read_text())
    assert doc["format"] == FORMAT and doc["samples"] == 14
    assert [(s["url"], s["samples"]) for s in doc["shards"]] == [
        ("train-000.tar", 3),
        ("train-001.tar", 4),
        ("train-002.tar", 5),
        ("extra.tar.gz", 2),
    ]
    assert (
        ShardIndex.load(tmp_path / "data" / "i.json").shards
        == ShardIndex.build([str(p) for p in shards]).shards
    )


def test_index_quiet_and_workers(tmp_path: Path, shards: List[Path]) -> None:
    out = webds("index", "data/", "-o", "idx.json", "--quiet", "--workers", "3", cwd=tmp_path)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    doc = json.loads((tmp_path / "idx.json").read_text())
    assert [s["url"] for s in doc["shards"]] == [
        "data/extra.tar.gz",
        "data/train-000.tar",
        "data/train-001.tar",
        "data/train-002.tar",
    ]


def test_verify_good_and_truncated(tmp_path: Path, shards: List[Path]) -> None:
    assert webds("index", "data/", "-o", "data/index.json", "-q", cwd=tmp_path).returncode == 0
    out = webds("verify", "data/index.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "all 4 shards, 14 samples, are good\n"
    bad = shards[1]
    bad.write_bytes(bad.read_bytes()[:1500])
    out = webds("verify", "data/index.json", cwd=tmp_path)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0].startswith("data/train-001.tar: corrupt: shard is truncated")
    assert lines[1] == "data/train-001.tar: size: 1500 bytes, the index says 10240"
    assert lines[-1] == "2 problem(s) in 1 of 4 shards listed in data/index.json"
    assert "Traceback" not in out.stderr
    quiet = webds("verify", "-q", "data/index.json", cwd=tmp_path)
    assert quiet.returncode == 1 and quiet.stdout.splitlines() == lines[:-1]
    assert quiet.stderr == ""


def test_verify_flipped_byte_and_missing_shard(tmp_path: Path, shards: List[Path]) -> None:
    assert webds("index", "data/", "-o", "data/index.json", "-q", cwd=tmp_path).returncode == 0
    raw = bytearray(shards[0].read_bytes())
    raw[512] ^= 0x01  # the first byte of the first member's data: the tar still parses
    shards[0].write_bytes(bytes(raw))
    shards[2].unlink()
    out = webds("verify", "data/index.json", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("data/train-000.tar: sha256: ")
    assert lines[1].startswith("data/train-002.tar: missing: ")
    assert lines[-1] == "2 problem(s) in 2 of 4 shards listed in data/index.json"


def test_help_has_examples(tmp_path: Path) -> None:
    for command in ("index", "verify"):
        out = webds(command, "--help", cwd=tmp_path)
        assert out.returncode == 0
        assert "example:" in out.stdout and f"webds {command} " in out.stdout
    out = webds("--help", cwd=tmp_path)
    assert out.returncode == 0 and "index" in out.stdout and "verify" in out.stdout
    out = webds(cwd=tmp_path)
    assert out.returncode == 2 and "COMMAND" in out.stderr


def test_errors_are_one_line_without_traceback(tmp_path: Path, shards: List[Path]) -> None:
    out = webds("index", "data/nope.tar", "-o", "i.json", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1].startswith(
        "webds index: error: no such file 'data/nope.tar'"
    )
    assert "Traceback" not in out.stderr and not (tmp_path / "i.json").exists()

    out = webds("index", "data/*.zip", "-o", "i.json", "-q", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("webds index: error: found no files matching")
    assert len(out.stderr.splitlines()) == 1

    out = webds("verify", "missing.json", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr == (
        "webds verify: error: no shard index at 'missing.json'; "
        "to create one run: webds index SHARDS -o missing.json\n"
    )

    (tmp_path / "bad.json").write_text('{"format": "nope"}')
    out = webds("verify", "bad.json", cwd=tmp_path)
    assert out.returncode == 2 and "is not a webds shard index" in out.stderr
    assert len(out.stderr.splitlines()) == 1

    out = webds("--debug", "verify", "bad.json", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" in out.stderr and "ArgumentError" in out.stderr

    out = webds("index", "data/", cwd=tmp_path)  # no -o: argparse's usage error
    assert out.returncode == 2 and "-o/--output" in out.stderr
