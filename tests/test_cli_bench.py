"""``webds bench``: the command on local JPEG shards and on S3 (moto), as a real subprocess, and
the rules that name the bottleneck."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clitools import cli_env
from clitools import run_webds as webds
from PIL import Image

from webds import TarWriter
from webds.cli import main
from webds.cli.bench import bottleneck, storage_options
from webds.errors import ArgumentError


def jpeg_shards(folder: Path, n: int = 2, per: int = 40) -> list:
    rng = np.random.default_rng(0)
    paths = []
    for s in range(n):
        path = folder / f"img-{s}.tar"
        with TarWriter(str(path)) as out:
            for i in range(per):
                pixels = (rng.random((48, 48, 3)) * 255).astype("uint8")
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, "JPEG")
                out.write({"__key__": f"{s}-{i:03d}", "jpg": buf.getvalue(), "cls": str(i % 3)})
        paths.append(path)
    return paths


def check_report(report: dict, shards: int, local: bool = True) -> None:
    assert report["shards"] == shards
    for run in ("read", "decode", "loader"):
        assert report[run]["samples_per_s"] > 0 and report[run]["mb_per_s"] > 0, run
        assert report[run]["samples"] > 0 and report[run]["shares"], run
    if local:
        # Decoding JPEGs costs more than reading them: the read run is the faster one. Over a
        # network the read run also pays for the first connections, so either may be faster.
        assert report["read"]["samples_per_s"] > report["decode"]["samples_per_s"]
        assert next(iter(report["decode"]["shares"])) == "decode('pil')"
    assert report["bottleneck"] and report["bottleneck_kind"] in {
        "shards", "storage", "parsing", "decoding", "stage", "main process", "cpus",
    }  # fmt: skip
    assert report["machine"]["cpus"] >= 1 and report["settings"]["workers"] == 2
    assert report["fields"] == ["cls", "jpg"]


def test_bench_json_and_table_on_local_shards(tmp_path: Path, monkeypatch, capsys) -> None:
    jpeg_shards(tmp_path)
    args = ["bench", "img-{0..1}.tar", "--seconds", "0.5", "--workers", "2", "--batch-size", "8"]
    out = webds(*args, "--json", cwd=tmp_path, text=True)
    assert out.returncode == 0, out.stderr
    check_report(json.loads(out.stdout), 2)
    # The table: the same command through webds.cli.main in this process (the subprocess above
    # showed the command itself runs; this saves starting Python and torch again).
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["samples/s", "MB/s"]
    assert [line.split()[0] for line in lines[1:4]] == ["read", "read+decode", "loader,"]
    assert lines[-1].startswith("Bottleneck: ")


def test_bench_on_s3_with_storage_options(s3: Any, tmp_path: Path) -> None:
    for path in jpeg_shards(tmp_path):
        s3.put(f"train/{path.name}", path.read_bytes())
    # The endpoint comes from --storage-option only: without it the command can't reach moto.
    env = {k: v for k, v in cli_env().items() if k != "AWS_ENDPOINT_URL"}
    endpoint = f"client_kwargs.endpoint_url={s3.server.endpoint}"
    args = ["bench", s3.url("train/"), "--seconds", "0.5", "--workers", "2", "--json"]
    out = webds(*args, "--storage-option", endpoint, cwd=tmp_path, text=True, env=env)
    assert out.returncode == 0, out.stderr
    check_report(json.loads(out.stdout), 2, local=False)


def test_bench_refuses_bad_arguments(tmp_path: Path, monkeypatch, capsys) -> None:
    jpeg_shards(tmp_path, n=1)
    cases = [
        (["img-0.tar", "--storage-option", "novalue"], "KEY=VALUE"),
        (["-"], "standard input"),
        (["img-0.tar", "--seconds", "0"], "--seconds"),
        (["missing-*.tar"], "missing"),
    ]
    # The first as a real subprocess (its exit status and stderr as a shell sees them), the
    # others through webds.cli.main in this process: the same code, without a Python start each.
    args, message = cases[0]
    out = webds("bench", *args, cwd=tmp_path, text=True)
    assert out.returncode == 2, (args, out.stderr)
    assert message in out.stderr and "Traceback" not in out.stderr
    monkeypatch.chdir(tmp_path)
    for args, message in cases[1:]:
        assert main(["bench", *args]) == 2, (args, capsys.readouterr().err)
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)


def test_storage_options_parse_json_and_nest() -> None:
    got = storage_options(["anon=true", "client_kwargs.region_name=eu", "block_size=1024"])
    assert got == {"anon": True, "client_kwargs": {"region_name": "eu"}, "block_size": 1024}
    with pytest.raises(ArgumentError):
        storage_options(["=3"])


def run(rate: float, shares: dict, seconds: float = 10.0, wait: float = 9.0, mb: float = 50.0):
    return {"samples_per_s": rate, "mb_per_s": mb, "shares": shares, "seconds": seconds,
            "wait_s": wait}  # fmt: skip


READ = "reading shards (waiting for storage or network)"
PARSE = "tarfile_to_samples: tar parsing"


@pytest.mark.parametrize(
    "decode_shares, loader_rate, workers, cpus, wait, kind",
    [
        ({"decode('pil')": 0.9, PARSE: 0.1}, 3900, 4, 4, 9.0, "decoding"),
        ({READ: 0.8, "decode('pil')": 0.2}, 3900, 4, 4, 9.0, "storage"),
        ({PARSE: 0.7, "map(f)": 0.3}, 3900, 4, 4, 9.0, "parsing"),
        ({"map(f)": 0.9}, 3900, 4, 4, 9.0, "stage"),
        ({"decode('pil')": 0.9}, 1500, 8, 2, 9.0, "cpus"),
        ({"decode('pil')": 0.9}, 1500, 4, 4, 1.0, "main process"),
        ({READ: 0.9}, 1500, 4, 4, 9.0, "storage"),
    ],
)
def test_bottleneck_rules(decode_shares, loader_rate, workers, cpus, wait, kind):
    read = run(20000, {PARSE: 0.6, READ: 0.4})
    got_kind, sentence = bottleneck(
        read, run(1000, decode_shares), run(loader_rate, {}, wait=wait), workers, cpus, ["jpg"]
    )
    assert got_kind == kind, sentence
    assert sentence.endswith(".") and len(sentence) > 30


def test_decoding_advice_follows_the_image_format():
    decode = run(1000, {"decode('pil')": 0.9})
    args = (run(20000, {}), decode, run(3900, {}), 4, 8)
    assert "simplejpeg" in bottleneck(*args, ["jpg", "cls"])[1]
    png = bottleneck(*args, ["png", "cls"])[1]
    assert "simplejpeg" not in png and "lossless" in png and "more workers (up to 8)" in png


def test_too_few_shards_for_the_workers_comes_first():
    decode = run(1000, {"decode('pil')": 0.9})
    kind, sentence = bottleneck(run(20000, {}), decode, run(900, {}), 4, 8, ["jpg"], shards=1)
    assert kind == "shards" and "1 for 4 workers" in sentence and "3 of them have" in sentence
    assert bottleneck(run(20000, {}), decode, run(3900, {}), 4, 8, ["jpg"], shards=4)[0] != "shards"
