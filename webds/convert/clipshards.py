"""Clip shards from long videos: :func:`pack_clips` cuts a folder of video files, or shards whose
samples hold a video, into clips at keyframes (:mod:`webds.convert.clips`, no re-encoding) and
writes them to shards, in parallel.

The work is planned before anything is written, so that parallel workers and reruns agree: one
task per input shard (its clips go to one output shard), or per group of video files taken in
sorted order until their bytes reach ``maxsize`` (clips are about as big as their source). Tasks
run on the executors :func:`~webds.parallel.map_shards` takes (local processes, threads, a Dask
cluster); each output shard appears only once complete, and a rerun skips those already there.

    webds.pack_clips("videos/", "clips/clips-%06d.tar", seconds=4, min_seconds=1)
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ArgumentError
from ..io.urls import check_secure, existing_size, local_path, make_parent_folder
from ..parallel import (
    ExecutorSpec,
    MapShardsError,
    ShardResult,
    _describe,
    _resolve_executor,
    output_urls,
)
from ..shards.shardlists import expand_urls
from ..tar.samples import tarfile_samples
from ..tarwriter import TarWriter, check_key, is_numbered_pattern
from .clips import VIDEO_EXTENSIONS, _check_seconds, clip_samples

__all__ = ["pack_clips", "ClipShardResult", "video_files"]

Inputs = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]


@dataclass(frozen=True)
class ClipShardResult(ShardResult):
    """What happened to one output shard of :func:`pack_clips`: ``samples_in`` videos read,
    ``samples_out`` clips written, and ``bad``, one line per video skipped as bad
    (``skip_bad=True``), naming it and why."""

    bad: Tuple[str, ...] = ()


@dataclass(frozen=True)
class _Options:
    seconds: float
    min_seconds: float
    video_only: bool
    field: Optional[str]
    info_field: str
    skip_bad: bool
    overwrite: bool
    storage_options: Mapping[str, Any]


@dataclass(frozen=True)
class _Task:
    input: str  # what the result names: the shard, or the group's files
    output: str
    shard: Optional[str]  # an input shard, or None for video files
    videos: Tuple[Tuple[str, str], ...]  # (key, path) of the video files
    options: _Options
    #: Unique per call: Dask's executors may take equal tasks as one and reuse a result.
    run_id: str = ""


# -- the plan ----------------------------------------------------------------------------------


def video_files(folder: Union[str, "os.PathLike[str]"]) -> List[Tuple[str, str]]:
    """The video files under ``folder`` (any depth, sorted; hidden ones skipped), as ``(key,
    path)``: the key is the path relative to ``folder`` without its suffix, dots in the file
    name made ``_`` (a key's last part can't hold a dot)."""
    root = os.fspath(folder)
    found: List[Tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            stem, suffix = os.path.splitext(name)
            if name.startswith(".") or suffix[1:].lower() not in VIDEO_EXTENSIONS:
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(os.path.join(dirpath, stem), root).replace(os.sep, "/")
            folder_part, _, last = rel.rpartition("/")
            found.append(
                ((folder_part + "/" if folder_part else "") + last.replace(".", "_"), path)
            )
    return sorted(found)


def _is_video_file(spec: Any) -> bool:
    path = local_path(os.fspath(spec))
    return path is not None and os.path.isfile(path) and _suffix(path) in VIDEO_EXTENSIONS


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1][1:].lower()


def _sources(inputs: Inputs) -> Tuple[List[Tuple[str, str]], List[str]]:
    """``(video files as (key, path), input shards)``: one of the two is empty."""
    specs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not specs:
        raise ArgumentError("pack_clips: no inputs; give a folder of videos, video files or shards")
    for spec in specs:
        if not isinstance(spec, (str, os.PathLike)):
            raise ArgumentError(f"pack_clips: inputs are paths or URLs, got {spec!r}")
        check_secure(spec)  # before a local folder is listed or a file read
    if len(specs) == 1:
        folder = local_path(os.fspath(specs[0]))
        if folder is not None and os.path.isdir(folder):
            videos = video_files(folder)
            if videos:
                return videos, []
    if all(_is_video_file(s) for s in specs):
        paths = [local_path(os.fspath(s)) or os.fspath(s) for s in specs]
        keys = [os.path.splitext(os.path.basename(p))[0].replace(".", "_") for p in paths]
        return list(zip(keys, paths)), []
    shards = expand_urls([_folder_spec(os.fspath(s)) for s in specs])
    if not shards:
        raise ArgumentError(f"pack_clips: no video files and no shards in {inputs!r}")
    return [], shards


def _folder_spec(spec: str) -> str:
    """A local folder of shards as the shard spec that lists it (``dir/``)."""
    path = local_path(spec)
    if path is not None and os.path.isdir(path) and not spec.endswith("/"):
        return spec + "/"
    return spec


def _groups(videos: List[Tuple[str, str]], maxsize: float) -> List[List[Tuple[str, str]]]:
    """Consecutive videos, each group up to ``maxsize`` bytes of source (at least one video)."""
    groups: List[List[Tuple[str, str]]] = []
    size = 0
    for key, path in videos:
        nbytes = os.path.getsize(path)
        if not groups or size + nbytes > maxsize:
            groups.append([])
            size = 0
        groups[-1].append((key, path))
        size += nbytes
    return groups


def _outputs(output: str, count: int, shards: List[str]) -> List[str]:
    if is_numbered_pattern(output):
        return [output % k for k in range(count)]
    if shards:
        return output_urls(shards, output)  # {stem}, {name}, {index}, a folder/, or one name
    if count == 1 and "{" not in output and not output.endswith("/"):
        return [output]
    raise ArgumentError(
        f"pack_clips: output {output!r} has no %-field (such as %06d) for the shard number, but "
        f"{count} shards are planned; give e.g. 'clips/clips-%06d.tar'"
    )


def _check_keys(videos: List[Tuple[str, str]]) -> None:
    seen: Dict[str, str] = {}
    for key, path in videos:
        check_key(key)
        if key in seen:
            raise ArgumentError(
                f"pack_clips: {seen[key]!r} and {path!r} both give the key {key!r}; rename one "
                "(files that differ only in their suffix or dots can't share a folder)"
            )
        seen[key] = path


def _describe_group(group: List[Tuple[str, str]]) -> str:
    if len(group) == 1:
        return group[0][1]
    return f"{group[0][1]} ... {group[-1][1]} ({len(group)} videos)"


# -- one task ----------------------------------------------------------------------------------


def _samples(task: _Task) -> Iterator[Dict[str, Any]]:
    if task.shard is not None:
        yield from tarfile_samples([{"url": task.shard}], **dict(task.options.storage_options))
        return
    for key, path in task.videos:
        # The path, not the bytes: split_video reads a file from disk as it goes.
        yield {"__key__": key, "__local_path__": path, _suffix(path): Path(path)}


def _run_task(task: _Task) -> ClipShardResult:
    """Write one output shard (runs in a worker); errors come back in the result."""
    opts = task.options
    storage = dict(opts.storage_options)
    bad: List[str] = []
    videos = clips = 0

    def skip(exn: BaseException) -> bool:
        bad.append(" ".join(str(exn).split()))
        return True

    def counted() -> Iterator[Dict[str, Any]]:
        nonlocal videos
        for sample in _samples(task):
            videos += 1
            yield sample

    try:
        if not opts.overwrite and existing_size(task.output, storage) is not None:
            return ClipShardResult(task.input, task.output, skipped=True)
        make_parent_folder(task.output)
        stream = clip_samples(
            counted(),
            opts.seconds,
            min_seconds=opts.min_seconds,
            video_only=opts.video_only,
            field=opts.field,
            info_field=opts.info_field,
            handler=skip if opts.skip_bad else None,
        )
        with TarWriter(task.output, encoder=False, storage_options=storage) as sink:
            for sample in stream:
                sink.write(sample)
                clips += 1
        return ClipShardResult(task.input, task.output, videos, clips, bad=tuple(bad))
    except Exception as exn:
        return ClipShardResult(task.input, task.output, videos, 0, error=_describe(exn))


# -- running the tasks -------------------------------------------------------------------------


def _run_tasks(
    tasks: List[_Task], executor: ExecutorSpec, workers: Optional[int], progress: bool
) -> List[ClipShardResult]:
    from ..progress import progress_bar

    if executor is None and workers is not None:
        executor, workers = ("serial", None) if workers == 0 else (None, min(workers, len(tasks)))
    pool, owned, _ = _resolve_executor(executor, workers)
    bar = progress_bar(len(tasks), "clips", " shards", progress)
    results: List[Optional[ClipShardResult]] = [None] * len(tasks)
    try:
        if pool is None:
            for i, task in enumerate(tasks):
                results[i] = _run_task(task)
                bar.update(1)
        else:
            pending = {pool.submit(_run_task, task): i for i, task in enumerate(tasks)}
            for done in cf.as_completed(pending):
                i = pending[done]
                exn = done.exception()  # the worker died, or the task could not be sent
                if exn is None:
                    results[i] = done.result()
                else:
                    results[i] = ClipShardResult(
                        tasks[i].input, tasks[i].output, error=_describe(exn)
                    )
                bar.update(1)
    finally:
        bar.close()
        if owned and pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return [r for r in results if r is not None]


def pack_clips(
    inputs: Inputs,
    output: Union[str, "os.PathLike[str]"],
    seconds: float = 2.0,
    *,
    min_seconds: float = 0.0,
    video_only: bool = False,
    field: Optional[str] = None,
    info_field: str = "json",
    maxsize: float = 1e9,
    executor: ExecutorSpec = None,
    workers: Optional[int] = None,
    skip_bad: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    storage_options: Optional[Mapping[str, Any]] = None,
) -> List[ClipShardResult]:
    """Cut long videos into clips at keyframes, without re-encoding, and write them to shards.

    ``inputs``: a folder of video files (any depth; keys are their paths without suffix), video
    files, or shards whose samples hold a video field (``field``, default the first with a video
    extension), whose other fields (``cls``, ``txt``, ...) go with each clip. Clips:
    :func:`~webds.convert.clips.split_video` (``seconds``, ``min_seconds``, ``video_only``) and
    :func:`~webds.convert.clips.clip_samples` (keys ``f"{key}_{clip:04d}"``, a JSON description
    as ``info_field``). ``output``: a pattern with a %-field (``'clips/clips-%06d.tar'``); for
    shard inputs also ``{stem}``/``{name}``/``{index}`` or a folder ending in ``/``, one output
    per input shard. Video files are grouped into output shards of about ``maxsize`` bytes.

    ``executor``/``workers`` as for :func:`~webds.parallel.map_shards` (``workers=0``: in this
    process); a progress bar of shards with ``progress``. A bad video (not a video, truncated,
    no video stream) fails its shard, naming the file or shard and member, unless ``skip_bad``:
    then it is left out and listed in its result's ``bad``. Outputs appear once complete and a
    rerun skips those there (``overwrite=True`` writes all); failed shards raise
    :class:`~webds.parallel.MapShardsError` after the others are done::

        webds.pack_clips("raw/train-{000..009}.tar", "clips/{stem}.tar", seconds=4)
    """
    _check_seconds(seconds, min_seconds)
    if not isinstance(info_field, str) or not info_field or info_field.startswith("__"):
        raise ArgumentError(f"pack_clips: info_field must be a field name, got {info_field!r}")
    if isinstance(maxsize, bool) or not isinstance(maxsize, (int, float)) or not maxsize > 0:
        raise ArgumentError(f"pack_clips: maxsize must be a positive number, got {maxsize!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        raise ArgumentError(f"pack_clips: workers must be an int >= 0, got {workers!r}")
    videos, shards = _sources(inputs)
    _check_keys(videos)
    groups = _groups(videos, maxsize) if videos else []
    outs = _outputs(os.fspath(output), len(groups) or len(shards), shards)
    options = _Options(
        float(seconds),
        float(min_seconds),
        bool(video_only),
        field,
        info_field,
        bool(skip_bad),
        bool(overwrite),
        dict(storage_options or {}),
    )
    run_id = uuid.uuid4().hex
    if videos:
        tasks = [
            _Task(_describe_group(g), out, None, tuple(g), options, run_id)
            for g, out in zip(groups, outs)
        ]
    else:
        tasks = [_Task(s, out, s, (), options, run_id) for s, out in zip(shards, outs)]
    results = _run_tasks(tasks, executor, workers, progress)
    failed = [r for r in results if r.error is not None]
    if failed:
        lines = "".join(f"\n  {r.input} -> {r.output}: {r.error}" for r in failed)
        raise MapShardsError(
            f"pack_clips: {len(failed)} of {len(results)} output shards failed:{lines}\nThe "
            "others were kept; run again to write only the missing ones (skip_bad=True, "
            "webds clips --skip-bad, leaves bad videos out).",
            results,
        )
    return results
