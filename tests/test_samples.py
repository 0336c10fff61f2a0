"""webds.tar.samples: grouping tar members into samples, error handling, closing, peer shards."""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import re
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import sample_members, write_tar

from webds.base.handlers import ignore_and_continue, ignore_and_stop, reraise_exception
from webds.errors import OpenError, SampleError, ShardReadError
from webds.pipeline import DataPipeline
from webds.tar.samples import (
    base_plus_ext,
    group_by_keys,
    tar_file_expander,
    tarfile_samples,
    tarfile_to_samples,
    url_opener,
)

# webdataset's own rule, written as its regular expression: an independent reference.
WDS_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
META_RE = re.compile(r"__[^/]*__($|/)")


def composed(handler=reraise_exception, select_files=None, rename_files=None) -> list:
    return [
        tarfile_to_samples(handler=handler, select_files=select_files, rename_files=rename_files)
    ]


def staged(handler=reraise_exception, select_files=None, rename_files=None) -> list:
    return [
        url_opener(handler=handler),
        tar_file_expander(handler=handler, select_files=select_files, rename_files=rename_files),
        group_by_keys(handler=handler),
    ]


@pytest.fixture(params=[composed, staged], ids=["tarfile_to_samples", "three_stages"])
def stages(request):
    return request.param


def run(stages, shards, **kw) -> List[Dict[str, Any]]:
    return list(DataPipeline(tuple(shards), stages(**kw)))


def run_until_error(stages, shards, **kw):
    """The samples yielded before an error, and the error."""
    got = []
    try:
        for s in DataPipeline(tuple(shards), stages(**kw)):
            got.append(s)
    except Exception as exn:
        return got, exn
    return got, None


def fields(sample: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in sample.items() if k not in ("__url__", "__local_path__")}


def reference_samples(path: Path) -> List[Dict[str, Any]]:
    """Samples as Python's tarfile plus webdataset's grouping regex make them."""
    out: List[Dict[str, Any]] = []
    cur: Dict[str, Any] = {}
    with tarfile.open(str(path), "r:*") as tf:
        for m in tf:
            if not m.isreg() or META_RE.match(m.name):
                continue
            match = WDS_KEY_RE.match(m.name)
            if not match:
                continue
            key, ext = match.group(1), match.group(2).lower()
            if cur.get("__key__") != key:
                if cur:
                    out.append(cur)
                cur = {"__key__": key}
            cur[ext] = tf.extractfile(m).read()
    if cur:
        out.append(cur)
    return out


# ---------------------------------------------------------------------------------------------
# The key rule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, expected",
    [
        ("a/b.c/d.seg.jpg", ("a/b.c/d", "seg.jpg")),
        ("0001.jpg", ("0001", "jpg")),
        ("0001.JPG", ("0001", "JPG")),
        ("235342 Track 2.0 (Clean).mp3", ("235342 Track 2", "0 (Clean).mp3")),
        ("x.", ("x", "")),
        ("noext", (None, None)),
        ("dir.v2/file", (None, None)),
        (".hidden", (None, None)),
        ("a/.b.c", ("a/", "b.c")),
        ("/.x", ("/", "x")),
        ("a/b.c/.x", (None, None)),
        ("d.v/x/.y", ("d.v/x/", "y")),
        ("a/b/", (None, None)),
    ],
)
def test_base_plus_ext(path: str, expected) -> None:
    assert base_plus_ext(path) == expected


def test_base_plus_ext_agrees_with_the_webdataset_regex() -> None:
    parts = ["a", "b.c", "", ".", ".z", "d.e.f", "x y", "ü", "__m__", "v."]
    for combo in itertools.product(parts, repeat=3):
        path = (
            "/".join(p for p in combo[:2] if p) + ("/" if combo[0] or combo[1] else "") + combo[2]
        )
        m = WDS_KEY_RE.match(path)
        assert base_plus_ext(path) == ((m.group(1), m.group(2)) if m else (None, None)), path


