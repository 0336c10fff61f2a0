"""``webds proc``: run a shell command on every sample (webdataset's ``tarproc``).

Each sample gets a fresh temporary folder holding its fields as files ``sample.<ext>``; the
command runs there (``sh -c``, with ``KEY`` set to the sample key), and the regular files
``sample.*`` found afterwards are the output sample. Samples run ``-p`` at a time (threads, each
waiting on its subprocess) and come out in input order. The output is one tar for the whole
stream, or one output shard per input shard through :func:`webds.parallel.map_shards` (local
processes or a Dask cluster), where complete outputs are skipped on a rerun. The per-sample
engine is :mod:`webds.cli.procrun`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Any, Iterable, Iterator, Optional, Sequence

from ..base.redact import redact
from ..errors import ArgumentError, OpenError
from ..parallel import MapShardsError, ShardResult, is_output_pattern, map_shards
from ..tar.writing import encode_header
from .common import (
    add_inputs,
    add_quiet,
    input_urls,
    open_output,
    positive_int,
    progress,
    read_samples,
    say,
    show_progress,
)
from .procrun import (
    Sample,
    SampleCommand,
    SampleCommandError,
    ShardCommand,
    _print_failure,
    run_samples,
)

__all__ = ["register", "SampleCommand", "SampleCommandError", "ShardCommand", "run_samples"]

EXAMPLE = """example:
  webds proc data/a.tar -o upper.tar -c 'tr a-z A-Z < sample.txt > t && mv t sample.txt'
  webds proc 'data/train-{000..099}.tar' -o small/ -p 4 -c 'mogrify -resize 256x sample.jpg'
  webds cat data/a.tar | webds proc - -o - -c 'gzip sample.json' | tar tvf -
  webds proc s3://b/raw/ -o 's3://b/gz/{stem}.tar' -c 'gzip sample.txt' --dask tcp://sched:8786

Each sample runs in a fresh temporary folder holding its fields as files sample.<ext>
(sample.jpg, sample.cls, ...) with KEY set to the sample's key; 'sh -c COMMAND' runs there.
Afterwards every regular file sample.* in the folder is a field of the output sample (same
key): changed files are taken as they are, removed ones dropped, new ones added
(sample.txt.gz -> field txt.gz). The command's stdout is discarded (it may be the tar stream).

A sample fails when the command exits non-zero, runs past --timeout, or leaves no sample.*
file; stderr gets its key, shard, exit status and the last lines of the command's stderr.
Without --keep-going the first failure stops the command (exit status 1) and the output is
discarded: nothing appears under OUT, and on stdout the stream ends in a truncated member so
that tar readers fail too (with one output per shard, the failure discards its shard's output
only; the other shards go on). With --keep-going failed samples are left out and counted; the
exit status is still 1 if any failed (an output shard written that way is complete, so a
rerun does not retry its failed samples).

OUT is one tar (a path, URL or '-') for all samples in input order; or, when it contains
{name}, {stem} or {index} or ends in '/', one output shard per input shard ('out/{stem}.tar',
'out/'), shards processed in parallel by local processes (--workers) or a Dask cluster
(--dask tcp://HOST:8786, or --dask local). Output shards appear only when complete; ones that
already exist are skipped, so a rerun after a failure does only the shards still missing.
With --dask, per-sample messages of --keep-going go to the workers' stderr."""


def register(subparsers: Any) -> None:
    """Add the ``proc`` subcommand."""
    from . import add_command

    p = add_command(
        subparsers,
        "proc",
        help="run a shell command on every sample (in a folder holding its files)",
        description="Run a shell command on every sample, in a temporary folder holding the\n"
        "sample's files as sample.<ext>, and collect the files sample.* it leaves as the\n"
        "output sample (webdataset's tarproc).",
        epilog=EXAMPLE,
        run=run_proc,
    )
    add_inputs(p)
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="a tar (path, URL or '-' for stdout) for all samples, or one output shard per "
        "input: a pattern with {name}/{stem}/{index} or a folder ending in '/'",
    )
    p.add_argument(
        "-c",
        "--command",
        dest="shell",
        metavar="COMMAND",
        required=True,
        help="the shell command run in each sample's folder",
    )
    p.add_argument(
        "-p",
        "--parallel",
        type=positive_int,
        default=1,
        metavar="P",
        help="samples processed at once (default 1); the output keeps the input order",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="leave failed samples out and go on (the exit status is still 1)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help="seconds a command may run on one sample before it is killed and fails",
    )
    p.add_argument(
        "-w",
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="with one output per shard: shards processed at once (default: one per CPU, or "
        "the Dask cluster's choice)",
    )
    p.add_argument(
        "--dask",
        metavar="SCHEDULER",
        default=None,
        help="with one output per shard: run the shards on a Dask cluster (tcp://HOST:PORT), "
        "or on a local one started for this run ('local'); needs pip install 'webds[dask]'",
    )
    add_quiet(p)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def run_proc(args: argparse.Namespace) -> int:
    if is_output_pattern(args.output):
        return _run_shards(args)
    if args.dask is not None or args.workers is not None:
        option = "--dask" if args.dask is not None else "--workers"
        raise ArgumentError(
            f"{option} needs one output per input shard: give -o a pattern with {{name}}, "
            f"{{stem}} or {{index}} (e.g. 'out/{{stem}}.tar') or a folder ending in '/'"
        )
    return _run_stream(args)


