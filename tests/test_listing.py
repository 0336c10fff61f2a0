"""Listing shards: a directory/prefix ("data/", "s3://b/train/") or a glob ("gs://b/x-*.tar")
expands to its shard files, sorted, at construction; against real loopback S3 and GCS servers."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest
from conftest import sample_members, write_tar

from webds.errors import ArgumentError, WebdsError
from webds.fluent import WebDataset
from webds.shards import ResampledShards, SimpleShardList, expand_urls
from webds.writer import TarWriter

TARS = ["b-000001.tar", "a-000010.tar", "a-000002.tar", "a-000001.tgz"]


def _populate_local(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name in TARS:
        write_tar(root / name, sample_members(1, prefix=name.split(".")[0] + "-"))
    (root / "notes.txt").write_text("not a shard")
    (root / ".hidden.tar").write_bytes(b"")
    (root / "dir.tar").mkdir()  # a directory that looks like a shard is not one
    (root / "sub").mkdir()
    write_tar(root / "sub" / "a-000003.tar", sample_members(1))


def _tar_bytes(keys) -> bytes:
    """A small tar, written by Python's tarfile, with one .txt member per key."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for k in keys:
            data = f"payload of {k}".encode()
            info = tarfile.TarInfo(f"{k}.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_local_directory_lists_shard_files_sorted(tmp_path: Path) -> None:
    _populate_local(tmp_path / "data")
    spec = f"{tmp_path}/data/"
    assert expand_urls(spec) == [
        f"{tmp_path}/data/a-000001.tgz",
        f"{tmp_path}/data/a-000002.tar",
        f"{tmp_path}/data/a-000010.tar",
        f"{tmp_path}/data/b-000001.tar",
    ]


def test_relative_directory_and_glob_keep_the_spelling(tmp_path: Path, monkeypatch) -> None:
    _populate_local(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    assert expand_urls("data/")[0] == "data/a-000001.tgz"
    assert expand_urls("data/a-*.tar") == ["data/a-000002.tar", "data/a-000010.tar"]


def test_local_glob_sorted_files_only_and_recursive(tmp_path: Path) -> None:
    _populate_local(tmp_path / "data")
    d = f"{tmp_path}/data"
    assert expand_urls(f"{d}/*.tar") == [
        f"{d}/a-000002.tar",
        f"{d}/a-000010.tar",
        f"{d}/b-000001.tar",
    ]
    assert expand_urls(f"{d}/a-00000[12].t*") == [f"{d}/a-000001.tgz", f"{d}/a-000002.tar"]
    assert expand_urls(f"{d}/?-000001.*") == [f"{d}/a-000001.tgz", f"{d}/b-000001.tar"]
    assert f"{d}/sub/a-000003.tar" in expand_urls(f"{d}/**/a-*.tar")
    # Braces first, then each alternative globbed in turn.
    assert expand_urls(f"{d}/{{b,a}}-*.tar") == [
        f"{d}/b-000001.tar",
        f"{d}/a-000002.tar",
        f"{d}/a-000010.tar",
    ]


def test_file_url_directory_and_literal_bracket_name(tmp_path: Path) -> None:
    _populate_local(tmp_path / "data")
    got = expand_urls(f"file://{tmp_path}/data/")
    assert got[0] == (tmp_path / "data" / "a-000001.tgz").as_uri()
    assert len(got) == 4
    odd = tmp_path / "odd[1].tar"
    write_tar(odd, sample_members(1))
    assert expand_urls(str(odd)) == [str(odd)]


def test_nothing_found_is_an_argument_error_naming_the_spec(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for spec in (f"{tmp_path}/empty/", f"{tmp_path}/missing/", f"{tmp_path}/empty/*.tar"):
        with pytest.raises(ArgumentError) as info:
            expand_urls(spec)
        assert spec in str(info.value)
    with pytest.raises(ArgumentError, match="found no"):
        SimpleShardList(f"{tmp_path}/empty/")
    with pytest.raises(ArgumentError, match="found no"):
        WebDataset(f"{tmp_path}/empty/*.tar")


def test_a_file_with_a_trailing_slash_says_so(tmp_path: Path) -> None:
    write_tar(tmp_path / "a.tar", sample_members(1))
    with pytest.raises(ArgumentError, match="not a directory"):
        expand_urls(f"{tmp_path}/a.tar/")


def test_plain_urls_pipes_and_queries_are_not_listed(tmp_path: Path) -> None:
    # No listing means no filesystem or network access: these names exist nowhere.
    assert expand_urls("s3://no-such-bucket/a-{0..1}.tar") == [
        "s3://no-such-bucket/a-0.tar",
        "s3://no-such-bucket/a-1.tar",
    ]
    assert expand_urls("pipe:cat /nowhere/*.tar") == ["pipe:cat /nowhere/*.tar"]
    signed = "https://host.invalid/a.tar?X-Amz-Signature=abc&x=[1]"
    assert expand_urls(signed) == [signed]
    assert expand_urls("-") == ["-"]


def test_webdataset_over_a_local_directory_reads_every_sample_once(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    for i in range(3):
        write_tar(d / f"s-{i:03d}.tar", sample_members(4, prefix=f"s{i}-"))
    # GNU tar writes one of them, as an independent check of the format.
    src = tmp_path / "src"
    src.mkdir()
    (src / "g-000001.txt").write_text("gnu")
    subprocess.run(["tar", "-cf", str(d / "s-003.tar"), "-C", str(src), "g-000001.txt"], check=True)
    keys = [s["__key__"] for s in WebDataset(f"{d}/")]
    assert sorted(keys) == sorted(
        [f"s{i}-{j:06d}" for i in range(3) for j in range(4)] + ["g-000001"]
    )
    assert len(keys) == len(set(keys))


# --- S3 (moto on loopback) ------------------------------------------------------------------


def _populate(store, names) -> None:
    for name in names:
        store.put(name, _tar_bytes([name.replace("/", "_").split(".")[0]]))


def test_s3_prefix_lists_shards_sorted(s3) -> None:
    _populate(
        s3,
        [
            "train/b-1.tar",
            "train/a-2.tar",
            "train/a-1.tar.gz",
            "train/readme.md",
            "train/sub/c-1.tar",
            "val/v-1.tar",
            "train.tar",
        ],
    )
    got = expand_urls(s3.url("train/"), storage_options=s3.storage_options)
    assert got == [s3.url("train/a-1.tar.gz"), s3.url("train/a-2.tar"), s3.url("train/b-1.tar")]
    # The bucket root lists only the top level.
    assert expand_urls(f"s3://{s3.bucket}/", storage_options=s3.storage_options) == [
        s3.url("train.tar")
    ]


def test_s3_glob_and_braces(s3) -> None:
    _populate(s3, [f"train/x-{i:03d}.tar" for i in (5, 0, 12, 3)] + ["train/y-000.tar"])
    opts = s3.storage_options
    assert expand_urls(s3.url("train/x-*.tar"), storage_options=opts) == [
        s3.url(f"train/x-{i:03d}.tar") for i in (0, 3, 5, 12)
    ]
    assert expand_urls(s3.url("train/{y,x}-00[03].tar"), storage_options=opts) == [
        s3.url("train/y-000.tar"),
        s3.url("train/x-000.tar"),
        s3.url("train/x-003.tar"),
    ]


def test_s3_nothing_found_is_an_argument_error(s3) -> None:
    _populate(s3, ["train/a.tar"])
    for spec in (s3.url("nothing/"), s3.url("train/*.tgz"), s3.url("train/")[:-1] + "x/"):
        with pytest.raises(ArgumentError) as info:
            expand_urls(spec, storage_options=s3.storage_options)
        assert spec in str(info.value)


def test_s3_listing_sees_shards_written_after_an_earlier_listing(s3) -> None:
    opts = s3.storage_options
    _populate(s3, ["t/a.tar"])
    assert expand_urls(s3.url("t/"), storage_options=opts) == [s3.url("t/a.tar")]
    # Written by another client, behind the back of s3fs's listing cache.
    _populate(s3, ["t/b.tar"])
    assert expand_urls(s3.url("t/"), storage_options=opts) == [s3.url("t/a.tar"), s3.url("t/b.tar")]
    assert expand_urls(s3.url("t/*"), storage_options=opts)[-1] == s3.url("t/b.tar")
    with TarWriter(s3.url("t/c.tar"), storage_options=opts) as sink:
        sink.write({"__key__": "k", "txt": "v"})
    assert expand_urls(s3.url("t/"), storage_options=opts)[-1] == s3.url("t/c.tar")


def test_webdataset_over_an_s3_prefix_reads_every_sample_once(s3) -> None:
    expected = []
    for i in range(5):
        keys = [f"s{i}-{j:04d}" for j in range(7)]
        expected += keys
        s3.put(f"train/shard-{i:06d}.tar", _tar_bytes(keys))
    ds = WebDataset(s3.url("train/"), storage_options=s3.storage_options, shardshuffle=True)
    assert len(ds.pipeline[0]) == 5
    keys = [s["__key__"] for s in ds]
    assert sorted(keys) == sorted(expected)
    assert len(keys) == len(expected)
    # Listing happened once, at construction: deleting a shard afterwards makes reading it fail
    # rather than silently shrinking the list.
    s3.delete("train/shard-000004.tar")
    with pytest.raises(WebdsError, match="shard-000004"):
        list(ds)


def test_listing_ignores_open_and_retry_options(s3) -> None:
    _populate(s3, ["o/a.tar"])
    opts = dict(
        s3.storage_options, block_size=2**20, cache_type="readahead", retries=2, retry_backoff=0.01
    )
    assert expand_urls(s3.url("o/*.tar"), storage_options=opts) == [s3.url("o/a.tar")]
    assert [s["__key__"] for s in WebDataset(s3.url("o/"), storage_options=opts)] == ["o_a"]


def test_resampled_over_an_s3_glob(s3) -> None:
    _populate(s3, ["r/a-0.tar", "r/a-1.tar"])
    src = ResampledShards(s3.url("r/a-*.tar"), nshards=20, storage_options=s3.storage_options)
    assert src.urls == [s3.url("r/a-0.tar"), s3.url("r/a-1.tar")]
    assert {d["url"] for d in src} <= set(src.urls)


def test_s3_listing_without_storage_options_uses_the_environment(s3) -> None:
    # The fixture points AWS_ENDPOINT_URL and the keys at moto, as a user's environment would.
    _populate(s3, ["e/a.tar"])
    assert expand_urls(s3.url("e/")) == [s3.url("e/a.tar")]


# --- GCS (the emulator, a separate process) -------------------------------------------------


def test_gcs_glob_and_prefix(gcs) -> None:
    _populate(gcs, ["x-002.tar", "x-000.tar", "x-001.tar", "y-000.tar", "d/x-003.tar"])
    opts = gcs.storage_options
    assert expand_urls(gcs.url("x-*.tar"), storage_options=opts) == [
        gcs.url(f"x-{i:03d}.tar") for i in range(3)
    ]
    assert expand_urls(gcs.url("d/"), storage_options=opts) == [gcs.url("d/x-003.tar")]
    with pytest.raises(ArgumentError, match="found no"):
        expand_urls(gcs.url("z-*.tar"), storage_options=opts)


def test_webdataset_over_a_gcs_glob(gcs) -> None:
    expected = []
    for i in range(3):
        keys = [f"g{i}-{j:03d}" for j in range(4)]
        expected += keys
        gcs.put(f"train-{i:03d}.tar", _tar_bytes(keys))
    ds = WebDataset(gcs.url("train-*.tar"), storage_options=gcs.storage_options)
    keys = [s["__key__"] for s in ds]
    assert sorted(keys) == sorted(expected) and len(keys) == len(expected)


def test_listing_an_unknown_protocol_names_the_url() -> None:
    with pytest.raises(ArgumentError, match="nosuchproto"):
        expand_urls("nosuchproto://bucket/x-*.tar")