# ---------------------------------------------------------------------------------------------
# Grouping rules
# ---------------------------------------------------------------------------------------------


def test_multi_dot_extensions_directories_and_case(stages, tar_factory) -> None:
    path = tar_factory(
        "s.tar",
        [
            ("a/b.c/d.seg.jpg", b"1"),
            ("a/b.c/d.JPG", b"2"),
            ("a/b.c/d.Cls", b"3"),
            ("a/b.c/E.txt", b"4"),
        ],
    )
    got = run(stages, [{"url": str(path)}])
    assert [fields(s) for s in got] == [
        {"__key__": "a/b.c/d", "seg.jpg": b"1", "jpg": b"2", "cls": b"3"},
        {"__key__": "a/b.c/E", "txt": b"4"},
    ]
    assert all(s["__url__"] == str(path) for s in got)
    assert all(s["__local_path__"] == str(path) for s in got)


def test_non_consecutive_keys_make_separate_samples(stages, tar_factory) -> None:
    path = tar_factory("s.tar", [("a.x", b"1"), ("b.x", b"2"), ("a.y", b"3")])
    got = run(stages, [{"url": str(path)}])
    assert [fields(s) for s in got] == [
        {"__key__": "a", "x": b"1"},
        {"__key__": "b", "x": b"2"},
        {"__key__": "a", "y": b"3"},
    ]


def test_samples_never_merge_across_shards(stages, tar_factory) -> None:
    one = tar_factory("one.tar", [("k.a", b"1")])
    two = tar_factory("two.tar", [("k.b", b"2"), ("z.b", b"3")])
    got = run(stages, [{"url": str(one)}, {"url": str(two)}])
    assert [(s["__key__"], s["__url__"], fields(s)) for s in got] == [
        ("k", str(one), {"__key__": "k", "a": b"1"}),
        ("k", str(two), {"__key__": "k", "b": b"2"}),
        ("z", str(two), {"__key__": "z", "b": b"3"}),
    ]


def test_dotless_members_are_skipped_with_one_warning_per_shard(
    stages, tar_factory, caplog
) -> None:
    one = tar_factory("one.tar", [("README", b"r"), ("a.x", b"1"), ("dir.v2/noext", b"n")])
    two = tar_factory("two.tar", [("b.x", b"2"), (".hidden", b"h")])
    with caplog.at_level(logging.WARNING, logger="webds"):
        got = run(stages, [{"url": str(one)}, {"url": str(two)}])
    assert [fields(s) for s in got] == [{"__key__": "a", "x": b"1"}, {"__key__": "b", "x": b"2"}]
    warnings = [
        r.getMessage() for r in caplog.records if "without a key.extension" in r.getMessage()
    ]
    assert len(warnings) == 2
    assert "2 member(s)" in warnings[0] and "'README'" in warnings[0] and str(one) in warnings[0]
    assert "1 member(s)" in warnings[1] and "'.hidden'" in warnings[1] and str(two) in warnings[1]


def test_duplicate_extension_is_a_sample_error(stages, tar_factory) -> None:
    path = tar_factory(
        "dup.tar", [("a.jpg", b"1"), ("b.jpg", b"2"), ("b.JPG", b"3"), ("c.jpg", b"4")]
    )
    got, exn = run_until_error(stages, [{"url": str(path)}])
    assert [s["__key__"] for s in got] == ["a"]
    assert isinstance(exn, SampleError)
    assert exn.url == str(path) and exn.member == "b.JPG"
    assert exn.offset == 2048  # the header of the third member
    assert "duplicate" in str(exn) and "'jpg'" in str(exn)


def test_duplicate_extension_with_a_skipping_handler_drops_the_sample(stages, tar_factory) -> None:
    members = [("a.jpg", b"1"), ("b.jpg", b"2"), ("b.jpg", b"3"), ("b.cls", b"x"), ("c.jpg", b"4")]
    path = tar_factory("dup.tar", members)
    got = run(stages, [{"url": str(path)}], handler=ignore_and_continue)
    assert [fields(s) for s in got] == [
        {"__key__": "a", "jpg": b"1"},
        {"__key__": "c", "jpg": b"4"},
    ]


