"""``webds stats``: count samples, fields and bytes; field size distributions; duplicate keys.

Reads its inputs fully (with a progress bar on a terminal). :func:`shard_stats` returns the
report as a dict, which is what ``--json`` prints.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from array import array
from contextlib import closing
from typing import Any, Dict, List, Sequence

from .common import (
    add_inputs,
    add_quiet,
    input_urls,
    progress,
    read_samples,
)
from .fields import field_names, human_size, nbytes

__all__ = ["register", "shard_stats"]

Sample = Dict[str, Any]

EXAMPLE_STATS = """example:
  webds stats 'data/train-{000000..000099}.tar'
  webds stats data/ --json | jq .fields.jpg

Counts samples, shards and bytes; per field how many samples have it and the distribution of its
size in bytes (median: middle value, or mean of the two middle ones; p95: the smallest size that
at least 95% of the samples with that field do not exceed); keys seen more than once; samples
that lack a field most samples have."""


def register(subparsers: Any) -> None:
    """Add the ``stats`` subcommand."""
    from . import add_command

    p = add_command(
        subparsers,
        "stats",
        help="count samples and fields; field size distributions",
        description="Read shards fully and report the number of samples, shards and bytes, "
        "how often each\nfield occurs and how big it is, duplicate keys, and samples missing "
        "common fields.",
        epilog=EXAMPLE_STATS,
        run=run_stats,
    )
    add_inputs(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_quiet(p)


# ---------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------

_EXAMPLES = 5  # keys listed per finding


def _median(values: Sequence[int]) -> float:
    return float(statistics.median(values))


def _p95(ordered: Sequence[int]) -> int:
    """Nearest-rank 95th percentile of sorted values."""
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _number(x: float) -> Any:
    return int(x) if float(x).is_integer() else x


class _Stats:
    """Running counts over samples; memory: one int per field occurrence and one set of keys."""

    def __init__(self) -> None:
        self.samples = 0
        self.bytes = 0
        self.sizes: Dict[str, array] = {}
        self.keys: set = set()
        self.dups: Dict[str, int] = {}
        self.first_keys: List[str] = []  # keys of the first samples: "missing" before a field
        self.missing: Dict[str, List[str]] = {}

    def add(self, sample: Sample) -> None:
        key = sample["__key__"]
        names = field_names(sample)
        for name in names:
            size = nbytes(sample[name])
            self.bytes += size
            sizes = self.sizes.get(name)
            if sizes is None:
                # Every earlier sample lacked this field: their first few keys are the examples.
                sizes = self.sizes[name] = array("q")
                self.missing[name] = self.first_keys[:_EXAMPLES]
            sizes.append(size)
        if len(names) < len(self.sizes):
            for name, examples in self.missing.items():
                if len(examples) < _EXAMPLES and name not in sample:
                    examples.append(key)
        if key in self.keys:
            self.dups[key] = self.dups.get(key, 1) + 1
        else:
            self.keys.add(key)
        if len(self.first_keys) < _EXAMPLES:
            self.first_keys.append(key)
        self.samples += 1

    def report(self, shards: int) -> Dict[str, Any]:
        n = self.samples
        fields: Dict[str, Any] = {}
        for name in sorted(self.sizes):
            ordered = sorted(self.sizes[name])
            fields[name] = {
                "samples": len(ordered),
                "frequency": len(ordered) / n,
                "min": ordered[0],
                "median": _number(_median(ordered)),
                "mean": sum(ordered) / len(ordered),
                "p95": _p95(ordered),
                "max": ordered[-1],
            }
        missing = {
            name: {"samples": n - info["samples"], "examples": self.missing[name]}
            for name, info in fields.items()
            if n / 2 < info["samples"] < n
        }
        return {
            "samples": n,
            "shards": shards,
            "bytes": self.bytes,
            "fields": fields,
            "duplicate_keys": {
                "keys": len(self.dups),
                "examples": {k: c for k, c in itertools.islice(self.dups.items(), _EXAMPLES)},
            },
            "missing": missing,
        }


def shard_stats(urls: Sequence[str], quiet: bool = True) -> Dict[str, Any]:
    """The ``webds stats`` report for shard URLs, as a dict (what ``--json`` prints)."""
    stats = _Stats()
    with closing(read_samples(urls)) as samples:
        for sample in progress(samples, "stats", quiet):
            stats.add(sample)
    return stats.report(len(urls))


def run_stats(args: argparse.Namespace) -> int:
    report = shard_stats(input_urls(args.inputs), quiet=args.quiet)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(_stats_text(report))
    return 0


def _stats_text(report: Dict[str, Any]) -> str:
    n = report["samples"]
    lines = [
        f"samples  {n:,}",
        f"shards   {report['shards']:,}",
        f"bytes    {report['bytes']:,} ({human_size(report['bytes'])}) in fields",
    ]
    if report["fields"]:
        head = ["field", "samples", "freq", "min", "median", "mean", "p95", "max"]
        rows = [head]
        for name, f in report["fields"].items():
            rows.append(
                [
                    name,
                    f"{f['samples']:,}",
                    f"{100 * f['frequency']:.1f}%",
                    str(f["min"]),
                    str(f["median"]),
                    f"{f['mean']:.1f}",
                    str(f["p95"]),
                    str(f["max"]),
                ]
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines.append("")
        for row in rows:
            cells = [row[0].ljust(widths[0])]
            cells += [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
            lines.append("  ".join(cells).rstrip())
    dups = report["duplicate_keys"]
    if dups["keys"]:
        shown = ", ".join(f"{k} ({c} times)" for k, c in dups["examples"].items())
        more = ", ..." if dups["keys"] > len(dups["examples"]) else ""
        lines += ["", f"duplicate keys: {dups['keys']:,} keys occur more than once: {shown}{more}"]
    for name, info in report["missing"].items():
        have = report["fields"][name]["frequency"] * 100
        more = ", ..." if info["samples"] > len(info["examples"]) else ""
        lines.append(
            f"missing {name}: {info['samples']:,} samples lack it ({have:.1f}% have it): "
            f"{', '.join(info['examples'])}{more}"
        )
    return "\n".join(lines) + "\n"
