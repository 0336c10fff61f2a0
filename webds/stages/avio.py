"""The media backend: open a field's bytes with PyAV (FFmpeg), check it against the limits, and
hand out video frames (:class:`VideoTrack`; audio samples are :mod:`webds.stages.avaudio`'s).
The clip decoders (:mod:`webds.stages.video`, :mod:`webds.stages.audio`) and ``torch_video`` /
``torch_audio`` reach FFmpeg only through these two modules, so another backend (TorchCodec,
once its FFmpeg loads) is one more pair of this shape.

What opening a field does, in order, so that no bad field costs more than the limits:

- the demuxers allowed are a fixed list of file formats (:data:`DEMUXERS`): a field that is an
  HLS or concat playlist would make FFmpeg open other files or URLs, or itself again forever;
- the stream-info probe reads at most :data:`PROBE_BYTES` and one second of packets, and every
  decoder FFmpeg opens (the probe's too) gets ``max_pixels``: a 91 KB H.264 stream whose SPS
  declares 15872x15872 would otherwise allocate 1.2-1.6 GB for its first frame, whatever the
  container's header says;
- the size the decoder reports, the declared duration and the frames a request would decode are
  checked against :class:`Limits` before any frame is decoded, and again frame by frame while
  decoding (a header may lie; a stream of tiny frames may never end);
- a video's packets are read once without decoding (:class:`VideoTrack`): their timestamps give
  the exact frame times and the keyframe before each frame, so a clip is decoded from that
  keyframe up to its last frame and no further.

Every failure is a :class:`~webds.errors.DecodeError` saying what was wrong; the decode stage
adds the shard and member.
"""

from __future__ import annotations

import io
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ..errors import ArgumentError, DecodeError
from .limits import MAX_PIXELS

__all__ = [
    "DEMUXERS",
    "Limits",
    "MAX_FRAME_PIXELS",
    "MAX_SAMPLES",
    "MAX_SECONDS",
    "MAX_VIDEO_PIXELS",
    "Media",
    "VideoTrack",
    "import_av",
    "open_arguments",
    "open_media",
]

#: Default of ``max_pixels`` for video: width x height x frames decoded from one field. The
#: number of :data:`webds.stages.limits.MAX_PIXELS`: what it decodes is at most 256 MiB as RGB.
MAX_VIDEO_PIXELS = MAX_PIXELS

#: Default of ``max_frame_pixels``: the largest frame decoded (4096x4096, DCI 4K fits; 8K does
#: not). An H.264 decoder holds up to 16 reference frames of 1.5 bytes a pixel, so this keeps a
#: decoder under about 400 MB; FFmpeg refuses a larger frame before allocating it.
MAX_FRAME_PIXELS = 4096 * 4096

#: Default of ``max_seconds``: the longest stream a field may declare (one hour).
MAX_SECONDS = 3600.0

#: Default of ``max_samples``: channels x samples decoded from one audio field (2**26: 256 MiB
#: as float32, an hour of 16 kHz mono; an hour of 48 kHz stereo needs ``max_samples=None``).
MAX_SAMPLES = 1 << 26

#: The FFmpeg demuxers a field may be read with: file formats only. Playlists (hls, concat,
#: dash), image sequences and devices, which open other files or URLs, are refused.
DEMUXERS = (
    "mov,mp4,m4a,3gp,3g2,mj2 matroska,webm avi mpeg mpegts h264 hevc m4v mjpeg ogg flac mp3 "
    "wav aac asf ivf flv obu sox"
).split()

#: Demuxers whose packets' pts are not each their frame's through a seek: their videos are decoded
#: from the start, frames numbered in the order the decoder gives them.
_SEQUENTIAL_FORMATS = frozenset(("mpeg", "mpegts", "asf", "h264", "hevc", "m4v", "mjpeg"))

#: How many bytes the stream-info probe may read (FFmpeg's default is 5 MB).
PROBE_BYTES = 1 << 20
_PROBE_MICROSECONDS = 1_000_000
# How far short of its declared duration a stream may end (container durations include every
# stream's padding: an AAC track outlasts its video by a frame or two).
_TRUNCATED_SECONDS = 0.1