def test_rename_runs_before_select(stages, tar_factory) -> None:
    path = tar_factory(
        "s.tar", [("a.jpeg", b"1"), ("a.txt", b"t"), ("b.jpg", b"2"), ("c.drop", b"d")]
    )
    seen = []

    def rename(name: str):
        return None if name.endswith(".drop") else name.replace(".jpeg", ".jpg")

    def select(name: str) -> bool:
        seen.append(name)
        return name.endswith(".jpg")

    got = run(stages, [{"url": str(path)}], select_files=select, rename_files=rename)
    assert [fields(s) for s in got] == [
        {"__key__": "a", "jpg": b"1"},
        {"__key__": "b", "jpg": b"2"},
    ]
    assert seen == ["a.jpg", "a.txt", "b.jpg"]


def test_meta_files_are_skipped(stages, tar_factory, caplog) -> None:
    path = tar_factory(
        "m.tar",
        [("__meta__", b"m"), ("__index__/x.json", b"{}"), ("a.x", b"1"), ("d/__x__.y", b"2")],
    )
    with caplog.at_level(logging.WARNING, logger="webds"):
        got = run(stages, [{"url": str(path)}])
    assert [fields(s) for s in got] == [
        {"__key__": "a", "x": b"1"},
        {"__key__": "d/__x__", "y": b"2"},  # not top-level: an ordinary member
    ]
    assert not caplog.records


def test_compressed_shards_need_no_flag(stages, tar_factory) -> None:
    members = sample_members(20, ("txt", "cls"))
    gz = tar_factory("s.tgz", members, compress="gz")
    bz = tar_factory("s.tar.bz2", members, compress="bz2")
    for path in (gz, bz):
        got = run(stages, [{"url": str(path)}])
        assert len(got) == 20 and got[3]["cls"] == b"3"


def test_pipe_urls_have_no_local_path(stages, tar_factory) -> None:
    path = tar_factory("s.tar", sample_members(3))
    url = f"pipe:cat {path}"
    got = run(stages, [{"url": url}])
    assert [s["__key__"] for s in got] == ["000000", "000001", "000002"]
    assert all(s["__url__"] == url and "__local_path__" not in s for s in got)


def test_group_by_keys_options(tar_factory) -> None:
    path = tar_factory("s.tar", [("a.JPG", b"1"), ("a.cls", b"2"), ("b.JPG", b"3")])
    shards = ({"url": str(path)},)
    got = list(DataPipeline(shards, url_opener(), tar_file_expander(), group_by_keys(lcase=False)))
    assert [fields(s) for s in got] == [
        {"__key__": "a", "JPG": b"1", "cls": b"2"},
        {"__key__": "b", "JPG": b"3"},
    ]
    got = list(
        DataPipeline(shards, url_opener(), tar_file_expander(), group_by_keys(suffixes=["cls"]))
    )
    assert [fields(s) for s in got] == [{"__key__": "a", "cls": b"2"}, {"__key__": "b"}]


def test_member_dicts_from_tar_file_expander(tar_factory) -> None:
    path = tar_factory("s.tar", [("a.x", b"1"), ("b.y", b"2")])
    got = list(DataPipeline(({"url": str(path)},), url_opener(), tar_file_expander()))
    assert got == [
        {
            "fname": "a.x",
            "data": b"1",
            "__url__": str(path),
            "__local_path__": str(path),
            "__offset__": 0,
        },
        {
            "fname": "b.y",
            "data": b"2",
            "__url__": str(path),
            "__local_path__": str(path),
            "__offset__": 1024,
        },
        {},  # the end-of-shard marker
    ]


