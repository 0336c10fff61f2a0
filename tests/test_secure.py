"""Secure mode (webdataset's ``utils.enforce_security``, or ``WDS_SECURE=1``) refuses what
webdataset 1.x refuses, through every door: ``pipe:`` commands (which must not run) and local
files through WebDataset, DataPipeline, gopen/open_url, the shard cache, ShardListDataset and the
``webds`` command; pickles and ``torch.load`` even when opted in. Remote shards still read."""

from __future__ import annotations

import io
import pickle
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
from clitools import cli_env, run_webds
from conftest import sample_members, write_tar

import webds
import webds as wds
from webds.errors import SecureModeError
from webds.io import security
from webds.shards.index import ShardIndex


@pytest.fixture
def secure(monkeypatch):
    """Secure mode on, as a webdataset user turns it on; off again after the test."""
    monkeypatch.setattr(security, "enforce_security", False)
    monkeypatch.delenv("WDS_SECURE", raising=False)
    wds.utils.enforce_security = True
    assert security.enforce_security is True and wds.utils.enforce_security is True
    yield


@pytest.fixture
def shard(tmp_path) -> Path:
    path = tmp_path / "a.tar"
    write_tar(path, sample_members(4, prefix="a-"))
    return path


def pipe_that_touches(tmp_path: Path, shard: Path) -> str:
    """A pipe: URL whose command leaves a file behind if it runs."""
    marker = tmp_path / "ran"
    return f"pipe:touch {shlex.quote(str(marker))} && cat {shlex.quote(str(shard))}"


def assert_refused(info: pytest.ExceptionInfo, what: str) -> None:
    text = str(info.value)
    assert "secure mode is on" in text and "enforce_security" in text and "WDS_SECURE" in text
    assert what in text
    assert isinstance(info.value, ValueError)  # what webdataset raised


def test_a_pipe_command_never_runs(secure, tmp_path, shard):
    url = pipe_that_touches(tmp_path, shard)
    with pytest.raises(SecureModeError) as info:
        list(webds.WebDataset(url))
    assert_refused(info, "pipe: URLs")
    with pytest.raises(SecureModeError):
        list(webds.DataPipeline(webds.SimpleShardList(url), webds.tarfile_to_samples()))
    with pytest.raises(SecureModeError):
        list(webds.DataPipeline(webds.SimpleShardList([url]), webds.url_opener()))
    with pytest.raises(SecureModeError):
        wds.gopen(url)
    with pytest.raises(SecureModeError):
        webds.io.urls.open_url(url, "wb")
    with pytest.raises(SecureModeError):
        list(webds.WebDataset(url, cache_dir=str(tmp_path / "cache")))
    assert not (tmp_path / "ran").exists()


def test_a_pipe_command_runs_without_secure_mode(tmp_path, shard, monkeypatch):
    monkeypatch.delenv("WDS_SECURE", raising=False)
    url = pipe_that_touches(tmp_path, shard)
    assert len(list(webds.WebDataset(url))) == 4
    assert (tmp_path / "ran").exists()


def test_local_files_are_refused(secure, tmp_path, shard):
    for url in (str(shard), f"file://{shard}"):
        with pytest.raises(SecureModeError) as info:
            list(webds.WebDataset(url))
        assert_refused(info, "local files")
    with pytest.raises(SecureModeError):
        wds.gopen(str(shard))
    with pytest.raises(SecureModeError):
        webds.TarWriter(str(tmp_path / "out.tar"))
    with pytest.raises(SecureModeError):
        list(webds.WebDataset(str(shard), cache_dir=str(tmp_path / "cache"), cache_local=True))


def test_shard_list_dataset_refuses_local_shards(tmp_path, shard, monkeypatch):
    index = ShardIndex.build([str(shard)])
    monkeypatch.setattr(security, "enforce_security", True)
    with pytest.raises(SecureModeError):
        webds.ShardListDataset(index)


def test_the_environment_variable_turns_it_on(tmp_path, shard, monkeypatch):
    monkeypatch.setattr(security, "enforce_security", False)
    monkeypatch.setenv("WDS_SECURE", "1")
    with pytest.raises(SecureModeError):
        list(webds.WebDataset(pipe_that_touches(tmp_path, shard)))
    monkeypatch.setenv("WDS_SECURE", "0")
    assert len(list(webds.WebDataset(str(shard)))) == 4


def test_the_command_line_refuses_too(tmp_path, shard):
    env = dict(cli_env(), WDS_SECURE="1")
    url = pipe_that_touches(tmp_path, shard)
    for args in (["ls", url], ["ls", str(shard)], ["cat", url]):
        out = run_webds(*args, cwd=tmp_path, env=env)
        assert out.returncode != 0, args
        assert "secure mode is on" in out.stderr and "WDS_SECURE" in out.stderr, out.stderr
    assert not (tmp_path / "ran").exists()


