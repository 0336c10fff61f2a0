"""webds.tariterators: webdataset's plain functions, composed the ways webdataset code does."""

from __future__ import annotations

import pickle

import pytest
from clients import open_clip_data
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


# -- damaged shards under open_clip's own grouping code --------------------------------------


def tarfile_to_samples_nothrow(wds, src, handler):
    """open_clip's ``tarfile_to_samples_nothrow`` (tests/clients/open_clip_data.py) over
    ``wds``, with the fix given in webdataset issue #384 / open_clip issue #935: its
    ``tar_file_expander`` yields members only (``eof_value=None``). That is how training code
    meets damaged shards."""
    streams = wds.tariterators.url_opener(src, handler=handler)
    files = wds.tariterators.tar_file_expander(streams, handler=handler, eof_value=None)
    return open_clip_data.make(wds).group_by_keys_nothrow(files, handler=handler)


def _damaged_shards(tmp_path, how):
    """A damaged shard of 6 samples followed by a good one, written by webdataset's TarWriter
    (a pax header before every member): cut inside the data of sample 3's second member, or
    cut between samples 3 and 4 without the end-of-archive marker (a killed writer)."""
    import tarfile

    wd = pytest.importorskip("webdataset")
    paths = []
    for name, n in (("bad", 6), ("good", 2)):
        path = tmp_path / f"{name}.tar"
        with wd.TarWriter(str(path)) as sink:
            for i in range(n):
                sink.write({"__key__": f"{name}{i}", "txt": b"t" * 700, "cls": str(i).encode()})
        paths.append(str(path))
    with tarfile.open(paths[0]) as tf:
        members = {m.name: m for m in tf.getmembers()}
    raw = open(paths[0], "rb").read()
    if how == "cut":
        end = members["bad3.txt"].offset_data + 300
    else:
        end = members["bad4.cls"].offset  # sample 4's first header (its pax header before it)
        end -= 1024 if raw[end - 1024 + 156 : end - 1024 + 157] == b"x" else 0
    with open(paths[0], "wb") as f:
        f.write(raw[:end])
    return paths


@pytest.mark.parametrize("how", ["cut", "unterminated"])
def test_open_clip_grouping_on_a_damaged_shard_reads_as_with_webdataset(tmp_path, how):
    """open_clip's tarfile_to_samples_nothrow, over webds.tariterators and over webdataset
    1.0.2's: the same samples, and the handler hears of the damage (it used to die with
    KeyError 'fname' on webds's marker after the damaged shard)."""
    import webdataset

    urls = _damaged_shards(tmp_path, how)
    got = {}
    for name, module in (("webdataset", webdataset), ("webds", webds)):
        heard: list = []
        samples = tarfile_to_samples_nothrow(
            module, [{"url": u} for u in urls], lambda exn, heard=heard: heard.append(exn) or True
        )
        got[name] = [(s["__key__"], sorted(k for k in s if k[:2] != "__")) for s in samples]
        assert heard or (how == "unterminated" and name == "webdataset"), name
    assert got["webds"] == got["webdataset"]
    whole = ["bad0", "bad1", "bad2"] + (["bad3"] if how == "unterminated" else [])
    assert [k for k, _ in got["webds"]][: len(whole)] == whole
    assert [k for k, _ in got["webds"]][-2:] == ["good0", "good1"]


def test_eof_value_none_yields_only_members_after_a_damaged_shard(tmp_path):
    urls = _damaged_shards(tmp_path, "cut")
    opened = t.url_opener([{"url": u} for u in urls])
    items = list(t.tar_file_expander(opened, handler=webds.ignore_and_continue, eof_value=None))
    assert len(items) == 7 + 4 and all({"fname", "data", "__url__"} <= set(m) for m in items)
    # The default still marks the damage, so that webds's group_by_keys drops the cut sample.
    opened = t.url_opener([{"url": u} for u in urls])
    items = list(t.tar_file_expander(opened, handler=webds.ignore_and_continue))
    assert {"__bad__": True, "__url__": urls[0]} in items and items[-1] == {}
    end = object()
    opened = t.url_opener([{"url": u} for u in urls])
    items = list(t.tar_file_expander(opened, handler=webds.ignore_and_continue, eof_value=end))
    assert [m for m in items if m is end] == [end] and items[-1] is end  # the good shard's