def test_plain_function_and_pickling(tar_factory) -> None:
    path = tar_factory("s.tar", sample_members(4))
    direct = list(tarfile_samples(iter([{"url": str(path)}])))
    assert [s["__key__"] for s in direct] == ["000000", "000001", "000002", "000003"]
    stage = pickle.loads(pickle.dumps(tarfile_to_samples(handler=ignore_and_continue)))
    assert list(stage(iter([{"url": str(path)}]))) == direct


# ---------------------------------------------------------------------------------------------
# Broken shards and handlers
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def three_shards(tmp_path: Path):
    """good (5 samples), truncated inside sample 6's second member (10 written), good (5)."""
    good1 = write_tar(tmp_path / "good1.tar", sample_members(5, prefix="g1-"))
    good2 = write_tar(tmp_path / "good2.tar", sample_members(5, prefix="g2-"))
    full = write_tar(tmp_path / "full.tar", sample_members(10, prefix="t-"))
    with tarfile.open(str(full)) as tf:
        cut_at = next(m for m in tf if m.name == "t-000006.cls").offset_data + 1
    bad = tmp_path / "bad.tar"
    bad.write_bytes(full.read_bytes()[:cut_at])
    keys = [f"g1-{i:06d}" for i in range(5)] + [f"t-{i:06d}" for i in range(6)]
    after = [f"g2-{i:06d}" for i in range(5)]
    return [{"url": str(p)} for p in (good1, bad, good2)], keys, after


def test_reraise_yields_every_complete_sample_first(stages, three_shards) -> None:
    shards, before, _ = three_shards
    got, exn = run_until_error(stages, shards)
    assert [s["__key__"] for s in got] == before
    assert isinstance(exn, ShardReadError)
    assert exn.url == shards[1]["url"] and exn.member == "t-000006.cls"
    assert "truncated" in str(exn)


def test_skipping_handler_drops_the_sample_in_flight(stages, three_shards, caplog) -> None:
    shards, before, after = three_shards
    with caplog.at_level(logging.WARNING, logger="webds"):
        got = run(stages, shards, handler=ignore_and_continue)
    assert [s["__key__"] for s in got] == before + after
    assert any("skipped 1 item" in r.getMessage() for r in caplog.records)


def test_stopping_handler_ends_the_stream(stages, three_shards) -> None:
    shards, before, _ = three_shards
    got = run(stages, shards, handler=ignore_and_stop)
    assert [s["__key__"] for s in got] == before


def test_missing_and_garbage_shards(stages, three_shards, tmp_path: Path) -> None:
    shards, before, after = three_shards
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"this is not a tar file\n" * 100)
    good1, good2 = shards[0], shards[2]
    listed = [good1, {"url": str(tmp_path / "missing.tar")}, {"url": str(garbage)}, good2]
    got = run(stages, listed, handler=ignore_and_continue)
    assert [s["__key__"] for s in got] == before[:5] + after
    got, exn = run_until_error(stages, listed)
    assert [s["__key__"] for s in got] == before[:5]
    assert isinstance(exn, OpenError) and "missing.tar" in str(exn)
    got, exn = run_until_error(stages, [good1, {"url": str(garbage)}])
    assert isinstance(exn, ShardReadError) and "not a tar archive" in str(exn)


def test_failing_pipe_command_is_an_error(stages, tar_factory) -> None:
    path = tar_factory("s.tar", sample_members(3))
    # The command delivers part of the shard, then fails.
    got, exn = run_until_error(stages, [{"url": f"pipe:head -c 3000 {path}; exit 3"}])
    assert isinstance(exn, OpenError) and "status 3" in str(exn)
    assert [s["__key__"] for s in got] == ["000000"]


# ---------------------------------------------------------------------------------------------
# Streams are closed
# ---------------------------------------------------------------------------------------------


def test_streams_are_closed_after_each_shard(stages, three_shards) -> None:
    shards, _, _ = three_shards
    streams = [open(s["url"], "rb") for s in shards]
    described = [dict(s, stream=f) for s, f in zip(shards, streams)]
    run(stages, described, handler=ignore_and_continue)
    assert all(f.closed for f in streams)


