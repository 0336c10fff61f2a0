"""The shard index (webds.shards.index): built from real tar files written by Python's tarfile,
saved, moved, loaded locally and from S3 (moto on loopback), verified against damaged shards,
and written by ShardWriter while it writes."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import List

import pytest
from conftest import sample_members, write_tar

import webds
from webds.errors import ArgumentError, OpenError, ShardReadError
from webds.shards.index import (
    FORMAT,
    Problem,
    ShardIndex,
    ShardInfo,
    default_index_name,
    is_index_url,
)
from webds.writer import ShardWriter


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def reader_count(url: str, **kw) -> int:
    return len(list(webds.WebDataset(url, **kw)))


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """A folder of shards: plain, gzipped, with meta members and a dotless member."""
    root = tmp_path / "data"
    root.mkdir()
    write_tar(root / "a-0.tar", sample_members(5))
    write_tar(root / "a-1.tar", sample_members(3, exts=("jpg", "cls", "seg.png")))
    write_tar(root / "a-2.tar.gz", sample_members(4), compress="gz")
    meta = [("__meta__", b"{}"), ("__index__/x.json", b"[]")] + sample_members(2)
    write_tar(root / "a-3.tar", meta + [("README", b"no key")] + sample_members(1, prefix="z"))
    return root


def shard_paths(root: Path) -> List[Path]:
    return [root / n for n in ("a-0.tar", "a-1.tar", "a-2.tar.gz", "a-3.tar")]


# -- build ----------------------------------------------------------------------------------


def test_build_counts_sizes_and_checksums_match_the_reader(dataset: Path) -> None:
    paths = shard_paths(dataset)
    index = ShardIndex.build([str(p) for p in paths])
    assert index.urls == [str(p) for p in paths]
    assert index.counts == [reader_count(str(p)) for p in paths] == [5, 3, 4, 3]
    assert index.total == 15 and len(index) == 4
    for info, path in zip(index.shards, paths):
        assert info.bytes == path.stat().st_size
        assert info.sha256 == sha256(path)  # of the stored bytes: gzip included
    assert index.location is None


def test_build_takes_patterns_globs_and_folders(dataset: Path) -> None:
    by_list = ShardIndex.build([str(p) for p in shard_paths(dataset)])
    by_glob = ShardIndex.build(str(dataset / "a-*.tar*"))
    by_folder = ShardIndex.build(str(dataset) + "/")
    by_braces = ShardIndex.build(str(dataset / "a-{0..1}.tar") + "::" + str(dataset / "a-3.tar"))
    assert by_glob.counts == by_folder.counts == by_list.counts
    assert by_braces.counts == [5, 3, 3]
    threaded = ShardIndex.build(str(dataset) + "/", workers=3)
    assert [s.sha256 for s in threaded] == [s.sha256 for s in by_folder]


def test_build_raises_the_reading_error_naming_the_shard(dataset: Path) -> None:
    bad = dataset / "a-0.tar"
    bad.write_bytes(bad.read_bytes()[:1800])
    with pytest.raises(ShardReadError, match="truncated") as info:
        ShardIndex.build(str(dataset) + "/")
    assert info.value.url == str(bad)
    with pytest.raises(OpenError, match="no such file"):
        ShardIndex.build(str(dataset / "nope.tar"))
    with pytest.raises(ArgumentError, match="workers"):
        ShardIndex.build(str(dataset / "a-1.tar"), workers=0)


# -- save and load ----------------------------------------------------------------------------


def test_save_writes_relative_urls_and_the_documented_format(dataset: Path) -> None:
    index = ShardIndex.build(str(dataset) + "/")
    index.save(dataset / "index.json")
    assert index.location == str(dataset / "index.json")
    doc = json.loads((dataset / "index.json").read_text())
    assert doc["format"] == FORMAT and doc["version"] == 1 and doc["samples"] == 15
    assert [s["url"] for s in doc["shards"]] == ["a-0.tar", "a-1.tar", "a-2.tar.gz", "a-3.tar"]
    assert doc["shards"][2] == {
        "url": "a-2.tar.gz",
        "samples": 4,
        "bytes": (dataset / "a-2.tar.gz").stat().st_size,
        "sha256": sha256(dataset / "a-2.tar.gz"),
    }
    # Saved atomically: no temporary file is left next to it.
    assert sorted(p.name for p in dataset.iterdir() if p.suffix == ".json") == ["index.json"]
    assert not [p for p in dataset.iterdir() if p.name.startswith(".")]


def test_moved_folder_loads_from_anywhere(dataset: Path, tmp_path: Path, monkeypatch) -> None:
    ShardIndex.build(str(dataset) + "/").save(str(dataset / "index.json"))
    before = ShardIndex.load(dataset / "index.json")
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(dataset, moved)
    shutil.rmtree(dataset)
    monkeypatch.chdir(tmp_path / "elsewhere")
    index = ShardIndex.load("copy/index.json")  # relative to another working folder
    assert index.urls == [str(moved / p.name) for p in shard_paths(dataset)]
    assert index.location == str(moved / "index.json")
    assert index.digest() == before.digest()  # same dataset, other place
    monkeypatch.chdir(tmp_path)  # the resolved URLs still work after a change of folder
    assert [reader_count(u) for u in index.urls] == index.counts
    assert index.verify() == []


def test_shards_outside_the_index_folder_are_stored_absolute(
    dataset: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(dataset)
    index = ShardIndex.build(["a-0.tar", "./a-1.tar"])
    (tmp_path / "idx").mkdir()
    index.save(tmp_path / "idx" / "i.json")
    doc = json.loads((tmp_path / "idx" / "i.json").read_text())
    assert [s["url"] for s in doc["shards"]] == [str(dataset / "a-0.tar"), str(dataset / "a-1.tar")]
    loaded = ShardIndex.load(tmp_path / "idx" / "i.json")
    assert loaded.urls == [str(dataset / "a-0.tar"), str(dataset / "a-1.tar")]
    # Saved inside the data folder instead, the same shards become relative.
    index.save("nested.json")
    doc = json.loads((dataset / "nested.json").read_text())
    assert [s["url"] for s in doc["shards"]] == ["a-0.tar", "a-1.tar"]


def test_subfolders_and_unknown_keys_round_trip(tmp_path: Path) -> None:
    sub = tmp_path / "train"
    sub.mkdir()
    write_tar(sub / "s.tar", sample_members(2))
    doc = {
        "format": FORMAT,
        "version": 1,
        "samples": 2,
        "created_by": {"tool": "future-webds", "n": 3},
        "shards": [{"url": "train/s.tar", "samples": 2, "bytes": None, "sha256": None, "x": [1]}],
    }
    (tmp_path / "index.json").write_text(json.dumps(doc))
    index = ShardIndex.load(str(tmp_path / "index.json"))
    assert index.urls == [str(sub / "s.tar")]
    assert index.shards[0] == ShardInfo(str(sub / "s.tar"), 2, None, None, {"x": [1]})
    assert index.extra == {"created_by": {"tool": "future-webds", "n": 3}}
    assert index.verify() == []  # unknown size and checksum: only readability and count
    index.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == doc


def test_digest_depends_on_urls_and_counts_only(dataset: Path, tmp_path: Path) -> None:
    index = ShardIndex.build(str(dataset) + "/")
    index.save(dataset / "index.json")
    digest = index.digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    same = ShardIndex.load(dataset / "index.json")
    same.shards[0].sha256 = None
    assert same.digest() == digest
    same.shards[0].samples += 1
    assert same.digest() != digest


# -- load errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ("[1, 2]", "not a webds shard index"),
        ('{"format": "other", "version": 1, "shards": []}', "'format' is 'other'"),
        (f'{{"format": "{FORMAT}", "version": 2, "shards": []}}', "version 2.*upgrade webds"),
        (f'{{"format": "{FORMAT}", "shards": []}}', "version None"),
        (f'{{"format": "{FORMAT}", "version": 1}}', "no 'shards' list"),
        (f'{{"format": "{FORMAT}", "version": 1, "shards": [3]}}', "shard entry 0 is int"),
        (f'{{"format": "{FORMAT}", "version": 1, "shards": [{{"samples": 1}}]}}', "no 'url'"),
        (
            f'{{"format": "{FORMAT}", "version": 1, "shards": [{{"url": "a.tar"}}]}}',
            r"shard entry 0 \('a.tar'\) has no 'samples' count",
        ),
        (
            f'{{"format": "{FORMAT}", "version": 1, "shards": [{{"url": "a", "samples": -1}}]}}',
            "not a count",
        ),
        (
            f'{{"format": "{FORMAT}", "version": 1, '
            '"shards": [{"url": "a", "samples": 1, "bytes": "9"}]}',
            "not a size",
        ),
        (
            f'{{"format": "{FORMAT}", "version": 1, '
            '"shards": [{"url": "a", "samples": 1, "sha256": "abc"}]}',
            "not a 64-digit hex digest",
        ),
        (
            f'{{"format": "{FORMAT}", "version": 1, "samples": 5, '
            '"shards": [{"url": "a", "samples": 1}]}',
            "add up to 1",
        ),
    ],
)
def test_bad_files_give_clear_errors(tmp_path: Path, text, match) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ArgumentError, match=match) as info:
        ShardIndex.load(path)
    assert str(path) in str(info.value)


def test_missing_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(OpenError, match=r"no shard index .*webds index SHARDS -o x\.json"):
        ShardIndex.load(tmp_path / "x.json")


# -- verify -----------------------------------------------------------------------------------


def test_verify_reports_every_problem_and_carries_on(tmp_path: Path) -> None:
    root = tmp_path / "v"
    root.mkdir()
    names = ["ok", "trunc", "data", "header", "missing", "count", "gz"]
    for name in names[:-1]:
        write_tar(root / f"{name}.tar", sample_members(4))
    write_tar(root / "gz.tar", sample_members(4), compress="gz")
    index = ShardIndex.build(str(root) + "/")
    index.save(root / "index.json")

    def damage(name: str, fn) -> None:
        path = root / f"{name}.tar"
        path.write_bytes(fn(bytearray(path.read_bytes())))

    def flip(at: int):
        def fn(data: bytearray) -> bytes:
            data[at] ^= 0x20
            return bytes(data)

        return fn

    damage("trunc", lambda d: bytes(d[:1800]))
    damage("data", flip(512))  # the first byte of the first member's data
    damage("header", flip(1024 + 3))  # the name in the second member's header
    (root / "missing.tar").unlink()
    damage("gz", lambda d: gzip.compress(gzip.decompress(bytes(d))[:-2048], mtime=0))
    doc = json.loads((root / "index.json").read_text())
    for entry in doc["shards"]:
        if entry["url"] == "count.tar":
            entry["samples"] = 3
            del entry["offsets"]  # they say 4 samples: an entry must agree with itself
    doc["samples"] -= 1
    (root / "index.json").write_text(json.dumps(doc))

    problems = ShardIndex.load(root / "index.json").verify()
    assert all(isinstance(p, Problem) for p in problems)
    kinds = {}
    for p in problems:
        kinds.setdefault(os.path.basename(p.url), set()).add(p.kind)
    assert kinds == {
        "trunc.tar": {"corrupt", "size"},
        "data.tar": {"sha256"},
        "header.tar": {"corrupt"},
        "missing.tar": {"missing"},
        "count.tar": {"samples"},
        # A gzip whose tar lost its end marker (cut at a member boundary): whole samples may
        # be missing, and nothing but the marker can say otherwise.
        "gz.tar": {"corrupt", "size"},
    }
    by_kind = {(os.path.basename(p.url), p.kind): p.message for p in problems}
    assert "truncated" in by_kind["trunc.tar", "corrupt"]
    assert "checksum" in by_kind["header.tar", "corrupt"]
    assert "end-of-archive marker" in by_kind["gz.tar", "corrupt"]
    assert "4 samples, the index says 3" == by_kind["count.tar", "samples"]
    assert "no such file" in by_kind["missing.tar", "missing"]
    assert [p.url for p in problems] == sorted(p.url for p in problems)  # in index order
    assert str(problems[-2]).startswith(str(root / "trunc.tar") + ": corrupt: ")
    assert ShardIndex.load(root / "index.json").verify(workers=4) == problems


# -- helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, name",
    [
        ("out/train-%06d.tar", "out/train.index.json"),
        ("out/%06d.tar", "out/index.json"),
        ("s3://b/p/val_%04d.tar.gz", "s3://b/p/val.index.json"),
        ("train.%d.tar", "train.index.json"),
        ("out/single.tar", "out/single.index.json"),
        ("out/single.tgz", "out/single.index.json"),
        ("pct-%%-%d.tar", "pct-%.index.json"),
        ("out/%03d/x.tar", "out/index.json"),
    ],
)
def test_default_index_name(pattern: str, name: str) -> None:
    assert default_index_name(pattern) == name


def test_is_index_url() -> None:
    assert is_index_url("a/index.json") and is_index_url("s3://b/X.JSON")
    assert is_index_url("https://h/i.json?sig=abc&x=y.tar")
    assert not is_index_url("a/b.tar") and not is_index_url("https://h/a.tar?x=.json")


# -- ShardWriter ------------------------------------------------------------------------------


def _samples(n: int, start: int = 0) -> list:
    return [{"__key__": f"{i:06d}", "txt": f"s{i}", "cls": i} for i in range(start, start + n)]


@pytest.mark.parametrize("suffix", ["tar", "tar.gz"])
def test_shardwriter_index_equals_build(tmp_path: Path, suffix: str) -> None:
    pattern = str(tmp_path / f"train-%03d.{suffix}")
    with ShardWriter(pattern, maxcount=4, start_shard=7) as sink:
        for s in _samples(10):
            sink.write(s)
    names = [f"train-{n:03d}.{suffix}" for n in (7, 8, 9)]
    assert sink.index.urls == [str(tmp_path / n) for n in names]
    built = ShardIndex.build(str(tmp_path / f"train-*.{suffix}"))
    assert [(s.url, s.samples, s.bytes, s.sha256) for s in sink.index] == [
        (s.url, s.samples, s.bytes, s.sha256) for s in built
    ]
    assert sink.index.counts == [4, 4, 2]
    loaded = ShardIndex.load(tmp_path / "train.index.json")
    assert [
        s["url"] for s in json.loads((tmp_path / "train.index.json").read_text())["shards"]
    ] == (names)
    assert loaded.shards == built.shards and loaded.verify() == []
    assert sink.index.location == str(tmp_path / "train.index.json")


def test_shardwriter_counts_samples_as_the_reader_groups_them(tmp_path: Path) -> None:
    data = [
        {"__key__": "a", "txt": "x"},
        {"__key__": "a", "cls": 1},  # same key, next to it: the reader merges the two
        {"__key__": "b", "txt": "y"},
        {"__key__": "__meta__/c", "txt": "z"},  # a meta name: the reader skips it
    ]
    with ShardWriter(str(tmp_path / "m-%d.tar")) as sink:
        for s in data:
            sink.write(s)
    assert sink.total == 4
    assert sink.index.counts == [2] == [reader_count(str(tmp_path / "m-0.tar"))]


def test_shardwriter_discard_indexes_committed_shards_only(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(str(tmp_path / "d-%d.tar"), maxcount=2) as sink:
            for s in _samples(5):
                sink.write(s)
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["d-0.tar", "d-1.tar", "d.index.json"]
    index = ShardIndex.load(tmp_path / "d.index.json")
    assert index.urls == [str(tmp_path / "d-0.tar"), str(tmp_path / "d-1.tar")]
    assert index.counts == [2, 2] and index.verify() == []
    # Nothing committed: no index either.
    with pytest.raises(RuntimeError):
        with ShardWriter(str(tmp_path / "e-%d.tar"), maxcount=2) as sink:
            sink.write(_samples(1)[0])
            raise RuntimeError("boom")
    with ShardWriter(str(tmp_path / "f-%d.tar")):
        pass
    assert sorted(os.listdir(tmp_path)) == ["d-0.tar", "d-1.tar", "d.index.json"]


def test_shardwriter_index_off_explicit_and_with_opener(tmp_path: Path) -> None:
    with ShardWriter(str(tmp_path / "n-%d.tar"), index=False) as sink:
        sink.write(_samples(1)[0])
    assert sink.index is None and os.listdir(tmp_path) == ["n-0.tar"]

    (tmp_path / "meta").mkdir()
    explicit = tmp_path / "meta" / "my.json"
    with ShardWriter(str(tmp_path / "x-%d.tar"), maxcount=1, index=str(explicit)) as sink:
        for s in _samples(2):
            sink.write(s)
    doc = json.loads(explicit.read_text())
    assert [s["url"] for s in doc["shards"]] == [str(tmp_path / f"x-{i}.tar") for i in (0, 1)]

    def opener(fname: str):
        return open(fname, "wb")

    with ShardWriter(str(tmp_path / "o-%d.tar"), opener=opener) as sink:
        sink.write(_samples(1)[0])
    assert sink.index is None and not (tmp_path / "o.index.json").exists()
    with ShardWriter(
        str(tmp_path / "p-%d.tar"), opener=opener, index=str(tmp_path / "p.json")
    ) as sink:
        sink.write(_samples(1)[0])
    assert ShardIndex.load(tmp_path / "p.json").verify() == []
    with ShardWriter(f"pipe:cat > {tmp_path}/c-%d.tar") as sink:
        sink.write(_samples(1)[0])
    assert sink.index is None and (tmp_path / "c-0.tar").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("pipe", "c."))]
    with pytest.raises(ArgumentError, match="index must be"):
        ShardWriter(str(tmp_path / "q-%d.tar"), index=3)


# -- remote (S3 on loopback) --------------------------------------------------------------


def test_s3_build_save_load_verify(s3, dataset: Path) -> None:
    for path in shard_paths(dataset):
        s3.put(f"ds/{path.name}", path.read_bytes())
    opts = s3.storage_options
    index = ShardIndex.build(s3.url("ds/"), storage_options=opts)
    assert index.urls == [s3.url(f"ds/{p.name}") for p in shard_paths(dataset)]
    assert index.counts == [5, 3, 4, 3]
    assert [s.sha256 for s in index] == [sha256(p) for p in shard_paths(dataset)]
    index.save(s3.url("ds/index.json"), storage_options=opts)
    doc = json.loads(s3.get("ds/index.json"))
    assert [s["url"] for s in doc["shards"]] == [p.name for p in shard_paths(dataset)]
    # A copy under another prefix resolves there.
    s3.put("copy/index.json", s3.get("ds/index.json"))
    for p in shard_paths(dataset):
        s3.put(f"copy/{p.name}", p.read_bytes())
    copy = ShardIndex.load(s3.url("copy/index.json"), storage_options=opts)
    assert copy.urls == [s3.url(f"copy/{p.name}") for p in shard_paths(dataset)]
    assert copy.digest() == index.digest()
    assert copy.verify(storage_options=opts) == []
    s3.delete("copy/a-1.tar")
    (problem,) = copy.verify(storage_options=opts)
    assert (problem.url, problem.kind) == (s3.url("copy/a-1.tar"), "missing")
    with pytest.raises(OpenError, match="webds index SHARDS"):
        ShardIndex.load(s3.url("nope/index.json"), storage_options=opts)


def test_s3_shardwriter_writes_its_index_to_s3(s3) -> None:
    with ShardWriter(
        s3.url("w/part-%04d.tar.gz"), maxcount=3, storage_options=s3.storage_options
    ) as sink:
        for s in _samples(7):
            sink.write(s)
    assert s3.list("w/") == [f"w/part-{i:04d}.tar.gz" for i in range(3)] + ["w/part.index.json"]
    doc = json.loads(s3.get("w/part.index.json"))
    assert [(s["url"], s["samples"]) for s in doc["shards"]] == [
        ("part-0000.tar.gz", 3),
        ("part-0001.tar.gz", 3),
        ("part-0002.tar.gz", 1),
    ]
    for entry in doc["shards"]:
        data = s3.get(f"w/{entry['url']}")
        assert (entry["bytes"], entry["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    index = ShardIndex.load(s3.url("w/part.index.json"))  # credentials from the environment
    assert index.verify() == []
    assert len(list(webds.WebDataset(index.urls))) == 7


def test_http_index_resolves_relative_urls(http_server, dataset: Path) -> None:
    for path in shard_paths(dataset)[:2]:
        http_server.put(f"ds/sub/{path.name}", path.read_bytes())
    ShardIndex.build([str(p) for p in shard_paths(dataset)[:2]]).save(dataset / "index.json")
    doc = json.loads((dataset / "index.json").read_text())
    doc["shards"][0]["url"] = "sub/a-0.tar"
    doc["shards"][1]["url"] = "x/../sub/a-1.tar"
    http_server.put("ds/index.json", json.dumps(doc).encode())
    index = ShardIndex.load(http_server.url("ds/index.json") + "?token=abc")
    assert index.urls == [http_server.url("ds/sub/a-0.tar"), http_server.url("ds/sub/a-1.tar")]
    assert index.verify() == []


def test_file_url_location(dataset: Path) -> None:
    ShardIndex.build(str(dataset) + "/").save(dataset.as_uri() + "/index.json")
    index = ShardIndex.load(dataset.as_uri() + "/index.json")
    assert index.urls == [str(p) for p in shard_paths(dataset)]
    assert index.location == dataset.as_uri() + "/index.json"


def test_an_index_and_a_spec_served_gzip_coded_are_read(tmp_path, http_server):
    # Bodies are read as sent (a shard's gzip coding is bounded by the tar reader): an index or
    # a spec a server sends with Content-Encoding: gzip arrived as gzip bytes, not JSON.
    from webds.shards.specs import MultiShardSample

    for i in range(2):
        write_tar(tmp_path / f"s-{i}.tar", sample_members(3, prefix=f"{i}-"))
        http_server.put(f"s-{i}.tar", (tmp_path / f"s-{i}.tar").read_bytes())
    local = tmp_path / "index.json"
    ShardIndex.build([http_server.url(f"s-{i}.tar") for i in range(2)]).save(str(local))
    url = http_server.put("index.json", gzip.compress(local.read_bytes()))
    spec = http_server.put("mix.yaml", gzip.compress(b"datasets:\n  - shards: a-{0..1}.tar\n"))
    http_server.content_encoding = "gzip"
    assert [s.samples for s in ShardIndex.load(url)] == [3, 3]
    assert len(list(MultiShardSample(spec))) == 2
