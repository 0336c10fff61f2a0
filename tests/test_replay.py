"""Record-and-replay stages: Cached (memory) and LMDBCached (disk)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from conftest import sample_members
from torch.utils.data import DataLoader

from webds.errors import WebdsError
from webds.pipeline import DataPipeline
from webds.shards import SimpleShardList, split_by_worker
from webds.stages.filters import map as map_stage
from webds.stages.replay import Cached, LMDBCached
from webds.tar.samples import tarfile_to_samples


class Counting:
    """A source that counts how often it was iterated."""

    def __init__(self, n):
        self.n = n
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return iter(range(self.n))


def test_cached_records_once_then_replays():
    src = Counting(5)
    pipe = DataPipeline(src, map_stage(lambda x: x * 2), Cached())
    assert list(pipe) == [0, 2, 4, 6, 8]
    assert list(pipe) == [0, 2, 4, 6, 8]
    assert list(pipe) == [0, 2, 4, 6, 8]
    # The source is still started by the pipeline each pass, but nothing is read from it.
    assert pipe.stage(2).cached == [0, 2, 4, 6, 8]


def test_cached_does_not_read_upstream_on_replay():
    reads = []

    def note(x):
        reads.append(x)
        return x

    pipe = DataPipeline(range(4), map_stage(note), Cached())
    list(pipe)
    list(pipe)
    assert reads == [0, 1, 2, 3]


def test_cached_abandoned_pass_is_not_a_recording():
    cache = Cached()
    pipe = DataPipeline(range(10), cache)
    it = iter(pipe)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()
    assert cache.cached is None
    assert list(pipe) == list(range(10))
    assert cache.cached == list(range(10))
    cache.clear()
    assert cache.cached is None


def test_cached_via_compose_and_real_tar(tar_factory):
    url = str(tar_factory("a.tar", sample_members(6)))
    base = DataPipeline(SimpleShardList(url), tarfile_to_samples())
    cached = base.compose(Cached())
    first = list(cached)
    assert [s["__key__"] for s in first] == [f"{i:06d}" for i in range(6)]
    os.unlink(url)  # replay must not need the shard any more
    assert list(cached) == first
    assert "6 items" in repr(cached.stage(2))


def test_cached_per_worker_recordings():
    pipe = DataPipeline(range(8), split_by_worker, Cached())
    loader = DataLoader(pipe, batch_size=None, num_workers=2, persistent_workers=True)
    first = sorted(int(x) for x in loader)
    second = sorted(int(x) for x in loader)
    assert first == second == list(range(8))


# -- LMDBCached --------------------------------------------------------------------------------

lmdb = pytest.importorskip("lmdb")


def test_lmdb_records_then_replays_from_disk(tmp_path, tar_factory):
    url = str(tar_factory("a.tar", sample_members(30)))
    db = str(tmp_path / "cache.lmdb")
    pipe = DataPipeline(
        SimpleShardList(url), tarfile_to_samples(), LMDBCached(db, map_size=2**26, chunksize=7)
    )
    first = list(pipe)
    assert len(first) == 30
    assert pipe.stage(2).is_complete() and len(pipe.stage(2)) == 30
    os.unlink(url)
    assert list(pipe) == first
    pipe.close()
    # A new stage object (as in a later run) replays the same data in the same order.
    again = DataPipeline([], LMDBCached(db, map_size=2**26))
    assert list(again) == first


def test_lmdb_replay_in_another_process(tmp_path):
    db = str(tmp_path / "cache.lmdb")
    stage = LMDBCached(db, map_size=2**24)
    data = [{"__key__": f"k{i}", "x": i} for i in range(12)]
    assert list(DataPipeline(tuple(data), stage)) == data
    stage.close()
    code = (
        "from webds.stages.replay import LMDBCached; from webds.pipeline import DataPipeline\n"
        f"print([s['x'] for s in DataPipeline([], LMDBCached({db!r}, map_size=2**24))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(list(range(12)))


def test_lmdb_partial_recording_is_never_replayed(tmp_path):
    db = str(tmp_path / "cache.lmdb")
    stage = LMDBCached(db, map_size=2**24, chunksize=2)
    it = iter(DataPipeline(range(10), stage))
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    it.close()
    assert not stage.is_complete()
    with pytest.raises(TypeError, match="no complete recording"):
        len(stage)
    stage.close()
    fresh = LMDBCached(db, map_size=2**24, chunksize=2)
    assert not fresh.is_complete()
    # The next pass records anew (and the old partial chunk does not leak into it).
    assert list(DataPipeline(range(100, 103), fresh)) == [100, 101, 102]
    assert list(DataPipeline([], fresh)) == [100, 101, 102]


def test_lmdb_custom_pickler_and_pickling_the_stage(tmp_path):
    class Tagged:
        @staticmethod
        def dumps(x):
            return b"T" + pickle.dumps(x)

        @staticmethod
        def loads(b):
            assert b[:1] == b"T"
            return pickle.loads(b[1:])

    db = str(tmp_path / "c.lmdb")
    stage = LMDBCached(db, map_size=2**24, pickler=Tagged)
    list(DataPipeline((1, 2), stage))
    assert list(DataPipeline([], stage)) == [1, 2]
    clone = pickle.loads(pickle.dumps(LMDBCached(db, map_size=2**24)))
    assert clone._env is None
    with pytest.raises(WebdsError):  # pickler without dumps/loads
        LMDBCached(db, pickler=object())


def test_lmdb_default_map_size(tmp_path):
    stage = LMDBCached(str(tmp_path / "big.lmdb"))
    assert list(DataPipeline(range(3), stage)) == [0, 1, 2]
    assert list(DataPipeline([], stage)) == [0, 1, 2]


def test_lmdb_with_dataloader_workers(tmp_path):
    db = str(tmp_path / "w.lmdb")
    poison = tmp_path / "poison"

    def guard(x):
        if poison.exists():
            raise RuntimeError("upstream was read during replay")
        return x

    pipe = DataPipeline(range(20), split_by_worker, map_stage(guard), LMDBCached(db, 2**26))
    first = sorted(int(x) for x in DataLoader(pipe, batch_size=None, num_workers=2))
    assert first == list(range(20))
    poison.touch()
    second = sorted(int(x) for x in DataLoader(pipe, batch_size=None, num_workers=2))
    assert second == first


def test_lmdb_missing_package_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdb", None)
    with pytest.raises(WebdsError, match="pip install lmdb"):
        LMDBCached(str(tmp_path / "x.lmdb"))


def test_lmdb_stage_pickles_with_module_pickler(tmp_path):
    db = str(tmp_path / "p.lmdb")
    stage = LMDBCached(db, map_size=2**24)
    assert list(DataPipeline(range(3), stage)) == [0, 1, 2]
    clone = pickle.loads(pickle.dumps(stage))
    assert clone.pickler is pickle and clone._env is None
    stage.close()
    assert list(DataPipeline(clone)) == [0, 1, 2]
