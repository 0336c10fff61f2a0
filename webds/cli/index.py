"""``webds index`` (write a shard index) and ``webds verify`` (check shards against one)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..base.redact import redact
from ..shards.index import ShardIndex
from .common import positive_int, show_progress

EXAMPLE_INDEX = """example:
  webds index 'data/train-{000000..000099}.tar' -o data/train.index.json
  webds index s3://bucket/train/ -o s3://bucket/train/index.json --workers 16

SHARDS are paths, URLs, brace patterns, globs ('data/*.tar') or folders/prefixes ending in '/'.
Shards under the index's folder are listed relative to it, so the folder can be moved whole.
Remote stores take their credentials and endpoint from fsspec's usual environment and config
(AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS, ...)."""

EXAMPLE_VERIFY = """example:
  webds verify data/train.index.json

Reads every shard fully and reports, one per line, shards that are missing, of another size or
sha256 than the index says, with another number of samples, or corrupt. Exit status: 0 if all
shards are good, 1 if any problem was found."""


def register(subparsers: Any) -> None:
    """Add the ``index`` and ``verify`` subcommands."""
    from . import add_command

    p = add_command(
        subparsers,
        "index",
        help="write a shard index (sample counts, sizes, sha256) for a set of shards",
        description="Read every shard once and write a shard index (JSON) listing each shard\n"
        "with its number of samples, size and sha256 (see docs/index-format.md).",
        epilog=EXAMPLE_INDEX,
        run=run_index,
    )
    p.add_argument("shards", nargs="+", metavar="SHARDS", help="shard paths, URLs or patterns")
    p.add_argument("-o", "--output", required=True, help="the index file to write (path or URL)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress and no summary")
    p.add_argument(
        "-w", "--workers", type=positive_int, default=1, help="shards read at once (default 1)"
    )

    p = add_command(
        subparsers,
        "verify",
        help="check every shard against a shard index",
        description="Read every shard listed in a shard index and check that it is there,\n"
        "readable, and has the size, sha256 and number of samples the index says.",
        epilog=EXAMPLE_VERIFY,
        run=run_verify,
    )
    p.add_argument("index", metavar="INDEX", help="the shard index file (path or URL)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the problems")
    p.add_argument(
        "-w", "--workers", type=positive_int, default=1, help="shards read at once (default 1)"
    )


def run_index(args: argparse.Namespace) -> int:
    index = ShardIndex.build(args.shards, workers=args.workers, progress=show_progress(args.quiet))
    index.save(args.output)
    if not args.quiet:
        print(redact(f"indexed {len(index)} shards, {index.total} samples -> {args.output}"))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    index = ShardIndex.load(args.index)
    problems = index.verify(progress=show_progress(args.quiet), workers=args.workers)
    for problem in problems:
        # A report, not data: the shard as given, credentials redacted (its message too).
        print(f"{redact(_show(problem.url))}: {problem.kind}: {redact(problem.message)}")
    if not args.quiet:
        if problems:
            bad = len({p.url for p in problems})
            print(
                redact(
                    f"{len(problems)} problem(s) in {bad} of {len(index)} shards listed in "
                    f"{args.index}"
                )
            )
        else:
            print(f"all {len(index)} shards, {index.total} samples, are good")
    sys.stdout.flush()
    return 1 if problems else 0


def _show(url: str) -> str:
    """A shard as the user knows it: relative to the current folder when it is under it."""
    if os.path.isabs(url):
        rel = os.path.relpath(url)
        if not rel.startswith(".."):
            return rel
    return url
