"""Damaged shards, read every way webds reads them: never a half sample, never a silent stop.

A copy killed mid-way or a network chunk cuts a shard at a 512-byte boundary; a hole in a sparse
or preallocated file zeroes whole blocks. Each test damages small shards from two writers
(webds's TarWriter, and Python's tarfile in pax format with a float mtime, as webdataset writes)
at every block boundary or header, and reads them raising, skipping, stage by stage, planned
by an index and through DataLoader workers. Whatever is yielded must be whole samples equal to
the originals; whatever is missing must be reported.
"""

from __future__ import annotations

import io
import logging
import random
import tarfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
from clitools import tar_members

import webds
from webds.errors import ShardReadError
from webds.tar.reader import read_members

N = 10
SIZE = 700  # bytes of each sample's text field, as in the report: cuts at 3,584 showed it


def originals(seed: int = 0) -> List[Dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "__key__": f"{i:04d}",
            "cls": str(i).encode(),
            "txt": bytes(rng.randrange(97, 123) for _ in range(SIZE)),
        }
        for i in range(N)
    ]


def write_shard(path: Path, writer: str, samples: List[Dict[str, Any]]) -> bytes:
    if writer == "webds":
        with webds.TarWriter(str(path)) as sink:
            for s in samples:
                sink.write(s)
    else:  # tarfile, pax with a float mtime: a pax header before every member
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
            for s in samples:
                for ext in ("cls", "txt"):
                    info = tarfile.TarInfo(f"{s['__key__']}.{ext}")
                    info.size = len(s[ext])
                    info.mtime = 1700000000.25
                    tf.addfile(info, io.BytesIO(s[ext]))
    return path.read_bytes()


