"""``webds sort``: write samples sorted by key or by a field, in bounded memory.

Samples are copied unchanged (member names as in the input, see :mod:`webds.cli.shardio`).
While the samples read fit in ``--memory`` they are sorted in memory; beyond that, sorted runs
are spilled to temporary tars and merged (``heapq.merge``, at most :data:`MERGE_FANIN` runs at
a time), so memory stays bounded whatever the input size. The sort is stable.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from ..io.urls import local_path
from ..tarwriter import TarWriter
from .common import (
    add_inputs,
    add_output,
    add_quiet,
    byte_size,
    input_urls,
    open_output,
    progress,
    read_samples,
    say,
)
from .fields import MISSING, field_value
from .shardio import (
    close_iterator,
    output_name,
    tar_fields,
    warn,
    write_samples,
)

__all__ = ["register", "SortKey", "external_sort"]

Sample = Dict[str, Any]

EXAMPLE_SORT = """example:
  webds sort train.tar -o sorted.tar
  webds sort 'train-{000..009}.tar' --by json.label --numeric -o by-label.tar --memory 2G

--by takes 'key' (the default) or a field spec: 'cls', 'seg.png', 'json.label', 'json.boxes.0'.
Values are decoded as 'webds tsv' shows them (cls and numeric text are numbers, JSON is parsed).
Numbers sort before text, text before binary data, and samples without the field (or with a
JSON null) always come last, also with --reverse. --numeric also reads numeric text as numbers
and orders text with digits naturally ('img9' before 'img10'). Equal values keep their input
order (the sort is stable). When the samples read exceed --memory, sorted runs are written to
temporary tars (in a hidden folder next to OUT, or in $TMPDIR when OUT is '-' or remote, or in
--tmpdir) and merged at the end, so memory stays bounded; the folder is removed afterwards."""

# Runs merged at once: each needs an open file and a sample in memory.
MERGE_FANIN = 64


def register(subparsers: Any) -> None:
    """Add the ``sort`` subcommand."""
    from . import add_command

    p = add_command(
        subparsers,
        "sort",
        help="sort samples by key or by a field, in bounded memory",
        description="Write the samples of the inputs to one tar, sorted by key or by a field.",
        epilog=EXAMPLE_SORT,
        run=run_sort,
    )
    add_inputs(p)
    add_output(p)
    p.add_argument(
        "--by", default="key", metavar="FIELD", help="'key' (default) or a field spec: cls, json.x"
    )
    p.add_argument("-n", "--numeric", action="store_true", help="compare numeric text as numbers")
    p.add_argument("-r", "--reverse", action="store_true", help="largest first")
    p.add_argument(
        "--memory",
        type=byte_size,
        default=int(500e6),
        metavar="SIZE",
        help="samples held in memory before spilling a sorted run to disk (default 500M)",
    )
    p.add_argument("--tmpdir", metavar="DIR", help="folder for the spilled runs")
    add_quiet(p)


# -- sort ---------------------------------------------------------------------------------------


class SortKey:
    """The sort key of a sample for ``--by``/``--numeric``/``--reverse``: a tuple that orders
    numbers < NaN < text < bytes < other JSON values, with missing values last (first in the
    tuple order when ``reverse``, so that a reversed sort still puts them last)."""

    def __init__(self, by: str = "key", numeric: bool = False, reverse: bool = False) -> None:
        self.by = by
        self.numeric = numeric
        self.reverse = reverse
        self._missing = (-1,) if reverse else (5,)

    def value(self, sample: Sample) -> Any:
        """The raw value sorted on (:data:`~webds.cli.fields.MISSING` when absent)."""
        return field_value(sample, self.by)

    def __call__(self, sample: Sample) -> Tuple[Any, ...]:
        value = self.value(sample)
        if value is MISSING or value is None:
            return self._missing
        if isinstance(value, (int, float)):  # bool included: JSON true/false
            return (1,) if isinstance(value, float) and math.isnan(value) else (0, value)
        if isinstance(value, str):
            if self.numeric:
                number = _number(value)
                if number is not None:
                    return (0, number) if not math.isnan(number) else (1,)
                return (2, _natural(value))
            return (2, value)
        if isinstance(value, (bytes, bytearray)):
            return (3, bytes(value))
        return (4, json.dumps(value, sort_keys=True, default=str))


def _number(text: str) -> Optional[float]:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


_DIGITS = re.compile(r"(\d+)")


def _natural(text: str) -> Tuple[Any, ...]:
    """'img10' -> ('img', 10, ''): text and numbers alternate, so tuples always compare."""
    parts: List[Any] = _DIGITS.split(text)
    for j in range(1, len(parts), 2):
        parts[j] = int(parts[j])
    return tuple(parts)


def run_sort(args: argparse.Namespace) -> int:
    urls = input_urls(args.inputs)
    key = SortKey(args.by, args.numeric, args.reverse)
    writer = open_output(args.output, keep_meta=True)
    stats: Dict[str, Any] = {}
    missing = [0]

    def count_missing(samples: Iterable[Sample]) -> Iterator[Sample]:
        for sample in samples:
            if key.value(sample) in (MISSING, None):
                missing[0] += 1
            yield sample

    samples = read_samples(urls)
    if args.by not in ("key", "__key__"):
        samples = count_missing(samples)
    with writer:
        ordered = external_sort(
            progress(samples, "sort", args.quiet),
            key,
            reverse=args.reverse,
            memory=args.memory,
            tmp_parent=_tmp_parent(args),
            stats=stats,
        )
        try:
            count = write_samples(writer, ordered, "sort")
        finally:
            ordered.close()
    spilled = stats.get("runs", 0)
    how = f" ({spilled} sorted runs spilled to disk and merged)" if spilled else ""
    say(args, f"sorted {count} samples by {args.by} to {output_name(args.output)}{how}")
    if missing[0]:
        warn("sort", f"{missing[0]} sample(s) have no {args.by!r}; they come last")
    return 0


def _tmp_parent(args: argparse.Namespace) -> Optional[str]:
    """Where the spill folder goes: --tmpdir, else next to a local OUT, else $TMPDIR."""
    if args.tmpdir:
        return str(args.tmpdir)
    path = None if args.output == "-" else local_path(args.output)
    if path is not None:
        return os.path.dirname(os.path.abspath(path))
    return None  # tempfile's default: $TMPDIR, /tmp, ...


def _footprint(sample: Sample) -> int:
    """About the bytes a sample holds: its fields plus a tar header each."""
    total = 0
    for name, value in sample.items():
        total += 512
        if isinstance(value, (bytes, bytearray, memoryview)):
            total += len(value)
        elif isinstance(value, str):
            total += len(name) + len(value)
    return total


def external_sort(
    samples: Iterable[Sample],
    key: Callable[[Sample], Any],
    reverse: bool = False,
    memory: int = int(500e6),
    tmp_parent: Optional[str] = None,
    stats: Optional[Dict[str, Any]] = None,
) -> Iterator[Sample]:
    """The samples sorted (stably) by ``key``, holding about ``memory`` bytes of samples.

    When more is read, the buffer is sorted and written as a run (a tar) to a temporary
    folder under ``tmp_parent`` (default: $TMPDIR), and the runs are merged with
    :func:`heapq.merge` at the end, ``MERGE_FANIN`` at a time. The folder is removed when the
    iterator is exhausted or closed. ``stats["runs"]`` is set to the number of runs spilled.
    """
    stats = {} if stats is None else stats
    stats["runs"] = 0
    tmpdir: Optional[str] = None
    runs: List[str] = []
    buffer: List[Sample] = []
    held = 0
    try:
        for sample in samples:
            buffer.append(sample)
            held += _footprint(sample)
            if held > memory:
                if tmpdir is None:
                    prefix = ".webds-sort-" if tmp_parent is not None else "webds-sort-"
                    tmpdir = tempfile.mkdtemp(prefix=prefix, dir=tmp_parent)
                buffer.sort(key=key, reverse=reverse)
                runs.append(_write_run(tmpdir, len(runs), buffer))
                buffer, held = [], 0
        buffer.sort(key=key, reverse=reverse)
        stats["runs"] = len(runs)
        if not runs:
            yield from buffer
            return
        assert tmpdir is not None
        # Merge runs a fan-in at a time, keeping them in input order so the result is stable.
        generation = 0
        while len(runs) + 1 > MERGE_FANIN:
            generation += 1
            merged = []
            for start in range(0, len(runs), MERGE_FANIN):
                group = runs[start : start + MERGE_FANIN]
                name = f"merge{generation}-{len(merged):06d}"
                merged.append(
                    _write_run(tmpdir, name, _merge([_read_run(r) for r in group], key, reverse))
                )
                for r in group:
                    os.unlink(r)
            runs = merged
        sources = [_read_run(r) for r in runs] + [iter(buffer)]
        try:
            yield from _merge(sources, key, reverse)
        finally:
            for source in sources:
                close_iterator(source)
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _merge(sources: List[Iterator[Sample]], key: Callable, reverse: bool) -> Iterator[Sample]:
    # heapq.merge breaks ties by source position: earlier runs first, which keeps it stable.
    return heapq.merge(*sources, key=key, reverse=reverse)


# The samples of a run are numbered in their keys ("0000000007/orig-key"), so that two
# neighbours with the same key stay two samples when the run is read back; the original
# __url__ travels in a field of its own.
_URL_FIELD = "__webds_url__"
_SEQ_WIDTH = 12


def _write_run(tmpdir: str, name: Any, samples: Iterable[Sample]) -> str:
    label = f"{name:06d}" if isinstance(name, int) else str(name)
    path = os.path.join(tmpdir, f"run-{label}.tar")
    with TarWriter(path, encoder=False, keep_meta=True) as writer:
        for seq, sample in enumerate(samples):
            out = tar_fields(sample)
            out["__key__"] = f"{seq:0{_SEQ_WIDTH}d}/{sample['__key__']}"
            url = sample.get("__url__")
            if isinstance(url, str):
                out[_URL_FIELD] = url
            writer.write(out)
    return path


def _read_run(path: str) -> Iterator[Sample]:
    for sample in read_samples([path]):
        sample["__key__"] = sample["__key__"][_SEQ_WIDTH + 1 :]
        url = sample.pop(_URL_FIELD, None)
        if url is not None:
            sample["__url__"] = bytes(url).decode("utf-8")
        else:
            sample.pop("__url__", None)
        sample.pop("__local_path__", None)
        yield sample
