"""The ``webds`` command on remote stores: moto's S3 server and an HTTP server on loopback.

Each command runs as a real subprocess; the ``s3`` fixture puts the credentials and endpoint in
the environment, where s3fs finds them as it would on a user's machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clitools import run_webds as webds
from clitools import tar_names
from conftest import sample_members, write_tar


def test_cat_split_verify_on_s3(s3: Any, tmp_path: Path) -> None:
    for i in range(2):
        local = write_tar(tmp_path / f"in-{i}.tar", sample_members(5, prefix=f"s{i}-"))
        s3.put(f"in/part-{i}.tar", local.read_bytes())
    # Read a prefix, write an object: the same bytes as the local command gives.
    out = webds("cat", s3.url("in/"), "-q", "-o", s3.url("all.tar"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    local = webds("cat", "in-0.tar", "in-1.tar", "-q", "-o", "all.tar", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    assert s3.get("all.tar") == (tmp_path / "all.tar").read_bytes()

    # Split the object into shards on S3, with their index, then verify them there.
    pattern = s3.url("out/p-%03d.tar")
    out = webds("split", s3.url("all.tar"), "-o", pattern, "--maxcount", "4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    names = ["out/p-000.tar", "out/p-001.tar", "out/p-002.tar", "out/p.index.json"]
    assert s3.list("out/") == names
    index = json.loads(s3.get("out/p.index.json"))
    assert [s["samples"] for s in index["shards"]] == [4, 4, 2]
    out = webds("verify", s3.url("out/p.index.json"), cwd=tmp_path, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("all 3 shards, 10 samples, are good\n")

    # A damaged object is reported by name, with exit status 1.
    s3.put("out/p-001.tar", s3.get("out/p-001.tar")[:700])
    out = webds("verify", s3.url("out/p.index.json"), cwd=tmp_path, text=True)
    assert out.returncode == 1
    assert "p-001.tar: corrupt: shard is truncated" in out.stdout


def test_tsv_from_s3_into_a_pipe(s3: Any, tmp_path: Path) -> None:
    local = write_tar(tmp_path / "a.tar", sample_members(3, ("cls", "txt")))
    url = s3.put("a.tar", local.read_bytes())
    out = webds("tsv", url, "--fields", "cls", "--no-header", cwd=tmp_path, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "000000\t0\n000001\t1\n000002\t2\n"


def test_s3_errors_name_the_object(s3: Any, tmp_path: Path) -> None:
    out = webds("ls", s3.url("missing.tar"), cwd=tmp_path, text=True)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("webds ls: error: ")
    assert s3.url("missing.tar") in out.stderr
    out = webds("ls", "s3://no-such-bucket-webds/a.tar", cwd=tmp_path, text=True)
    assert out.returncode == 1 and "no-such-bucket-webds" in out.stderr


def test_http_inputs(http_server: Any, tmp_path: Path) -> None:
    local = write_tar(tmp_path / "a.tar", sample_members(4, ("cls", "txt")))
    url = http_server.put("a.tar", local.read_bytes())
    out = webds("first", url, "--where", "cls == 2", "-q", "-o", "two.tar", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert tar_names(tmp_path / "two.tar") == ["000002.cls", "000002.txt"]
    out = webds("ls", http_server.url("nope.tar"), cwd=tmp_path, text=True)
    assert out.returncode == 1 and "404" in out.stderr and "nope.tar" in out.stderr
