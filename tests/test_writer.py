"""TarWriter and ShardWriter: real shards checked with GNU tar, Python's tarfile and our reader."""

from __future__ import annotations

import gzip
import io
import logging
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

import webds
from webds.errors import ArgumentError, EncodeError, WriteError
from webds.stages.decode import Decoder
from webds.stages.encode import encode_sample
from webds.tar.reader import read_members
from webds.tar.samples import tarfile_to_samples
from webds.tar.writing import END_OF_ARCHIVE, member_bytes
from webds.writer import ShardWriter, TarWriter, check_key


def samples(n, start=0, payload=b""):
    return [
        {"__key__": f"{i:06d}", "txt": f"sample {i}", "cls": i, "bin": payload}
        for i in range(start, start + n)
    ]


def names_in(path: Path) -> list:
    with tarfile.open(path) as tf:
        return [m.name for m in tf]


def our_samples(path: Path) -> list:
    return list(tarfile_to_samples()([{"url": str(path)}]))


def listdir(path: Path) -> list:
    return sorted(os.listdir(path))


# -- TarWriter --------------------------------------------------------------------------------


def test_members_headers_and_payload_count(tmp_path):
    path = tmp_path / "a.tar"
    with TarWriter(str(path)) as sink:
        n = sink.write({"__key__": "k1", "txt": "hello", "cls": 3, "json": {"a": 1}, "_skip": "m"})
        assert n == len(b"hello") + len(b"3") + len(b'{"a": 1}')
        sink.write({"__key__": "dir/k2", "bin": b"\x00" * 1000})
    with tarfile.open(path) as tf:
        members = list(tf)
        assert [m.name for m in members] == ["k1.cls", "k1.json", "k1.txt", "dir/k2.bin"]
        for m in members:
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "bigdata", "bigdata")
            assert m.mode == 0o644 and m.isfile()
        assert tf.extractfile("k1.txt").read() == b"hello"
    # the tar layout is exact: 512-byte headers, padded data, two zero blocks at the end
    assert path.stat().st_size == 4 * 512 + 3 * 512 + 2 * 512 + 1024
    assert [name for name, _, _ in read_members(open(path, "rb"))] == [
        "k1.cls",
        "k1.json",
        "k1.txt",
        "dir/k2.bin",
    ]


def test_gnu_tar_lists_and_extracts(tmp_path):
    path = tmp_path / "g.tar"
    with TarWriter(str(path)) as sink:
        for s in samples(3):
            sink.write(s)
    listing = subprocess.run(["tar", "-tf", str(path)], capture_output=True, check=True, text=True)
    assert listing.stdout.split() == [
        f"{i:06d}.{e}" for i in range(3) for e in ("bin", "cls", "txt")
    ]
    assert listing.stderr == ""
    out = subprocess.run(["tar", "-xOf", str(path), "000002.txt"], capture_output=True, check=True)
    assert out.stdout == b"sample 2"
    dest = tmp_path / "x"
    dest.mkdir()
    subprocess.run(["tar", "-xf", str(path), "-C", str(dest)], check=True)
    assert (dest / "000001.cls").read_bytes() == b"1"


def test_long_and_unicode_keys_survive(tmp_path):
    long_key = "d" * 60 + "/" + "e" * 120
    uni_key = "données/ünï-κλειδί"
    path = tmp_path / "long.tar"
    with TarWriter(str(path)) as sink:
        sink.write({"__key__": long_key, "txt": "long"})
        sink.write({"__key__": uni_key, "txt": "uni"})
    listing = subprocess.run(["tar", "-tf", str(path)], capture_output=True, check=True)
    assert listing.stdout.decode().split("\n")[:2] == [f"{long_key}.txt", f"{uni_key}.txt"]
    assert names_in(path) == [f"{long_key}.txt", f"{uni_key}.txt"]
    got = our_samples(path)
    assert [s["__key__"] for s in got] == [long_key, uni_key]


