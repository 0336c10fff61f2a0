"""Processing many shards at once: :func:`map_shards`.

Each input shard is read, its samples go through a function, and the results are written to
that shard's own output shard, one task per shard on an executor: local processes by default,
threads, or a Dask cluster (``distributed.Client(...).get_executor()``)::

    results = webds.map_shards(resize, "data/train-{000000..000999}.tar", "small/{name}")

Outputs are written atomically (:class:`~webds.tarwriter.TarWriter`: a shard appears under its name
only once complete), so an output that exists is complete, and a rerun skips it: after a crash
or a failed shard, running the same call again does only the shards still missing.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import pickle
import posixpath
import traceback
import uuid
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)
from urllib.parse import urlparse

from .errors import ArgumentError, WebdsError
from .io.urls import existing_size, local_path, make_parent_folder, url_identity
from .shards.shardlists import SHARD_SUFFIXES, expand_urls
from .stages.encode import EncoderSpec
from .tar.samples import tarfile_samples
from .tarwriter import TarWriter

__all__ = ["map_shards", "ShardResult", "MapShardsError", "output_urls", "is_output_pattern"]

Sample = Dict[str, Any]
ExecutorSpec = Union[None, str, cf.Executor, Any]


@dataclass(frozen=True)
class ShardResult:
    """What happened to one input shard of :func:`map_shards`.

    ``samples_in``/``samples_out``: samples read and written (0 when ``skipped``: the output
    already existed). ``error``: why the shard failed (its output was not written), else None.
    """

    input: str
    output: str
    samples_in: int = 0
    samples_out: int = 0
    skipped: bool = False
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        """True when the output is complete (written now, or skipped as already there)."""
        return self.error is None


class MapShardsError(WebdsError):
    """Some shards of :func:`map_shards` failed; ``results`` has every shard's
    :class:`ShardResult` (the failed ones have ``error`` set), in input order."""

    def __init__(self, message: str, results: Sequence[ShardResult] = ()) -> None:
        super().__init__(message)
        self.results: List[ShardResult] = list(results)

    @property
    def failed(self) -> List[ShardResult]:
        return [r for r in self.results if r.error is not None]

    def __reduce__(self) -> Any:
        return (type(self), (self.message, self.results))


def is_output_pattern(output: str) -> bool:
    """True when ``output`` names one output per input shard: it has ``{...}`` format fields
    (``'out/{stem}.tar'``) or is a folder or prefix ending in ``/``."""
    return "{" in output or output.endswith("/")


def output_urls(
    inputs: Sequence[str], outputs: Union[str, "os.PathLike[str]", Sequence[str]]
) -> List[str]:
    """The output URL of each input shard.

    ``outputs`` is a pattern with ``{name}`` (the input's file name, ``train-000.tar``),
    ``{stem}`` (without its shard extension, ``train-000``) or ``{index}`` (its position,
    ``{index:06d}``) fields; a folder or prefix ending in ``/`` (same file name as the input);
    a single name (for a single input); or a list with one output per input. Two inputs mapping
    to one output, or an output that is an input, is an :class:`ArgumentError`.
    """
    if isinstance(outputs, (str, os.PathLike)):
        spec = os.fspath(outputs)
        if spec == "":
            raise ArgumentError("map_shards: outputs is empty; give a pattern such as 'out/{name}'")
        if spec.endswith("/"):
            urls = [spec + _input_name(url, "name", spec) for url in inputs]
        elif "{" in spec or "}" in spec:
            urls = [_format_output(spec, url, i) for i, url in enumerate(inputs)]
        else:
            urls = [spec] * len(inputs)
    elif isinstance(outputs, Iterable):
        urls = [os.fspath(u) if isinstance(u, os.PathLike) else u for u in outputs]
        if not all(isinstance(u, str) and u for u in urls):
            raise ArgumentError(f"map_shards: outputs must be non-empty strings, got {outputs!r}")
        if len(urls) != len(inputs):
            raise ArgumentError(
                f"map_shards: {len(inputs)} input shards but {len(urls)} outputs; give one "
                "output per input, or a pattern such as 'out/{stem}.tar'"
            )
    else:
        raise ArgumentError(
            f"map_shards: outputs must be a pattern string or a list, got {type(outputs).__name__}"
        )
    sources = {url_identity(url): url for url in inputs}
    seen: Dict[str, str] = {}
    for src, out in zip(inputs, urls):
        if out == "-":
            raise ArgumentError(
                "map_shards writes one output shard per input; '-' (stdout) can't be one"
            )
        ident = url_identity(out)
        if ident in seen:
            raise ArgumentError(
                f"map_shards: inputs {seen[ident]!r} and {src!r} both map to output {out!r}; "
                "use a pattern that tells them apart, e.g. with {index:06d} or {stem}"
            )
        if ident in sources:
            raise ArgumentError(
                f"map_shards: output {out!r} is also an input shard ({sources[ident]!r}); write "
                "the outputs elsewhere"
            )
        seen[ident] = src
    return urls


def _input_name(url: str, field: str, spec: str) -> str:
    name = ""
    if not url.startswith("pipe:") and url != "-":
        path = local_path(url)
        name = (
            os.path.basename(path) if path is not None else posixpath.basename(urlparse(url).path)
        )
    if not name:
        raise ArgumentError(
            f"map_shards: input {url!r} has no file name for {{{field}}} in output {spec!r}; "
            "use {index} or a list of outputs"
        )
    return name


def _stem(name: str) -> str:
    lower = name.lower()
    for suffix in sorted(SHARD_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return os.path.splitext(name)[0] or name


class _Fields(dict):
    """Format fields computed on demand, so ``{index}`` works for inputs without a name."""

    def __init__(self, url: str, index: int, spec: str) -> None:
        super().__init__(index=index)
        self.url, self.spec = url, spec

    def __missing__(self, field: str) -> Any:
        if field == "name":
            return _input_name(self.url, field, self.spec)
        if field == "stem":
            return _stem(_input_name(self.url, field, self.spec))
        raise KeyError(field)


def _format_output(spec: str, url: str, index: int) -> str:
    try:
        return spec.format_map(_Fields(url, index, spec))
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exn:
        raise ArgumentError(
            f"map_shards: output pattern {spec!r} is not valid ({type(exn).__name__}: {exn}); "
            "its {...} fields can be {name}, {stem} and {index} (e.g. 'out/{stem}.tar', "
            "'out/{index:06d}.tar'); give a list of outputs for anything else"
        ) from None


@dataclass(frozen=True)
class _Task:
    fn: Callable[..., Any]
    level: str
    input: str
    output: str
    overwrite: bool
    encoder: EncoderSpec
    storage_options: Mapping[str, Any]
    #: Unique per map_shards call: Dask's executors may treat equal tasks as one ("pure") and
    #: hand back an earlier result instead of running the shard again.
    run_id: str = ""


class _Counted:
    """Passes items through, counting them."""

    def __init__(self, items: Iterable[Any]) -> None:
        self._items = iter(items)
        self.count = 0

    def __iter__(self) -> "_Counted":
        return self

    def __next__(self) -> Any:
        item = next(self._items)
        self.count += 1
        return item


def _run_task(task: _Task) -> ShardResult:
    """Process one shard (runs in a worker); errors come back in the result, not raised, so
    that an exception that can't be pickled still reports."""
    options = dict(task.storage_options)
    samples: Optional[_Counted] = None
    try:
        if not task.overwrite and existing_size(task.output, options) is not None:
            return ShardResult(task.input, task.output, skipped=True)
        make_parent_folder(task.output)
        samples = _Counted(tarfile_samples([{"url": task.input}], **options))
        written = 0
        with TarWriter(task.output, encoder=task.encoder, storage_options=options) as sink:
            for sample in _outputs(task.fn, task.level, samples):
                sink.write(sample)
                written += 1
        return ShardResult(task.input, task.output, samples.count, written)
    except Exception as exn:
        count = samples.count if samples is not None else 0
        return ShardResult(task.input, task.output, count, 0, error=_describe(exn))


def _outputs(fn: Callable[..., Any], level: str, samples: Iterator[Sample]) -> Iterator[Any]:
    if level == "shard":
        result = fn(samples)
        if (
            result is None
            or isinstance(result, (str, bytes, Mapping))
            or not isinstance(result, Iterable)
        ):
            raise ArgumentError(
                f"the shard-level fn returned {type(result).__name__}; it must take the "
                "iterator of samples and return (or yield) an iterator of samples"
            )
        yield from result
        return
    for sample in samples:
        result = fn(sample)
        if result is None:
            continue
        if isinstance(result, Mapping):
            if "__key__" not in result:
                result = {**result, "__key__": sample["__key__"]}
            yield result
        elif isinstance(result, (str, bytes, bytearray)) or not isinstance(result, Iterable):
            raise ArgumentError(
                f"fn returned {type(result).__name__} for sample {sample['__key__']!r}; a "
                "sample-level fn returns a sample dict, None (drop it) or an iterable of samples",
            )
        else:
            yield from result


def _describe(exn: BaseException) -> str:
    """One line for a shard's error; for the user's own code, where it was raised."""
    text = str(exn) if isinstance(exn, WebdsError) else f"{type(exn).__name__}: {exn}"
    if not isinstance(exn, WebdsError):
        frames = traceback.extract_tb(exn.__traceback__)
        if frames:
            last = frames[-1]
            text += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return " ".join(text.split())


def _resolve_executor(
    executor: ExecutorSpec, workers: Optional[int]
) -> Tuple[Optional[cf.Executor], bool, str]:
    """``(executor or None for serial, whether we own it, kind)``."""
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ArgumentError(f"map_shards: workers must be a positive int or None, got {workers!r}")
    if executor is None or executor == "processes":
        return cf.ProcessPoolExecutor(workers or os.cpu_count() or 1), True, "processes"
    if executor == "threads":
        return cf.ThreadPoolExecutor(workers or min(32, (os.cpu_count() or 1) + 4)), True, "threads"
    if executor == "serial":
        return None, False, "serial"
    dask = type(executor).__module__.split(".")[0] == "distributed"
    if dask and not isinstance(executor, cf.Executor) and hasattr(executor, "get_executor"):
        executor = executor.get_executor()  # a distributed.Client
    if isinstance(executor, cf.Executor):
        if dask:
            kind = "dask"
        elif isinstance(executor, cf.ProcessPoolExecutor):
            kind = "processes"
        else:
            kind = "other"
        return executor, False, kind
    raise ArgumentError(
        f"map_shards: executor must be None (local processes), 'processes', 'threads', "
        f"'serial', a concurrent.futures.Executor or a distributed.Client; got {executor!r}"
    )


def _check_sendable(fn: Callable[..., Any], kind: str) -> None:
    """Fail early, in the caller, for a function worker processes can't receive."""
    if kind == "processes":
        dumps = pickle.dumps
        how = "pickled"
    elif kind == "dask":
        import cloudpickle

        dumps = cloudpickle.dumps
        how = "cloudpickled"
    else:
        return
    try:
        dumps(fn)
    except Exception as exn:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ArgumentError(
            f"map_shards: fn {name} can't be sent to worker processes (it can't be {how}: "
            f"{type(exn).__name__}: {exn}); define fn at module top level (not a lambda, a "
            "closure or a function inside another function), or use executor='threads'"
        ) from None


def map_shards(
    fn: Callable[..., Any],
    inputs: Union[str, "os.PathLike[str]", Sequence[str]],
    outputs: Union[str, "os.PathLike[str]", Sequence[str]],
    executor: ExecutorSpec = None,
    *,
    level: str = "sample",
    workers: Optional[int] = None,
    overwrite: bool = False,
    progress: bool = False,
    storage_options: Optional[Mapping[str, Any]] = None,
    encoder: EncoderSpec = True,
) -> List[ShardResult]:
    """Map ``fn`` over the samples of many shards, writing one output shard per input shard.

    ``level="sample"``: ``fn(sample)`` takes a raw sample (bytes fields) and returns a sample, None
    (dropped) or an iterable of samples; ``level="shard"``: ``fn(samples)`` maps a shard's samples
    (a stage such as ``webds.map(f)``). ``inputs``: a shard spec or list
    (:func:`~webds.shards.shardlists.expand_urls`); ``outputs``: a pattern (``'out/{stem}.tar'``), a
    folder or a list (:func:`output_urls`). An output appears once complete and is skipped if it
    exists unless ``overwrite``, so a rerun does only what is missing. ``encoder``: by default the
    :mod:`webds.stages.encode` table; False writes bytes only. ``executor``: None or ``"processes"``
    (``workers`` processes, default one per CPU; ``fn`` must be picklable), ``"threads"``,
    ``"serial"``, any ``concurrent.futures.Executor``, or a Dask ``distributed.Client`` (its workers
    import ``fn``'s module). ``storage_options`` go to fsspec; ``progress`` shows a bar of shards.

    Returns one :class:`ShardResult` per input, in order; a failing shard stops no other, and
    :class:`MapShardsError` then lists the failed ones.
    [More](../cli.md#webdsmap_shards-the-python-api)::

        webds.map_shards(add_label, "s3://b/raw/", "s3://b/labelled/", storage_options=opts)
    """
    if not callable(fn):
        raise ArgumentError(f"map_shards: fn must be callable, got {fn!r}")
    if level not in ("sample", "shard"):
        raise ArgumentError(f"map_shards: level must be 'sample' or 'shard', got {level!r}")
    options = dict(storage_options or {})
    urls = expand_urls(inputs, storage_options=options)
    if not urls:
        raise ArgumentError("map_shards: no input shards; give a path, a URL or a pattern")
    if "-" in urls:
        raise ArgumentError(
            "map_shards reads each input shard in a worker; '-' (stdin) can't be one"
        )
    outs = output_urls(urls, outputs)
    pool, owned, kind = _resolve_executor(executor, workers)
    run_id = uuid.uuid4().hex
    tasks = [
        _Task(fn, level, u, o, bool(overwrite), encoder, options, run_id)
        for u, o in zip(urls, outs)
    ]
    try:
        _check_sendable(fn, kind)
        results = _run_all(tasks, pool, progress)
    finally:
        if owned and pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    failed = [r for r in results if r.error is not None]
    if failed:
        lines = "\n".join(f"  {r.input} -> {r.output}: {r.error}" for r in failed)
        kept = len(results) - len(failed)
        raise MapShardsError(
            f"{len(failed)} of {len(results)} shards failed:\n{lines}\n"
            f"The {kept} completed output(s) were kept and no partial output was left for the "
            "failed ones; run again to redo only the failed shards.",
            results,
        )
    return results


def _run_all(tasks: List[_Task], pool: Optional[cf.Executor], progress: bool) -> List[ShardResult]:
    from .progress import progress_bar

    bar = progress_bar(len(tasks), "map_shards", " shards", progress)
    results: List[Optional[ShardResult]] = [None] * len(tasks)
    try:
        if pool is None:
            for i, task in enumerate(tasks):
                results[i] = _run_task(task)
                bar.update(1)
            return results  # type: ignore[return-value]
        futures = {pool.submit(_run_task, task): i for i, task in enumerate(tasks)}
        try:
            for future in cf.as_completed(futures):
                i = futures[future]
                try:
                    results[i] = future.result()
                except Exception as exn:  # the worker died, or the task could not be sent
                    task = tasks[i]
                    results[i] = ShardResult(task.input, task.output, error=_describe(exn))
                bar.update(1)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return results  # type: ignore[return-value]
    finally:
        bar.close()