class Limits(NamedTuple):
    """The bounds a field is decoded under (None: no bound); see the ``MAX_*`` defaults."""

    max_pixels: Optional[int] = MAX_VIDEO_PIXELS
    max_frame_pixels: Optional[int] = MAX_FRAME_PIXELS
    max_seconds: Optional[float] = MAX_SECONDS
    max_samples: Optional[int] = MAX_SAMPLES

    @classmethod
    def checked(
        cls,
        max_pixels: Optional[int] = MAX_VIDEO_PIXELS,
        max_frame_pixels: Optional[int] = MAX_FRAME_PIXELS,
        max_seconds: Optional[float] = MAX_SECONDS,
        max_samples: Optional[int] = MAX_SAMPLES,
    ) -> "Limits":
        """The limits, each a positive number or None; otherwise an ArgumentError."""
        values = (max_pixels, max_frame_pixels, max_seconds, max_samples)
        for name, value in zip(cls._fields, values):
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ArgumentError(f"{name} must be a positive number or None, got {value!r}")
        return cls(*values)


_av: Any = None


def import_av() -> Any:
    """The ``av`` module (PyAV), or a DecodeError saying how to install it."""
    global _av
    if _av is None:
        try:
            import av
        except ImportError as exn:
            raise DecodeError(
                f"decoding video and audio needs PyAV ({exn}): pip install 'webds[av]'"
            ) from None
        _av = av
    return _av


def _over(what: str, value: float, name: str, limit: Any) -> DecodeError:
    return DecodeError(
        f"{what} ({value:,.0f}) is over {name}={limit:,}; refused before decoding. If such "
        f"media are genuine, raise the limit: VideoClipDecoder(..., {name}=N) or "
        f"AudioClipDecoder (None: no limit); for torch_video / torch_audio, a handler calling "
        f"webds.stages.video.read_video(data, Limits({name}=N)) or audio.load_audio"
    )


def _failed(exn: BaseException, doing: str) -> DecodeError:
    if isinstance(exn, DecodeError):
        return exn
    return DecodeError(f"{doing} failed: {type(exn).__name__}: {exn}")


class Media:
    """One field's bytes opened by FFmpeg (through PyAV), with :class:`Limits`; close it (or use
    it as a context manager) when done. Made by :func:`open_media`."""

    def __init__(self, data: bytes, limits: Optional[Limits] = None) -> None:
        av = import_av()
        if not data:
            raise DecodeError("the field is empty (0 bytes): no media to decode")
        self.limits = limits = limits or Limits()
        try:
            self.container = av.open(io.BytesIO(data), **open_arguments(limits.max_frame_pixels))
        except Exception as exn:
            raise _failed(exn, "opening the media (is it a complete video or audio file?)") from exn
        self.data = data  # (held by the container's reader anyway)
        # Nothing read since opening: the demuxer stands at the stream's first packet, as no
        # seek can put it back (a seek to 0 skips Matroska's priming packet), decoders unused.
        self.pristine = True
        self._check_duration()

    def _check_duration(self) -> None:
        limit = self.limits.max_seconds
        duration = self.container.duration  # microseconds, or None
        if limit is not None and duration is not None and duration / 1e6 > limit:
            self.close()
            raise _over("its declared duration in seconds", duration / 1e6, "max_seconds", limit)

    def video(self) -> "VideoTrack":
        """The first video stream, indexed; a DecodeError if there is none."""
        streams = self.container.streams.video
        if not streams:
            kinds = ", ".join(s.type for s in self.container.streams) or "none"
            raise DecodeError(f"the media has no video stream (its streams: {kinds})")
        self.pristine = False
        return VideoTrack(self, streams[0])

    def close(self) -> None:
        self.container.close()

    def __enter__(self) -> "Media":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_arguments(max_frame_pixels: Optional[int] = MAX_FRAME_PIXELS) -> Dict[str, Any]:
    """The keyword arguments of ``av.open`` that bound what opening reads and decodes: the
    probe's bytes and time, the demuxers allowed (:data:`DEMUXERS`), and ``max_frame_pixels``
    for every decoder FFmpeg opens, the stream-info probe's included (which may decode a frame
    to learn its size)."""
    options = {"probesize": str(PROBE_BYTES), "analyzeduration": str(_PROBE_MICROSECONDS)}
    if max_frame_pixels is not None:
        options["max_pixels"] = str(max_frame_pixels)
    return {"options": options, "container_options": {"format_whitelist": ",".join(DEMUXERS)}}


def open_media(data: bytes, limits: Optional[Limits] = None) -> Media:
    """Open a field's bytes; ``with open_media(data) as m: track = m.video()``."""
    return Media(data, limits)