def test_same_samples_give_identical_bytes(tmp_path):
    rng = np.random.default_rng(3)
    data = [
        {
            "__key__": f"{i:04d}",
            "png": rng.integers(0, 256, (5, 5, 3), dtype=np.uint8),
            "npz": {"a": rng.random(3)},
            "pth": {"t": i},
            "txt.gz": "x" * i,
            "json": {"i": i},
        }
        for i in range(5)
    ]
    outputs = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        for suffix in ("tar", "tar.gz"):
            with TarWriter(str(tmp_path / name / f"s.{suffix}")) as sink:
                for s in data:
                    sink.write(s)
        outputs.append([(tmp_path / name / f"s.{s}").read_bytes() for s in ("tar", "tar.gz")])
    assert outputs[0] == outputs[1]
    with TarWriter(str(tmp_path / "t.tar"), mtime=1_700_000_000) as sink:
        sink.write(data[0])
    with tarfile.open(tmp_path / "t.tar") as tf:
        assert {m.mtime for m in tf} == {1_700_000_000}


def reference_tar(data, keep_meta=False, **header):
    """The archive TarWriter must write, built from encode_sample and member_bytes."""
    parts = []
    for sample in data:
        encoded = encode_sample(sample)
        for field in sorted(encoded):
            if field == "__key__" or (field.startswith("_") and not keep_meta):
                continue
            value = encoded[field]
            value = value.encode("utf-8") if isinstance(value, str) else value
            parts.append(member_bytes(f"{sample['__key__']}.{field}", value, **header))
    return b"".join(parts) + END_OF_ARCHIVE


def varied_samples():
    out = []
    for i in range(40):
        sample = {
            "__key__": f"{i:06d}",
            "cls": i,
            "txt": f"text {i} é",
            "bin": os.urandom(i * 97 % 1500),
            "json": {"i": i},
        }
        if i % 4 == 0:
            sample["__key__"] = "d/" * 60 + f"long{i}"  # a pax name
        if i % 5 == 0:
            sample["__key__"] = f"ünïcödé-{i}"
        if i % 6 == 0:
            sample["_meta"] = "meta"
        if i % 7 == 0:
            sample["txt.gz"] = "zip " * i
        if i % 8 == 0:
            sample["bin"] = bytearray(b"b" * i)
        if i % 9 == 0:
            sample["bin"] = memoryview(b"m" * 600)
        if i % 10 == 0:
            sample["cls"] = np.int64(i)
        if i % 11 == 0:
            sample["n" * 120] = b"a long field name"
        out.append(sample)
    return out


@pytest.mark.parametrize(
    "options, header",
    [
        ({}, {}),
        ({"keep_meta": True}, {}),
        (
            {"mtime": 1_700_000_000.7, "mode": 0o600, "user": "u", "group": "g"},
            {"mtime": 1_700_000_000, "mode": 0o600, "uname": "u", "gname": "g"},
        ),
        ({"user": "ü" * 3, "group": "g" * 40}, {"uname": "ü" * 3, "gname": "g" * 40}),
        ({"mtime": 8**11 + 1}, {"mtime": 8**11 + 1}),
    ],
)
def test_output_is_what_the_tar_primitives_give(options, header):
    data = varied_samples()
    buf = io.BytesIO()
    with TarWriter(buf, **options) as sink:
        for s in data:
            sink.write(s)
    expected = reference_tar(data, keep_meta=options.get("keep_meta", False), **header)
    assert buf.getvalue() == expected


def test_gzip_shards(tmp_path):
    path = tmp_path / "z.tar.gz"
    with TarWriter(str(path)) as sink:
        for s in samples(4):
            sink.write(s)
    raw = path.read_bytes()
    assert raw[:3] == b"\x1f\x8b\x08"
    assert raw[3] & 0x08 == 0, "no file name in the gzip header"
    assert raw[4:8] == b"\0\0\0\0", "gzip mtime 0"
    dest = tmp_path / "out"
    dest.mkdir()
    subprocess.run(["tar", "-xzf", str(path), "-C", str(dest)], check=True)
    assert (dest / "000003.txt").read_bytes() == b"sample 3"
    assert [s["cls"] for s in map(Decoder([]), our_samples(path))] == [0, 1, 2, 3]
    # explicit compress=True on a .tar name, and compress=False on a .tgz name
    with TarWriter(str(tmp_path / "c.tar"), compress=True) as sink:
        sink.write(samples(1)[0])
    assert gzip.decompress((tmp_path / "c.tar").read_bytes())[257:262] == b"ustar"
    with TarWriter(str(tmp_path / "p.tgz"), compress=False) as sink:
        sink.write(samples(1)[0])
    assert (tmp_path / "p.tgz").read_bytes()[257:262] == b"ustar"
    with pytest.raises(ArgumentError, match="compress='bz2'"):
        TarWriter(str(tmp_path / "b.tar"), compress="bz2")


