"""Shard lists described by a spec (:class:`MultiShardSample`, :func:`shardspec`, from
:mod:`webds.shards.specs`) or by a directory used as a work queue (:class:`DirectoryShardList`).

The spec format and :class:`MultiShardSample` are in :mod:`webds.shards.specs`.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import random
import re
import time
from typing import Callable, Dict, Iterator, List, Optional, Union

import braceexpand
from torch.utils.data import IterableDataset

from ..base.workers import derive_seed, worker_info
from ..errors import ArgumentError
from ..io.cache import pid_alive
from ..io.security import WEBDATASET_LOCAL, refuse
from ..shards.specs import MultiShardSample, shardspec

__all__ = [
    "MultiShardSample",
    "shardspec",
    "DirectoryShardList",
    "glob_with_braces",
    "fnmatch_with_braces",
]


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


def _refuse_in_secure_mode(path: str) -> None:
    refuse(
        "a local folder as a work queue (DirectoryShardList lists, renames and deletes local "
        "files)",
        path,
        WEBDATASET_LOCAL,
    )


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

    #: It renames (or deletes) the files it reads: nothing may read it just to measure it.
    claims_files = True

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
        _refuse_in_secure_mode(self.path)
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
        _refuse_in_secure_mode(self.path)  # the switch may have been turned on since
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
