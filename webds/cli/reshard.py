"""``webds split`` and ``webds cat``: rewrite a stream of samples as other tars.

Both copy samples unchanged (member names as in the input, see :mod:`webds.cli.shardio`),
read any input the library reads (paths, URLs, patterns, ``pipe:``, ``-`` for stdin) and write
outputs atomically. ``split`` cuts the stream into numbered shards (with a shard index),
and ``cat`` concatenates, shuffles (``--shuffle``) or interleaves (``--parallel``) shards.
``webds sort`` is in :mod:`webds.cli.sort`.
"""

from __future__ import annotations

import argparse
import itertools
import queue
import random
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import ArgumentError
from ..io.streams import abandon_stream
from ..io.urls import open_url
from ..shards.index import default_index_name
from ..shardwriter import ShardWriter
from ..stages.filters import shuffle
from .common import (
    add_inputs,
    add_output,
    add_quiet,
    byte_size,
    input_urls,
    open_output,
    positive_int,
    progress,
    read_samples,
    say,
)
from .shardio import (
    close_iterator,
    output_name,
    require_shard_pattern,
    shard_range,
    warn,
    write_samples,
)

__all__ = ["register", "interleave_shards"]

Sample = Dict[str, Any]

EXAMPLE_SPLIT = """example:
  webds split big.tar -o 'shards/train-%06d.tar' --maxcount 10000
  webds cat 'old-{000..099}.tar' | webds split - -o 'new-%04d.tar' --maxsize 1e9

OUT must have one %-field for the shard number ('%06d'). A new shard starts when the current one
holds --maxcount samples or --maxsize bytes of member data (tar headers not counted; a larger
sample gets a shard of its own). A shard index (docs/index-format.md) is written next to the
shards, named after the pattern up to its %-field ('shards/train.index.json'), unless
--no-index. Each shard written is listed on stderr."""

EXAMPLE_CAT = """example:
  webds cat a.tar b.tar c.tar.gz > all.tar
  webds cat 'train-{000..099}.tar' --shuffle 5000 --seed 1 -o shuffled.tar
  webds cat 'train-{000..099}.tar' --parallel 8 --count 1000 -o sample.tar

--shuffle BUF passes the samples through a buffer of BUF samples and writes a random one of them
at each step (the same --seed and inputs give the same order). --parallel P reads P shards at
a time, each on its own thread, and writes their samples in turn (round robin), a finished shard
giving its turn to the next input; the order depends only on the inputs and P."""


def register(subparsers: Any) -> None:
    """Add the ``split`` and ``cat`` subcommands."""
    from . import add_command

    p = add_command(
        subparsers,
        "split",
        help="split a stream of samples into numbered shards",
        description="Read samples from the inputs and write them to numbered shards of at\n"
        "most --maxcount samples and --maxsize bytes each, with a shard index.",
        epilog=EXAMPLE_SPLIT,
        run=run_split,
    )
    add_inputs(p)
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATTERN",
        help="shard name pattern with a %%-field for the shard number, e.g. 'out-%%06d.tar' "
        "(a path or URL; '.tar.gz' shards are gzipped)",
    )
    p.add_argument(
        "--maxcount", type=positive_int, default=100000, help="samples per shard (default 100000)"
    )
    p.add_argument(
        "--maxsize",
        type=byte_size,
        default=int(3e9),
        help="member bytes per shard, e.g. 1e9, 500M (default 3e9)",
    )
    p.add_argument(
        "--start", type=int, default=0, metavar="K", help="number of the first shard (default 0)"
    )
    p.add_argument("--no-index", action="store_true", help="do not write a shard index")
    add_quiet(p)

    p = add_command(
        subparsers,
        "cat",
        help="concatenate shards, optionally shuffled or interleaved",
        description="Write the samples of all inputs to one tar: in order, shuffled through a\n"
        "buffer (--shuffle), or interleaved from shards read in parallel (--parallel).",
        epilog=EXAMPLE_CAT,
        run=run_cat,
    )
    add_inputs(p)
    add_output(p)
    p.add_argument(
        "--shuffle",
        type=positive_int,
        metavar="BUF",
        help="shuffle through a buffer of BUF samples",
    )
    p.add_argument("--seed", type=int, help="seed for --shuffle (default: a fresh random order)")
    p.add_argument("--count", type=positive_int, metavar="N", help="stop after N samples")
    p.add_argument(
        "--parallel",
        type=positive_int,
        default=1,
        metavar="P",
        help="read P shards at a time and interleave their samples (default 1)",
    )
    add_quiet(p)


# -- split --------------------------------------------------------------------------------------


