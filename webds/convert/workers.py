"""Writing the shards :func:`~webds.convert.pack` planned: one task per shard, run in this
process or in a pool of worker processes, with a progress bar of samples.

Each shard is written by one :class:`~webds.tarwriter.TarWriter`, which shows it under its name only
once complete; a shard already there whose index entry can't be reused is only hashed. The
dataset goes to each worker once (inherited through fork on Linux, pickled elsewhere). After a
failure no new shard is started, the shards in progress finish, and the error raised says what
was kept and that a rerun writes only the missing shards.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import multiprocessing as mp
import os
import queue as queue_module
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..errors import WebdsError, WriteError
from ..io.urls import make_parent_folder, open_url
from ..parallel import _describe
from ..shards.index import ShardInfo
from ..tarwriter import TarWriter
from .items import _Config, _index_key, _sample

# -- one shard ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Task:
    shard: int
    url: str
    indices: List[int]
    keys: Optional[List[str]]
    #: Only hash the existing shard (its index entry could not be reused).
    hash_only: bool = False


@dataclass(frozen=True)
class _Done:
    shard: int
    url: str
    samples: int
    bytes: Optional[int]
    sha256: Optional[str]


Report = Optional[Callable[[int, int], None]]


def _key(cfg: _Config, task: _Task, k: int) -> str:
    if task.keys is not None:
        return task.keys[k]
    return _index_key(cfg, task.indices[k])


def _run_task(dataset: Any, cfg: _Config, task: _Task, report: Report) -> _Done:
    if task.hash_only:
        size, sha = _hash_url(task.url, cfg.storage_options)
        return _Done(task.shard, task.url, len(task.indices), size, sha)
    make_parent_folder(task.url)
    last, unreported = time.monotonic(), 0
    with TarWriter(
        task.url, encoder=False, storage_options=cfg.storage_options, checksum=True
    ) as sink:
        for k, i in enumerate(task.indices):
            key = _key(cfg, task, k)
            try:
                sink.write(_sample(dataset, cfg, i, key))
            except WebdsError as exn:
                if exn.url is not None:
                    raise
                raise type(exn)(exn.message, url=task.url, member=exn.member, key=exn.key) from exn
            unreported += 1
            if report is not None and time.monotonic() - last > 0.2:
                report(task.shard, unreported)
                last, unreported = time.monotonic(), 0
    return _Done(task.shard, task.url, sink.count, sink.file_bytes, sink.sha256)


def _hash_url(url: str, storage_options: Mapping[str, Any]) -> Tuple[int, str]:
    sha, size = hashlib.sha256(), 0
    with open_url(url, "rb", **dict(storage_options)) as stream:
        while True:
            block = stream.read(1 << 20)
            if not block:
                break
            sha.update(block)
            size += len(block)
    return size, sha.hexdigest()


_WORKER: Dict[str, Any] = {}


def _init_worker(dataset: Any, cfg: _Config, progress: Any) -> None:
    _WORKER.update(dataset=dataset, cfg=cfg, progress=progress)


def _worker_task(task: _Task) -> _Done:
    progress = _WORKER["progress"]
    report = None if progress is None else (lambda shard, n: progress.put((shard, n)))
    return _run_task(_WORKER["dataset"], _WORKER["cfg"], task, report)


# -- running the tasks -------------------------------------------------------------------------


def _run_tasks(
    dataset: Any,
    cfg: _Config,
    tasks: List[_Task],
    infos: List[Optional[ShardInfo]],
    workers: Optional[int],
    progress: bool,
    pattern: str,
    n: int,
) -> List[_Done]:
    from ..progress import progress_bar

    desc = f"packing {os.path.basename(pattern) or pattern}"
    bar = progress_bar(n, desc, " samples", progress, dynamic_ncols=True)
    try:
        bar.update(sum(info.samples for info in infos if info is not None))
        if workers is None:
            workers = os.cpu_count() or 1
        workers = min(workers, len(tasks))
        if workers == 0:
            return _run_here(dataset, cfg, tasks, bar)
        return _run_pool(dataset, cfg, tasks, workers, bar, progress)
    finally:
        bar.close()


def _run_here(dataset: Any, cfg: _Config, tasks: List[_Task], bar: Any) -> List[_Done]:
    results = []
    for task in tasks:
        reported = 0

        def report(shard: int, k: int) -> None:
            nonlocal reported
            reported += k
            bar.update(k)

        try:
            result = _run_task(dataset, cfg, task, report)
        except Exception as exn:
            raise _failure([(task, exn)], len(results)) from exn
        bar.update(len(task.indices) - reported)
        results.append(result)
    return results


def _context() -> Any:
    # fork: the dataset is inherited, not pickled (fast, and works for datasets that can't
    # be pickled); elsewhere the platform's default, which pickles it once per worker.
    if sys.platform.startswith("linux"):
        return mp.get_context("fork")
    return mp.get_context()


def _run_pool(
    dataset: Any, cfg: _Config, tasks: List[_Task], workers: int, bar: Any, progress: bool
) -> List[_Done]:
    ctx = _context()
    updates = ctx.Queue() if progress else None
    pool = cf.ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(dataset, cfg, updates)
    )
    results: List[_Done] = []
    errors: List[Tuple[_Task, BaseException]] = []
    closed: set = set()  # shards done: their late progress messages count for nothing
    reported: Dict[int, int] = {}  # samples the bar has counted, per shard in progress
    try:
        futures = {pool.submit(_worker_task, task): task for task in tasks}
        pending = set(futures)
        while pending:
            finished, pending = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
            _drain(updates, reported, closed, bar)
            for future in finished:
                task = futures[future]
                if future.cancelled():
                    continue
                exn = future.exception()
                if exn is not None:
                    if not errors:
                        # Stop starting shards: the dataset is likely to fail again. Shards in
                        # progress finish, so a rerun has less to do.
                        for other in pending:
                            other.cancel()
                    errors.append((task, exn))
                    continue
                results.append(future.result())
                bar.update(len(task.indices) - reported.pop(task.shard, 0))
                closed.add(task.shard)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    if errors:
        raise _failure(errors, len(results)) from errors[0][1]
    return results


def _drain(updates: Any, reported: Dict[int, int], closed: set, bar: Any) -> None:
    if updates is None:
        return
    while True:
        try:
            shard, k = updates.get_nowait()
        except queue_module.Empty:
            return
        except (OSError, EOFError, ValueError):
            return
        if shard not in closed:
            reported[shard] = reported.get(shard, 0) + k
            bar.update(k)


def _failure(errors: List[Tuple[_Task, BaseException]], written: int) -> WebdsError:
    """The first shard's error, saying what was kept and what a rerun does."""
    task, exn = errors[0]
    more = f" ({len(errors) - 1} other shard(s) failed too)" if len(errors) > 1 else ""
    tail = (
        f"{more}; the {written} shard(s) completed in this run were kept and no partial shard "
        "was left: fix the problem and run again to write only the missing shards"
    )
    if isinstance(exn, WebdsError):
        try:
            return type(exn)(
                exn.message + tail,
                url=exn.url or task.url,
                member=exn.member,
                key=exn.key,
                offset=exn.offset,
            )
        except TypeError:  # a subclass with another constructor
            pass
    return WriteError(f"writing the shard failed: {_describe(exn)}{tail}", url=task.url)
