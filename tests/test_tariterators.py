"""webds.tariterators: webdataset's plain functions, composed the ways webdataset code does."""

from __future__ import annotations

import pickle

import pytest
from conftest import sample_members, write_tar

import webds
from webds.compat import tariterators as t


@pytest.fixture
def shards(tmp_path):
    return [
        str(write_tar(tmp_path / f"s{i}.tar", sample_members(3, prefix=f"{i}-"))) for i in range(2)
    ]


def keys(samples):
    return [s["__key__"] for s in samples]


EXPECTED = ["0-000000", "0-000001", "0-000002", "1-000000", "1-000001", "1-000002"]


def test_called_on_iterators(shards):
    samples = list(t.group_by_keys(t.tar_file_expander(t.url_opener({"url": u} for u in shards))))
    assert keys(samples) == EXPECTED
    assert samples[0]["txt"] == b"sample 0-000000 txt" and samples[0]["__url__"] == shards[0]


def test_passed_uncalled_as_pipeline_stages(shards):
    pipeline = webds.DataPipeline(
        webds.SimpleShardList(shards), t.url_opener, t.tar_file_expander, t.group_by_keys
    )
    assert keys(pipeline) == EXPECTED
    assert keys(t.tarfile_samples({"url": u} for u in shards)) == EXPECTED


def test_keyword_arguments_as_in_webdataset(shards):
    opened = t.url_opener([{"url": shards[0]}], handler=webds.reraise_exception)
    members = t.tar_file_expander(opened, select_files=lambda name: name.endswith(".cls"))
    samples = list(t.group_by_keys(members, lcase=True, suffixes=None))
    assert [sorted(s) for s in samples] == [["__key__", "__local_path__", "__url__", "cls"]] * 3


def test_tar_file_iterator_on_an_open_stream(shards, tmp_path):
    with open(shards[1], "rb") as stream:
        members = list(t.tar_file_iterator(stream, rename_files=str.upper))
        assert not stream.closed  # the caller's stream
    assert [m["fname"] for m in members][:2] == ["1-000000.TXT", "1-000000.CLS"]
    assert members[1]["data"] == b"0"
    meta = str(write_tar(tmp_path / "m.tar", [("__meta__", b"x"), ("a.txt", b"y")]))
    with open(meta, "rb") as stream:
        assert [m["fname"] for m in t.tar_file_iterator(stream)] == ["a.txt"]


def test_tar_file_iterator_errors_name_the_shard(tmp_path, shards):
    broken = tmp_path / "broken.tar"
    broken.write_bytes(open(shards[0], "rb").read()[:1500])
    with open(broken, "rb") as stream, pytest.raises(webds.ShardReadError, match="broken.tar"):
        list(t.tar_file_iterator(stream))
    with open(broken, "rb") as stream, pytest.warns(UserWarning, match="truncated"):
        got = list(t.tar_file_iterator(stream, handler=webds.warn_and_continue))
    assert [m["fname"] for m in got] == ["0-000000.txt"]  # the next header is cut


def test_functions_pickle_for_spawned_workers():
    for f in (t.url_opener, t.tar_file_expander, t.group_by_keys, t.tar_file_iterator):
        assert pickle.loads(pickle.dumps(f)) is f
