"""LRUCleanup and pipe_cleaner on a real directory."""

from __future__ import annotations

import os

import pytest

from webds.cache import LRUCleanup, pipe_cleaner
from webds.errors import ArgumentError


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