def test_file_object_destination_is_not_closed(tmp_path):
    buf = io.BytesIO()
    with TarWriter(buf) as sink:
        sink.write(samples(1)[0])
    assert not buf.closed
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        assert tf.getnames() == ["000000.bin", "000000.cls", "000000.txt"]
    gzbuf = io.BytesIO()
    with TarWriter(gzbuf, compress="gz") as sink:
        sink.write(samples(1)[0])
    assert gzbuf.getvalue()[:2] == b"\x1f\x8b"


def test_pipe_destination(tmp_path):
    out = tmp_path / "piped.tar"
    with TarWriter(f"pipe:cat > {out}") as sink:
        sink.write(samples(1)[0])
    assert names_in(out) == ["000000.bin", "000000.cls", "000000.txt"]


def test_keep_meta_and_metadata_rules(tmp_path):
    path = tmp_path / "m.tar"
    with TarWriter(str(path), keep_meta=True) as sink:
        sink.write({"__key__": "a", "__source__": "here", "txt": "t"})
    assert names_in(path) == ["a.__source__", "a.txt"]
    with TarWriter(str(tmp_path / "n.tar")) as sink:
        with pytest.raises(EncodeError, match="must be a str"):
            sink.write({"__key__": "a", "__source__": 5, "txt": "t"})


@pytest.mark.parametrize(
    "key, why",
    [
        ("", "empty"),
        ("../evil", "'..'"),
        ("a/../../b", "'..'"),
        ("/etc/passwd", "absolute"),
        ("a\\b", "backslash"),
        ("a\0b", "NUL"),
        ("a//b", "empty path component"),
        ("dir/", "empty path component"),
        ("file.with.dots", "dot"),
        (7, "must be a str"),
    ],
)
def test_refused_keys(tmp_path, key, why):
    path = tmp_path / "r.tar"
    with TarWriter(str(path)) as sink:
        with pytest.raises(EncodeError, match=why) as info:
            sink.write({"__key__": key, "txt": "x"})
        if isinstance(key, str):
            assert repr(key) in str(info.value)
        assert str(path) in str(info.value)
        sink.write(
            {"__key__": "fine", "txt": "still usable"}
        )  # nothing was written for the bad key
    assert names_in(path) == ["fine.txt"]


def test_keys_with_dots_in_folders_are_fine():
    assert check_key("v1.2/sub.dir/000001") == "v1.2/sub.dir/000001"
    assert check_key("./a") == "./a"


def test_bad_samples_and_fields(tmp_path):
    with TarWriter(str(tmp_path / "b.tar")) as sink:
        with pytest.raises(EncodeError, match="no '__key__'"):
            sink.write({"txt": "x"})
        with pytest.raises(EncodeError, match="no fields"):
            sink.write({"__key__": "a"})
        with pytest.raises(EncodeError, match="field name"):
            sink.write({"__key__": "a", "x/y": b"1"})
        with pytest.raises(EncodeError, match="no encoder for extension 'weird'") as info:
            sink.write({"__key__": "a", "weird": 3.5})
        assert info.value.member == "a.weird"
        with pytest.raises(EncodeError, match="samples must be dicts"):
            sink.write([1, 2])


def test_exception_inside_with_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with TarWriter(str(tmp_path / "partial.tar")) as sink:
            sink.write(samples(1)[0])
            raise RuntimeError("boom")
    assert listdir(tmp_path) == []


def test_write_after_close_and_argument_errors(tmp_path):
    sink = TarWriter(str(tmp_path / "c.tar"))
    sink.close()
    sink.close()  # idempotent
    with pytest.raises(WriteError, match="closed"):
        sink.write(samples(1)[0])
    with pytest.raises(ArgumentError, match="format"):
        TarWriter(io.BytesIO(), format="zip")
    with pytest.raises(ArgumentError, match="mode"):
        TarWriter(io.BytesIO(), mode=0o77777)
    with pytest.raises(ArgumentError, match="file object"):
        TarWriter(12)
    TarWriter(io.BytesIO(), format=tarfile.GNU_FORMAT).close()


