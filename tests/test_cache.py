"""LRUCleanup and pipe_cleaner on a real directory."""

from __future__ import annotations

import os

import pytest

from webds.errors import ArgumentError
from webds.io.cache import LRUCleanup, pipe_cleaner


def test_pipe_cleaner_finds_the_url():
    assert pipe_cleaner("pipe:curl -s -L https://host/d/a-000.tar") == "https://host/d/a-000.tar"
    assert pipe_cleaner("pipe:aws s3 cp s3://bucket/a.tar -") == "s3://bucket/a.tar"
    assert pipe_cleaner("pipe:gsutil cat 'gs://b/x.tar'") == "gs://b/x.tar"
    assert pipe_cleaner("pipe:cat local.tar") == "pipe:cat local.tar"
    assert pipe_cleaner("/data/a.tar") == "/data/a.tar"


def make(path, size, when):
    path.write_bytes(b"x" * size)
    os.utime(path, (when, when))
    return path


def test_lru_cleanup_deletes_oldest_until_it_fits(tmp_path):
    old = make(tmp_path / "old.tar", 400, 1000)
    mid = make(tmp_path / "mid.tar", 400, 2000)
    new = make(tmp_path / "new.tar", 400, 3000)
    hidden = make(tmp_path / ".new.tar.tmp-1", 400, 10)  # a download in progress
    lru = LRUCleanup(str(tmp_path), cache_size=900, interval=None)
    assert lru.cleanup() == 400
    assert not old.exists() and mid.exists() and new.exists() and hidden.exists()
    lru.cache_size = 0
    assert lru.cleanup() == 800
    assert sorted(os.listdir(tmp_path)) == [".new.tar.tmp-1"]


def test_lru_cleanup_respects_interval(tmp_path):
    make(tmp_path / "a.tar", 100, 1000)
    lru = LRUCleanup(str(tmp_path), cache_size=1000, interval=3600)
    assert lru.cleanup() == 0
    make(tmp_path / "b.tar", 5000, 2000)
    assert lru.cleanup() == 0, "a second run within the interval does nothing"
    lru.interval = None
    assert lru.cleanup() == 5100 and os.listdir(tmp_path) == []


def test_lru_cleanup_missing_dir_and_bad_size(tmp_path):
    assert LRUCleanup(str(tmp_path / "none"), interval=None).cleanup() == 0
    with pytest.raises(ArgumentError):
        LRUCleanup(str(tmp_path), cache_size=-1)


# -- the shard cache ------------------------------------------------------------------------------

import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from conftest import sample_members, write_tar  # noqa: E402

from webds.base.handlers import ignore_and_continue  # noqa: E402
from webds.errors import OpenError, ShardReadError  # noqa: E402
from webds.fluent import WebDataset  # noqa: E402


@pytest.fixture
def remote(tmp_path):
    """Three shards reached through pipe: URLs: not local files, so the cache copies them."""
    src = tmp_path / "src"
    src.mkdir()
    for s in range(3):
        write_tar(src / f"s-{s}.tar", sample_members(40, prefix=f"s{s}-"))
    return src, [f"pipe:cat {src / f's-{s}.tar'}" for s in range(3)]


def visible(d):
    return sorted(n for n in os.listdir(d) if not n.startswith("."))


def test_first_epoch_fills_the_cache_later_epochs_read_it(remote, tmp_path):
    src, urls = remote
    cache = tmp_path / "cache"
    ds = WebDataset(urls, cache_dir=str(cache))
    first = [(s["__key__"], s["txt"]) for s in ds]
    assert len(first) == 120
    files = visible(cache)
    assert sorted(os.listdir(cache)) == files, "no temporary file left behind"
    for s in range(3):
        assert (src / f"s-{s}.tar").read_bytes() in [(cache / f).read_bytes() for f in files]
    for f in src.iterdir():
        f.unlink()  # the sources are gone: only the cache can serve the second epoch
    second = list(ds)
    assert [(s["__key__"], s["txt"]) for s in second] == first
    assert all(s["__local_path__"].startswith(str(cache)) for s in second)


