"""``webds ls``, ``show``, ``tsv`` and ``first``: look inside shards (``stats``: its own module).

All of them read samples as training does (:func:`webds.cli.common.read_samples`) and stop
reading as soon as they have what they need (``--count``), so ``webds ls huge.tar --count 3`` or
``webds first 'pipe:curl ...' --where ...`` opens no more than it must. Text goes to stdout, one
line per sample where possible, for ``grep``, ``cut`` and ``head``; warnings, summaries and
progress bars go to stderr. A damaged shard ends the command with exit status 1 and a message
naming it, after everything read before the damage has been printed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence

from ..base.redact import redact
from ..errors import ArgumentError, WebdsError
from . import contact
from .common import (
    add_inputs,
    add_output,
    add_quiet,
    input_urls,
    open_output,
    positive_int,
    progress,
    read_samples,
    say,
)
from .fields import (
    MISSING,
    Where,
    decode_field,
    field_names,
    field_value,
    format_value,
    human_size,
    nbytes,
)

__all__ = ["register"]

Sample = Dict[str, Any]

EXAMPLE_LS = """example:
  webds ls data/train-000000.tar --count 5
  cat shard.tar | webds ls - --long | grep -v ' jpg '

One line per sample: the key, then each field's name and size, in the order of the tar:
"0001  cls 1 B, jpg 95.3 kB, json 45 B" (kB is 1,000 bytes, MB 1,000,000); --bytes prints exact
sizes ("jpg 95312 B"), --long adds the shard."""

EXAMPLE_SHOW = """example:
  webds show data/train-000000.tar --count 2 --fields jpg,cls,json
  webds show 'data/train-{000000..000009}.tar' --images grid.png --count 64 --thumb 96

Per sample: its key, its shard, and each field: text, numbers and JSON decoded (cut to --width
characters), binary fields as <N bytes>, images with their format and size (read from the
header). --images writes a contact sheet instead (the first image of each sample, or the field
named in --fields) with each key under its thumbnail; --count defaults to 16 with it."""

EXAMPLE_TSV = """example:
  webds tsv data/train-000000.tar --fields cls,json.label > labels.tsv
  webds tsv 'data/*.tar' --fields json.width,json.height --no-header | sort -u

One line per sample: __key__ (unless --no-key), then each field spec: a field (cls, seg.png) or a
path into a JSON field (json.label, json.boxes.0); missing values are empty, tabs and newlines in
values become spaces, binary fields are shown as <N bytes>."""

EXAMPLE_FIRST = """example:
  webds first data/train-000000.tar --where 'cls == 3' -o sample.tar
  webds first 'data/*.tar' --where 'json.label == "cat" and len(jpg) > 50_000' --count 5 | tar tv