class FailingStream(io.RawIOBase):
    """A destination that accepts ``limit`` bytes and then fails, like a full disk."""

    def __init__(self, limit):
        self.limit = limit
        self.data = bytearray()
        self.discarded = False

    def writable(self):
        return True

    def write(self, b):
        if len(self.data) + len(b) > self.limit:
            raise OSError(28, "No space left on device")
        self.data += b
        return len(b)

    def discard(self):
        self.discarded = True


def test_failed_write_raises_write_error_and_stops(tmp_path):
    stream = FailingStream(limit=4000)
    sink = TarWriter(stream)
    sink.write(samples(1)[0])
    with pytest.raises(WriteError, match="No space left") as info:
        sink.write(samples(1, payload=b"x" * 5000)[0])
    assert info.value.key == "000000"
    with pytest.raises(WriteError, match="closed"):
        sink.write(samples(1)[0])


# -- ShardWriter ------------------------------------------------------------------------------


def shard_contents(paths):
    return [[s["__key__"] for s in our_samples(p)] for p in paths]


def test_rollover_by_count(tmp_path):
    pattern = str(tmp_path / "s-%03d.tar")
    with ShardWriter(pattern, maxcount=3) as sink:
        for s in samples(10):
            sink.write(s)
        assert (sink.count, sink.total, sink.shard) == (1, 10, 4)
    expected = [str(tmp_path / f"s-{i:03d}.tar") for i in range(4)]
    assert sink.shards == expected
    # The shard index (webds.shards.index) is written next to the shards.
    assert listdir(tmp_path) == [os.path.basename(p) for p in expected] + ["s.index.json"]
    keys = [f"{i:06d}" for i in range(10)]
    assert shard_contents(expected) == [keys[0:3], keys[3:6], keys[6:9], keys[9:]]
    # Python's tarfile agrees
    assert names_in(Path(expected[3])) == ["000009.bin", "000009.cls", "000009.txt"]


def test_rollover_by_size(tmp_path):
    pattern = str(tmp_path / "z-%d.tar")
    payload = b"p" * 91  # each sample: 91 + len("sample i") + len("i") = 100 payload bytes
    with ShardWriter(pattern, maxsize=250) as sink:
        sizes = [sink.write(s) for s in samples(7, payload=payload)]
    assert sizes == [100] * 7
    # rollover happens before a write once size >= maxsize: 100, 200, 300 -> new shard
    assert shard_contents(sink.shards) == [
        ["000000", "000001", "000002"],
        ["000003", "000004", "000005"],
        ["000006"],
    ]


def test_sample_bigger_than_maxsize_gets_its_own_shard(tmp_path):
    pattern = str(tmp_path / "big-%02d.tar")
    data = samples(3)
    data[1]["bin"] = b"B" * 5000
    with ShardWriter(pattern, maxsize=1000) as sink:
        for s in data:
            sink.write(s)
    assert shard_contents(sink.shards) == [["000000", "000001"], ["000002"]]
    with ShardWriter(str(tmp_path / "big2-%02d.tar"), maxsize=1000) as sink:
        for s in [data[1], data[0]]:
            sink.write(s)
    assert shard_contents(sink.shards) == [["000001"], ["000000"]]


def test_no_empty_shard_and_idempotent_close(tmp_path):
    sink = ShardWriter(str(tmp_path / "e-%d.tar"))
    assert sink.fname is None
    sink.close()
    sink.close()
    assert listdir(tmp_path) == [] and sink.shards == []
    with pytest.raises(WriteError, match="closed"):
        sink.write(samples(1)[0])


def test_post_hook_sees_committed_shards(tmp_path):
    seen = []

    def post(fname):
        assert os.path.exists(fname)  # already committed under its final name
        seen.append((fname, len(names_in(Path(fname)))))

    with ShardWriter(str(tmp_path / "p-%d.tar"), maxcount=2, post=post, start_shard=5) as sink:
        for s in samples(5):
            sink.write(s)
        assert [f for f, _ in seen] == [str(tmp_path / f"p-{i}.tar") for i in (5, 6)]
        assert sink.fname == str(tmp_path / "p-7.tar")
    # The shards stayed: the index is written beside them, and post never sees it.
    assert seen == [(str(tmp_path / f"p-{i}.tar"), n) for i, n in ((5, 6), (6, 6), (7, 3))]
    assert (tmp_path / "p.index.json").exists()


