"""No credentials in what the ``webds`` commands report: shard URLs given with a password or a
presigned signature are redacted in report and diagnostic lines (``verify``, ``show``, summaries,
warnings, failures), and kept as given only in data output a script asked for (``ls --long``,
``tsv --fields __url__``), as docs/remote.md says ("Credentials in messages").

Served by the loopback HTTP server (``http_server``), which ignores the query string, so a URL
with ``?X-Amz-Signature=...`` reads the shard as a presigned URL would.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any, Tuple

import pytest
from clitools import run_webds
from conftest import sample_members, write_tar

from webds.cli import main
from webds.parallel import MapShardsError, ShardResult

webds = functools.partial(run_webds, text=True)

SECRET = "SEKRIT123"
PASSWORD = "hunter2pw"


def _signed(server: Any, name: str) -> str:
    return f"http://user:{PASSWORD}@127.0.0.1:{server.port}/{name}?X-Amz-Signature={SECRET}"


def _clean(text: str) -> None:
    assert SECRET not in text and PASSWORD not in text, text


def _run(capsys: pytest.CaptureFixture, *argv: str) -> Tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def shards(http_server: Any, tmp_path: Path) -> Tuple[str, str]:
    for name, n in (("a.tar", 2), ("b.tar", 3)):
        http_server.put(name, write_tar(tmp_path / name, sample_members(n)).read_bytes())
    return _signed(http_server, "a.tar"), _signed(http_server, "b.tar")


def test_verify_reports_a_changed_and_a_missing_shard_without_secrets(
    http_server: Any, shards: Tuple[str, str], tmp_path: Path
) -> None:
    from webds.shards.index import ShardIndex

    ShardIndex.build(list(shards)).save(str(tmp_path / "i.json"))
    raw = bytearray((http_server.root / "a.tar").read_bytes())
    raw[512] ^= 0x01  # the first member's data: the tar still parses, its sha256 differs
    (http_server.root / "a.tar").write_bytes(bytes(raw))
    (http_server.root / "b.tar").unlink()
    out = webds("verify", "i.json", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"http://user:***@127.0.0.1:{http_server.port}/a.tar?")
    assert "X-Amz-Signature=***: sha256: " in lines[0]
    assert "/b.tar?X-Amz-Signature=***: missing: " in lines[1]
    _clean(out.stdout + out.stderr)


def test_show_redacts_its_url_while_ls_and_tsv_give_it_as_data(
    capsys: pytest.CaptureFixture, shards: Tuple[str, str]
) -> None:
    url = shards[0]
    status, out, err = _run(capsys, "show", url, "--count", "1")
    assert status == 0, err
    assert "__url__  http://user:***@127.0.0.1:" in out and "a.tar?X-Amz-Signature=***" in out
    _clean(out + err)
    # Data a script asked for: the URL as given, to open again.
    status, out, err = _run(capsys, "ls", "--long", url, "--count", "1")
    assert (status, out) == (0, f"000000  txt 17 B, cls 1 B  {url}\n"), err
    status, out, err = _run(capsys, "tsv", "--fields", "__url__", "--no-key", url, "--count", "1")
    assert (status, out) == (0, f"__url__\n{url}\n"), err


def test_summaries_warnings_and_failures_hide_secrets(
    capsys: pytest.CaptureFixture,
    shards: Tuple[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from webds.cli.common import say
    from webds.cli.shardio import warn

    url = shards[0]
    say(argparse.Namespace(quiet=False), f"wrote 2 samples to {url}")
    warn("cat", f"odd shard {url}")
    _, err = capsys.readouterr()
    assert "a.tar?X-Amz-Signature=***" in err and err.count("\n") == 2
    _clean(err)

    # proc, one output: the failing sample's report names its shard.
    status, out, err = _run(capsys, "proc", url, "-c", "exit 3", "-o", str(tmp_path / "o.tar"))
    assert status == 1 and "sample '000000' in shard 'http://user:***@" in err, err
    _clean(out + err)

    # proc and clips, one output per shard: the failed shards' lines.
    failed = ShardResult(url, str(tmp_path / "o.tar"), error=f"cannot open {url}")

    def fail(*args: Any, **kw: Any) -> Any:
        raise MapShardsError("1 shard failed", [failed])

    monkeypatch.setattr("webds.cli.proc.map_shards", fail)
    monkeypatch.setattr("webds.convert.clipshards.pack_clips", fail)
    status, out, err = _run(capsys, "proc", url, "-c", "true", "-o", str(tmp_path) + "/")
    assert status == 1 and "webds proc: shard 'http://user:***@" in err, err
    _clean(out + err)
    status, out, err = _run(capsys, "clips", url, "-o", str(tmp_path) + "/", "--seconds", "1")
    assert status == 1 and "webds clips: http://user:***@" in err, err
    _clean(out + err)