def _check_whole(media: Media, end: float, what: str) -> None:
    """A DecodeError if the field's {what} stop before the end its header declares (by more
    than two frames' worth): a truncated field decodes quietly to its cut otherwise."""
    container = media.container
    if container.duration is None:
        return
    start = (container.start_time or 0) / 1e6
    declared = start + container.duration / 1e6
    if "matroska" in container.format.name:
        declared = max(container.duration / 1e6, start)  # its Duration counts from 0
    if end < declared - _TRUNCATED_SECONDS:
        raise DecodeError(
            f"the field is truncated: its header declares {declared:.3f} s, its {what} end "
            f"at {end:.3f} s"
        )


def _decoder(stream: Any, limits: Limits) -> Any:
    ctx = stream.codec_context
    if ctx is None:
        raise DecodeError(f"this FFmpeg build has no decoder for the field's {stream.type} codec")
    if limits.max_frame_pixels is not None:
        ctx.options = {"max_pixels": str(limits.max_frame_pixels)}
    # One thread: a loader's workers already use the cores, and frame threads multiply the
    # frames a decoder holds (its memory) by their number.
    ctx.thread_count = 1
    return ctx


class VideoTrack:
    """A video stream with its packets indexed (read once, not decoded).

    ``pts``: every frame's presentation timestamp in ``time_base`` units, ascending;
    ``fps``; ``width`` x ``height`` (as the decoder reports them, checked against
    ``max_frame_pixels``); ``decoded``: the frames decoded so far (what a clip cost).
    """

    def __init__(self, media: Media, stream: Any) -> None:
        self.media, self.stream, self.limits = media, stream, media.limits
        self.ctx = _decoder(stream, self.limits)
        self.width, self.height = int(self.ctx.width), int(self.ctx.height)
        if self.width <= 0 or self.height <= 0:
            raise DecodeError("the video stream declares no frame size (a damaged header?)")
        self._check_frame(self.width, self.height)
        self.time_base = stream.time_base
        self.decoded = 0
        self._index()

    def _check_frame(self, width: int, height: int) -> None:
        limit = self.limits.max_frame_pixels
        if limit is not None and width * height > limit:
            raise _over(
                f"a {width}x{height} frame's pixels", width * height, "max_frame_pixels", limit
            )

    def _index(self) -> None:
        """Read the packets (no decoding): frame times, and the keyframe each frame needs."""
        order: List[int] = []  # pts in decode order
        keys: List[int] = []  # index into order of the keyframe before each packet
        key = -1
        # A raw elementary stream (.h264) has no timestamps, and in MPEG program and transport
        # streams and ASF a packet's pts need not be its frame's after a seek (MPEG-1/2 video
        # came out a frame early, or twice): their frames are numbered in the order they come
        # out of the decoder and decoded from the start, which is what a sequential decode does.
        self.untimed = self.media.container.format.name in _SEQUENTIAL_FORMATS
        seen = set()
        try:
            for packet in self.media.container.demux(self.stream):
                if packet.size == 0:
                    continue  # the demuxer's flush packet
                if packet.pts is None or packet.pts in seen:
                    self.untimed = True
                seen.add(packet.pts)
                if packet.is_keyframe and not self.untimed:
                    key = len(order)
                order.append(len(order) if self.untimed else packet.pts)
                keys.append(max(key, 0))
        except Exception as exn:
            raise _failed(
                exn, "reading the video's packets (a truncated or damaged field?)"
            ) from exn
        if not order:
            raise DecodeError("the video stream holds no frames (an empty or truncated field?)")
        declared = self.stream.frames
        if declared and len(order) < declared:
            raise DecodeError(
                f"the video is truncated: its header declares {declared} frames, the field "
                f"holds {len(order)}"
            )
        self.offset = 0.0
        if self.untimed:
            rate = self.stream.average_rate or self.stream.guessed_rate or 25
            self.time_base = 1 / rate
            order, keys = list(range(len(order))), [0] * len(order)
            self.offset = (self.media.container.start_time or 0) / 1e6
        self.order, self.keys = order, keys
        self.pts = sorted(order)
        self._ordinal = {p: i for i, p in enumerate(order)}  # decode position of each pts
        rate = self.stream.average_rate or self.stream.guessed_rate
        if rate:
            self.fps = float(rate)
        elif len(self.pts) > 1:
            self.fps = (len(self.pts) - 1) / float((self.pts[-1] - self.pts[0]) * self.time_base)
        else:
            self.fps = 1.0
        _check_whole(self.media, self.seconds(self.pts[-1]) + 1.0 / self.fps, "video frames")
        limit = self.limits.max_seconds
        if limit is not None and self.seconds(self.pts[-1] - self.pts[0]) > limit:
            raise _over("its duration in seconds", self.seconds(self.pts[-1]), "max_seconds", limit)

    def seconds(self, pts: int) -> float:
        return self.offset + float(pts * self.time_base)

    def __len__(self) -> int:
        return len(self.pts)

    def runs(self, targets: Sequence[int]) -> List[Tuple[int, int]]:
        """The decode-order spans ``(first, last)`` that give the ``targets`` (pts, ascending):
        each from the keyframe its first frame needs; one span where the next would start at
        or before where this one ends (decoding on is no dearer than seeking)."""
        spans: List[Tuple[int, int]] = []
        for p in targets:
            at = self._ordinal[p]
            first = self.keys[at]
            if spans and first <= spans[-1][1] + 1:
                spans[-1] = (spans[-1][0], max(spans[-1][1], at))
            else:
                spans.append((first, at))
        return spans

    def check_budget(self, targets: Sequence[int]) -> None:
        """Refuse, before decoding, a request whose frames to decode would pass ``max_pixels``."""
        limit = self.limits.max_pixels
        if limit is None:
            return
        delay = int(self.ctx.has_b_frames or 0)  # frames the decoder holds back for reordering
        frames = sum(last - first + 1 + delay for first, last in self.runs(targets))
        if frames * self.width * self.height > limit:
            raise _over(
                f"{frames} frames of {self.width}x{self.height} to decode, in pixels",
                frames * self.width * self.height,
                "max_pixels",
                limit,
            )

    def frames(self, targets: Sequence[int]) -> Iterator[Tuple[int, Any]]:
        """``(pts, av.VideoFrame)`` for each of ``targets`` (pts of this track, ascending,
        unique), decoding from the keyframe before each run of them up to its last frame."""
        self.check_budget(targets)
        wanted = set(targets)
        spans = self.runs(targets)
        ends = [self.order[last] for _, last in spans]
        done = 0
        for (first, _), end in zip(spans, ends):
            # Each frame is handed on as it is decoded: a list of them held 290 KB a frame
            # (FFmpeg's buffers) whatever its size, gigabytes for a long video of tiny frames.
            for pts, frame in self._decode_span(self.order[first], end, wanted):
                done += 1
                yield pts, frame
        if done != len(wanted):
            raise DecodeError(
                f"the video's frames did not decode as indexed ({done} of {len(wanted)} found): "
                "a damaged stream?"
            )

    def _decoded(self, wanted: set) -> Iterator[Any]:
        """The stream's frames from where it was sought, decoding a packet whose frame is not
        wanted only if later frames refer to it: FFmpeg skips a non-reference frame
        (``skip_frame="NONREF"``: B-frames that no frame predicts from) before decoding it,
        so the frames wanted come out the same, pixel for pixel, for less work. A packet's
        pts is its frame's; an untimed stream (raw H.264) decodes every packet."""
        ctx = self.ctx
        try:
            for packet in self.media.container.demux(self.stream):
                skip = not self.untimed and packet.pts is not None and packet.pts not in wanted
                ctx.skip_frame = "NONREF" if skip else "DEFAULT"
                yield from ctx.decode(packet)
        finally:
            ctx.skip_frame = "DEFAULT"
            ctx.flush_buffers()  # the next run starts clean from its own keyframe

    def _decode_span(self, start: int, end: int, wanted: set) -> Iterator[Tuple[int, Any]]:
        """Seek to the keyframe at ``start`` and decode until the frames up to ``end`` are out."""
        container, limit = self.media.container, self.limits.max_pixels
        last_needed = max(p for p in wanted if self._ordinal[p] <= self._ordinal[end])
        try:
            if self.untimed:
                container.seek(0)
            else:
                container.seek(start, stream=self.stream, backward=True, any_frame=False)
            for number, frame in enumerate(self._decoded(wanted)):
                self.decoded += 1
                if self.untimed:
                    frame.pts = number
                self._check_frame(frame.width, frame.height)
                if limit is not None and self.decoded * frame.width * frame.height > limit:
                    raise _over(
                        "the pixels decoded",
                        self.decoded * frame.width * frame.height,
                        "max_pixels",
                        limit,
                    )
                if frame.pts in wanted:
                    yield frame.pts, frame
                if frame.pts is not None and frame.pts >= last_needed:
                    break
        except DecodeError:
            raise
        except Exception as exn:
            raise _failed(exn, "decoding the video (a truncated or damaged field?)") from exn
