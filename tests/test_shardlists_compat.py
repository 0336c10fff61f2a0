"""webdataset's extra shard lists: non_empty, resampled, MultiShardSample / shardspec,
DirectoryShardList."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest
from conftest import sample_members, write_tar
from torch.utils.data import DataLoader

from webds.compat.shardsources import (
    DirectoryShardList,
    MultiShardSample,
    fnmatch_with_braces,
    glob_with_braces,
    shardspec,
)
from webds.errors import ArgumentError, WebdsError
from webds.pipeline import DataPipeline
from webds.shards import SimpleShardList, non_empty, resampled, split_by_worker
from webds.tar.samples import tarfile_to_samples


def urls(it):
    return [d["url"] for d in it]


# -- non_empty, resampled ----------------------------------------------------------------------


def test_non_empty_passes_through_or_raises():
    assert list(DataPipeline(range(3), non_empty)) == [0, 1, 2]
    with pytest.raises(ArgumentError, match="no data"):
        list(DataPipeline(range(0), non_empty))


def test_non_empty_catches_a_worker_without_shards():
    pipe = DataPipeline(SimpleShardList(["only.tar"]), split_by_worker, non_empty)
    with pytest.raises(ArgumentError):
        list(DataLoader(pipe, batch_size=None, num_workers=2))


def test_resampled_stage(monkeypatch):
    items = [{"url": f"s{i}"} for i in range(5)]
    drawn = list(resampled(200, seed=3)(iter(items)))
    assert len(drawn) == 200 and {d["url"] for d in drawn} == {d["url"] for d in items}
    assert drawn == list(resampled(200, seed=3)(iter(items)))
    assert drawn != list(resampled(200, seed=4)(iter(items)))
    assert list(resampled(200)(iter(items))) != list(resampled(200)(iter(items)))
    # Seeded per epoch and per worker.
    pipe = DataPipeline(SimpleShardList([d["url"] for d in items]), resampled(50, seed=1))
    assert urls(pipe) != urls(pipe)
    monkeypatch.setenv("WORKER", "1")
    monkeypatch.setenv("NUM_WORKERS", "2")
    assert list(resampled(50, seed=3)(iter(items))) != drawn[:50]
    with pytest.raises(ArgumentError, match="nothing"):
        list(resampled(5)(iter([])))


def test_resampled_prints_nothing(capfd):
    list(resampled(3, seed=0)(iter([1, 2])))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# -- MultiShardSample / shardspec --------------------------------------------------------------

SPEC = {
    "prefix": "/data/",
    "buckets": "main",
    "datasets": [
        {"name": "web", "shards": "web-{000..009}.tar", "choose": 3},
        {"shards": ["book-{0..1}.tar", "extra.tar"], "buckets": "other"},
        {"name": "rs", "shards": "rs-{0..2}.tar", "resample": 5, "buckets": []},
    ],
}


def test_multishardsample_selection_per_epoch():
    ms = MultiShardSample(SPEC, seed=7)
    assert len(ms) == 3 + 3 + 5
    e0 = urls(ms)
    assert len(e0) == 11
    web = [u for u in e0 if u.startswith("/data/main/web-")]
    assert len(web) == 3 == len(set(web))
    assert sorted(u for u in e0 if "/other/" in u) == [
        "/data/other/book-0.tar",
        "/data/other/book-1.tar",
        "/data/other/extra.tar",
    ]
    rs = [u for u in e0 if "rs-" in u]
    assert len(rs) == 5 and set(rs) <= {f"/data/rs-{i}.tar" for i in range(3)}
    # The same (seed, epoch) gives the same list anywhere; a new epoch gives a new one.
    assert urls(MultiShardSample(SPEC, seed=7)) == e0
    ms.set_epoch(1)
    assert urls(ms) != e0
    ms.set_epoch(0)
    assert urls(ms) == e0
    assert urls(MultiShardSample(SPEC, seed=8)) != e0
    assert "web" in repr(ms)


def test_multishardsample_same_list_in_every_worker():
    pipe = DataPipeline(MultiShardSample(SPEC, seed=1))
    lists = list(DataLoader(_ListAll(pipe), batch_size=None, num_workers=2))
    assert lists[0] == lists[1] and len(lists[0]) == 11


class _ListAll(__import__("torch").utils.data.IterableDataset):
    def __init__(self, pipe):
        self.pipe = pipe

    def __iter__(self):
        yield urls(self.pipe)


def test_multishardsample_yaml_file_expands_vars(tmp_path, monkeypatch):
    pytest.importorskip("yaml")
    monkeypatch.setenv("SHARDROOT", str(tmp_path))
    spec = tmp_path / "mix.yaml"
    spec.write_text(
        "datasets:\n"
        "  - shards: ${SHARDROOT}/a-{0..1}.tar\n"
        "  - shards: [b.tar]\n"
        "    buckets: ${SHARDROOT}/sub\n"
    )
    got = sorted(urls(shardspec(str(spec))))
    assert got == sorted([f"{tmp_path}/a-0.tar", f"{tmp_path}/a-1.tar", f"{tmp_path}/sub/b.tar"])


def test_multishardsample_reads_real_shards(tmp_path):
    for name in ("a", "b"):
        write_tar(tmp_path / f"{name}.tar", sample_members(3, prefix=name))
    spec = {"prefix": str(tmp_path) + "/", "datasets": [{"shards": "{a,b}.tar"}]}
    keys = sorted(s["__key__"] for s in DataPipeline(shardspec(spec), tarfile_to_samples()))
    assert keys == [f"{n}{i:06d}" for n in "ab" for i in range(3)]


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"datasets": [{"shards": "a.tar"}], "extra": 1}, "unknown key"),
        ({"datasets": [{"shards": "a.tar", "weight": 2}]}, "unknown key"),
        ({"datasets": []}, "non-empty"),
        ({"datasets": [{"name": "x"}]}, "shards"),
        ({"datasets": [{"shards": "a-{0..1}.tar", "choose": 3}]}, "only 2"),
        ({"datasets": [{"shards": "a.tar", "choose": 1, "resample": 2}]}, "not both"),
        ({"datasets": [{"shards": "a.tar", "choose": "2"}]}, "integer"),
        ({"datasets": [{"shards": "a.tar", "buckets": ["x", "y"]}]}, "several buckets"),
    ],
)
def test_multishardsample_rejects_bad_specs(spec, match):
    with pytest.raises(ArgumentError, match=match):
        MultiShardSample(spec)


def test_shardspec_and_yaml_errors(tmp_path, monkeypatch):
    plain = shardspec("a-{0..2}.tar")
    assert isinstance(plain, SimpleShardList) and len(plain) == 3
    assert isinstance(shardspec(SPEC), MultiShardSample)
    bad = tmp_path / "bad.yaml"
    bad.write_text("datasets: [\n")
    if "yaml" in sys.modules or _has_yaml():
        with pytest.raises(ArgumentError, match="not valid YAML"):
            shardspec(str(bad))
        with pytest.raises(ArgumentError, match="cannot read"):
            shardspec(str(tmp_path / "missing.yml"))
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(WebdsError, match="pip install pyyaml"):
        shardspec(str(bad))
    assert isinstance(shardspec(SPEC), MultiShardSample)  # a dict needs no YAML


def _has_yaml():
    try:
        import yaml  # noqa: F401
    except ImportError:
        return False
    return True


# -- DirectoryShardList ------------------------------------------------------------------------


def test_glob_and_fnmatch_with_braces(tmp_path):
    for name in ("a.tar", "b.tgz", "c.tar.tgz", "d.txt"):
        (tmp_path / name).write_bytes(b"")
    got = sorted(os.path.basename(p) for p in glob_with_braces(f"{tmp_path}/*.{{tar,tgz}}"))
    assert got == ["a.tar", "b.tgz", "c.tar.tgz"]
    assert fnmatch_with_braces("x.tgz", "*.{tar,tgz}")
    assert not fnmatch_with_braces("x.txt", "*.{tar,tgz}")


def _queue(tmp_path, n=3):
    d = tmp_path / "queue"
    d.mkdir()
    for i in range(n):
        write_tar(d / f"s{i}.tar", sample_members(2, prefix=f"s{i}-"))
    (d / "notes.txt").write_text("not a shard")
    return d


def test_directory_default_pattern_claims_and_restores(tmp_path):
    d = _queue(tmp_path)
    ds = DirectoryShardList(str(d) + "/", poll=None, select="oldest")
    it = iter(ds)
    first = next(it)["url"]
    assert first.endswith(f"._{os.getpid()}_") and os.path.exists(first)
    assert sorted(os.listdir(d)).count(os.path.basename(first)) == 1
    # The default brace pattern matched the .tar files (webdataset bug #415).
    it.close()
    # Closing mid-shard puts the shard back under its name.
    assert sorted(os.listdir(d)) == ["notes.txt", "s0.tar", "s1.tar", "s2.tar"]


def test_directory_resample_mode_reads_real_shards(tmp_path):
    d = _queue(tmp_path)
    ds = DirectoryShardList(d, poll=None, seed=0)
    pipe = DataPipeline(ds, tarfile_to_samples()).with_epoch(12)
    keys = [s["__key__"] for s in pipe]
    assert len(keys) == 12
    assert set(keys) <= {f"s{i}-{j:06d}" for i in range(3) for j in range(2)}
    pipe.close()
    assert sorted(os.listdir(d)) == ["notes.txt", "s0.tar", "s1.tar", "s2.tar"]


def test_directory_unlink_mode_consumes_each_shard_once(tmp_path):
    d = _queue(tmp_path, n=4)
    seen = urls(DirectoryShardList(d, poll=None, mode="unlink"))
    assert len(seen) == 4
    assert sorted(os.path.basename(u).split(".")[0] for u in seen) == ["s0", "s1", "s2", "s3"]
    assert os.listdir(d) == ["notes.txt"]


def test_directory_keep_mode_and_fate(tmp_path):
    d = _queue(tmp_path)
    assert len(urls(DirectoryShardList(d, poll=None, mode="keep"))) == 3
    assert sorted(os.listdir(d)) == ["notes.txt"] + [f"s{i}.tar._done_" for i in range(3)]

    d2 = tmp_path / "q2"
    d2.mkdir()
    for name in ("keep.tar", "drop.tar"):
        (d2 / name).write_bytes(b"")

    def fate(path):
        return "keep" if os.path.basename(path).startswith("keep") else "unlink"

    assert len(urls(DirectoryShardList(d2, poll=None, mode="resample", fate=fate))) == 2
    assert os.listdir(d2) == ["keep.tar._done_"]


def test_directory_two_consumers_never_share_a_shard(tmp_path):
    d = _queue(tmp_path, n=6)
    a = iter(DirectoryShardList(d, poll=None, mode="unlink", seed=1))
    b = iter(DirectoryShardList(d, poll=None, mode="unlink", seed=1))
    got = []
    for x, y in zip(a, b):
        assert x["url"] != y["url"]
        got += [x["url"], y["url"]]
    got += urls(a) + urls(b)
    assert len(got) == len(set(got)) == 6


def test_directory_releases_claims_of_dead_processes(tmp_path):
    d = _queue(tmp_path, n=2)
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(proc.stdout)
    os.rename(d / "s0.tar", d / f"s0.tar._{dead}_")
    ds = DirectoryShardList(d, poll=None, mode="unlink")
    ds.cleanup_files_without_processes()
    assert sorted(os.listdir(d)) == ["notes.txt", "s0.tar", "s1.tar"]
    # A live process's claim is left alone.
    os.rename(d / "s1.tar", d / f"s1.tar._{os.getpid()}_")
    ds.cleanup_files_without_processes()
    assert f"s1.tar._{os.getpid()}_" in os.listdir(d)


def test_directory_with_dataloader_workers(tmp_path):
    d = _queue(tmp_path, n=6)
    ds = DirectoryShardList(d, poll=None, mode="unlink")
    got = [x["url"] for x in DataLoader(ds, batch_size=None, num_workers=2)]
    names = collections.Counter(os.path.basename(u).split("._")[0] for u in got)
    assert names == {f"s{i}.tar": 1 for i in range(6)}
    assert os.listdir(d) == ["notes.txt"]


def test_directory_argument_errors(tmp_path):
    with pytest.raises(ArgumentError, match="not a directory"):
        DirectoryShardList(tmp_path / "nope")
    with pytest.raises(ArgumentError, match="mode"):
        DirectoryShardList(tmp_path, mode="shred")
    with pytest.raises(ArgumentError, match="select"):
        DirectoryShardList(tmp_path, select="newest")
    (tmp_path / "x.tar").write_bytes(b"")
    bad = DirectoryShardList(tmp_path, poll=None, fate=lambda p: "shred")
    with pytest.raises(ArgumentError, match="fate returned"):
        urls(bad)
    assert os.listdir(tmp_path) == ["x.tar"]


def test_directory_waits_then_times_out(tmp_path):
    ds = DirectoryShardList(tmp_path, poll=0.01, timeout=0.05)
    assert urls(ds) == []


_CONSUMER = """
import os, sys, time, warnings
warnings.simplefilter("ignore")
lib, path, out, mode = sys.argv[1:5]
if lib == "webdataset":
    import types
    import webdataset.shardlists as wsl
    from webdataset.shardlists import DirectoryShardList
    # webdataset 1.0.2 sleeps `poll` after losing a claim race, and poll=None (return when the
    # directory is empty) makes that sleep a TypeError: its bug, not the protocol's.
    wsl.time = types.SimpleNamespace(time=time.time, sleep=lambda s: time.sleep(s or 0))
