"""``webds clips``: cut long videos into clips at keyframes, without re-encoding, into shards
(:func:`webds.convert.clipshards.pack_clips`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, Sequence

from ..base.redact import redact
from ..parallel import MapShardsError
from .common import add_quiet, byte_size, positive_int, say, show_progress

__all__ = ["register"]

EXAMPLE = """example:
  webds clips videos/ -o clips/clips-%06d.tar --seconds 4 --min-seconds 1
  webds clips 'raw/train-{000..099}.tar' -o 'clips/{stem}.tar' --seconds 2 -w 8
  webds clips s3://b/raw/ -o 's3://b/clips/{stem}.tar' --skip-bad --dask tcp://sched:8786

IN is a folder of video files (any depth; .mp4 .m4v .mov .mkv .webm .avi .ogv .mpg .ts .flv
.wmv .3gp), video files, or shards whose samples hold a video field (--field, default the first
field with one of those extensions). Each video is cut at keyframes: a clip starts at a
keyframe and ends at the first keyframe at least --seconds later, so clips are whole GOPs
(--seconds or longer, by up to one GOP). Its packets are copied byte for byte into a new file
of the same format (Matroska .mkv for formats without a muxer here), timestamps starting at 0:
nothing is decoded or encoded. Audio tracks are cut with the video (each audio packet goes to
the clip holding its timestamp) unless --video-only.

A clip sample: key KEY_0000, KEY_0001, ... (KEY: the source sample's key, or the file's path
under the folder without its suffix), the clip under the video's field name, a .json (source,
member, key, clip, start, end in seconds on the source's timeline, fps, width, height, frames,
codec, audio) and the source sample's other fields (.cls, .txt, ...) unchanged.

-o is a pattern with a %-field for the shard number; with shard inputs also one output per
input shard ({stem}, {name}, {index}, or a folder ending in '/'). Video files are grouped into
output shards of about --maxsize bytes. Shards are written in parallel (--workers processes, or
--dask); each appears only when complete, and a rerun skips those already there.
A bad video (not a video, truncated, no video stream) fails its shard with an error naming it;
with --skip-bad it is left out, named on stderr and counted. Exit status: 0 done; 1 a shard
failed or a video was skipped; 2 a bad argument.
Read back: WebDataset("clips/clips-{000000..000009}.tar").to_tuple("mp4", "json")"""


def register(subparsers: Any) -> None:
    """Add the ``clips`` subcommand."""
    from . import add_command

    p = add_command(
        subparsers,
        "clips",
        help="cut long videos (a folder, or shards of videos) into clip shards at keyframes",
        description="Cut long videos into clips at keyframes without re-encoding (packets\n"
        "remuxed, audio cut with them), each with a .json, into shards, in parallel.",
        epilog=EXAMPLE,
        run=run_clips,
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="IN",
        help="a folder of video files, video files, or shards (paths, URLs, brace patterns)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATTERN",
        help="output shards: clips/clips-%%06d.tar; for shard inputs also clips/{stem}.tar or "
        "clips/",
    )
    p.add_argument(
        "--seconds",
        type=_seconds,
        default=2.0,
        metavar="S",
        help="clip length: each clip ends at the first keyframe at least S seconds after its "
        "start (default 2)",
    )
    p.add_argument(
        "--min-seconds",
        type=_seconds,
        default=0.0,
        metavar="S",
        help="drop a video's last clip when it is shorter than S seconds (default 0: keep it)",
    )
    p.add_argument("--video-only", action="store_true", help="leave the audio tracks out")
    p.add_argument(
        "--field",
        metavar="EXT",
        help="the video field of shard samples (default: found by extension)",
    )
    p.add_argument(
        "--info-field",
        default="json",
        metavar="EXT",
        help="the field holding each clip's description (default json)",
    )
    p.add_argument(
        "--maxsize",
        type=byte_size,
        default=10**9,
        help="video files: group them into output shards of about this many bytes (default 1G)",
    )
    p.add_argument(
        "-w",
        "--workers",
        type=_workers,
        default=None,
        metavar="N",
        help="shards written at once (default: one per CPU; 0: in this process)",
    )
    p.add_argument(
        "--dask",
        metavar="SCHEDULER",
        help="run on a Dask cluster (tcp://HOST:PORT, or 'local'); needs pip install 'webds[dask]'",
    )
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="leave bad videos out (named on stderr, counted; the exit status is then 1)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="write every shard again, also those already there"
    )
    add_quiet(p)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}")
    return value


def _workers(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def run_clips(args: argparse.Namespace) -> int:
    from ..convert.clipshards import pack_clips
    from .proc import _dask_executor

    with contextlib.ExitStack() as stack:
        executor: Any = None
        if args.dask is not None:
            executor = _dask_executor(args.dask, args.workers or None, stack)
        try:
            results = pack_clips(
                args.inputs,
                args.output,
                args.seconds,
                min_seconds=args.min_seconds,
                video_only=args.video_only,
                field=args.field,
                info_field=args.info_field,
                maxsize=args.maxsize,
                executor=executor,
                workers=None if executor is not None else args.workers,
                skip_bad=args.skip_bad,
                overwrite=args.overwrite,
                progress=show_progress(args.quiet),
            )
        except MapShardsError as exn:
            for r in exn.failed:
                print(
                    redact(f"webds clips: {r.input} -> {r.output} failed: {r.error}"),
                    file=sys.stderr,
                )
            _summary(args, exn.results)
            return 1
    return _summary(args, results)


def _summary(args: argparse.Namespace, results: Sequence[Any]) -> int:
    bad = [line for r in results for line in getattr(r, "bad", ())]
    for line in bad:
        print(redact(f"webds clips: skipped a bad video: {line}"), file=sys.stderr)
    written = [r for r in results if r.error is None and not r.skipped]
    parts = [f"{len(written)} shards written"]
    skipped = sum(r.skipped for r in results)
    failed = sum(r.error is not None for r in results)
    if skipped:
        parts.append(f"{skipped} skipped (already complete)")
    if failed:
        parts.append(f"{failed} failed")
    videos = sum(r.samples_in for r in written) - len(bad)
    clips = sum(r.samples_out for r in written)
    text = f"clips: {', '.join(parts)}; {videos} videos cut into {clips} clips"
    if bad:
        text += f", {len(bad)} bad videos skipped"
    say(args, text + f" -> {args.output}")
    return 1 if bad or failed else 0