def _run_stream(args: argparse.Namespace) -> int:
    """All samples into one tar."""
    urls = input_urls(args.inputs)
    command = SampleCommand(args.shell, args.timeout)
    failures = []
    counts = {"in": 0, "out": 0}

    def on_failure(exn: SampleCommandError) -> None:
        failures.append(exn)
        _print_failure(exn)

    def counted(samples: Iterable[Sample]) -> Iterator[Sample]:
        for sample in samples:
            counts["in"] += 1
            yield sample

    sink = open_output(args.output)
    source = counted(progress(read_samples(urls), "proc", args.quiet))
    results = run_samples(
        source,
        command,
        args.parallel,
        on_failure if args.keep_going else None,
    )
    try:
        for sample in results:
            sink.write(sample)
            counts["out"] += 1
    except SampleCommandError as exn:
        source.close()  # ends the progress bar before the report
        _abandon(sink, args.output)
        _print_failure(exn)
        say(
            args,
            f"proc: stopped at the first failure after {counts['out']} sample(s); "
            f"{_nothing_written(args.output)} (--keep-going skips failed samples)",
        )
        return 1
    except BaseException:
        results.close()
        source.close()
        _abandon(sink, args.output)
        raise
    sink.close()
    failed = f", {len(failures)} failed and left out" if failures else ""
    say(args, f"proc: {counts['in']} samples in, {counts['out']} out{failed} -> {args.output}")
    return 1 if failures else 0


def _nothing_written(output: str) -> str:
    if output == "-":
        return "the stream on stdout ends in a truncated member"
    return f"nothing was written to {output}"


#: The name of the truncated member that ends a failed stream on stdout.
FAILED_MEMBER = "webds-proc-FAILED-see-stderr"


def _abandon(sink: Any, output: str) -> None:
    """Discard the output; stdout can't be taken back, so end it in a member header without its
    data: every tar reader then reports a truncated archive instead of a complete one."""
    sink.discard()
    if output == "-":
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.buffer.write(encode_header(FAILED_MEMBER, 512))
            sys.stdout.buffer.flush()


def _run_shards(args: argparse.Namespace) -> int:
    """One output shard per input shard, through map_shards."""
    urls = input_urls(args.inputs)
    if "-" in urls:
        raise ArgumentError(
            "'-' (stdin) needs a single output (-o FILE or -o -): one output per input shard "
            "reads named shards"
        )
    fn = ShardCommand(args.shell, args.timeout, args.parallel, args.keep_going)
    with contextlib.ExitStack() as stack:
        executor: Any = None
        if args.dask is not None:
            executor = _dask_executor(args.dask, args.workers, stack)
        try:
            results = map_shards(
                fn,
                urls,
                args.output,
                executor,
                level="shard",
                workers=args.workers,
                progress=show_progress(args.quiet),
                encoder=False,
            )
        except MapShardsError as exn:
            for r in exn.failed:
                print(redact(f"webds proc: shard {r.input!r} failed: {r.error}"), file=sys.stderr)
            _summary(args, exn.results)
            say(args, "proc: outputs of the failed shards were not written; run again to redo them")
            return 1
    return _summary(args, results)


def _summary(args: argparse.Namespace, results: Sequence[ShardResult]) -> int:
    done = [r for r in results if r.error is None and not r.skipped]
    skipped = sum(r.skipped for r in results)
    broken = sum(r.error is not None for r in results)
    samples_in = sum(r.samples_in for r in done)
    samples_out = sum(r.samples_out for r in done)
    lost = samples_in - samples_out  # each command leaves a sample or fails: these failed
    parts = [f"{len(done)} shards written"]
    if skipped:
        parts.append(f"{skipped} skipped (output already complete)")
    if broken:
        parts.append(f"{broken} failed")
    text = f"proc: {', '.join(parts)}; {samples_in} samples in, {samples_out} out"
    if lost:
        text += f", {lost} failed and left out"
    say(args, text + f" -> {args.output}")
    return 1 if lost or broken else 0


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _dask_executor(spec: str, workers: Optional[int], stack: contextlib.ExitStack) -> Any:
    try:
        import distributed
    except ImportError:
        raise ArgumentError(
            "--dask needs Dask's 'distributed' package: pip install 'webds[dask]'"
        ) from None
    if spec == "local":
        # Dask logs its start and stop at INFO; they would bury our summary on stderr.
        stack.enter_context(_quiet_logger("distributed"))
        cluster = stack.enter_context(
            distributed.LocalCluster(
                n_workers=workers,
                processes=True,
                threads_per_worker=1,
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
        )
        client = stack.enter_context(distributed.Client(cluster))
    else:
        try:
            client = stack.enter_context(distributed.Client(spec))
        except (OSError, ValueError) as exn:
            raise OpenError(
                f"cannot connect to the Dask scheduler {spec!r} ({type(exn).__name__}: {exn}); "
                "give its address as tcp://HOST:PORT, or --dask local"
            ) from None
    # pure=False: every submission runs (a rerun after deleting an output must redo it).
    return client.get_executor(pure=False)
