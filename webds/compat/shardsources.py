"""Shard lists described by a spec (:class:`MultiShardSample`, :func:`shardspec`) or by a
directory used as a work queue (:class:`DirectoryShardList`).

A multi-source spec is a YAML file or a dict::

    prefix: /data/                 # optional, put before every shard
    buckets: train/                # optional default bucket (a directory under the prefix)
    datasets:
      - name: web                  # optional; defaults to "@" + bucket
        shards: web-{000000..000099}.tar
        choose: 10                 # optional: 10 distinct shards per epoch
      - shards: [books-{0..9}.tar, extra.tar]
        buckets: other/
        resample: 30               # optional: 30 shards drawn with replacement per epoch

Each epoch takes every dataset's shards (or its ``choose``/``resample`` selection), shuffles the
union and yields ``{"url": ...}`` for each. The selection depends only on (seed, epoch), so every
node and worker sees the same list and ``split_by_node``/``split_by_worker`` partition it.
webdataset made ``MultiShardSample`` raise ``ObsoleteException``; here it works.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import random
import re
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Union

import braceexpand
from torch.utils.data import IterableDataset

from ..errors import ArgumentError, WebdsError
from ..io.cache import pid_alive
from ..shards.datasets import SimpleShardList
from ..shards.shardlists import derive_seed, worker_info

__all__ = [
    "MultiShardSample",
    "shardspec",
    "DirectoryShardList",
    "glob_with_braces",
    "fnmatch_with_braces",
]

Spec = Union[str, "os.PathLike[str]", Mapping[str, Any]]

_TOP_KEYS = {"prefix", "datasets", "buckets"}
_DATASET_KEYS = {"buckets", "name", "shards", "resample", "choose"}


def glob_with_braces(pattern: str) -> List[str]:
    """``glob.glob`` after brace expansion: ``glob_with_braces("d/*.{tar,tgz}")``."""
    seen: Dict[str, None] = {}
    for pat in braceexpand.braceexpand(pattern):
        for name in glob.glob(pat):
            seen.setdefault(name, None)
    return list(seen)


def fnmatch_with_braces(filename: str, pattern: str) -> bool:
    """``fnmatch.fnmatch`` after brace expansion of ``pattern``."""
    return any(fnmatch.fnmatch(filename, pat) for pat in braceexpand.braceexpand(pattern))


def _expand(s: str) -> str:
    return os.path.expanduser(os.path.expandvars(s))


def _load_spec(spec: Spec) -> tuple:
    if isinstance(spec, Mapping):
        return dict(spec), "<dict>"
    fname = os.fspath(spec)
    try:
        import yaml
    except ImportError:
        raise WebdsError(
            f"reading the shard spec {fname!r} needs PyYAML: pip install pyyaml "
            "(or pass the spec as a dict)"
        ) from None
    try:
        with open(fname, encoding="utf-8") as stream:
            loaded = yaml.safe_load(stream)
    except OSError as exn:
        raise ArgumentError(f"cannot read the shard spec {fname!r}: {exn}") from None
    except yaml.YAMLError as exn:
        raise ArgumentError(f"the shard spec {fname!r} is not valid YAML: {exn}") from None
    if not isinstance(loaded, Mapping):
        raise ArgumentError(f"the shard spec {fname!r} must be a mapping with a 'datasets' list")
    return dict(loaded), fname


def _count(ds: Mapping[str, Any], key: str, where: str) -> int:
    value = ds.get(key, -1)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{where}: {key!r} must be an integer, got {value!r}")
    return value


class _Source:
    """One dataset of a spec: its name, shard URLs and per-epoch selection."""

    def __init__(self, name: str, urls: List[str], choose: int, resample: int) -> None:
        self.name = name
        self.urls = urls
        self.choose = choose
        self.resample = resample

    def per_epoch(self) -> int:
        if self.resample > 0:
            return self.resample
        if self.choose > 0:
            return self.choose
        return len(self.urls)

    def select(self, rng: random.Random) -> List[str]:
        if self.resample > 0:
            return rng.choices(self.urls, k=self.resample)
        if self.choose > 0:
            return rng.sample(self.urls, self.choose)
        return list(self.urls)


def _parse(spec: Mapping[str, Any], where: str) -> List[_Source]:
    unknown = set(spec) - _TOP_KEYS
    if unknown:
        raise ArgumentError(
            f"{where}: unknown key(s) {sorted(unknown)}; a spec has {sorted(_TOP_KEYS)}"
        )
    datasets = spec.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise ArgumentError(f"{where}: 'datasets' must be a non-empty list of datasets")
    prefix = _expand(str(spec.get("prefix", "")))
    sources = []
    for i, ds in enumerate(datasets):
        here = f"{where}, dataset {i}"
        if not isinstance(ds, Mapping):
            raise ArgumentError(f"{here}: must be a mapping, got {ds!r}")
        unknown = set(ds) - _DATASET_KEYS
        if unknown:
            raise ArgumentError(
                f"{here}: unknown key(s) {sorted(unknown)}; a dataset has {sorted(_DATASET_KEYS)}"
            )
        buckets = ds.get("buckets", spec.get("buckets", []))
        buckets = [buckets] if isinstance(buckets, str) else list(buckets)
        if len(buckets) > 1:
            raise ArgumentError(
                f"{here}: several buckets {buckets} are not supported; give one bucket, or one "
                "dataset entry per bucket"
            )
        bucket = _expand(str(buckets[0])) if buckets else ""
        shards = ds.get("shards")
        if isinstance(shards, str):
            shards = [shards]
        if not shards or not all(isinstance(s, str) for s in shards):
            raise ArgumentError(f"{here}: 'shards' must be a shard spec or a list of them")
        urls = [
            prefix + os.path.join(bucket, url)
            for spec_url in shards
            for url in braceexpand.braceexpand(_expand(spec_url))
        ]
        choose, resample = _count(ds, "choose", here), _count(ds, "resample", here)
        if choose > 0 and resample > 0:
            raise ArgumentError(f"{here}: give 'choose' or 'resample', not both")
        if choose > len(urls):
            raise ArgumentError(f"{here}: choose={choose} but it has only {len(urls)} shards")
        sources.append(_Source(str(ds.get("name", "@" + bucket)), urls, choose, resample))
    return sources


class MultiShardSample(IterableDataset):
    """The shards of several datasets, selected and shuffled per epoch from a YAML spec file or
    a dict (the format is in this module's docstring).

    ``MultiShardSample("mix.yaml", seed=0)``; call :meth:`set_epoch` (a DataPipeline does) to
    get a new selection. The selection depends only on (seed, epoch).
    """

    def __init__(self, fname: Spec, seed: int = 0) -> None:
        super().__init__()
        spec, self.fname = _load_spec(fname)
        self.sources = _parse(spec, f"shard spec {self.fname}")
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose selection the next iteration yields."""
        self.epoch = int(epoch)

    def get_shards_for_epoch(self) -> List[str]:
        """The shard URLs of the current epoch, in order."""
        rng = random.Random(derive_seed("multishardsample", self.seed, self.epoch))
        urls = [url for source in self.sources for url in source.select(rng)]
        rng.shuffle(urls)
        return urls

    def __len__(self) -> int:
        return sum(source.per_epoch() for source in self.sources)

    def __iter__(self) -> Iterator[Dict[str, str]]:
        for url in self.get_shards_for_epoch():
            yield {"url": url}

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.sources)
        return f"MultiShardSample({self.fname!r}: {names}; seed={self.seed})"