def test_exception_mid_shard_keeps_earlier_shards_only(tmp_path):
    committed = []
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(str(tmp_path / "x-%d.tar"), maxcount=2, post=committed.append) as sink:
            for s in samples(3):
                sink.write(s)
            raise RuntimeError("boom")
    assert listdir(tmp_path) == ["x-0.tar", "x.index.json"]  # x-1, in progress, was discarded
    assert committed == [str(tmp_path / "x-0.tar")]  # post never sees a discarded shard
    assert sink.shards == committed


def test_a_post_that_moves_shards_takes_the_index_along(tmp_path):
    out, dest = tmp_path / "out", tmp_path / "dest"
    dest.mkdir()
    moved = []

    def post(fname):
        moved.append(Path(fname).name)
        shutil.move(fname, dest / Path(fname).name)

    with ShardWriter(str(out / "train-%06d.tar"), maxcount=3, post=post) as sink:
        for s in samples(10):
            sink.write(s)
    assert moved == [f"train-{i:06d}.tar" for i in range(4)] + ["train.index.json"]
    assert listdir(out) == []  # nothing left behind that lists shards no longer there
    got = webds.WebDataset(str(dest / "train.index.json"), shardshuffle=False)
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples(10)]
    # An index given a path is written there, and not posted.
    moved.clear()
    with ShardWriter(
        str(out / "b-%06d.tar"), maxcount=5, post=post, index=str(tmp_path / "b.json")
    ) as sink:
        for s in samples(10):
            sink.write(s)
    assert moved == ["b-000000.tar", "b-000001.tar"] and (tmp_path / "b.json").exists()


def test_a_post_that_uploads_to_s3_takes_the_index_along(tmp_path, s3):
    def upload_and_delete(fname):
        s3.put(f"ds/{Path(fname).name}", Path(fname).read_bytes())
        os.remove(fname)

    with ShardWriter(str(tmp_path / "train-%06d.tar"), maxcount=4, post=upload_and_delete) as sink:
        for s in samples(9):
            sink.write(s)
    assert listdir(tmp_path) == []
    assert sorted(s3.list("ds/")) == [f"ds/train-{i:06d}.tar" for i in range(3)] + [
        "ds/train.index.json"
    ]
    got = webds.WebDataset(s3.url("ds/train.index.json"), shardshuffle=False)
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples(9)]


def test_in_progress_shard_is_discarded(tmp_path):
    with pytest.raises(KeyError):
        with ShardWriter(str(tmp_path / "y-%d.tar"), maxcount=2) as sink:
            for s in samples(3):
                sink.write(s)
            {}["missing"]
    # y-0 (2 samples) was committed at the rollover; y-1 (in progress) never appears,
    # and no temporary file is left behind.
    assert listdir(tmp_path) == ["y-0.tar", "y.index.json"]
    assert shard_contents([tmp_path / "y-0.tar"]) == [["000000", "000001"]]


def test_gz_pattern_and_keywords_reach_tarwriter(tmp_path):
    with ShardWriter(str(tmp_path / "g-%d.tar.gz"), maxcount=2, mtime=42, user="u") as sink:
        for s in samples(3):
            sink.write(s)
    for p in sink.shards:
        assert Path(p).read_bytes()[:2] == b"\x1f\x8b"
        with tarfile.open(p) as tf:
            assert {(m.mtime, m.uname) for m in tf} == {(42, "u")}
    assert shard_contents(sink.shards) == [["000000", "000001"], ["000002"]]


def test_opener(tmp_path):
    opened = []

    def opener(fname):
        opened.append(fname)
        return open(fname, "wb")

    with ShardWriter(str(tmp_path / "o-%d.tgz"), maxcount=2, opener=opener) as sink:
        for s in samples(3):
            sink.write(s)
    assert opened == sink.shards == [str(tmp_path / f"o-{i}.tgz") for i in range(2)]
    assert Path(opened[0]).read_bytes()[:2] == b"\x1f\x8b"  # gzip chosen from the shard name
    assert shard_contents(opened) == [["000000", "000001"], ["000002"]]