Writes the first --count samples for which --where is true (all samples without --where) as a
tar, and stops reading there. The expression is Python with each field as a name; a field a
sample lacks is None. Exit status 1 when no sample matched."""


def register(subparsers: Any) -> None:
    """Add the ``ls``, ``show``, ``tsv``, ``first`` and ``stats`` subcommands."""
    from . import add_command

    p = add_command(
        subparsers,
        "ls",
        help="list samples and their fields with sizes",
        description="List the samples of shards, one line per sample: its key and each field "
        "with its size.",
        epilog=EXAMPLE_LS,
        run=run_ls,
    )
    add_inputs(p)
    _add_count(p, None)
    _add_where(p)
    p.add_argument("--fields", type=_field_list, help="list only these fields (comma-separated)")
    p.add_argument("-b", "--bytes", action="store_true", help="exact sizes in bytes")
    p.add_argument("-l", "--long", action="store_true", help="add the shard URL to each line")

    p = add_command(
        subparsers,
        "show",
        help="show the fields of the first samples; --images draws a contact sheet",
        description="Show the first samples of shards field by field, decoded where that is "
        "cheap\n(text, numbers, JSON; image format and size from the header).",
        epilog=EXAMPLE_SHOW,
        run=run_show,
    )
    add_inputs(p)
    _add_count(p, None, "samples to show (default 3, or 16 with --images)")
    _add_where(p)
    p.add_argument(
        "--fields", type=_field_list, help="show only these fields or specs (cls,json.label)"
    )
    p.add_argument(
        "--width",
        type=int,
        default=100,
        metavar="W",
        help="cut values to W characters (default 100; 0: never)",
    )
    p.add_argument("--images", metavar="GRID", help="write a contact sheet (path or URL, .png)")
    p.add_argument(
        "--columns", type=positive_int, metavar="C", help="thumbnails per row (default: square)"
    )
    p.add_argument(
        "--thumb", type=positive_int, default=128, metavar="PX", help="thumbnail size (128)"
    )
    add_quiet(p)

    p = add_command(
        subparsers,
        "tsv",
        help="tabulate fields of samples as tab-separated values",
        description="Print chosen fields of each sample as one line of tab-separated values "
        "(tar2tsv).",
        epilog=EXAMPLE_TSV,
        run=run_tsv,
    )
    add_inputs(p)
    p.add_argument(
        "--fields",
        type=_field_list,
        required=True,
        help="comma-separated field specs: cls,json.label,txt",
    )
    p.add_argument(
        "--header",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print a first line naming the columns (default: yes)",
    )
    p.add_argument("--no-key", dest="key", action="store_false", help="leave out __key__")
    _add_count(p, None)
    _add_where(p)

    p = add_command(
        subparsers,
        "first",
        help="extract the first samples (matching --where) as a tar",
        description="Write the first sample(s) of shards, or the first that match --where, "
        "as a tar\narchive, reading no further than needed (tarfirst).",
        epilog=EXAMPLE_FIRST,
        run=run_first,
    )
    add_inputs(p)
    _add_where(p)
    _add_count(p, 1, "samples to extract (default 1)")
    add_output(p)
    add_quiet(p)


def _add_count(p: argparse.ArgumentParser, default: Optional[int], help: str = "") -> None:
    p.add_argument(
        "--count",
        type=positive_int,
        default=default,
        metavar="N",
        help=help or "stop after N samples (default: all)",
    )


def _add_where(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--where",
        metavar="EXPR",
        help="only samples for which this Python expression is true, e.g. 'cls == 3'",
    )


def _field_list(text: str) -> List[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected field names like cls,json.label, got {text!r}")
    return names


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


@contextmanager
def _samples(
    args: argparse.Namespace, count: Optional[int] = None, bar: Optional[str] = None
) -> Iterator[Iterator[Sample]]:
    """The samples of ``args.inputs`` passing ``--where``, at most ``count``; the shards are
    closed (a ``pipe:`` command ended) on leaving, so nothing is read past what was used.

    Inputs and ``--where`` are checked on entry, before anything is read or written. ``bar``
    shows a progress bar of the samples read (unless ``--quiet``).
    """
    urls = input_urls(args.inputs)
    where = Where(args.where) if getattr(args, "where", None) is not None else None
    source = read_samples(urls)
    read = [0]

    def counted(samples: Iterator[Sample]) -> Iterator[Sample]:
        for sample in samples:
            read[0] += 1
            yield sample

    stream: Iterator[Sample] = counted(source)
    if bar is not None:
        stream = progress(stream, bar, getattr(args, "quiet", False))
    bar_stream = stream
    try:
        if where is not None:
            stream = (sample for sample in stream if where(sample))
        if count is not None:
            stream = itertools.islice(stream, count)
        yield stream
    finally:
        bar_stream.close()  # type: ignore[attr-defined]  # a generator: ends the bar
        source.close()
        # Also when nothing matched (the command then fails): a misspelt field is the likely cause.
        if where is not None and read[0]:
            _warn_unseen(args, where)


def _warn_unseen(args: argparse.Namespace, where: Where) -> None:
    unseen = where.unseen()
    if unseen:
        print(
            f"webds {args.command}: warning: --where uses {', '.join(unseen)}, which no sample "
            "read had as a field (a typo?)",
            file=sys.stderr,
        )


# ---------------------------------------------------------------------------------------------
# ls
# ---------------------------------------------------------------------------------------------


def _size_text(n: int, exact: bool = False) -> str:
    """A field size with its unit, so that it can't be read as the field's value: ``1 B``,
    ``95.3 kB``, ``3.4 MB`` (powers of 1000, as :func:`human_size`); ``exact``: ``95312 B``."""
    if exact or n < 1000:
        return f"{n} B"
    short = human_size(n)  # "95.3k"
    return f"{short[:-1]} {short[-1]}B"


def run_ls(args: argparse.Namespace) -> int:
    exact = bool(args.bytes)
    out = sys.stdout
    with _samples(args, args.count) as samples:
        for sample in samples:
            names = field_names(sample) if args.fields is None else args.fields
            parts = [
                f"{name} {_size_text(nbytes(sample[name]), exact)}"
                for name in names
                if name in sample
            ]
            line = f"{sample['__key__']}  {', '.join(parts)}"
            if args.long:
                line += f"  {sample.get('__url__')}"
            out.write(line + "\n")
    return 0


# ---------------------------------------------------------------------------------------------
# show
# ---------------------------------------------------------------------------------------------


def _describe(name: str, value: Any, width: int) -> str:
    """One field for ``show``: decoded text, or ``<N bytes>`` (plus format and size of images)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        text = f"<{len(data)} bytes>"
        if contact.is_image_field(name) or contact.looks_like_image(data):
            info = contact.image_info(data)
            if info:
                text += f" {info}"
        return text
    if value is MISSING:
        return "<missing>"
    return format_value(value, width)


