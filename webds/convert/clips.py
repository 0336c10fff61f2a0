"""Cutting long videos into clips at keyframes, without re-encoding: :func:`split_video` (one
video's bytes or file into clips) and :func:`clip_samples` (a stage: samples holding a video field
into clip samples). :func:`pack_clips` (:mod:`webds.convert.clipshards`) writes them to shards.

A clip is a run of whole GOPs: it starts at a keyframe and ends where the next clip's keyframe
starts, the first keyframe at or after ``seconds`` from its own start. Its packets are the
source's packets, byte for byte, remuxed into a new container with timestamps shifted to start at
0 (PyAV, FFmpeg's muxers); no frame is decoded. Audio packets go to the clip whose time range
holds their timestamp (a packet is never cut), so a clip's audio starts and ends within one
audio frame of its video. Needs PyAV (``pip install av``), imported on first use.

    for clip in webds.split_video(open("talk.mp4", "rb").read(), seconds=4):
        print(clip.index, clip.start, clip.end, len(clip.data))
"""

from __future__ import annotations

import bisect
import io
import json
import logging
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from ..errors import ArgumentError, DecodeError, WebdsError
from ..io.urls import check_secure
from ..stages.avio import open_arguments

__all__ = ["VIDEO_EXTENSIONS", "VideoClip", "split_video", "clip_samples", "video_field"]

#: Field extensions (and file suffixes) read as videos, and the muxer each clip is written with;
#: other formats' clips go into Matroska (``mkv``), which holds any codec.
VIDEO_EXTENSIONS: Dict[str, str] = {
    "mp4": "mp4",
    "m4v": "mp4",
    "mov": "mov",
    "mkv": "matroska",
    "webm": "webm",
    "avi": "avi",
    "ogv": "ogg",
    "mpg": "matroska",
    "mpeg": "matroska",
    "ts": "matroska",
    "flv": "matroska",
    "wmv": "matroska",
    "3gp": "mp4",
}

log = logging.getLogger("webds")

Source = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]"]
Sample = Dict[str, Any]

# A declared duration this much longer than the packets found means the file was cut short
# (Matroska and WebM demuxers stop quietly at the cut instead of failing).
_TRUNCATION_SLACK = Fraction(1, 2)


@dataclass(frozen=True)
class VideoClip:
    """One clip of :func:`split_video`: ``data`` (a whole file in the container ``ext``) and
    ``info``, its description (also stored as the clip sample's ``.json``): ``clip`` (index),
    ``start``/``end`` (seconds on the source's timeline, end exclusive), ``fps``, ``width``,
    ``height``, ``frames``, ``codec``, ``audio`` (codec names of the audio tracks kept)."""

    index: int
    data: bytes
    ext: str
    info: Dict[str, Any]

    @property
    def start(self) -> float:
        return float(self.info["start"])

    @property
    def end(self) -> float:
        return float(self.info["end"])


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise ArgumentError(
            "cutting videos into clips needs PyAV (FFmpeg inside a wheel): pip install av"
        ) from None
    return av