def test_streams_are_closed_on_early_stop(stages, three_shards) -> None:
    shards, _, _ = three_shards
    streams = [open(s["url"], "rb") for s in shards]
    described = [dict(s, stream=f) for s, f in zip(shards, streams)]
    it = iter(DataPipeline(tuple(described), stages()))
    assert next(it)["__key__"] == "g1-000000"
    assert not streams[0].closed
    it.close()
    assert streams[0].closed
    for f in streams[1:]:  # never reached: not ours to close
        assert not f.closed
        f.close()


def test_streams_are_closed_on_error(stages, three_shards) -> None:
    shards, _, _ = three_shards
    streams = [open(s["url"], "rb") for s in shards[:2]]
    described = [dict(s, stream=f) for s, f in zip(shards, streams)]
    _, exn = run_until_error(stages, described)
    assert isinstance(exn, ShardReadError)
    assert all(f.closed for f in streams)


def test_url_opener_adds_stream_and_local_path(tar_factory) -> None:
    path = tar_factory("s.tar", sample_members(1))
    (out,) = list(url_opener()(iter([{"url": str(path), "extra": 1}])))
    try:
        assert out["url"] == str(path) and out["extra"] == 1
        assert out["local_path"] == str(path)
        assert out["stream"].read(5) == b"00000"
    finally:
        out["stream"].close()


def test_only_the_sample_in_flight_is_held(stages, tar_factory) -> None:
    members = [(f"{i:04d}.bin", os.urandom(256 * 1024)) for i in range(80)]  # 20 MiB shard
    path = tar_factory("s.tar", members)
    tracemalloc.start()
    try:
        n = 0
        for sample in DataPipeline(({"url": str(path)},), stages()):
            n += len(sample["bin"])
            del sample
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 80 * 256 * 1024
    assert peak < 8 * 1024 * 1024  # read chunks and a sample or two, not the shard


# ---------------------------------------------------------------------------------------------
# Shards written by another implementation
# ---------------------------------------------------------------------------------------------

PEER_EXPECTED = {
    "compressed.tar": (None, {"txt.gz"}),
    "mpdata.tar": (100, {"mp"}),
    "tendata.tar": (100, {"ten"}),
    "testgz.tar": (1000, {"txt.gz"}),
    "sample.tgz": (90, {"cls", "png"}),
}


@pytest.mark.parametrize("name", list(PEER_EXPECTED))
def test_peer_shards(stages, peer_dir: Path, name: str) -> None:
    path = peer_dir / name
    got = run(stages, [{"url": str(path)}])
    assert [fields(s) for s in got] == reference_samples(path)
    count, exts = PEER_EXPECTED[name]
    if count is not None:
        assert len(got) == count
    assert got and all(set(s) - {"__key__", "__url__", "__local_path__"} == exts for s in got)
    assert all(s["__url__"] == str(path) and s["__local_path__"] == str(path) for s in got)


def test_peer_member_bytes_match_tarfile(peer_dir: Path) -> None:
    from webds.tar.reader import read_members

    for path in sorted(peer_dir.glob("*.t*")):
        with tarfile.open(str(path), "r:*") as tf:
            expected = [(m.name, tf.extractfile(m).read()) for m in tf if m.isreg()]
        with open(path, "rb") as f:
            assert [(n, d) for n, d, _ in read_members(f, str(path))] == expected


def test_missing_peer_data_skips_here_and_fails_where_it_must_run(tmp_path, monkeypatch):
    from conftest import find_peer_dir

    missing = tmp_path / "no-such-folder"
    monkeypatch.delenv("WEBDS_REQUIRE_PEER_TESTDATA", raising=False)
    with pytest.raises(pytest.skip.Exception):
        find_peer_dir(missing)
    monkeypatch.setenv("WEBDS_REQUIRE_PEER_TESTDATA", "1")  # as .ci/run sets it
    with pytest.raises(pytest.fail.Exception, match="must run"):
        find_peer_dir(missing)
    assert find_peer_dir(tmp_path) == tmp_path