def run_split(args: argparse.Namespace) -> int:
    pattern = require_shard_pattern(args.output)
    urls = input_urls(args.inputs)
    if args.start < 0:
        raise ArgumentError(f"--start must be 0 or more, got {args.start}")
    writer: Optional[ShardWriter] = None
    written: List[str] = []  # listed at the end: a line printed now would break the progress bar

    def done(fname: str) -> None:
        assert writer is not None
        written.append(f"{fname}: {writer.count} samples")

    writer = ShardWriter(
        pattern,
        maxcount=args.maxcount,
        maxsize=args.maxsize,
        start_shard=args.start,
        index=not args.no_index,
        post=done,
        encoder=False,
        keep_meta=True,
    )
    try:
        with writer:
            count = write_samples(
                writer, progress(read_samples(urls), "split", args.quiet), "split"
            )
    finally:
        for line in written:  # also when a later shard failed: these are complete
            say(args, line)
    if not writer.shards:
        warn("split", "the inputs hold no samples; no shard was written")
        return 0
    index = "" if writer.index is None else f"; index {default_index_name(pattern)}"
    say(args, f"split {count} samples into {shard_range(writer.shards)}{index}")
    return 0


# -- cat ----------------------------------------------------------------------------------------


def run_cat(args: argparse.Namespace) -> int:
    urls = input_urls(args.inputs)
    if args.seed is not None and args.shuffle is None:
        warn("cat", "--seed has no effect without --shuffle")
    writer = open_output(args.output, keep_meta=True)
    with writer:
        if args.parallel > 1:
            source: Iterator[Sample] = interleave_shards(urls, args.parallel)
        else:
            source = read_samples(urls)
        samples = source
        try:
            if args.shuffle is not None:
                rng = random.Random(args.seed) if args.seed is not None else None
                samples = shuffle.fn(samples, args.shuffle, args.shuffle, rng=rng)
            if args.count is not None:
                samples = itertools.islice(samples, args.count)
            count = write_samples(writer, progress(samples, "cat", args.quiet), "cat")
        finally:
            # Stopping early (--count, an error) closes the shards now: pipe: commands end.
            close_iterator(samples)
            close_iterator(source)
    if args.count is not None and count < args.count:
        warn("cat", f"--count {args.count}: the inputs hold only {count} samples")
    say(args, f"wrote {count} samples from {len(urls)} shard(s) to {output_name(args.output)}")
    return 0


def interleave_shards(
    urls: List[str],
    parallel: int,
    read: Callable[[List[Any]], Iterator[Sample]] = read_samples,
    queue_size: int = 16,
) -> Iterator[Sample]:
    """Samples of ``parallel`` shards at a time, one from each in turn (round robin).

    Each shard is read on its own thread into a queue of ``queue_size`` samples; when a shard
    ends, the next input takes its place. The order depends only on the inputs and ``parallel``,
    not on thread timing. An error in a shard is raised here, when its turn comes. Closing the
    iterator stops the threads (and closes their shards); a ``pipe:`` command a thread still
    waits on is ended first (it may keep its output open after the tar).
    """
    stop = threading.Event()
    pending = iter(urls)
    slots: List[Tuple["queue.Queue[Tuple[str, Any]]", threading.Thread]] = []
    streams: List[Any] = []  # the threads' open shards, appended as they open them

    def start(url: str) -> Tuple["queue.Queue[Tuple[str, Any]]", threading.Thread]:
        q: "queue.Queue[Tuple[str, Any]]" = queue.Queue(queue_size)
        thread = threading.Thread(
            target=_pump,
            args=(read, url, q, stop, streams),
            name=f"webds-cat {url}",
            daemon=True,
        )
        thread.start()
        return q, thread

    try:
        for url in itertools.islice(pending, parallel):
            slots.append(start(url))
        i = 0
        while slots:
            i %= len(slots)
            kind, value = slots[i][0].get()
            if kind == "sample":
                yield value
                i += 1
            elif kind == "end":
                nxt = next(pending, None)
                if nxt is None:
                    del slots[i]
                else:
                    slots[i] = start(nxt)
            else:
                raise value
    finally:
        stop.set()
        for stream in list(streams):
            interrupt = getattr(stream, "interrupt", None)
            if interrupt is not None and not stream.closed:
                interrupt()  # a thread blocked reading this command's output wakes up
        for _, thread in slots:
            thread.join(timeout=30)


def _pump(
    read: Callable[[List[Any]], Iterator[Sample]],
    url: str,
    q: "queue.Queue[Tuple[str, Any]]",
    stop: threading.Event,
    streams: List[Any],
) -> None:
    """Thread body: put ("sample", s)... then ("end", None) or ("error", exn) on ``q``."""

    def put(item: Tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        stream = open_url(url)
        streams.append(stream)
        samples = read([{"url": url, "stream": stream}])
        try:
            for sample in samples:
                if not put(("sample", sample)):
                    return
        finally:
            close_iterator(samples)
            if not getattr(stream, "closed", True):
                abandon_stream(stream)  # stopped before the reader took the stream over
        put(("end", None))
    except BaseException as exn:  # handed to the reading thread, which raises it
        put(("error", exn))