else:
    from webds.compat.shardsources import DirectoryShardList
# Both programs start consuming together (their imports take different times).
open(out + ".ready", "w").close()
deadline = time.time() + 60
while not all(os.path.exists(os.path.join(os.path.dirname(out), f"{lib}.txt.ready"))
              for lib in ("webdataset", "webds")):
    assert time.time() < deadline, "the other program never started"
    time.sleep(0.01)
got = []
# webdataset's default pattern matches nothing (its glob has no braces): name one both take.
for shard in DirectoryShardList(path + "/", pattern="*.tar", poll=None, mode=mode):
    name = shard["url"]
    assert name.endswith(f"._{os.getpid()}_"), name  # the claim: NAME._PID_
    assert os.path.exists(name)
    got.append(os.path.basename(name).rsplit("._", 1)[0])
    time.sleep(0.05)  # hold the claim a while, so the two programs interleave
with open(out, "w") as f:
    f.write("\\n".join(got))
"""


@pytest.mark.parametrize("mode", ["unlink", "keep"])
def test_directory_interoperates_with_webdatasets(tmp_path, mode):
    # A webdataset 1.0.2 program and a webds one share a directory: each shard is claimed by
    # one of them only, and recycled as the mode says, whoever claimed it.
    pytest.importorskip("webdataset")
    d = _queue(tmp_path, n=24)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONSUMER, lib, d, str(tmp_path / f"{lib}.txt"), mode],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        for lib in ("webdataset", "webds")
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    got = {lib: (tmp_path / f"{lib}.txt").read_text().split() for lib in ("webdataset", "webds")}
    assert got["webdataset"] and got["webds"]  # both took part
    names = got["webdataset"] + got["webds"]
    assert sorted(names) == sorted(set(names)) and len(names) == 24
    left = sorted(n for n in os.listdir(d) if n != "notes.txt")
    if mode == "unlink":
        assert left == []
    else:
        assert left == sorted(f"{n}._done_" for n in names)


def test_webdataset_takes_a_spec_as_webdataset_does(tmp_path, monkeypatch):
    # A dict or a .yaml file in place of URLs is a MultiShardSample, as in webdataset 1.x: the
    # same samples as webdataset 1.0.2 reads, each once, also across DataLoader workers.
    import webds

    for s in range(4):
        write_tar(tmp_path / f"s-{s}.tar", sample_members(5, prefix=f"s{s}-"))
    spec = {"prefix": str(tmp_path) + "/", "datasets": [{"shards": "s-{0..3}.tar"}]}
    want = sorted(f"s{s}-{i:06d}" for s in range(4) for i in range(5))
    assert sorted(x["__key__"] for x in webds.WebDataset(spec)) == want
    loader = DataLoader(webds.WebDataset(spec).to_tuple("__key__"), num_workers=2, batch_size=None)
    assert sorted(k for (k,) in loader) == want
    yaml = pytest.importorskip("yaml")
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(spec))
    assert sorted(x["__key__"] for x in webds.WebDataset(str(tmp_path / "mix.yaml"))) == want
    webdataset = pytest.importorskip("webdataset")
    monkeypatch.setenv("ALLOW_OBSOLETE", "1")  # 1.0.2 made MultiShardSample opt-in
    theirs = webdataset.WebDataset(str(tmp_path / "mix.yaml"), shardshuffle=False)
    assert sorted(x["__key__"] for x in theirs) == want
    with pytest.raises(ArgumentError, match="resampled"):
        webds.WebDataset(spec, resampled=True)
    with pytest.raises(ArgumentError, match="datasets"):
        webds.WebDataset({"no": "datasets"})


def test_a_shard_source_passed_as_urls_is_refused_before_it_claims_anything(tmp_path):
    import webds

    d = _queue(tmp_path)
    before = sorted(os.listdir(d))
    with pytest.raises(ArgumentError, match="DataPipeline"):
        webds.WebDataset(DirectoryShardList(str(d) + "/", poll=None, mode="keep"))
    assert sorted(os.listdir(d)) == before  # nothing claimed or recycled
    with pytest.raises(ArgumentError, match="shard source"):
        webds.WebDataset(SimpleShardList([str(d / "s0.tar")]))
    queue = DirectoryShardList(str(d) + "/", poll=None, mode="keep")
    pipeline = DataPipeline(queue, tarfile_to_samples())
    assert len(list(pipeline)) == 6