def test_early_stop(remote, tmp_path):
    # A small rest of the shard (under 1 MiB) is read to finish the copy...
    _, urls = remote
    cache = tmp_path / "cache"
    it = iter(WebDataset(urls, cache_dir=str(cache)))
    next(it)
    it.close()
    assert len(visible(cache)) == 1 and len(os.listdir(cache)) == 1
    # ...a large one is not downloaded just for the cache: nothing is kept.
    big = write_tar(tmp_path / "big.tar", [(f"{i:05d}.bin", os.urandom(4096)) for i in range(800)])
    cache2 = tmp_path / "cache2"
    it = iter(WebDataset(f"pipe:cat {big}", cache_dir=str(cache2)))
    next(it)
    it.close()
    assert os.listdir(cache2) == []


def test_truncated_remote_shard_is_never_cached(remote, tmp_path):
    src, urls = remote
    data = (src / "s-1.tar").read_bytes()
    (src / "s-1.tar").write_bytes(data[: len(data) // 2 + 100])
    cache = tmp_path / "cache"
    with pytest.raises(ShardReadError):
        list(WebDataset(urls, cache_dir=str(cache)))
    assert all(not n.startswith(".") for n in os.listdir(cache))
    got = list(WebDataset(urls, cache_dir=str(cache), handler=ignore_and_continue))
    assert 80 <= len(got) < 120
    files = visible(cache)
    assert len(files) == 2 and sorted(os.listdir(cache)) == files, "only the complete shards"


def test_failing_command_is_never_cached(tmp_path):
    path = write_tar(tmp_path / "a.tar", sample_members(10))
    cache = tmp_path / "cache"
    url = f"pipe:cat {path}; exit 3"
    with pytest.raises(OpenError, match="status 3"):
        list(WebDataset(url, cache_dir=str(cache)))
    assert os.listdir(cache) == []


def test_names_never_collide(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        write_tar(tmp_path / d / "train.tar", sample_members(5, prefix=d))
    urls = [f"pipe:cat {tmp_path / d / 'train.tar'}" for d in ("a", "b")]
    cache = tmp_path / "cache"
    keys = [s["__key__"] for s in WebDataset(urls, cache_dir=str(cache))]
    assert len(visible(cache)) == 2
    assert [s["__key__"] for s in WebDataset(urls, cache_dir=str(cache))] == keys
    assert keys[0].startswith("a") and keys[-1].startswith("b")


def test_cache_size_bound(remote, tmp_path):
    src, urls = remote
    cache = tmp_path / "cache"
    one = (src / "s-0.tar").stat().st_size
    list(WebDataset(urls, cache_dir=str(cache), cache_size=int(2.5 * one)))
    sizes = [(cache / f).stat().st_size for f in visible(cache)]
    assert len(sizes) == 2 and sum(sizes) <= 2.5 * one


def test_local_files_are_read_in_place_unless_asked(tmp_path):
    from webds.io.cache import ShardCache

    path = write_tar(tmp_path / "a.tar", sample_members(3))
    cache = ShardCache(str(tmp_path / "cache"))
    stream, lpath = cache.open(str(path))
    stream.close()
    assert lpath == str(path) and os.listdir(tmp_path / "cache") == []
    cache = ShardCache(str(tmp_path / "cache"), cache_local=True)
    stream, lpath = cache.open(str(path))
    while stream.read(1 << 16):
        pass
    stream.close()
    assert len(visible(tmp_path / "cache")) == 1


READER = """
import sys, webds
urls = sys.argv[2:]
keys = [s["__key__"] for s in webds.WebDataset(urls, cache_dir=sys.argv[1])]
print(len(keys), len(set(keys)))
"""


def test_processes_sharing_a_cache_dir(remote, tmp_path):
    _, urls = remote
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(cache), *urls], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs == [["120", "120"]] * 3
    files = visible(cache)
    assert len(files) == 3 and sorted(os.listdir(cache)) == files, "no temporary file left"
    keys = [s["__key__"] for s in WebDataset(urls, cache_dir=str(cache))]
    assert len(keys) == 120


def test_killed_reader_leaves_no_visible_partial_file(tmp_path):
    path = write_tar(tmp_path / "a.tar", sample_members(200))
    cache = tmp_path / "cache"
    # The command sends part of the shard, then stalls: the reader is killed mid-download.
    url = f"pipe:head -c 20000 {path}; sleep 60; tail -c +20001 {path}"
    proc = subprocess.Popen([sys.executable, "-c", READER, str(cache), url])
    # Killed mid-download: once its temporary copy exists. (It may still be empty: the first
    # 20000 bytes wait in the reader's 1 MiB read for the rest, which the stall holds back.)
    deadline = time.monotonic() + 60
    while not any(n.startswith(".") and ".tmp-" in n for n in _list(cache)):
        assert proc.poll() is None, f"the reader exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"no partial copy in the cache: {_list(cache)}"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert visible(cache) == [], "no partial shard under a cache name"
    assert any(n.startswith(".") and ".tmp-" in n for n in os.listdir(cache))
    # The next user of the cache removes the dead process's temporary copy.
    from webds.io.cache import ShardCache

    ShardCache(str(cache))
    assert os.listdir(cache) == []


def _list(d):
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []


def test_entry_being_filled_elsewhere_is_streamed_not_copied(tmp_path):
    import fcntl

    from webds.io.cache import ShardCache

    path = write_tar(tmp_path / "a.tar", sample_members(20))
    url = f"pipe:cat {path}"
    cache = ShardCache(str(tmp_path / "cache"))
    entry = cache.path_for(url)
    directory, name = os.path.split(entry)
    # Another process "fills" the entry: it holds the lock.
    holder = os.open(os.path.join(directory, f".{name}.lock"), os.O_CREAT | os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        keys = [s["__key__"] for s in WebDataset(url, cache_dir=str(tmp_path / "cache"))]
        assert len(keys) == 20
        assert visible(tmp_path / "cache") == [], "a second copy must not be written"
    finally:
        os.close(holder)  # the holder went away without filling it
    keys2 = [s["__key__"] for s in WebDataset(url, cache_dir=str(tmp_path / "cache"))]
    assert keys2 == keys and visible(tmp_path / "cache") == [name]


def test_local_shards_cached_on_request(tmp_path):
    write_tar(tmp_path / "n-0.tar", sample_members(10, prefix="n"))
    url = str(tmp_path / "n-0.tar")
    cache = tmp_path / "cache"
    first = [s["__key__"] for s in WebDataset(url, cache_dir=str(cache), cache_local=True)]
    assert len(visible(cache)) == 1
    (tmp_path / "n-0.tar").unlink()  # the "network filesystem" is gone; the cache serves
    again = list(WebDataset(url, cache_dir=str(cache), cache_local=True))
    assert [s["__key__"] for s in again] == first
    assert again[0]["__local_path__"].startswith(str(cache))


def test_webdatasets_cache_variables_apply(remote, tmp_path, monkeypatch):
    # WDS_CACHE / WDS_CACHE_SIZE win over the arguments, as in webdataset 1.x.
    _, urls = remote
    cache = tmp_path / "from-env"
    monkeypatch.setenv("WDS_CACHE", str(cache))
    assert len(list(WebDataset(urls))) == 120
    assert len(visible(cache)) == 3
    monkeypatch.setenv("WDS_CACHE_SIZE", "0")  # 0 turns the cache off
    other = tmp_path / "off"
    monkeypatch.setenv("WDS_CACHE", str(other))
    assert len(list(WebDataset(urls, cache_dir=str(tmp_path / "arg")))) == 120
    assert not other.exists() and not (tmp_path / "arg").exists()
    monkeypatch.setenv("WDS_CACHE_SIZE", "lots")
    with pytest.raises(ArgumentError, match="WDS_CACHE_SIZE"):
        WebDataset(urls)
