"""WebDataset and the fluent methods, end to end on real tar files."""

from __future__ import annotations

import inspect
import io
import logging
import pickle

import numpy as np
import pytest
import torch
from conftest import sample_members, write_tar
from PIL import Image

from webds.base.handlers import warn_and_continue
from webds.errors import ArgumentError, OpenError, ShardReadError, WebdsError
from webds.fluent import FluentMixin, WebDataset
from webds.pipeline import DataPipeline
from webds.stages import batching, fields, filters
from webds.stages.decode import decode as decode_stage


def jpeg_bytes(i: int) -> bytes:
    rng = np.random.default_rng(i)
    img = Image.fromarray(rng.integers(0, 255, (16, 20, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture
def image_shards(tmp_path):
    """Three shards of 10 samples each, with a JPEG and a class label."""
    for s in range(3):
        members = []
        for i in range(10):
            key = f"{s:02d}{i:04d}"
            members.append((f"{key}.jpg", jpeg_bytes(s * 10 + i)))
            members.append((f"{key}.cls", str(i % 4).encode()))
        write_tar(tmp_path / f"img-{s}.tar", members)
    return str(tmp_path / "img-{0..2}.tar")


@pytest.fixture
def text_shards(tmp_path):
    """Five shards of 20 samples with .txt and .cls, keys unique across shards."""
    for s in range(5):
        write_tar(tmp_path / f"t-{s}.tar", sample_members(20, prefix=f"s{s}-"))
    return str(tmp_path / "t-{0..4}.tar")


def keys(ds):
    return [s["__key__"] for s in ds]


def test_the_one_liner(image_shards):
    ds = WebDataset(image_shards).shuffle(1000).decode("pil").to_tuple("jpg", "cls").batched(8)
    batches = list(ds)
    assert [len(b[0]) for b in batches] == [8, 8, 8, 6]
    img, cls = batches[0][0][0], batches[0][1]
    assert isinstance(img, Image.Image) and img.size == (20, 16)
    assert isinstance(cls, np.ndarray) and cls.dtype.kind == "i"


def test_decode_to_tensors_and_batch(image_shards):
    ds = WebDataset(image_shards).decode("torchrgb").to_tuple("jpg", "cls").batched(10)
    x, y = next(iter(ds))
    assert x.shape == (10, 3, 16, 20) and x.dtype == torch.float32
    assert list(y) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_sample_fields(text_shards, tmp_path):
    first = next(iter(WebDataset(text_shards)))
    assert first["__key__"] == "s0-000000"
    assert first["__url__"] == str(tmp_path / "t-0.tar")
    assert first["__local_path__"] == str(tmp_path / "t-0.tar")
    assert first["txt"] == b"sample s0-000000 txt"
    assert first["cls"] == b"0"


def test_every_sample_once_in_order_without_shuffle(text_shards):
    ks = keys(WebDataset(text_shards))
    assert ks == [f"s{s}-{i:06d}" for s in range(5) for i in range(20)]


def test_fluent_methods_derive_from_stages():
    pairs = {
        "shuffle": filters.shuffle,
        "map": filters.map,
        "to_tuple": fields.to_tuple,
        "batched": batching.batched,
        "decode": decode_stage,
        "select": filters.select,
    }
    for name, factory in pairs.items():
        method = getattr(FluentMixin, name)
        params = list(inspect.signature(method).parameters.values())[1:]
        assert params == list(inspect.signature(factory).parameters.values()), name
        assert method.__doc__ == factory.__doc__


def test_chaining_does_not_mutate(text_shards):
    base = WebDataset(text_shards)
    n = len(base.pipeline)
    sliced = base.slice(5)
    assert len(base.pipeline) == n
    assert len(list(sliced)) == 5
    assert len(list(base)) == 100


def test_shardshuffle_reproducible_and_changes_per_epoch(text_shards):
    a = WebDataset(text_shards, shardshuffle=True, seed=3)
    b = WebDataset(text_shards, shardshuffle=True, seed=3)
    epochs_a = [keys(a) for _ in range(3)]
    epochs_b = [keys(b) for _ in range(3)]
    assert epochs_a == epochs_b
    assert all(sorted(e) == sorted(epochs_a[0]) for e in epochs_a)
    shard_orders = [[k.split("-")[0] for k in e[::20]] for e in epochs_a]
    assert len({tuple(o) for o in shard_orders}) > 1


def test_sample_shuffle_seeded(text_shards):
    a = keys(WebDataset(text_shards).shuffle(50, seed=1))
    b = keys(WebDataset(text_shards).shuffle(50, seed=1))
    assert a == b and sorted(a) == sorted(keys(WebDataset(text_shards)))
    assert a != keys(WebDataset(text_shards))


def test_resampled_with_epoch(text_shards):
    ds = WebDataset(text_shards, resampled=True, seed=0).with_epoch(37)
    assert len(keys(ds)) == 37
    assert len(keys(ds)) == 37


def test_node_split(text_shards, monkeypatch):
    seen = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        seen.extend(keys(WebDataset(text_shards, shardshuffle=True, seed=5)))
    assert sorted(seen) == sorted(f"s{s}-{i:06d}" for s in range(5) for i in range(20))


def test_empty_check(tmp_path):
    write_tar(tmp_path / "e-0.tar", [])
    write_tar(tmp_path / "e-1.tar", [])
    with pytest.raises(WebdsError, match="no samples found"):
        list(WebDataset(str(tmp_path / "e-{0..1}.tar")))
    assert list(WebDataset(str(tmp_path / "e-{0..1}.tar"), empty_check=False)) == []


def test_missing_shard_default_raises(text_shards, tmp_path):
    urls = [str(tmp_path / "t-0.tar"), str(tmp_path / "missing.tar")]
    with pytest.raises(OpenError) as info:
        list(WebDataset(urls))
    assert info.value.url == str(tmp_path / "missing.tar")


def test_missing_shard_skipped_with_handler(text_shards, tmp_path, caplog):
    urls = [str(tmp_path / "t-0.tar"), str(tmp_path / "missing.tar"), str(tmp_path / "t-1.tar")]
    with caplog.at_level(logging.WARNING, logger="webds"), pytest.warns(UserWarning):
        got = keys(WebDataset(urls, handler=warn_and_continue))
    assert len(got) == 40
    assert any("skipped 1" in r.getMessage() for r in caplog.records)


def test_truncated_shard_raises_after_complete_samples(tmp_path):
    path = write_tar(tmp_path / "t.tar", sample_members(10))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])  # mid-member, not at a header boundary
    got = []
    with pytest.raises(ShardReadError) as info:
        for s in WebDataset(str(path)):
            got.append(s["__key__"])
    assert info.value.url == str(path)
    assert 0 < len(got) < 10


def test_gz_and_pipe_shards(tmp_path):
    write_tar(tmp_path / "a.tar.gz", sample_members(5, prefix="a"), compress="gz")
    write_tar(tmp_path / "b.tar", sample_members(5, prefix="b"))
    urls = [str(tmp_path / "a.tar.gz"), f"pipe:cat {tmp_path / 'b.tar'}"]
    got = list(WebDataset(urls))
    assert [s["__key__"] for s in got] == [f"a{i:06d}" for i in range(5)] + [
        f"b{i:06d}" for i in range(5)
    ]
    assert got[-1]["__url__"] == f"pipe:cat {tmp_path / 'b.tar'}"
    assert "__local_path__" not in got[-1]


def test_whole_chain_pickles(image_shards):
    ds = (
        WebDataset(image_shards, shardshuffle=True, seed=1)
        .shuffle(10, seed=2)
        .decode("rgb8")
        .to_tuple("jpg", "cls")
        .batched(5)
    )
    clone = pickle.loads(pickle.dumps(ds))
    a, b = list(ds), list(clone)
    assert len(a) == len(b) == 6
    for (xa, ya), (xb, yb) in zip(a, b):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_webdataset_is_a_pipeline(text_shards):
    ds = WebDataset(text_shards)
    assert isinstance(ds, DataPipeline)
    assert isinstance(ds, torch.utils.data.IterableDataset)


def _group_gone(pgid: int, timeout: float = 10.0) -> bool:
    import os
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_pipe_processes_end_when_iteration_stops_early(tmp_path):
    # 2000 samples: far more than the pipe buffer, so `cat` is still running when we stop.
    write_tar(tmp_path / "big.tar", sample_members(2000))
    pidfile = tmp_path / "pid"
    ds = WebDataset(f"pipe:echo $$ > {pidfile}; cat {tmp_path / 'big.tar'} | cat")
    it = iter(ds)
    assert next(it)["__key__"] == "000000"
    it.close()
    assert _group_gone(int(pidfile.read_text())), "the pipe's processes outlived the iteration"


def test_pipe_processes_reaped_after_full_read(tmp_path):
    write_tar(tmp_path / "s.tar", sample_members(50))
    pidfile = tmp_path / "pid"
    ds = WebDataset(f"pipe:echo $$ > {pidfile}; cat {tmp_path / 's.tar'}")
    assert len(list(ds)) == 50
    assert _group_gone(int(pidfile.read_text()))


def test_failing_pipe_command_is_a_typed_error(tmp_path):
    with pytest.raises(OpenError, match="status 3") as info:
        list(WebDataset("pipe:echo 'no such bucket' >&2; exit 3"))
    assert "no such bucket" in str(info.value)


def test_stdin_shard(tmp_path):
    import subprocess
    import sys

    path = write_tar(tmp_path / "s.tar", sample_members(7))
    code = "import webds; print(sum(1 for _ in webds.WebDataset('-')))"
    out = subprocess.run(
        [sys.executable, "-c", code], stdin=path.open("rb"), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "7"


def test_wds_seed_environment_variable(text_shards, monkeypatch):
    monkeypatch.setenv("WDS_SEED", "17")
    from_env = keys(WebDataset(text_shards, shardshuffle=True))
    assert from_env == keys(WebDataset(text_shards, shardshuffle=True, seed=17))
    assert from_env != keys(WebDataset(text_shards, shardshuffle=True, seed=0))
    monkeypatch.setenv("WDS_SEED", "abc")
    with pytest.raises(ArgumentError, match="WDS_SEED must be an integer"):
        WebDataset(text_shards, shardshuffle=True)
