"""Record a stream once, replay it afterwards: in memory (:class:`Cached`) or in an LMDB
database on disk (:class:`LMDBCached`).

    DataPipeline(SimpleShardList(urls), tarfile_to_samples(), decode("rgb8"), Cached())
    dataset.compose(LMDBCached("/tmp/decoded.lmdb"))

A recording counts only once its source has been read to the end: a pass that is abandoned half
way (a ``break``, an exception, ``with_epoch`` cutting it short) is thrown away, and the next pass
records again, so a partial recording is never replayed as if it were the whole dataset.
"""

from __future__ import annotations

import importlib
import os
import pickle
import types
from typing import Any, Iterable, Iterator, List, Optional

from ..base.workers import worker_info
from ..errors import ArgumentError, WebdsError

__all__ = ["Cached", "LMDBCached"]


def _nothing_recorded(stage: Any) -> ArgumentError:
    return ArgumentError(
        f"{stage!r} has no complete recording to replay and no source to record; put it after "
        "the stages whose output it should cache"
    )


class _Replay:
    """A stage object: ``stage(src)`` runs :meth:`run`; as a pipeline's first stage, ``stage()``.

    (webdataset built these on its ``PipelineStage``, which :mod:`webds.compat.legacy` serves to
    old code; the core does not depend on it.)
    """

    def run(self, src: Optional[Iterable[Any]] = None) -> Iterator[Any]:
        raise NotImplementedError

    def __call__(self, src: Optional[Iterable[Any]] = None) -> Iterator[Any]:
        return self.run(src)


class Cached(_Replay):
    """In-memory cache: the first complete pass records every item, later passes replay them
    (the upstream stages are then not read at all).

    Each DataLoader worker holds its own recording of its own part of the data.
    """

    def __init__(self) -> None:
        self.cached: Optional[List[Any]] = None

    def run(self, src: Optional[Iterable[Any]] = None) -> Iterator[Any]:
        """Replay the recording if there is a complete one; otherwise pass ``src`` through,
        recording it. (With no ``src``, as a pipeline's first stage, it only replays.)"""
        if self.cached is not None:
            yield from self.cached
            return
        if src is None:
            raise _nothing_recorded(self)
        recording: List[Any] = []
        for item in src:
            recording.append(item)
            yield item
        # Reached only when src ended: an abandoned pass never becomes the recording.
        self.cached = recording

    def clear(self) -> None:
        """Forget the recording; the next pass records again."""
        self.cached = None

    def __repr__(self) -> str:
        state = "empty" if self.cached is None else f"{len(self.cached)} items"
        return f"Cached({state})"


_COMPLETE = b"__webds_complete__"


class _ModuleRef:
    def __init__(self, name: str) -> None:
        self.name = name


def _lmdb() -> Any:
    try:
        import lmdb
    except ImportError:
        raise WebdsError(
            "LMDBCached needs the lmdb package: pip install lmdb (or pip install webds[lmdb])"
        ) from None
    return lmdb


