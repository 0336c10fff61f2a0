"""Secure mode decides by allow-list (webds.io.security.ALLOWED_PROTOCOLS): every protocol fsspec
registers is either on the list or refused with SecureModeError before a filesystem is made;
filesystems fsspec makes underneath (``.fs``, ``.fss``, a cache's target) are checked too.
``${NAME}`` in a URL spec reads only ``WDS_NAME``; no local folder is listed. The attacks are
real: a loopback HTTP server serves the attacker's ``refs.json`` and records what was asked."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import fsspec
import pytest
from clitools import cli_env, run_webds
from conftest import sample_members, write_tar
from fsspec.registry import known_implementations

import webds
from webds.errors import SecureModeError
from webds.io import security, urls
from webds.shards.index import ShardIndex
from webds.shards.specs import MultiShardSample

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def secure(monkeypatch):
    monkeypatch.delenv("WDS_SECURE", raising=False)
    monkeypatch.setattr(security, "enforce_security", True)
    yield


@pytest.fixture
def shard(tmp_path) -> Path:
    path = tmp_path / "a.tar"
    write_tar(path, sample_members(4, prefix="a-"))
    return path


@pytest.fixture
def nothing_made(monkeypatch):
    """Fails the test if any fsspec filesystem is made (making one may read a file)."""
    made = []

    def spy(cls, *args, **kwargs):
        made.append(cls.__name__)
        raise AssertionError(f"an fsspec {cls.__name__} was made")

    monkeypatch.setattr(fsspec.spec._Cached, "__call__", spy)
    return made


def every_fsspec_protocol() -> list:
    return sorted(set(known_implementations) | set(fsspec.available_protocols()))


def url_for(protocol: str, path: Path) -> str:
    return f"{protocol}:,{path}" if protocol.lower() == "data" else f"{protocol}://{path}"


def test_every_fsspec_protocol_is_allowed_or_refused_unmade(secure, shard, nothing_made):
    protocols = every_fsspec_protocol()
    allowed = [p for p in protocols if p in security.ALLOWED_PROTOCOLS]
    assert {"http", "https", "s3", "s3a", "gs", "gcs"} <= set(allowed)
    assert security.ALLOWED_PROTOCOLS <= set(protocols), "a name fsspec does not register"
    refused = [p for p in protocols if p not in security.ALLOWED_PROTOCOLS]
    for must in ("file", "local", "reference", "data", "memory", "dir", "zip", "tar", "generic"):
        assert must in refused
    spellings = []
    for p in refused:
        spellings += [url_for(p, shard), f"simplecache::{url_for(p, shard)}", f"{p}::s3://b/a.tar"]
    # Upper case is no protocol fsspec knows, allowed ones included: refused, not "unknown".
    spellings += [url_for(p.upper(), shard) for p in protocols]
    spellings += [f"{p.upper()}::s3://b/a.tar" for p in allowed]
    for url in spellings:
        with pytest.raises(SecureModeError, match="secure mode is on"):
            urls.open_url(url)
        with pytest.raises(SecureModeError):
            security.url_to_fs(url)
    for url in (f"LOCAL://{shard}", f"FILE://{shard}", f"reference://{shard}"):
        with pytest.raises(SecureModeError):
            list(webds.WebDataset(url))
        with pytest.raises(SecureModeError):
            urls.deferred_open(url)()
    assert nothing_made == []


def test_the_allow_list_is_the_documented_one():
    text = (ROOT / "docs" / "migrating.md").read_text()
    section = text.split("## Secure mode", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z0-9]+)`", section))
    assert security.ALLOWED_PROTOCOLS <= named, security.ALLOWED_PROTOCOLS - named
    listed = set(re.findall(r"[a-z0-9]+", (security.__doc__ or "").split("It decides", 1)[1]))
    assert security.ALLOWED_PROTOCOLS <= listed, security.ALLOWED_PROTOCOLS - listed


def test_reference_urls_read_no_local_file(secure, shard, http_server):
    size = shard.stat().st_size
    refs = {"version": 1, "refs": {"a.tar": [shard.as_uri(), 0, size]}}
    url = "reference://a.tar::" + http_server.put("refs.json", json.dumps(refs).encode())
    security.enforce_security = False  # the attack works where secure mode is off...
    assert len(list(webds.WebDataset([url]))) == 4
    security.enforce_security = True  # ...and is refused before refs.json is even asked for
    asked = http_server.requests
    with pytest.raises(SecureModeError, match="'reference://' URLs"):
        list(webds.WebDataset([url]))
    with pytest.raises(SecureModeError):
        webds.shards.expand_urls(url.replace("a.tar", "*.tar"))
    with pytest.raises(SecureModeError, match="'data:' URLs"):
        list(webds.WebDataset("data:application/x-tar;base64,AAAA"))
    assert http_server.requests == asked


def test_filesystems_made_underneath_are_checked(secure, tmp_path, shard):
    from fsspec.implementations.cached import SimpleCacheFileSystem
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.http import HTTPFileSystem
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.implementations.reference import ReferenceFileSystem

    class Renamed(LocalFileSystem):
        """Local files under an allowed name: only what it is, found at any depth, tells."""

        protocol = ("s3",)

    refs = {"version": 1, "refs": {"a.tar": ["http://127.0.0.1:1/a.tar", 0, 10]}}
    http = HTTPFileSystem(skip_instance_cache=True)
    refused = [
        LocalFileSystem(),
        ReferenceFileSystem(refs, fs={"http": http}),  # fsspec adds a local one under None
        SimpleCacheFileSystem(fs=LocalFileSystem(), cache_storage=str(tmp_path / "c")),
        SimpleCacheFileSystem(fs=DirFileSystem(str(tmp_path), fs=http), cache_storage="TMP"),
        SimpleCacheFileSystem(fs=SimpleCacheFileSystem(fs=Renamed()), cache_storage="TMP"),
        DirFileSystem(str(tmp_path), fs=http),
        fsspec.filesystem("zip", fo=str(shard).replace("a.tar", "z.zip"), mode="w"),
    ]
    for fs in refused:
        with pytest.raises(SecureModeError):
            security.check_filesystem(fs, "x")
    # Allowed: a remote filesystem, and a cache whose target is one.
    security.check_filesystem(http, "x")
    security.check_filesystem(SimpleCacheFileSystem(fs=http, cache_storage="TMP"), "x")
    with pytest.raises(SecureModeError, match="local files"):
        security.url_to_fs("http://127.0.0.1:1/a.tar", protocol="file")  # options name it


def test_what_a_protocol_name_makes_is_checked(secure, shard, monkeypatch):
    # A plugin registered under an allowed name: the URL passes, what fsspec makes does not.
    from fsspec.implementations.local import LocalFileSystem

    registry = importlib.import_module("fsspec.registry")._registry
    monkeypatch.setitem(registry, "s3", LocalFileSystem)
    with pytest.raises(SecureModeError, match="local files"):
        list(webds.WebDataset(f"s3://{shard}"))
    with pytest.raises(SecureModeError, match="local files"):
        list(webds.WebDataset([f"simplecache::s3://{shard}"]))


def test_remote_urls_and_registered_openers_still_open(secure, shard, http_server, monkeypatch):
    url = http_server.put("a.tar", shard.read_bytes())
    keys = [f"a-{i:06d}" for i in range(4)]
    assert [s["__key__"] for s in webds.WebDataset(url)] == keys
    assert [s["__key__"] for s in webds.WebDataset(["simplecache::" + url])] == keys
    seen = []

    def default(u, mode="rb", bufsize=0, **kw):
        seen.append(u)
        return open(shard, "rb")

    monkeypatch.setitem(urls.SCHEMES, "__default__", default)
    monkeypatch.setitem(urls.SCHEMES, "mine", lambda u, *a, **k: open(shard, "rb"))
    assert len(list(webds.WebDataset("store://b/a.tar"))) == 4  # a scheme fsspec doesn't know
    assert len(list(webds.WebDataset("MINE://b/a.tar"))) == 4  # registered by name
    for refused in (f"local://{shard}", f"reference://{shard}", f"memory://{shard}"):
        with pytest.raises(SecureModeError):
            urls.open_url(refused)  # the catch-all opener does not take these
    assert seen == ["store://b/a.tar"]


def test_secure_mode_reads_only_wds_variables(secure, http_server, monkeypatch):
    monkeypatch.setenv("MY_API_TOKEN", "tok")
    monkeypatch.delenv("WDS_MY_API_TOKEN", raising=False)
    spec = f"{http_server.endpoint}/x-${{MY_API_TOKEN}}.tar"
    with pytest.raises(SecureModeError, match="set WDS_MY_API_TOKEN") as info:
        list(webds.WebDataset(spec))
    assert "tok" not in str(info.value).replace("TOKEN", "")
    for value in ("x-$MY_API_TOKEN.tar", "x-${MY_API_TOKEN}.tar"):  # a shard spec's $VAR
        shards = {"datasets": [{"shards": f"{http_server.endpoint}/{value}"}]}
        with pytest.raises(SecureModeError, match="only WDS_-prefixed"):
            MultiShardSample(shards)
    monkeypatch.delenv("MY_API_TOKEN")  # unset, the same refusal: whether it is set is not told
    with pytest.raises(SecureModeError, match="set WDS_MY_API_TOKEN"):
        webds.shards.expand_urls(spec)
    assert not any("tok" in path for _, path, _ in http_server.log)
    monkeypatch.setenv("WDS_MY_API_TOKEN", "public")
    assert webds.shards.expand_urls(spec) == [f"{http_server.endpoint}/x-public.tar"]
    # Off, webds's documented fallback to the bare NAME stays.
    monkeypatch.setenv("MY_API_TOKEN", "tok")
    monkeypatch.delenv("WDS_MY_API_TOKEN")
    security.enforce_security = False
    assert webds.shards.expand_urls(spec) == [f"{http_server.endpoint}/x-tok.tar"]


def test_no_local_folder_is_listed(secure, tmp_path, shard):
    for spec in (f"{tmp_path}/*.tar", f"{tmp_path}/", f"{tmp_path}/none-*.tar", "file:///n/"):
        with pytest.raises(SecureModeError, match="local files") as info:
            webds.shards.expand_urls(spec)
        assert "a.tar" not in str(info.value)  # what the folder holds is not told
    with pytest.raises(SecureModeError):
        webds.DirectoryShardList(str(tmp_path))
    security.enforce_security = False
    queue = webds.DirectoryShardList(str(tmp_path), poll=None)
    security.enforce_security = True
    with pytest.raises(SecureModeError):
        next(iter(queue))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar"], "nothing may be renamed"
    # A local index: refused as such, whether or not it exists (not "no index there").
    (tmp_path / "i.index.json").write_text("{}")
    for index in (tmp_path / "i.index.json", tmp_path / "none.index.json"):
        with pytest.raises(SecureModeError):
            ShardIndex.load(str(index))


def test_create_from_a_folder_is_refused(tmp_path, shard):
    (tmp_path / "k.txt").write_bytes(b"SECRET")
    env = dict(cli_env(), WDS_SECURE="1")
    out = run_webds("create", "--from-dir", str(tmp_path), "-o", "-", cwd=tmp_path, env=env)
    assert out.returncode != 0 and b"SECRET" not in out.stdout
    assert "secure mode is on" in out.stderr and "local files" in out.stderr, out.stderr
    plan = f"k.txt {tmp_path / 'k.txt'}\n".encode()
    out = run_webds("create", "-", "-o", "-", cwd=tmp_path, env=env, input=plan)
    assert out.returncode != 0 and b"SECRET" not in out.stdout
    assert "secure mode is on" in out.stderr, out.stderr


def test_converters_and_spec_files_read_no_local_file(secure, tmp_path, http_server):
    # Found one step off: webds clips / pack_clips and pack-folder listed and read local folders
    # and files in secure mode (and uploaded them); a YAML spec was read from local disk.
    from media import make_video

    videos = tmp_path / "v"
    (videos / "cls").mkdir(parents=True)
    (videos / "cls" / "a.mp4").write_bytes(make_video(seconds=1))
    (videos / "cls" / "b.jpg").write_bytes(b"\xff\xd8 not really")
    out = "s3://bucket/c-%06d.tar"
    for inputs in (str(videos), str(videos / "cls" / "a.mp4"), [str(videos / "cls" / "a.mp4")]):
        with pytest.raises(SecureModeError, match="local files"):
            webds.pack_clips(inputs, out, 1, workers=0, progress=False)
    with pytest.raises(SecureModeError, match="local files"):
        list(webds.split_video(str(videos / "cls" / "a.mp4"), 1))
    with pytest.raises(SecureModeError, match="local files"):
        webds.pack_folder(str(videos), out)
    spec = tmp_path / "mix.yaml"
    spec.write_text("datasets:\n  - shards: http://127.0.0.1:9/a-{0..1}.tar\n")
    with pytest.raises(SecureModeError, match="local files"):
        webds.WebDataset(str(spec))
    # a spec file served remotely is read (before, open() took the URL for a local name)
    url = http_server.put("mix.yaml", spec.read_bytes())
    assert sorted(d["url"] for d in MultiShardSample(url)) == [
        "http://127.0.0.1:9/a-0.tar",
        "http://127.0.0.1:9/a-1.tar",
    ]
