"""webdataset's ``cache`` module under webds: ``FileCache`` (whole download, then open),
``StreamingOpen``, ``url_to_cache_name`` and helpers, beside webdataset 1.0.2 on the same
inputs, over a real HTTP server."""

from __future__ import annotations

import pytest
from conftest import sample_members, write_tar

import webds
import webds as wds
from webds.errors import ShardReadError


def test_names_and_cache_names_match_webdatasets():
    import webdataset.cache as theirs

    names = [n for n in dir(theirs) if not n.startswith("_")]
    ours = [n for n in names if not hasattr(wds.cache, n)]
    imported = {"Callable", "Iterable", "Optional", "gopen", "io", "os", "re", "subprocess", "sys"}
    imported |= {"time", "urllib", "urlparse", "obsolete", "reraise_exception"}
    assert sorted(set(ours) - imported) == []
    for url in (
        "http://host/a/b/train-000.tar",
        "s3://bucket/x/y.tar",
        "gs://b/c.tar?x=1",
        "pipe:curl -s http://host/a.tar",
        "ais://b/z.tar",
        "file:///data/q.tar",
        "local/path.tar",
    ):
        for ndir in (0, 1):
            assert wds.cache.url_to_cache_name(url, ndir) == theirs.url_to_cache_name(url, ndir)
        assert wds.cache.islocal(url) == theirs.islocal(url)


def test_file_cache_downloads_whole_then_reads_the_copy(http_server, tmp_path):
    shard = tmp_path / "train-000.tar"
    write_tar(shard, sample_members(5, prefix="t-"))
    url = http_server.put("d/train-000.tar", shard.read_bytes())
    cache = tmp_path / "cache"

    def keys() -> list:
        ds = webds.DataPipeline(
            webds.SimpleShardList([url]),
            wds.cache.FileCache(str(cache)),
            webds.tar_file_expander(),
            webds.group_by_keys(),
        )
        return [s["__key__"] for s in ds]

    assert keys() == [f"t-{i:06d}" for i in range(5)]
    assert (cache / "train-000.tar").read_bytes() == shard.read_bytes()
    http_server.log.clear()
    assert keys() == [f"t-{i:06d}" for i in range(5)]
    assert not [r for r in http_server.log if r[0] == "GET"]  # read from the copy


def test_file_cache_refuses_what_is_not_a_tar(http_server, tmp_path):
    url = http_server.put("page.tar", b"<html>an error page</html>")
    fc = wds.cache.FileCache(str(tmp_path / "cache"))
    with pytest.raises(ShardReadError, match="not a tar archive"):
        fc.get_file(url)
    assert not (tmp_path / "cache" / "page.tar").exists()
    skipping = wds.cache.FileCache(str(tmp_path / "c2"), handler=lambda exn: False)
    assert list(skipping([url])) == []


def test_streaming_open_yields_streams(tmp_path):
    shard = tmp_path / "a.tar"
    write_tar(shard, sample_members(2))
    (item,) = list(wds.cache.StreamingOpen()([str(shard)]))
    assert item["url"] == str(shard) and item["local_path"] == str(shard)
    assert item["stream"].read() == shard.read_bytes()
    item["stream"].close()
