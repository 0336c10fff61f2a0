"""What every ``webds`` subcommand shares: input and output arguments, reading samples, writing
tars, progress bars.

Inputs are shard specs as the library takes them (paths, URLs, brace patterns, globs, folders or
prefixes ending in ``/``, ``pipe:CMD``) or ``-`` for standard input. Samples are read with the
same grouping rules as training (:func:`webds.tar.samples.tarfile_samples`), except that field names
keep the case they have in the tar (``a.JPG`` stays ``JPG``), so commands that copy shards write
the same member names back; ``__meta__`` files are skipped. Outputs are a path, a URL or ``-`` for
standard output; a file or object appears only when complete (written to a temporary name, then
renamed or committed), so an interrupted command never leaves a half-written shard under the
final name.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

from ..base.redact import redact
from ..errors import ArgumentError
from ..shards.shardlists import expand_urls
from ..tar.samples import tarfile_samples
from ..tarwriter import TarWriter

__all__ = [
    "INPUTS_HELP",
    "add_inputs",
    "add_output",
    "add_quiet",
    "positive_int",
    "byte_size",
    "input_urls",
    "read_samples",
    "open_output",
    "progress",
    "show_progress",
    "say",
]

INPUTS_HELP = (
    "shards: paths, URLs (s3://, gs://, https://, any fsspec URL), brace patterns "
    "('a-{000..009}.tar'), globs, folders ending in '/', 'pipe:CMD', or '-' for stdin"
)

Sample = Dict[str, Any]


def add_inputs(parser: argparse.ArgumentParser, nargs: str = "+") -> None:
    """The positional input shards (``IN...``)."""
    parser.add_argument("inputs", nargs=nargs, metavar="IN", help=INPUTS_HELP)


def add_output(parser: argparse.ArgumentParser, default: Optional[str] = "-") -> None:
    """``-o/--output``: a path or URL, or ``-`` (stdout); required when ``default`` is None."""
    parser.add_argument(
        "-o",
        "--output",
        default=default,
        required=default is None,
        metavar="OUT",
        help="where to write the tar: a path, a URL or '-' for stdout"
        + (f" (default {default})" if default is not None else ""),
    )


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """``-q/--quiet``: no progress bars and no summary on stderr."""
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar and no summary on stderr"
    )


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


_SIZE_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def byte_size(text: str) -> int:
    """argparse type: a byte count such as ``1e9``, ``500M``, ``2G`` or ``65536`` (>= 1)."""
    raw = text.strip().lower().rstrip("b")
    scale = 1
    if raw and raw[-1] in _SIZE_SUFFIXES:
        scale = _SIZE_SUFFIXES[raw[-1]]
        raw = raw[:-1]
    try:
        value = int(float(raw) * scale)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 1e9, 500M or 2G, got {text!r}"
        )
    return value


def input_urls(inputs: Sequence[str]) -> List[str]:
    """Expand the inputs into shard URLs; ``-`` (stdin) may appear once."""
    urls: List[str] = []
    for spec in inputs:
        if spec == "-":
            urls.append(spec)
        else:
            # One spec per argument: "::" inside an argument still splits, as in the library.
            urls.extend(expand_urls(spec))
    if urls.count("-") > 1:
        raise ArgumentError("'-' (standard input) can be given only once")
    if not urls:
        raise ArgumentError("no input shards: give at least one path, URL or '-'")
    return urls


def read_samples(urls: Iterable[Any]) -> Iterator[Sample]:
    """The raw samples of the shards, in order: ``{"__key__", "__url__", ext: bytes, ...}``,
    extensions as in the tar. A shard is a URL, or a descriptor ``{"url", "stream"}`` with its
    stream already open.

    A shard that cannot be opened or read raises (:class:`~webds.errors.OpenError`,
    :class:`~webds.errors.ShardReadError`) after every complete sample before the damage.
    """
    return tarfile_samples(
        ({"url": url} if isinstance(url, str) else url for url in urls), lcase=False
    )


def open_output(output: str, **kw: Any) -> TarWriter:
    """A :class:`TarWriter` for raw samples (fields already bytes) to ``output``.

    Refuses to write a tar to a terminal: that is almost always a forgotten ``-o``.
    """
    if output == "-" and _isatty(sys.stdout):
        raise ArgumentError(
            "refusing to write a tar archive to the terminal; give -o FILE, or redirect or "
            "pipe standard output"
        )
    return TarWriter(output, encoder=False, **kw)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def show_progress(quiet: bool) -> bool:
    """Whether to draw progress bars: not with ``--quiet``, and only on a terminal (a log file
    would fill with bar redraws)."""
    return not quiet and _isatty(sys.stderr)


def progress(
    items: Iterable[Any],
    desc: str,
    quiet: bool,
    total: Optional[int] = None,
    unit: str = " samples",
) -> Iterator[Any]:
    """``items`` with a tqdm progress bar on stderr (see :func:`show_progress`); closed when
    done."""
    if not show_progress(quiet):
        yield from items
        return
    from tqdm.auto import tqdm

    bar = tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False)
    try:
        yield from bar
    finally:
        bar.close()


def say(args: argparse.Namespace, message: str) -> None:
    """A summary line on stderr (stdout may be the data), unless ``--quiet``; credentials in
    the URLs it names are redacted."""
    if not getattr(args, "quiet", False):
        print(redact(message), file=sys.stderr)