def test_remote_shards_still_read(secure, s3, shard):
    url = s3.put("a.tar", shard.read_bytes())
    assert [s["__key__"] for s in webds.WebDataset(url)] == [f"a-{i:06d}" for i in range(4)]


def test_pickles_and_torch_loads_are_refused_even_when_allowed(secure, tmp_path):
    import torch

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf)
    sample = {"__key__": "k", "pkl": pickle.dumps({"a": 1}), "pth": buf.getvalue()}
    with pytest.raises(SecureModeError, match="unpickling '.pkl' fields"):
        webds.Decoder([], allow_pickle=True)({"__key__": "k", "pkl": sample["pkl"]})
    with pytest.raises(SecureModeError, match="torch.load"):
        webds.Decoder([])({"__key__": "k", "pth": sample["pth"]})
    with pytest.raises(SecureModeError) as info:
        list(webds.decode(allow_pickle=True)(iter([dict(sample)])))
    assert info.value.member == "k.pkl"
    with pytest.raises(SecureModeError):
        wds.autodecode.unpickle_loads(sample["pkl"])
    with pytest.raises(SecureModeError):
        wds.autodecode.torch_loads(sample["pth"])


def test_variables_in_url_specs(tmp_path, shard, monkeypatch):
    # webdataset's rule: ${NAME} is WDS_NAME; webds falls back to NAME.
    monkeypatch.setenv("WDS_DATA", str(tmp_path))
    monkeypatch.setenv("SHARD", "a")
    assert webds.shards.expand_urls("${DATA}/${SHARD}.tar::${DATA}/b-{0..1}.tar") == [
        str(shard),
        str(tmp_path / "b-0.tar"),
        str(tmp_path / "b-1.tar"),
    ]
    assert len(list(webds.WebDataset("${DATA}/a.tar"))) == 4
    assert wds.shardlists.envsubst("${DATA}") == str(tmp_path)
    with pytest.raises(webds.ArgumentError, match="neither WDS_NOPE nor NOPE is set"):
        webds.shards.expand_urls("${NOPE}/a.tar")


def test_gopen_rewrite_and_secure_mode_refuses_it(tmp_path, shard, monkeypatch):
    monkeypatch.delenv("WDS_SECURE", raising=False)
    monkeypatch.setenv("GOPEN_REWRITE", f"/nowhere/={tmp_path}/;x=y")
    assert wds.gopen.rewrite_url("/nowhere/a.tar") == str(shard)
    assert len(list(webds.WebDataset("/nowhere/a.tar"))) == 4
    with wds.gopen("/nowhere/a.tar") as f:
        assert f.read() == shard.read_bytes()
    monkeypatch.setattr(security, "enforce_security", True)
    with pytest.raises(SecureModeError, match="GOPEN_REWRITE"):
        wds.gopen.rewrite_url("/nowhere/a.tar")


def local_spellings(path: Path) -> list:
    """Every spelling of a local file that fsspec (or open_url) would open."""
    return [f"local://{path}", f"local:{path}", f"file:{path}", f"simplecache::file://{path}"]


def test_local_files_in_fsspec_spellings_are_refused(secure, tmp_path, shard, capfd):
    for url in local_spellings(shard):
        with pytest.raises(SecureModeError) as info:
            list(webds.WebDataset(url))
        assert_refused(info, "local files")
        with pytest.raises(SecureModeError):
            wds.gopen(url)
        with pytest.raises(SecureModeError):
            list(webds.WebDataset(url, cache_dir=str(tmp_path / "cache")))
        with pytest.raises(SecureModeError):
            webds.io.urls.deferred_open(url)()
    # Writing, and listing a folder, through fsspec's local filesystem.
    out = tmp_path / "out"
    for url in (f"local://{out}.tar", f"local:{out}.tar"):
        with pytest.raises(SecureModeError):
            webds.TarWriter(url)
    assert not list(tmp_path.glob("out*")), "nothing may be written"
    with pytest.raises(SecureModeError):
        webds.shards.expand_urls(f"local://{tmp_path}/")
    # An archive filesystem over a local zip: refused before fsspec opens the zip.
    with pytest.raises(SecureModeError):
        webds.io.urls.open_url(f"zip://a.tar::{tmp_path}/none.zip")


