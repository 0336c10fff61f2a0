"""``webds create``: build a tar (or a series of shards) from a plan file or from a folder.

A *plan* has one line per tar member, ``archive-name source``; the archive name is split into
sample key and extension at the first dot of its file name (``train/0001.seg.png`` is key
``train/0001``, field ``seg.png``). The members of one sample are written together, samples in
the order their keys first appear (``--sort``: by key). ``--from-dir DIR`` makes the plan from a
folder: every file under it, named by its path relative to DIR, samples sorted by key.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Type

from ..errors import ArgumentError, OpenError, SampleError, SecureModeError, WebdsError
from ..io.urls import check_secure, local_path, open_url
from ..tar.samples import base_plus_ext
from ..tarwriter import check_key
from .common import add_quiet, byte_size, positive_int, progress, say
from .shardio import open_writer, shard_range, warn, write_samples

__all__ = ["register", "run_create", "parse_plan", "plan_from_dir", "group_entries", "Entry"]

EXAMPLE = r"""example:
  webds create plan.txt -o data.tar
  webds create --from-dir images/ -o 'shards/train-%06d.tar' --maxcount 10000

a plan has one member per line, 'ARCHIVE-NAME SOURCE' ('#' comments and blank lines skipped):
  # name         source
  0001.jpg       photos/cat.jpg
  0001.cls       text:3
  0001.txt       text:a cat\non a mat
  0002.jpg       pipe:convert photos/dog.png jpg:-
  0002.cls       text:5

SOURCE is a file path or URL (relative paths are taken from the current folder), 'text:...'
(the rest of the line, as UTF-8; escapes \n newline, \t tab, \r return, \0 NUL, \\ backslash),
or 'pipe:CMD' (the standard output of the shell command CMD; a failing command is an error).
ARCHIVE-NAME is KEY.EXT: the members of one sample share the KEY and are written together,
samples in the order their keys first appear (--sort: sorted by key). An output name with a
%-field ('out-%06d.tar') writes a series of shards (--maxcount, --maxsize) and their index.

--from-dir DIR takes every file under DIR (recursively; hidden files and folders skipped, files
without an extension skipped with a warning), named by its path relative to DIR, so
'DIR/a/0001.jpg' and 'DIR/a/0001.cls' form the sample 'a/0001'; samples are sorted by key.
A symbolic link to a file is packed as the file's content if the file is inside DIR; a link
that leads out of DIR is an error (it would put a file from elsewhere, say ~/.ssh, into the
tar) unless --follow-links is given. Links to folders are not followed (a warning says so).