@pytest.mark.parametrize("spelling", ["path", "file-url"])
def test_missing_folder_of_a_local_pattern_is_created(tmp_path, spelling):
    out = tmp_path / "new" / "deeper"
    pattern = str(out / "train-%02d.tar")
    if spelling == "file-url":
        pattern = "file://" + pattern
    with ShardWriter(pattern, maxcount=2) as sink:
        for s in samples(3):
            sink.write(s)
    assert listdir(out) == ["train-00.tar", "train-01.tar", "train.index.json"]
    assert [names_in(out / f"train-0{i}.tar")[0] for i in range(2)] == ["000000.bin", "000002.bin"]


def test_shard_number_in_the_folder_name_creates_each_folder(tmp_path):
    with ShardWriter(str(tmp_path / "out" / "%02d" / "data.tar"), maxcount=1, index=False) as sink:
        for s in samples(2):
            sink.write(s)
    assert listdir(tmp_path / "out") == ["00", "01"]
    assert [len(our_samples(tmp_path / "out" / d / "data.tar")) for d in ("00", "01")] == [1, 1]


def test_pipe_and_opener_outputs_create_no_folder(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(WriteError):
        with ShardWriter(f"pipe:cat > {missing}/p-%d.tar 2>/dev/null", index=False) as sink:
            sink.write(samples(1)[0])
    assert not missing.exists()
    opened = []

    def opener(fname):
        opened.append(fname)
        return io.BytesIO()

    with ShardWriter(str(missing / "o-%d.tar"), opener=opener) as sink:
        sink.write(samples(1)[0])
    assert opened == [str(missing / "o-0.tar")] and not missing.exists()


def test_pattern_without_field(tmp_path):
    with ShardWriter(str(tmp_path / "single.tar"), maxcount=5) as sink:
        for s in samples(5):
            sink.write(s)
    assert sink.shards == [str(tmp_path / "single.tar")]
    with pytest.raises(ArgumentError, match="no %-field"):
        with ShardWriter(str(tmp_path / "one.tar"), maxcount=2) as sink:
            for s in samples(3):
                sink.write(s)
    assert not (tmp_path / "one.tar").exists()
    assert listdir(tmp_path) == ["single.index.json", "single.tar"]
    with ShardWriter(str(tmp_path / "pct-%%.tar")) as sink:
        sink.write(samples(1)[0])
    assert sink.shards == [str(tmp_path / "pct-%.tar")]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"maxcount": 0}, "maxcount"),
        ({"maxcount": 2.5}, "maxcount"),
        ({"maxsize": 0}, "maxsize"),
        ({"maxsize": -1.0}, "maxsize"),
        ({"maxsize": float("nan")}, "maxsize"),
        ({"start_shard": -1}, "start_shard"),
        ({"post": "no"}, "post"),
        ({"opener": 3}, "opener"),
        ({"bogus": 1}, "unknown keyword"),
        ({"compress": "lz4"}, "compress"),
        ({"encoder": 5}, "encoder"),
    ],
)
def test_argument_errors(tmp_path, kw, match):
    with pytest.raises(ArgumentError, match=match):
        ShardWriter(str(tmp_path / "a-%d.tar"), **kw)
    assert listdir(tmp_path) == []


def test_bad_pattern(tmp_path):
    with pytest.raises(ArgumentError, match="pattern"):
        ShardWriter(str(tmp_path / "a-%d-%d.tar"))
    with pytest.raises(ArgumentError, match="pattern"):
        ShardWriter("")


def test_verbose_logs_not_stdout_and_progress_on_stderr(tmp_path, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="webds"):
        with ShardWriter(str(tmp_path / "v-%d.tar"), maxcount=2, verbose=1) as sink:
            for s in samples(3):
                sink.write(s)
    assert any("v-0.tar" in r.getMessage() for r in caplog.records)
    captured = capsys.readouterr()
    assert captured.out == ""
    with ShardWriter(str(tmp_path / "q-%d.tar"), progress=True) as sink:
        for s in samples(3):
            sink.write(s)
    captured = capsys.readouterr()
    assert captured.out == "" and "3" in captured.err