def walk(raw: bytes) -> Tuple[List[int], int]:
    """Offsets of every header block (pax headers included), and where the marker starts."""
    out, pos = [], 0
    while pos + 512 <= len(raw) and raw[pos : pos + 512] != bytes(512):
        size = int(raw[pos + 124 : pos + 136].rstrip(b" \0") or b"0", 8)
        out.append(pos)
        pos += 512 + ((size + 511) // 512) * 512
    return out, pos


def members_end(raw: bytes) -> int:
    """The offset of the end-of-archive marker, after the last member's padded data."""
    return walk(raw)[1]


def header_offsets(raw: bytes) -> List[int]:
    return walk(raw)[0]


def read(
    urls: Any, mode: str, handler: Any = webds.reraise_exception, index: Any = None
) -> Tuple[List[Dict[str, Any]], Optional[BaseException]]:
    """Samples yielded until the end or an error, read one of the ways webds reads."""
    if mode == "fluent":
        ds: Any = webds.WebDataset(
            urls, shardshuffle=False, handler=handler, index=index, empty_check=False
        )
    elif mode == "steps":
        ds = webds.DataPipeline(
            webds.SimpleShardList(urls),
            webds.url_opener(handler=handler),
            webds.tar_file_expander(handler=handler),
            webds.group_by_keys(handler=handler),
        )
    else:
        raise AssertionError(mode)
    got: List[Dict[str, Any]] = []
    try:
        for s in ds:
            got.append(s)
    except ShardReadError as exn:
        return got, exn
    return got, None


def assert_whole(got: List[Dict[str, Any]], want: List[Dict[str, Any]], where: Any) -> None:
    """Every sample yielded is one of ``want``, whole, in order, without repeats."""
    by_key = {s["__key__"]: s for s in want}
    keys = [s["__key__"] for s in got]
    assert keys == sorted(set(keys)), where
    for s in got:
        o = by_key[s["__key__"]]
        fields = {k: v for k, v in s.items() if not k.startswith("__")}
        assert fields == {"cls": o["cls"], "txt": o["txt"]}, (where, s["__key__"], sorted(s))


@pytest.mark.parametrize("writer", ["webds", "pax"])
@pytest.mark.parametrize("mode", ["fluent", "steps"])
def test_every_cut_at_a_block_boundary_raises(tmp_path: Path, writer: str, mode: str) -> None:
    want = originals()
    raw = write_shard(tmp_path / "whole.tar", writer, want)
    end = members_end(raw)
    cut_path = tmp_path / "cut.tar"
    for cut in range(512, len(raw), 512):
        cut_path.write_bytes(raw[:cut])
        got, err = read(str(cut_path), mode)
        assert_whole(got, want, cut)
        if cut <= end:  # at `end` every member is there, but nothing says none is missing
            assert err is not None, f"a cut at {cut} of {end} read as a whole shard"
            assert err.url == str(cut_path)
            assert len(got) < N
        else:
            # The end-of-archive marker (a zero block) is there: nothing is missing.
            assert err is None and len(got) == N, (cut, err)


@pytest.mark.filterwarnings("ignore:webds. skipping after")  # warn_and_continue, by design
@pytest.mark.parametrize("writer", ["webds", "pax"])
@pytest.mark.parametrize("mode", ["fluent", "steps"])
def test_every_cut_skipped_keeps_the_next_shard_whole(
    tmp_path: Path, writer: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under a skipping handler a cut shard is counted and logged, its sample in flight is
    dropped, and the next shard is read whole."""
    want, other = originals(0), originals(1)
    for s in other:
        s["__key__"] = "b" + s["__key__"]
    raw = write_shard(tmp_path / "a.tar", writer, want)
    write_shard(tmp_path / "b.tar", writer, other)
    end = members_end(raw)
    cut_path = tmp_path / "cut.tar"
    for cut in range(512, end + 1, 512):
        cut_path.write_bytes(raw[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="webds"):
            got, err = read(
                [str(cut_path), str(tmp_path / "b.tar")], mode, handler=webds.warn_and_continue
            )
        assert err is None
        first = [s for s in got if not s["__key__"].startswith("b")]
        assert_whole(first, want, cut)
        assert len(first) < N
        assert [s["__key__"] for s in got[len(first) :]] == [s["__key__"] for s in other], cut
        assert_whole(got[len(first) :], other, cut)
        assert "skipped 1 item" in caplog.text and "cut.tar" in caplog.text, (cut, caplog.text)


@pytest.mark.parametrize("writer", ["webds", "pax"])
@pytest.mark.parametrize("hole", [512, 1024, 4096])
def test_a_hole_over_any_header_raises(tmp_path: Path, writer: str, hole: int) -> None:
    """Zero blocks over a member header (a hole in a sparse or preallocated file), inside or
    between samples: an error, after whole samples only."""
    want = originals()
    raw = write_shard(tmp_path / "whole.tar", writer, want)
    index = webds.ShardIndex.build([str(tmp_path / "whole.tar")])
    end = members_end(raw)
    path = tmp_path / "whole.tar"
    for at in header_offsets(raw):
        damaged = bytearray(raw)
        damaged[at : min(at + hole, end)] = bytes(min(hole, end - at))
        path.write_bytes(bytes(damaged))
        if at + hole >= end:
            # A hole that reaches the end-of-archive marker leaves a shorter archive that is
            # well-formed (the marker is just earlier): only the index can tell, by its sample
            # count if whole samples went, by its checksum if only a last member did.
            assert {p.kind for p in index.verify()} & {"sha256", "samples", "corrupt"}, at
            continue
        for mode, with_index in [("fluent", None), ("steps", None), ("fluent", index)]:
            got, err = read(str(path), mode, index=with_index)
            assert_whole(got, want, (at, mode))
            assert err is not None, f"a {hole}-byte hole at {at} read as a whole shard ({mode})"
            assert len(got) < N


@pytest.mark.parametrize("writer", ["webds", "pax"])
def test_an_index_vouches_only_for_a_complete_count(tmp_path: Path, writer: str) -> None:
    """A shard without its end-of-archive marker reads whole when its index's sample count is
    complete; cut short, it raises, naming the missing marker (not a stale index)."""
    want = originals()
    path = tmp_path / "s.tar"
    raw = write_shard(path, writer, want)
    end = members_end(raw)
    index = webds.ShardIndex.build([str(path)])
    path.write_bytes(raw[:end])  # no marker, every sample there
    got, err = read(str(path), "fluent", index=index)
    assert err is None and len(got) == N
    assert_whole(got, want, "unmarked")
    got, err = read(str(path), "fluent")  # without the index nothing can vouch for it
    assert isinstance(err, webds.tar.reader.EndWithoutMarker) and len(got) == N - 1
    sample_ends = sorted({o + 0 for o in _sample_ends(raw)})
    for cut in sample_ends[:-1]:
        path.write_bytes(raw[:cut])
        got, err = read(str(path), "fluent", index=index)
        assert_whole(got, want, cut)
        assert err is not None and "end-of-archive marker" in str(err), (cut, err)
        assert len(got) < N


def _sample_ends(raw: bytes) -> List[int]:
    """Offsets where each sample's last member's padded data ends."""
    offsets = [(name, off) for name, _, off in read_members(io.BytesIO(raw))]
    ends = []
    for (name, _), (nxt, off) in zip(offsets, offsets[1:]):
        if name.split(".")[0] != nxt.split(".")[0]:
            ends.append(off)
    return ends


def test_a_cut_shard_through_dataloader_workers(tmp_path: Path) -> None:
    want = originals()
    raw = write_shard(tmp_path / "whole.tar", "webds", want)
    shards = []
    cuts = (3584, members_end(raw))  # inside a sample; at the last member's end
    whole = sum(1 for e in _sample_ends(raw) if e <= cuts[0]) + N - 1
    for i, cut in enumerate(cuts):
        p = tmp_path / f"cut-{i}.tar"
        p.write_bytes(raw[:cut])
        shards.append(str(p))
    for handler in (webds.reraise_exception, webds.ignore_and_continue):
        ds = webds.WebDataset(shards, shardshuffle=False, handler=handler, empty_check=False)
        loader = webds.WebLoader(ds, batch_size=None, num_workers=2)
        got = []
        if handler is webds.reraise_exception:
            with pytest.raises(ShardReadError):
                for s in loader:
                    got.append(s)
        else:
            got = list(loader)
            assert len(got) == whole  # the sample in flight where each shard ends is dropped
        for s in got:
            assert_whole([s], want, s["__key__"])


def test_compressed_shards_cut_or_holed(tmp_path: Path) -> None:
    import gzip

    want = originals()
    raw = write_shard(tmp_path / "whole.tar", "webds", want)
    end = members_end(raw)
    path = tmp_path / "s.tar.gz"
    for cut in (end, 3584):
        path.write_bytes(gzip.compress(raw[:cut]))
        got, err = read(str(path), "fluent")
        assert err is not None and len(got) < N
        assert_whole(got, want, cut)
    holed = bytearray(raw)
    at = header_offsets(raw)[3]  # 0001.txt's header
    holed[at : at + 512] = bytes(512)
    path.write_bytes(gzip.compress(bytes(holed)))
    got, err = read(str(path), "fluent")
    assert err is not None and "follows the zero block" in str(err)
    assert_whole(got, want, "hole")


def test_peer_shards_still_read_whole(peer_dir: Path) -> None:
    """Shards another implementation wrote end cleanly: the stricter end check refuses none."""
    paths = sorted(peer_dir.glob("*.t*"))
    assert paths, f"no peer shards in {peer_dir}"
    for path in paths:
        with open(path, "rb") as f:
            got = [(name, data) for name, data, _ in read_members(f, str(path))]
        assert got, f"{path.name}: no members read"
        # Python's tarfile is the independent reader: the same regular files, in order, same bytes.
        assert got == tar_members(path), path.name


# -- reading unterminated shards as complete, when the caller says so ------------------------


def _unterminated(path: Path, n: int = 276) -> str:
    """A shard of ``n`` samples written by webdataset's TarWriter (a pax header per member) and
    cut where its end-of-archive marker starts: what a writer killed between samples leaves."""
    wd = pytest.importorskip("webdataset")
    with wd.TarWriter(str(path)) as sink:
        for i in range(n):
            sink.write({"__key__": f"{i:04d}", "txt": b"x" * (i % 700), "cls": str(i).encode()})
    raw = path.read_bytes()
    path.write_bytes(raw[: members_end(raw)])
    return str(path)


def test_an_unterminated_shard_reads_whole_with_accept_unterminated(tmp_path, caplog, monkeypatch):
    """clip_benchmark's case: webdataset reads 276 samples, webds withheld the last one and
    raised. The error names the way out; accept_unterminated=True (or the environment's
    WDS_ACCEPT_UNTERMINATED=1, which WebDataset follows) yields all 276, with a warning."""
    import webdataset as wd

    url = _unterminated(tmp_path / "killed.tar")
    want = [s["__key__"] for s in wd.WebDataset(url, shardshuffle=False)]
    assert len(want) == 276
    got, err = read(url, "fluent")
    assert len(got) == 275 and isinstance(err, webds.tar.reader.EndWithoutMarker)
    for words in (
        "webds verify",
        "re-write",
        "accept_unterminated=True",
        "WDS_ACCEPT_UNTERMINATED",
    ):
        assert words in str(err), words
    steps = [
        webds.tarfile_to_samples(accept_unterminated=True),
        webds.url_opener(),
        webds.tar_file_expander(accept_unterminated=True),
        webds.group_by_keys(),
    ]
    for stages in (steps[:1], steps[1:]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="webds"):
            pipeline = webds.DataPipeline(webds.SimpleShardList(url), *stages)
            assert [s["__key__"] for s in pipeline] == want
        assert "killed.tar" in caplog.text and "end-of-archive marker" in caplog.text
    with caplog.at_level(logging.WARNING, logger="webds"):
        ds = webds.WebDataset(url, shardshuffle=False, accept_unterminated=True)
        assert [s["__key__"] for s in ds] == want
    monkeypatch.setenv("WDS_ACCEPT_UNTERMINATED", "1")
    assert [s["__key__"] for s in webds.WebDataset(url, shardshuffle=False)] == want
    with pytest.raises(webds.tar.reader.EndWithoutMarker):
        list(webds.WebDataset(url, shardshuffle=False, accept_unterminated=False))
    pipeline = webds.DataPipeline(webds.SimpleShardList(url), webds.tarfile_to_samples())
    assert len(list(pipeline)) == 276
    # The keyword wins over the environment; a value that is not a yes or a no is an error.
    got, err = read(url, "fluent")
    assert len(got) == 276 and err is None
    strict = webds.DataPipeline(
        webds.SimpleShardList(url), webds.tarfile_to_samples(accept_unterminated=False)
    )
    with pytest.raises(webds.tar.reader.EndWithoutMarker):
        list(strict)
    monkeypatch.setenv("WDS_ACCEPT_UNTERMINATED", "maybe")
    with pytest.raises(webds.ArgumentError, match="WDS_ACCEPT_UNTERMINATED"):
        list(webds.WebDataset(url, shardshuffle=False))


def test_accept_unterminated_still_reports_a_shard_cut_inside_a_member(tmp_path):
    url = _unterminated(tmp_path / "cut.tar", n=20)
    raw = Path(url).read_bytes()
    Path(url).write_bytes(raw[: len(raw) - 700])
    pipeline = webds.DataPipeline(
        webds.SimpleShardList(url), webds.tarfile_to_samples(accept_unterminated=True)
    )
    with pytest.raises(ShardReadError, match="truncated"):
        list(pipeline)