def test_names_with_a_colon_in_the_current_folder_are_refused(secure, tmp_path, shard, monkeypatch):
    # fsspec opens these as files of the current folder: ab:y.tar, " pipe:x.tar", "PIPE:x.tar".
    monkeypatch.chdir(tmp_path)
    for name in ("ab:y.tar", " pipe:x.tar", "PIPE:x.tar"):
        (tmp_path / name).write_bytes(shard.read_bytes())
        with pytest.raises(SecureModeError) as info:
            list(webds.WebDataset(name))
        assert_refused(info, "pipe: URLs" if "pipe" in name.lower() else "local files")
        with pytest.raises(SecureModeError):
            wds.gopen(name)
    # Without secure mode they are files of those names, as fsspec opens them.
    security.enforce_security = False
    assert len(list(webds.WebDataset("ab:y.tar"))) == 4


def test_the_command_line_refuses_fsspec_spellings(tmp_path, shard):
    env = dict(cli_env(), WDS_SECURE="1")
    for args in (
        ["cat", f"local://{shard}"],
        ["cat", f"local:{shard}"],
        ["ls", f"local://{shard}"],
    ):
        out = run_webds(*args, cwd=tmp_path, env=env)
        assert out.returncode != 0, args
        assert "secure mode is on" in out.stderr, out.stderr
        assert b"a-000000" not in out.stdout


def test_xdecode_refuses_pickles_even_when_allowed(secure, tmp_path, s3):
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (ran,))

    payload = pickle.dumps(Payload())
    write_tar(tmp_path / "p.tar", [("k.pyd", payload), ("k.txt", b"x")])
    url = s3.put("p.tar", (tmp_path / "p.tar").read_bytes())
    with pytest.raises(SecureModeError) as info:
        list(webds.WebDataset(url).xdecode(allow_pickle=True))
    assert_refused(info, "unpickling")
    assert info.value.member == "k.pyd" and info.value.url == url
    with pytest.raises(SecureModeError):
        webds.stages.xdecode.decode_pickle(io.BytesIO(payload))
    with pytest.raises(SecureModeError):
        wds.filters.decode_pickle(io.BytesIO(payload))  # webdataset 1.x's spelling
    assert not ran.exists()
    # Off, the opt-in works as before (and runs the payload: that is what a pickle is).
    security.enforce_security = False
    out = list(webds.WebDataset(url).xdecode(allow_pickle=True))
    assert ran.exists() and out[0]["pyd"] is None and out[0]["txt"] == "x"


def test_refusals_quote_webdataset_s_words(secure, tmp_path, shard, monkeypatch):
    """Each refusal keeps webds's explanation and quotes what webdataset 1.0.2 says at the same
    place (its own tests match those words), side by side with webdataset's own refusal."""
    wd = pytest.importorskip("webdataset")
    import sys

    monkeypatch.setattr(wd.utils, "enforce_security", True)
    monkeypatch.setenv("GOPEN_REWRITE", "s3://a/=http://b/")
    payload = pickle.dumps({"a": 1})
    cases = [
        lambda m: m.gopen(f"pipe:cat {shard}"),
        lambda m: m.gopen(str(shard)),
        lambda m: m.gopen(shard.as_uri()),
        lambda m: m.rewrite_url("s3://a/x.tar"),
        lambda m: m.autodecode.unpickle_loads(payload),
        lambda m: m.autodecode.torch_loads(payload),
    ]
    # webdataset.gopen is the function, its module only in sys.modules; webds's is both.
    wd_gopen = sys.modules["webdataset.gopen"]
    theirs = SimpleNamespace(
        gopen=wd_gopen.gopen, rewrite_url=wd_gopen.rewrite_url, autodecode=wd.autodecode
    )
    ours = SimpleNamespace(
        gopen=wds.gopen, rewrite_url=wds.gopen.rewrite_url, autodecode=wds.autodecode
    )
    for call in cases:
        with pytest.raises(ValueError) as expected:
            call(theirs)
        with pytest.raises(SecureModeError) as got:
            call(ours)
        said = str(expected.value).rstrip(".")
        assert said in str(got.value) and "secure mode is on" in str(got.value), said


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_the_python_switch_reaches_workers_that_import_webds_afresh(tmp_path, monkeypatch, context):
    # A spawned worker imports webds with enforce_security off: it read the local shard (and
    # unpickled fields) that the main process refuses. The dataset carries the switch there.
    write_tar(tmp_path / "a.tar", sample_members(3))
    monkeypatch.delenv("WDS_SECURE", raising=False)
    monkeypatch.setattr(security, "enforce_security", True)
    dataset = webds.WebDataset(str(tmp_path / "a.tar"), shardshuffle=False)
    loader = webds.WebLoader(
        dataset, batch_size=None, num_workers=1, multiprocessing_context=context
    )
    with pytest.raises(SecureModeError, match="local files"):
        list(loader)
    # pickled where secure mode is off, nothing is carried
    monkeypatch.setattr(security, "enforce_security", False)
    copy = pickle.loads(pickle.dumps(dataset))
    assert "_secure" not in copy.__dict__ and len(list(copy)) == 3