def test_write_error_discards_and_stops(tmp_path):
    streams = []

    def opener(fname):
        streams.append(FailingStream(limit=3000))
        return streams[-1]

    sink = ShardWriter(str(tmp_path / "f-%d.tar"), opener=opener)
    sink.write(samples(1)[0])
    with pytest.raises(WriteError):
        sink.write(samples(1, payload=b"x" * 4000)[0])
    assert streams[0].discarded
    with pytest.raises(WriteError, match="closed"):
        sink.write(samples(1)[0])
    assert sink.shards == []


@pytest.mark.parametrize("name", ["c.tar", "c.tar.gz"])
def test_checksum_counts_and_hashes_the_stored_bytes(tmp_path, name):
    import hashlib

    with TarWriter(str(tmp_path / name), checksum=True) as sink:
        for s in samples(3):
            sink.write(s)
    data = (tmp_path / name).read_bytes()
    assert (sink.file_bytes, sink.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    buf = io.BytesIO()
    with TarWriter(buf, checksum=True, compress=name.endswith(".gz")) as sink:
        for s in samples(3):
            sink.write(s)
    assert buf.getvalue() == data and sink.sha256 == hashlib.sha256(data).hexdigest()
    plain = TarWriter(io.BytesIO())
    plain.close()
    assert plain.sha256 is None and plain.file_bytes is None


# A writer killed mid-shard leaves its hidden temporary file: the next writer removes it, but
# never the temporary file of a writer still running.

_KILLED_WRITER = """
import sys, time
from webds.writer import ShardWriter, TarWriter
target, kind = sys.argv[1], sys.argv[2]
writer = ShardWriter(target, maxcount=1000) if kind == "shards" else TarWriter(target)
for i in range(50):
    writer.write({"__key__": f"{i:04d}", "bin": b"x" * 100_000})
print("writing", flush=True)
time.sleep(600)
"""


def _start_writer(target: str, kind: str) -> subprocess.Popen:
    import sys

    from clitools import cli_env

    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, target, kind],
        stdout=subprocess.PIPE,
        env=cli_env(),
        text=True,
    )
    assert proc.stdout.readline() == "writing\n"
    return proc


def _temps(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


@pytest.mark.parametrize("kind", ["shards", "tar"])
def test_a_later_writer_removes_what_a_killed_writer_left(tmp_path, kind):
    import signal

    target = str(tmp_path / ("out-%03d.tar" if kind == "shards" else "out-000.tar"))
    killed = _start_writer(target, kind)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    stale = _temps(tmp_path)
    assert len(stale) == 1 and stale[0].startswith(".out-000.tar.tmp-")
    # Another writer of the same output, running right now (it cleans up too): its file stays.
    live = _start_writer(
        str(tmp_path / ("out-%03d.tar" if kind == "shards" else "out-000.tar")), kind
    )
    try:
        running = [t for t in _temps(tmp_path) if t not in stale]
        assert len(running) == 1
        if kind == "shards":
            with ShardWriter(target, maxcount=10, start_shard=5, index=False) as w:
                w.write({"__key__": "a", "txt": "fresh"})  # shard 5: cleans the whole pattern
        else:
            with TarWriter(target) as w:
                w.write({"__key__": "a", "txt": "fresh"})
        assert _temps(tmp_path) == running
    finally:
        live.kill()
        live.wait()


def test_stale_temps_by_age_and_name(tmp_path):
    from webds.io.streams import remove_stale_temps

    old = time.time() - 2 * 24 * 3600
    names = {
        ".a.tar.tmp-123-0badc0de": old,  # name without a host: stale only by age
        ".a.tar.tmp-124-0badc0de": time.time(),
        ".a.tar.tmp-1-ffffffff-0badc0de": time.time(),  # another host's live writer
        ".a.tar.tmp-1-ffffffff-1badc0de": old,  # another host's, untouched for two days
        ".b.tar.tmp-123-0badc0de": old,  # another output
        "a.tar": old,
    }
    for name, mtime in names.items():
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (mtime, mtime))
    removed = remove_stale_temps(str(tmp_path), "a.tar".__eq__)
    assert sorted(os.path.basename(p) for p in removed) == [
        ".a.tar.tmp-1-ffffffff-1badc0de",
        ".a.tar.tmp-123-0badc0de",
    ]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [
            ".a.tar.tmp-124-0badc0de",
            ".a.tar.tmp-1-ffffffff-0badc0de",
            ".b.tar.tmp-123-0badc0de",
            "a.tar",
        ]
    )