def _show_value(sample: Sample, spec: str) -> Any:
    """The raw bytes of image and binary fields (to describe them), else the decoded value."""
    if spec in sample and not spec.startswith("__"):
        raw = sample[spec]
        if contact.is_image_field(spec):
            return raw
        return decode_field(spec, raw)
    return field_value(sample, spec)


def _image_of(sample: Sample, specs: Optional[Sequence[str]]) -> Optional[str]:
    """The field to put on the contact sheet: the first image among ``specs`` (or the sample's
    fields), by extension or by file signature; a named binary field when none is an image."""
    names = [n for n in (specs or field_names(sample)) if n in sample and not n.startswith("__")]
    binary = [n for n in names if isinstance(decode_field(n, sample[n]), bytes)]
    for name in names:
        if contact.is_image_field(name) or (
            name in binary and contact.looks_like_image(sample[name])
        ):
            return name
    if specs and binary:
        return binary[0]
    return None


def run_show(args: argparse.Namespace) -> int:
    if args.width < 0:
        raise ArgumentError(f"--width must be 0 (no limit) or more, got {args.width}")
    if args.images is not None:
        if args.images == "-":
            raise ArgumentError(
                "--images needs a file name or URL: on stdout the image would mix with the text"
            )
        contact.image_format(args.images)  # a bad name fails before any reading
    count = args.count or (16 if args.images else 3)
    tiles: List[Any] = []
    out = sys.stdout
    with _samples(args, count) as samples:
        for i, sample in enumerate(samples):
            if args.images is not None:
                # The sheet is what was asked for: no wall of text blocks on stdout.
                field = _image_of(sample, args.fields)
                if field is not None:
                    tiles.append((sample["__key__"], bytes(sample[field]), field))
                continue
            # A display, not data: the URL without its credentials (ls --long and tsv give it
            # as it is, for scripts to open again).
            rows = [("__key__", sample["__key__"]), ("__url__", redact(sample.get("__url__", "")))]
            specs = args.fields if args.fields is not None else field_names(sample)
            rows += [
                (spec, _describe(spec, _show_value(sample, spec), args.width)) for spec in specs
            ]
            pad = max(len(name) for name, _ in rows)
            block = "".join(f"{name:<{pad}}  {text}".rstrip() + "\n" for name, text in rows)
            out.write(("\n" if i else "") + block)
    if args.images is not None:
        _write_sheet(args, tiles)
    return 0


def _write_sheet(args: argparse.Namespace, tiles: List[Any]) -> None:
    if not tiles:
        raise WebdsError(
            "no images in the samples shown, so no contact sheet was written; name the image "
            "field with --fields, or show more samples with --count"
        )
    sheet, failed = contact.contact_sheet(
        [(key, data) for key, data, _ in tiles], args.columns, args.thumb
    )
    for index, reason in failed:
        key, _, field = tiles[index]
        print(
            f"webds show: warning: field {field!r} of sample {key!r} is not a readable "
            f"image ({reason}); drawn as a crossed-out tile",
            file=sys.stderr,
        )
    contact.save_image(sheet, args.images)
    say(args, f"webds show: wrote a contact sheet of {len(tiles)} images to {args.images}")


# ---------------------------------------------------------------------------------------------
# tsv
# ---------------------------------------------------------------------------------------------


def run_tsv(args: argparse.Namespace) -> int:
    columns = (["__key__"] if args.key else []) + list(args.fields)
    out = sys.stdout
    header = args.header
    with _samples(args, args.count) as samples:
        for sample in samples:
            if header:  # after the first read: a shard that can't be opened prints nothing
                out.write("\t".join(columns) + "\n")
                header = False
            values = [format_value(field_value(sample, spec)) for spec in columns]
            out.write("\t".join(values) + "\n")
    if header:
        out.write("\t".join(columns) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------
# first
# ---------------------------------------------------------------------------------------------


def run_first(args: argparse.Namespace) -> int:
    with _samples(args, bar="first") as samples:
        with open_output(args.output) as writer:
            for sample in samples:
                writer.write(sample)
                if writer.count >= args.count:
                    break
            if writer.count == 0:  # the output is discarded: no empty tar left behind
                what = f"matched --where {args.where!r}" if args.where is not None else "was found"
                raise WebdsError(f"no sample {what} in {' '.join(args.inputs)}")
    target = "stdout" if args.output == "-" else args.output
    short = f" (only {writer.count} of --count {args.count})" if writer.count < args.count else ""
    say(args, f"webds first: wrote {writer.count} sample(s){short} to {target}")
    return 0