exit status: 0 done, 1 a source could not be read (or a pipe: command failed),
2 a bad plan line or argument (the message names the plan line)."""

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\"}


@dataclass
class Entry:
    """One member to write: its archive ``name``, ``source`` and where it was asked for."""

    name: str
    key: str
    ext: str
    source: str
    where: str  # "plan.txt line 3", or the file's path for --from-dir
    local: bool = False  # source is a local file path (--from-dir), never a URL or pipe:


def register(subparsers: Any) -> None:
    """Add the ``create`` subcommand."""
    from . import add_command

    p = add_command(
        subparsers,
        "create",
        help="build a tar from a plan of 'name source' lines, or from a folder",
        description="Build a WebDataset tar from a plan file (lines 'ARCHIVE-NAME SOURCE',\n"
        "SOURCE a file, 'text:...' or 'pipe:CMD') or from the files of a folder (--from-dir),\n"
        "writing the members of each sample together.",
        epilog=EXAMPLE,
        run=run_create,
    )
    p.add_argument(
        "plan", nargs="?", metavar="PLAN", help="the plan file, or '-' to read it from stdin"
    )
    p.add_argument(
        "--from-dir", metavar="DIR", help="make the plan from the files under DIR instead"
    )
    p.add_argument(
        "--follow-links",
        action="store_true",
        help="with --from-dir: also pack the files that symbolic links lead to outside DIR",
    )
    p.add_argument(
        "-o",
        "--output",
        default="-",
        metavar="OUT",
        help="the tar to write: a path, a URL, '-' for stdout (default), or a shard name "
        "pattern such as 'out-%%06d.tar' for a series of shards",
    )
    p.add_argument("--sort", action="store_true", help="write the samples sorted by key")
    p.add_argument(
        "--maxcount",
        type=positive_int,
        default=100000,
        help="with a shard pattern: samples per shard (default 100000)",
    )
    p.add_argument(
        "--maxsize",
        type=byte_size,
        default=int(3e9),
        help="with a shard pattern: payload bytes per shard, e.g. 1e9 or 500M (default 3e9)",
    )
    p.add_argument(
        "--no-index", action="store_true", help="with a shard pattern: write no shard index"
    )
    add_quiet(p)


def run_create(args: argparse.Namespace) -> int:
    if (args.plan is None) == (args.from_dir is None):
        raise ArgumentError(
            "give either a PLAN file (or '-') or --from-dir DIR; see 'webds create --help'"
        )
    if args.from_dir is not None:
        entries = plan_from_dir(
            args.from_dir, skip=_local_output(args.output), follow_links=args.follow_links
        )
        where = args.from_dir
    else:
        entries = parse_plan(args.plan)
        where = "standard input" if args.plan == "-" else args.plan
    samples = group_entries(
        entries,
        sort=args.sort or args.from_dir is not None,
        error=ArgumentError if args.from_dir is None else SampleError,
    )
    if not samples:
        raise ArgumentError(f"nothing to write: {where} lists no files")
    writer = open_writer(
        args.output, maxcount=args.maxcount, maxsize=args.maxsize, index=not args.no_index
    )
    with writer:
        bar = progress(samples, "create", args.quiet, total=len(samples))
        count = write_samples(writer, (_load(group) for group in bar), "create")
    shards = getattr(writer, "shards", None)
    target = args.output if shards is None else shard_range(shards)
    say(args, f"created {target}: {count} samples, {len(entries)} files")
    return 0


# -- plans --------------------------------------------------------------------------------------


def parse_plan(plan: str) -> List[Entry]:
    """Read a plan file (or ``-``, stdin): its entries, checked, in order.

    Raises :class:`ArgumentError` naming the plan line for a malformed line, a name that is not
    ``KEY.EXT``, an unknown escape in ``text:`` or a member named twice.
    """
    label = "standard input" if plan == "-" else plan
    if plan == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            with open_url(plan, "rb") as stream:
                data = stream.read()
        except SecureModeError:
            raise
        except WebdsError as exn:
            raise OpenError(f"cannot read the plan {plan!r}: {exn.message}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exn:
        raise ArgumentError(f"the plan {label!r} is not UTF-8 text ({exn})") from None
    entries: List[Entry] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{label} line {number}"
        parts = stripped.split(None, 1)
        if len(parts) < 2:
            raise ArgumentError(
                f"{where}: expected 'ARCHIVE-NAME SOURCE', got {line.strip()!r}; SOURCE is a "
                "file, 'text:...' or 'pipe:CMD'"
            )
        name, source = parts
        if not source.startswith("text:"):
            source = source.rstrip()
        else:
            source = "text:" + _unescape(source[5:], where)
        key, ext = _split_name(name, where)
        entries.append(Entry(name, key, ext, source, where))
    return entries


def _unescape(text: str, where: str) -> str:
    out = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            nxt = text[i + 1 : i + 2]
            if nxt not in _ESCAPES:
                raise ArgumentError(
                    f"{where}: unknown escape '\\{nxt}' in text: (known: \\n \\t \\r \\0, and "
                    "\\\\ for a backslash)"
                )
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _split_name(name: str, where: str) -> Tuple[str, str]:
    key, ext = base_plus_ext(name)
    if key is None or ext is None or ext == "":
        raise ArgumentError(
            f"{where}: archive name {name!r} is not KEY.EXT; a sample's members are named "
            "like '0001.jpg', 'train/0001.cls'"
        )
    try:
        check_key(key)
    except WebdsError as exn:
        raise ArgumentError(f"{where}: archive name {name!r}: {exn.message}") from None
    if "\\" in ext or "\0" in ext:
        raise ArgumentError(f"{where}: archive name {name!r} has a backslash or NUL")
    return key, ext


# -- folders ------------------------------------------------------------------------------------


def plan_from_dir(
    directory: str, skip: Optional[str] = None, follow_links: bool = False
) -> List[Entry]:
    """The entries for every regular file under ``directory`` (recursively, not following links
    to folders), named by their path relative to it. Hidden files and folders are skipped;
    files without an extension are skipped with one warning; ``skip`` (a path) is left out.
    A link to a file outside ``directory`` is an :class:`ArgumentError` unless ``follow_links``
    (its content would be packed: a file the folder's owner may not mean to publish)."""
    check_secure(directory)  # secure mode: before anything is listed or told about the folder
    if not os.path.isdir(directory):
        raise OpenError(f"--from-dir {directory!r} is not a folder")
    entries: List[Entry] = []
    dotless: List[str] = []
    special: List[str] = []
    dir_links: List[str] = []
    skip_real = os.path.realpath(skip) if skip is not None else None
    top = os.path.realpath(directory)
    for root, dirs, files in os.walk(directory, onerror=_walk_error):
        dir_links += [
            os.path.relpath(os.path.join(root, d), directory).replace(os.sep, "/")
            for d in dirs
            if not d.startswith(".") and os.path.islink(os.path.join(root, d))
        ]
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for fname in sorted(files):
            if fname.startswith("."):
                continue
            path = os.path.join(root, fname)
            rel = os.path.relpath(path, directory).replace(os.sep, "/")
            if not os.path.isfile(path):
                special.append(rel)  # a fifo or socket: reading it could block forever
                continue
            real = os.path.realpath(path)
            if skip_real is not None and real == skip_real:
                continue
            if not follow_links and os.path.commonpath([real, top]) != top:
                raise ArgumentError(
                    f"--from-dir {directory!r}: {rel!r} is a symbolic link to {real!r}, outside "
                    "the folder; its content would go into the tar (GNU tar would store the "
                    "link instead). Pass --follow-links to pack such files, or replace the link "
                    "by a copy"
                )
            key, ext = base_plus_ext(rel)
            if key is None or ext is None or ext == "":
                dotless.append(rel)
                continue
            try:
                check_key(key)
            except WebdsError as exn:
                raise SampleError(f"file {rel!r} in {directory!r}: {exn.message}") from None
            entries.append(Entry(rel, key, ext, path, path, local=True))
    if dotless:
        warn(
            "create",
            f"skipped {len(dotless)} file(s) without an extension in {directory!r} "
            f"(first: {dotless[0]!r}); name them like KEY.EXT to include them",
        )
    if special:
        warn("create", f"skipped {len(special)} non-regular file(s) (first: {special[0]!r})")
    if dir_links:
        warn(
            "create",
            f"did not follow {len(dir_links)} symbolic link(s) to folders (first: "
            f"{dir_links[0]!r}); pack the folder itself, or copy it into {directory!r}",
        )
    return entries


def _walk_error(exn: OSError) -> None:
    raise OpenError(f"cannot list folder {exn.filename!r}: {exn.strerror}")


def _local_output(output: str) -> Optional[str]:
    """The output's local path (so --from-dir never packs its own output), if it has one."""
    if output == "-":
        return None
    return local_path(output)


# -- samples ------------------------------------------------------------------------------------


def group_entries(
    entries: List[Entry], sort: bool, error: Type[WebdsError] = ArgumentError
) -> List[List[Entry]]:
    """Entries grouped into samples by key, in first-appearance order (or sorted by key).

    Two entries of one sample with the same extension (ignoring case, as readers do) are an
    ``error`` naming both.
    """
    groups: Dict[str, List[Entry]] = {}
    seen: Dict[Tuple[str, str], Entry] = {}
    for entry in entries:
        earlier = seen.get((entry.key, entry.ext.lower()))
        if earlier is not None:
            raise error(
                f"{entry.where}: {entry.name!r} is a second {entry.ext!r} member of sample "
                f"{entry.key!r} (the first is {earlier.name!r}, {earlier.where}); readers "
                "would refuse the sample"
            )
        seen[(entry.key, entry.ext.lower())] = entry
        groups.setdefault(entry.key, []).append(entry)
    keys = sorted(groups) if sort else list(groups)
    return [groups[key] for key in keys]


def _load(group: List[Entry]) -> Dict[str, Any]:
    sample: Dict[str, Any] = {"__key__": group[0].key}
    for entry in group:
        sample[entry.ext] = _read_source(entry)
    return sample


def _read_source(entry: Entry) -> bytes:
    if entry.source.startswith("text:") and not entry.local:
        return entry.source[5:].encode("utf-8")
    try:
        if entry.local:
            check_secure(entry.source)
        stream = open(entry.source, "rb") if entry.local else open_url(entry.source, "rb")
    except SecureModeError:
        raise  # as it is: the refusal names the setting to change
    except WebdsError as exn:
        raise OpenError(f"{entry.where} ({entry.name}): {exn.message}") from None
    except OSError as exn:
        raise OpenError(
            f"{entry.where} ({entry.name}): cannot open {entry.source!r}: {exn.strerror or exn}"
        ) from None
    try:
        chunks = []
        # Read to the end (an empty read), so a pipe: command's exit status is checked.
        while True:
            chunk = stream.read(1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        stream.close()
    except WebdsError as exn:
        raise OpenError(f"{entry.where} ({entry.name}): {exn.message}") from None
    except OSError as exn:
        raise OpenError(f"{entry.where} ({entry.name}): reading {entry.source!r}: {exn}") from None
    finally:
        try:
            stream.close()
        except Exception:
            pass
    return b"".join(chunks)