def shardspec(spec: Union[Spec, List[str]]) -> IterableDataset:
    """A shard list for ``spec``: a ``.yaml``/``.yml`` file or a dict gives a
    :class:`MultiShardSample`, anything else a :class:`SimpleShardList`."""
    if isinstance(spec, Mapping):
        return MultiShardSample(spec)
    if isinstance(spec, (str, os.PathLike)) and os.fspath(spec).endswith((".yaml", ".yml")):
        return MultiShardSample(spec)
    return SimpleShardList(spec)


_CLAIMED = re.compile(r"^(.*)\._(\d+)_$")
_MODES = {"resample": "resample", "resampled": "resample", None: "resample"}
_MODES.update({"unlink": "unlink", "keep": "keep"})


class DirectoryShardList(IterableDataset):
    """A directory used as a work queue of shards, shared by any number of processes.

    Each iteration step claims a shard matching ``pattern`` (braces allowed, so the default
    ``*.{tar,tgz,tar.tgz}`` works) by renaming it to ``NAME._PID_``, and yields that path. When
    the next shard is asked for, the finished one is recycled by ``mode``: ``"resample"`` renames
    it back (it can be drawn again), ``"unlink"`` deletes it, ``"keep"`` renames it to
    ``NAME._done_``. ``fate``, if given, is called with the claimed path and returns the mode for
    that shard (None: ``mode``). A shard whose consumer stops early (``close``, an exception) is
    always renamed back, and claims left by processes on this machine that died are released the
    same way.

    ``select`` is ``"random"`` or ``"oldest"`` (by mtime). When no shard is free it waits
    ``poll`` seconds and looks again, giving up after ``timeout`` seconds without one;
    ``poll=None`` stops as soon as none is free.
    """

    def __init__(
        self,
        path: Union[str, "os.PathLike[str]"],
        pattern: str = "*.{tar,tgz,tar.tgz}",
        poll: Optional[float] = 1,
        timeout: float = 1e12,
        mode: Optional[str] = "resample",
        select: str = "random",
        fate: Optional[Callable[[str], str]] = None,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise ArgumentError(f"DirectoryShardList: {self.path!r} is not a directory")
        if mode not in _MODES:
            raise ArgumentError(
                f"DirectoryShardList mode must be 'resample', 'unlink' or 'keep', got {mode!r}"
            )
        if select not in ("random", "oldest"):
            raise ArgumentError(
                f"DirectoryShardList select must be 'random' or 'oldest', got {select!r}"
            )
        if fate is not None and not callable(fate):
            raise ArgumentError(f"DirectoryShardList fate must be callable, got {fate!r}")
        self.pattern = pattern
        self.poll = poll
        self.timeout = float(timeout)
        self.mode = _MODES[mode]
        self.select = select
        self.fate = fate
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Change the random selection order for the next iteration (with a ``seed``)."""
        self.epoch = int(epoch)

    def candidates(self) -> List[str]:
        """The free shards now in the directory, sorted."""
        return sorted(glob_with_braces(os.path.join(glob.escape(self.path), self.pattern)))

    def _release(self, claimed: str, mode: str) -> None:
        original = _CLAIMED.sub(r"\1", claimed)
        try:
            if mode == "unlink":
                os.unlink(claimed)
            elif mode == "keep":
                os.rename(claimed, original + "._done_")
            else:
                os.rename(claimed, original)
        except FileNotFoundError:
            pass  # someone else already released it

    def recycle(self, claimed: str) -> None:
        """Recycle a finished shard by ``fate(claimed)`` or else ``mode``."""
        choice = self.fate(claimed) if self.fate is not None else None
        mode = self.mode if choice is None else _MODES.get(choice)
        if mode is None:
            self._release(claimed, "resample")
            raise ArgumentError(
                f"DirectoryShardList fate returned {choice!r} for {claimed}; "
                "it must return 'resample', 'unlink', 'keep' or None (use mode)"
            )
        self._release(claimed, mode)

    def cleanup_files_without_processes(self) -> None:
        """Put back shards claimed by processes (on this machine) that no longer exist."""
        for name in glob.glob(os.path.join(glob.escape(self.path), "*._*_")):
            m = _CLAIMED.match(name)
            if m is not None and not pid_alive(int(m.group(2))):
                self._release(name, "resample")

    def _rng(self) -> random.Random:
        if self.seed is None:
            return random.Random(os.urandom(16))
        where = worker_info()
        return random.Random(derive_seed("dirshards", self.seed, self.epoch, tuple(where)))

    def _pick(self, candidates: List[str], rng: random.Random) -> str:
        if self.select == "oldest":

            def mtime(name: str) -> float:
                try:
                    return os.stat(name).st_mtime
                except FileNotFoundError:
                    return float("inf")

            return min(candidates, key=mtime)
        return rng.choice(candidates)

    def __iter__(self) -> Iterator[Dict[str, str]]:
        rng = self._rng()
        pid = os.getpid()
        waiting_since = time.monotonic()
        self.cleanup_files_without_processes()
        while True:
            candidates = self.candidates()
            if not candidates:
                if self.poll is None or time.monotonic() - waiting_since >= self.timeout:
                    return
                time.sleep(self.poll)
                self.cleanup_files_without_processes()
                continue
            candidate = self._pick(candidates, rng)
            claimed = f"{candidate}._{pid}_"
            try:
                os.rename(candidate, claimed)
            except FileNotFoundError:
                continue  # another process claimed it first
            try:
                yield {"url": claimed}
            except BaseException:
                # Abandoned or failed mid-shard: it was not finished, so put it back.
                self._release(claimed, "resample")
                raise
            self.recycle(claimed)
            waiting_since = time.monotonic()

    def __repr__(self) -> str:
        return f"DirectoryShardList({self.path!r}, {self.pattern!r}, mode={self.mode!r})"