def _check_seconds(seconds: float, min_seconds: float) -> Tuple[Fraction, Fraction]:
    """Exact lengths: ``Fraction("0.1")`` is a tenth, where ``Fraction(0.1)`` is a float's."""
    for name, value in (("seconds", seconds), ("min_seconds", min_seconds)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ArgumentError(f"{name} must be a number of seconds, got {value!r}")
    if not seconds > 0:
        raise ArgumentError(f"seconds (the clip length) must be > 0, got {seconds!r}")
    if min_seconds < 0:
        raise ArgumentError(f"min_seconds must be >= 0, got {min_seconds!r}")
    return Fraction(str(seconds)), Fraction(str(min_seconds))


# Splitting decodes no frame, but opening may (FFmpeg's stream-info probe decodes one to learn
# its size where the header does not say): bounded so that a stream declaring 15872x15872 is
# refused, while 8K sources (7680x4320) still split.
_PROBE_FRAME_PIXELS = 8192 * 8192


def _open(av: Any, source: Source, where: Dict[str, Any]) -> Any:
    """The demuxer of a path or of bytes (read in memory, no temporary file)."""
    if isinstance(source, (str, os.PathLike)):
        check_secure(source)  # a local file, refused in secure mode
    target = source if isinstance(source, (str, os.PathLike)) else io.BytesIO(bytes(source))
    try:
        return av.open(target, "r", **open_arguments(_PROBE_FRAME_PIXELS))
    except (av.FFmpegError, OSError) as exn:
        raise _bad(
            f"FFmpeg can't read it as a video ({_reason(exn)}): it is truncated, damaged or "
            "not a video file",
            where,
        ) from None


def _reason(exn: BaseException) -> str:
    text = getattr(exn, "strerror", None) or str(exn)
    return " ".join(str(text).split())


def _bad(message: str, where: Dict[str, Any]) -> DecodeError:
    """A :class:`DecodeError` naming the shard and member, or the file in the message."""
    if where.get("url") is None and where.get("name"):
        message = f"{where['name']}: {message}"
    return DecodeError(message, url=where.get("url"), member=where.get("member"))


def _time(packet: Any) -> Optional[int]:
    return packet.pts if packet.pts is not None else packet.dts


@dataclass
class _Survey:
    """What the first pass over the packets found (no packet data is kept)."""

    keyframes: List[int]  # video pts of the keyframes, in stream order
    video_end: int  # video pts just after the last frame
    streams_end: Fraction  # seconds, the end of the last packet of any stream


def _survey(container: Any, video: Any, where: Dict[str, Any]) -> _Survey:
    keyframes: List[int] = []
    video_end: Optional[int] = None
    streams_end = Fraction(-(10**9))
    try:
        for packet in container.demux():
            t = _time(packet)
            if t is None or packet.size == 0:
                continue  # the demuxer's flush packets
            end = t + (packet.duration or 0)
            streams_end = max(streams_end, end * packet.time_base)
            if packet.stream.index != video.index:
                continue
            if packet.is_keyframe:
                keyframes.append(t)
            video_end = end if video_end is None else max(video_end, end)
    except (_av().FFmpegError, OSError) as exn:
        raise _bad(
            f"reading its packets failed ({_reason(exn)}); the file is damaged", where
        ) from None
    if not keyframes or video_end is None:
        raise _bad("its video stream has no keyframe (no clip can start)", where)
    if container.duration is not None:
        declared = Fraction(container.duration, 1_000_000)
        start = Fraction(container.start_time or 0, 1_000_000)
        if streams_end - start < declared - _TRUNCATION_SLACK:
            raise _bad(
                f"it is truncated: its header says {float(declared):.3f} s but its packets end "
                f"at {float(streams_end - start):.3f} s",
                where,
            )
    return _Survey(keyframes, video_end, streams_end)


def _cuts(
    survey: _Survey, time_base: Fraction, seconds: Fraction, min_seconds: Fraction
) -> List[int]:
    """Clip boundaries in video pts: clip i runs from ``bounds[i]`` to ``bounds[i + 1]``.

    A clip starts at the first keyframe; the next starts at the first keyframe at least
    ``seconds`` after it. A last clip shorter than ``min_seconds`` is dropped.
    """
    starts = [survey.keyframes[0]]
    for k in sorted(set(survey.keyframes)):
        if (k - starts[-1]) * time_base >= seconds:
            starts.append(k)
    bounds = starts + [max(survey.video_end, starts[-1] + 1)]
    if (bounds[-1] - bounds[-2]) * time_base < min_seconds:
        bounds.pop()  # the tail's start is now the end of the clip before it (or of nothing)
    return bounds


class _ClipWriter:
    """One clip's muxer, writing to memory; timestamps shifted so the clip starts at 0."""

    def __init__(self, av: Any, muxer: str, streams: List[Any], start: Fraction) -> None:
        self.buffer = io.BytesIO()
        # bitexact: no library version in the file, so the same packets give the same bytes.
        self.out = av.open(self.buffer, "w", format=muxer, options={"fflags": "+bitexact"})
        self.streams = {s.index: self.out.add_stream_from_template(s) for s in streams}
        self.offsets = {s.index: int(start / s.time_base) for s in streams}
        self.frames = 0

    def mux(self, packet: Any) -> None:
        index = packet.stream.index
        offset = self.offsets[index]
        if packet.pts is not None:
            packet.pts -= offset
        if packet.dts is not None:
            packet.dts -= offset
        packet.stream = self.streams[index]
        self.out.mux(packet)

    def close(self) -> bytes:
        self.out.close()
        return self.buffer.getvalue()


def _stream_info(video: Any, audio: List[Any]) -> Dict[str, Any]:
    rate = video.average_rate or video.guessed_rate or video.base_rate
    ctx = video.codec_context
    return {
        "fps": float(rate) if rate else None,
        "width": ctx.width,
        "height": ctx.height,
        "codec": ctx.name,
        "audio": [a.codec_context.name for a in audio],
    }


def _remux(
    av: Any,
    container: Any,
    bounds: List[int],
    muxer: str,
    video_only: bool,
    where: Dict[str, Any],
) -> Iterator[Tuple[int, bytes, Dict[str, Any]]]:
    """The second pass: each packet to its clip's muxer; (index, bytes, info) per clip, in order."""
    video = container.streams.video[0]
    audio = [] if video_only else list(container.streams.audio)
    kept = [video] + audio
    tb = video.time_base
    times = [b * tb for b in bounds]
    nclips = len(bounds) - 1
    clip_at = {b: i for i, b in enumerate(bounds)}  # a keyframe at the last bound: past the end
    base = _stream_info(video, audio)
    writers: Dict[int, _ClipWriter] = {}
    reached = {s.index: -1 for s in kept}  # the last clip each stream's packets went to
    current, emitted, late = -1, 0, 0

    def finish(i: int) -> Tuple[int, bytes, Dict[str, Any]]:
        writer = writers.pop(i)
        info = {"clip": i, "start": float(times[i]), "end": float(times[i + 1]), **base}
        info["frames"] = writer.frames
        return i, writer.close(), info

    try:
        for packet in container.demux(kept):
            t = _time(packet)
            if t is None or packet.size == 0:
                continue
            if packet.stream.index == video.index:
                if packet.is_keyframe and t in clip_at:
                    current = clip_at[t]
                i = current  # by decode order: a clip holds its keyframe's whole GOP
            else:
                i = bisect.bisect_right(times, t * packet.time_base) - 1
                i = max(i, 0)  # audio before the first keyframe (an encoder's priming)
            reached[packet.stream.index] = max(reached[packet.stream.index], i)
            late += 0 <= i < emitted
            if emitted <= i < nclips:
                if i not in writers:
                    writers[i] = _ClipWriter(av, muxer, kept, times[i])
                writers[i].frames += packet.stream.index == video.index
                writers[i].mux(packet)
            # A clip is complete once every stream has moved past it; a stream that lags (or
            # has ended) holds back no more than one clip, so memory stays at about two clips.
            done = max(min(reached.values()), reached[video.index] - 1)
            while emitted < min(done, nclips):
                yield finish(emitted)
                emitted += 1
    except (av.FFmpegError, OSError) as exn:
        raise _bad(f"reading or remuxing its packets failed ({_reason(exn)})", where) from None
    if late:
        log.warning(
            "webds: %s: %d packets came more than a clip after their time in the file and were "
            "left out of their clip",
            where.get("member") or where.get("name"),
            late,
        )
    while emitted < nclips:
        if emitted in writers:
            yield finish(emitted)
        emitted += 1


def split_video(
    video: Source,
    seconds: float = 2.0,
    *,
    min_seconds: float = 0.0,
    video_only: bool = False,
    ext: Optional[str] = None,
    url: Optional[str] = None,
    member: Optional[str] = None,
) -> Iterator[VideoClip]:
    """Cut a video (its bytes, or a file path) into clips at keyframes, without re-encoding.

    Each clip starts at a keyframe and runs to the first keyframe at least ``seconds`` later
    (clips are whole GOPs, so they run ``seconds`` or more, up to one GOP more); a last clip
    shorter than ``min_seconds`` is dropped. The clip holds the source's first video stream
    and, unless ``video_only``, its audio streams, remuxed; other streams are left out. ``ext``
    (default: the path's suffix, else ``mp4``) picks the clips' container (see
    :data:`VIDEO_EXTENSIONS`). ``url``/``member`` name the source in errors: a file that is not
    a video, is truncated or damaged, or has no video stream raises
    :class:`~webds.errors.DecodeError`::

        clips = list(webds.split_video(Path("talk.mp4"), seconds=4, min_seconds=1))
    """
    seconds_, min_seconds_ = _check_seconds(seconds, min_seconds)
    av = _av()
    path = os.fspath(video) if isinstance(video, (str, os.PathLike)) else None
    if ext is None:
        ext = os.path.splitext(path)[1][1:].lower() if path else "mp4"
    muxer = VIDEO_EXTENSIONS.get(ext.lower(), "matroska")
    out_ext = "mkv" if muxer == "matroska" else ext
    where = {"url": url, "member": member, "name": path or member or "the video"}
    with _open(av, video, where) as container:
        if not container.streams.video:
            found = ", ".join(s.type for s in container.streams) or "no streams"
            raise _bad(f"it has no video stream (found: {found})", where)
        stream = container.streams.video[0]
        survey = _survey(container, stream, where)
        time_base = stream.time_base
    if time_base is None:
        raise _bad("its video stream has no time base", where)
    bounds = _cuts(survey, time_base, seconds_, min_seconds_)
    if len(bounds) < 2:
        return
    with _open(av, video, where) as container:
        for index, data, info in _remux(av, container, bounds, muxer, video_only, where):
            yield VideoClip(index, data, out_ext, info)


def video_field(sample: Sample, field: Optional[str] = None) -> str:
    """The name of ``sample``'s video field: ``field`` if given, else the first field whose last
    extension is in :data:`VIDEO_EXTENSIONS` (``mp4``, ``video.webm``, ...)."""
    where = {"url": sample.get("__url__"), "key": sample.get("__key__")}
    if field is not None:
        if field not in sample:
            raise DecodeError(f"the sample has no {field!r} field (its video)", **where)
        return field
    for name in sample:
        if not name.startswith("__") and name.lower().rsplit(".", 1)[-1] in VIDEO_EXTENSIONS:
            return name
    fields = " ".join(n for n in sample if not n.startswith("__")) or "none"
    raise DecodeError(
        f"the sample has no video field (fields: {fields}; looked for the extensions "
        f"{' '.join(VIDEO_EXTENSIONS)}); name it with field=",
        **where,
    )


def clip_samples(
    samples: Iterable[Sample],
    seconds: float = 2.0,
    *,
    min_seconds: float = 0.0,
    video_only: bool = False,
    field: Optional[str] = None,
    info_field: str = "json",
    handler: Optional[Callable[[BaseException], bool]] = None,
) -> Iterator[Sample]:
    """Replace each raw sample holding a video by its clips (:func:`split_video`).

    A clip sample has the key ``f"{key}_{clip:04d}"``, the clip under the video's field name
    (``mkv`` for formats whose clips go to Matroska), its description as ``info_field`` (JSON:
    ``source``, ``member``, ``key``, ``clip``, ``start``, ``end``, ``fps``, ``width``,
    ``height``, ``frames``, ``codec``, ``audio``), and the source sample's other fields
    (``cls``, ``txt``, ...) unchanged. A bad video raises its
    :class:`~webds.errors.DecodeError` unless ``handler(exn)`` returns True (skip it)::

        webds.map_shards(functools.partial(webds.clip_samples, seconds=4), "raw/", "clips/",
                         level="shard")
    """
    for sample in samples:
        try:
            yield from _clips_of(sample, seconds, min_seconds, video_only, field, info_field)
        except WebdsError as exn:
            if handler is not None and handler(exn):
                continue
            raise


def _clips_of(
    sample: Sample,
    seconds: float,
    min_seconds: float,
    video_only: bool,
    field: Optional[str],
    info_field: str,
) -> Iterator[Sample]:
    key = sample["__key__"]
    name = video_field(sample, field)
    if info_field in sample:
        raise ArgumentError(
            f"sample {key!r} already has a {info_field!r} field; name the clips' description "
            "field otherwise (info_field=, webds clips --info-field)"
        )
    url = sample.get("__url__")
    member = f"{key}.{name}" if url is not None else None  # a video file is named by its path
    ext = name.lower().rsplit(".", 1)[-1]
    others = {k: v for k, v in sample.items() if not k.startswith("__") and k != name}
    source = url if url is not None else sample.get("__local_path__")
    for clip in split_video(
        sample[name],
        seconds,
        min_seconds=min_seconds,
        video_only=video_only,
        ext=ext,
        url=url,
        member=member,
    ):
        out_name = name if clip.ext == ext else name[: len(name) - len(ext)] + clip.ext
        info = {"source": source, "member": member, "key": key, **clip.info}
        yield {
            "__key__": f"{key}_{clip.index:04d}",
            **others,
            out_name: clip.data,
            info_field: json.dumps(info).encode("utf-8"),
        }