class LMDBCached(_Replay):
    """Cache a stream in the LMDB database ``fname`` (a directory): the first complete pass
    writes every item, pickled, in transactions of ``chunksize``; later passes (in this process
    or a later run) replay them in order.

    Completion is marked only after the last item is written, so a pass that is interrupted
    leaves an incomplete recording, which the next pass discards and records anew. Each
    (rank, DataLoader worker) records into its own named database inside ``fname``, so several
    workers can share one file. ``pickler`` is any module with ``dumps``/``loads``.
    """

    def __init__(
        self,
        fname: str,
        map_size: float = 1e12,
        pickler: Any = pickle,
        chunksize: int = 500,
    ) -> None:
        _lmdb()  # fail at construction, not in a DataLoader worker, if lmdb is missing
        if int(chunksize) < 1:
            raise ArgumentError(f"LMDBCached chunksize must be >= 1, got {chunksize}")
        if not (hasattr(pickler, "dumps") and hasattr(pickler, "loads")):
            raise ArgumentError(f"LMDBCached pickler must have dumps and loads, got {pickler!r}")
        self.fname = str(fname)
        self.map_size = int(map_size)
        self.pickler = pickler
        self.chunksize = int(chunksize)
        # The environment is opened lazily, in the process that iterates: an LMDB handle must
        # not cross a fork into DataLoader workers.
        self._env: Any = None
        self._pid = 0
        self._inherited: List[Any] = []

    def _open(self) -> Any:
        if self._env is not None and self._pid != os.getpid():
            # Inherited across a fork: LMDB forbids using (or closing) it here; keep it alive
            # untouched and open our own.
            self._inherited.append(self._env)
            self._env = None
        if self._env is None:
            self._env = _lmdb().open(self.fname, map_size=self.map_size, max_dbs=4096)
            self._pid = os.getpid()
        return self._env

    @staticmethod
    def _dbname() -> bytes:
        info = worker_info()
        return (
            f"part-{info.rank}-of-{info.world_size}-worker-{info.worker}-of-{info.num_workers}"
        ).encode()

    def is_complete(self) -> bool:
        """True if this process's part of the database holds a complete recording."""
        env = self._open()
        db = env.open_db(self._dbname())
        with env.begin(db=db) as txn:
            return txn.get(_COMPLETE) is not None

    def __len__(self) -> int:
        env = self._open()
        db = env.open_db(self._dbname())
        with env.begin(db=db) as txn:
            count = txn.get(_COMPLETE)
        if count is None:
            raise TypeError(f"LMDBCached({self.fname!r}) has no complete recording yet")
        return int(count)

    def run(self, src: Optional[Iterable[Any]] = None) -> Iterator[Any]:
        """Replay a complete recording, or pass ``src`` through while recording it. (With no
        ``src``, as a pipeline's first stage, it only replays.)"""
        env = self._open()
        db = env.open_db(self._dbname())
        if self.is_complete():
            yield from self._replay(env, db)
            return
        if src is None:
            raise _nothing_recorded(self)
        with env.begin(write=True) as txn:
            txn.drop(db, delete=False)  # a partial recording from an interrupted pass
        buffer: List[tuple] = []
        count = 0
        for item in src:
            buffer.append((b"%016d" % count, self.pickler.dumps(item)))
            count += 1
            if len(buffer) >= self.chunksize:
                self._put(env, db, buffer)
                buffer = []
            yield item
        buffer.append((_COMPLETE, str(count).encode()))
        self._put(env, db, buffer)

    def _replay(self, env: Any, db: Any) -> Iterator[Any]:
        # One short read transaction per chunk, so a long replay does not pin an old snapshot.
        start = b"%016d" % 0
        while True:
            chunk = []
            with env.begin(db=db) as txn:
                cursor = txn.cursor()
                if not cursor.set_range(start):
                    return
                for key, value in cursor:
                    if key == _COMPLETE:
                        break
                    chunk.append((key, value))
                    if len(chunk) >= self.chunksize:
                        break
            if not chunk:
                return
            for _, value in chunk:
                yield self.pickler.loads(value)
            start = b"%016d" % (int(chunk[-1][0]) + 1)

    @staticmethod
    def _put(env: Any, db: Any, items: List[tuple]) -> None:
        with env.begin(write=True, db=db) as txn:
            for key, value in items:
                txn.put(key, value)

    def close(self) -> None:
        """Close the database (it is reopened if the stage runs again)."""
        if self._env is not None and self._pid == os.getpid():
            self._env.close()
            self._env = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_env"] = None
        state["_inherited"] = []
        if isinstance(self.pickler, types.ModuleType):
            # Modules don't pickle; a worker started by spawn imports it by name.
            state["pickler"] = _ModuleRef(self.pickler.__name__)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state.get("pickler"), _ModuleRef):
            state["pickler"] = importlib.import_module(state["pickler"].name)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"LMDBCached({self.fname!r})"
