"""Audio on the media backend of :mod:`webds.stages.avio`: :class:`AudioTrack` (any stretch of
an audio stream as float32, from the packets before it), the end checks for the formats whose
duration FFmpeg cannot check (WAV, Sox, Ogg), and :func:`resample`.

A stretch is decoded from a **pre-roll** before it, whose output is dropped, so that it equals
the whole decode at the same stream time: a decoder's output after a seek depends on the packets
before it. How much, per codec (measured on FFmpeg 8's decoders):

- PCM, FLAC, ALAC, WavPack: none (each packet stands alone);
- MP3: the bit reservoir (a frame's data may begin up to 511 bytes back, 255 at 16-24 kHz) and
  the filterbank's overlap: packets back until they hold the reservoir, and two more (at least
  four). Bit-exact after that; a frame fewer was wrong by up to 0.57 on a 0.5 tone;
- AAC: two frames (the window overlap). Bit-exact, except in bands coded as noise (PNS: the
  decoder's noise generator is not reset by a seek: up to 0.005 on a 44.1 kHz stereo tone);
- Opus: 250 ms (RFC 7845 asks for at least 80 ms; the decoder converges gradually: 80 ms left
  0.08-0.1 on a 0.5 tone, 250 ms 5e-4, 300 ms 6e-5); the stream's pre-skip is applied by FFmpeg
  after each seek, to the pre-roll;
- anything else: three frames and at least 100 ms.

Where a stretch begins within the pre-roll of the stream's start, it is decoded from the first
packet; it then equals the whole decode only from a decoder that has decoded nothing else (a
seek does not reset all of a decoder's state: AAC's window shape), which is why the clip
decoders decode their clips in time order, in runs.
"""

from __future__ import annotations

import math
import struct
from collections import deque
from typing import Any, Deque, Iterator, List, Optional, Tuple

from ..errors import DecodeError
from .avio import Media, _check_whole, _decoder, _failed, _over, import_av, open_media

__all__ = ["AudioTrack", "audio_track", "check_end", "resample"]

# Decoders whose packets decode alone: no pre-roll.
_LOSSLESS = frozenset("flac alac wavpack tta ape truehd mlp sox".split())
_MP3 = frozenset(("mp3", "mp3float", "mp3fixed"))
_AAC = frozenset(("aac", "aac_fixed", "aac_latm", "libfdk_aac"))
_OPUS = frozenset(("opus", "libopus"))
_OPUS_PREROLL = 0.25
# MP3: bytes of a packet that are header and side information, not reservoir (at most).
_MP3_SIDE_BYTES = 38


def audio_track(media: Media, required: bool = True) -> Optional["AudioTrack"]:
    """The first audio stream of ``media`` (None, or a DecodeError if ``required``, when there
    is none)."""
    streams = media.container.streams.audio
    if not streams:
        if not required:
            return None
        kinds = ", ".join(s.type for s in media.container.streams) or "none"
        raise DecodeError(f"the media has no audio stream (its streams: {kinds})")
    return AudioTrack(media, streams[0])


class _Preroll:
    """How many packets before a stretch to decode and drop: at least ``packets`` of them,
    covering ``seconds`` and holding ``reservoir`` bytes, then ``extra`` more."""

    def __init__(self, name: str, rate: int, frame_size: int) -> None:
        frame = (frame_size or 1024) / rate
        self.packets, self.seconds, self.reservoir, self.extra = 3, 0.1, 0, 0
        if name in _LOSSLESS or name.startswith("pcm_"):
            self.packets, self.seconds = 0, 0.0
        elif name in _MP3:
            self.packets, self.seconds, self.extra = 4, 0.0, 2
            self.reservoir = 511 if rate >= 32000 else 255
        elif name in _AAC:
            self.packets, self.seconds = 2, 0.0
        elif name in _OPUS:
            self.packets, self.seconds = 1, _OPUS_PREROLL
        # How far back to seek: what the rules above ask for (an MP3 reservoir: at most half a
        # second of packets, at 8 kbps).
        self.back = max(self.seconds + frame, (self.packets + self.extra + 1) * frame)
        if self.reservoir:
            self.back += 0.5

    def start(self, pending: Deque[Tuple[Any, float]], lo: float) -> int:
        """The index in ``pending`` (packets before ``lo``, with their start times) to decode
        from."""
        i = len(pending)
        count = held = 0
        while i > 0:
            covered = self.seconds == 0 or (count and pending[i][1] <= lo - self.seconds + 1e-9)
            if count >= self.packets and held >= self.reservoir and covered:
                break
            i -= 1
            count += 1
            held += max(pending[i][0].size - _MP3_SIDE_BYTES, 0)
        # MP3: the frames before the first one kept must decode right too (its overlap).
        i = max(i - self.extra, 0)
        return i


class AudioTrack:
    """An audio stream: ``rate`` (samples a second), ``channels``, ``seconds`` (its declared
    duration, or None), and :meth:`samples` of any stretch as float32. Opening it checks that a
    WAV, Sox or Ogg field holds all its header declares (:func:`check_end`)."""

    def __init__(self, media: Media, stream: Any) -> None:
        self.media, self.stream, self.limits = media, stream, media.limits
        check_end(media.data, media.container.format.name)
        self.ctx = _decoder(stream, self.limits)
        self.rate = int(self.ctx.sample_rate or stream.rate or 0)
        if self.rate <= 0:
            raise DecodeError("the audio stream declares no sample rate (a damaged header?)")
        self.channels = int(self.ctx.channels or 1)
        duration = None
        if stream.duration is not None:
            duration = float(stream.duration * stream.time_base)
        elif media.container.duration is not None:
            duration = media.container.duration / 1e6
        self.seconds = duration
        frame_size = int(self.ctx.frame_size or 0)
        self._frame = frame_size / self.rate  # a packet's seconds where it does not say (0: ?)
        self.preroll = _Preroll(self.ctx.name, self.rate, frame_size)
        first = stream.start_time
        self.first = float(first * stream.time_base) if first is not None else 0.0
        # Matroska's timestamps are in milliseconds, coarser than a sample: a frame's place is
        # then snapped to its codec's grid (frames of one size, the first short by the delay).
        self._tick = float(stream.time_base) * self.rate  # samples a timestamp unit
        self._delay = int(getattr(self.ctx, "delay", 0) or 0)

    def check_whole(self) -> None:
        """A DecodeError if the stream's packets stop before the end its header declares, read
        from its last second of packets without decoding. A clip decoder checks this first: a
        clip drawn from the intact part of a truncated field would decode, and the same field
        fail in another epoch's draw."""
        container, stream = self.media.container, self.stream
        if container.duration is None:
            return
        self.media.pristine = False
        declared = ((container.start_time or 0) + container.duration) / 1e6
        end: Optional[float] = None
        try:
            target = max(int((declared - 1.0) / stream.time_base), 0)
            container.seek(target, stream=stream, backward=True)
            for packet in container.demux(stream):
                if packet.pts is not None:
                    end = float((packet.pts + (packet.duration or 0)) * stream.time_base)
        except Exception as exn:
            raise _failed(
                exn, "reading the audio's packets (a truncated or damaged field?)"
            ) from exn
        _check_whole(self.media, -1.0 if end is None else end, "packets")

    def _packets(self, lo: float) -> Iterator[Any]:
        """The stream's packets from the pre-roll before ``lo`` on (demuxed from a seek a little
        earlier; those before the pre-roll are not decoded)."""
        container, stream, rule = self.media.container, self.stream, self.preroll
        base = stream.time_base
        back = lo - rule.back
        if self.media.pristine and back <= self.first:
            # From the stream's first packet with a decoder that has decoded nothing: what the
            # whole decode does (no seek can be trusted to find that packet).
            self.media.pristine = False
            yield from container.demux(stream)
            return
        self.media.pristine = False
        container.seek(max(math.floor(back / base), 0), stream=stream, backward=True)
        self.ctx.flush_buffers()  # no state from the last stretch (AAC's overlap carried over)
        pending: Deque[Tuple[Any, float]] = deque()
        packets = iter(container.demux(stream))
        for packet in packets:
            size = float(packet.duration * base) if packet.duration else self._frame
            if packet.pts is None or not size:
                break  # untimed (or the demuxer's flush packet): decode on from here
            at = float(packet.pts * base)
            if at + size > lo:
                break
            if at + size > back:
                pending.append((packet, at))
        else:
            packet = None
        keep = rule.start(pending, lo)
        for i, (held, _) in enumerate(pending):
            if i >= keep:
                yield held
        if packet is not None:
            yield packet
            yield from packets

    def _place(self, t: Optional[float], size: int) -> float:
        """The stream time of a frame's first sample, from its timestamp ``t`` and the size of
        the codec's frames (``size`` samples)."""
        if t is None:
            return 0.0
        if self._tick <= 1 or size <= 0:
            return t
        n = (t - self.first) * self.rate
        offset = -self._delay % size
        snapped = offset + round((n - offset) / size) * size
        if snapped < 0 or abs(n) <= abs(n - snapped):
            snapped = 0  # the stream's first frame
        if abs(n - snapped) > self._tick / 2 + 1:
            return t  # not on a grid of frames of one size: the timestamp as it is
        return self.first + snapped / self.rate

    def samples(
        self, start: float = 0.0, end: Optional[float] = None, margin: float = 0.0
    ) -> Tuple[Any, float]:
        """(float32 array channels x N, the time of its first sample) holding at least
        ``[start - margin, end + margin)`` where the stream has it (``end=None``: to the end),
        decoded from the pre-roll before ``start`` and positioned by the first kept frame's own
        timestamp. Bounded by ``max_samples``."""
        import numpy as np

        limit = self.limits.max_samples
        if (
            limit is not None
            and end is not None
            and (end - start) * self.rate * self.channels > limit
        ):
            raise _over(
                "the samples to decode",
                (end - start) * self.rate * self.channels,
                "max_samples",
                limit,
            )
        lo = start - margin
        if lo - self.preroll.back <= self.first and not self.media.pristine:
            # The stretch needs the stream's start: from a fresh opening of the field (cheap:
            # under a millisecond), whose decoder starts as the whole decode's did.
            with open_media(self.media.data, self.limits) as fresh:
                track = audio_track(fresh)
                assert track is not None
                return track.samples(start, end, margin)
        chunks: List[Any] = []
        first: Optional[float] = None
        total = size = 0
        ctx = self.ctx
        to_float = import_av().AudioResampler(format="fltp")  # float, planar; rate kept
        try:
            for packet in self._packets(lo):
                for frame in ctx.decode(packet):
                    size = max(size, frame.samples)
                    t = float(frame.time) if frame.pts is not None else None
                    if (
                        t is not None
                        and first is None
                        and t + frame.samples / frame.sample_rate <= lo
                    ):
                        continue  # the pre-roll: decoded for the decoder's state, dropped
                    for out in to_float.resample(frame):
                        a = out.to_ndarray()
                        if first is None:
                            first = self._place(t, size)
                        chunks.append(a)
                        total += a.shape[0] * a.shape[1]
                    if limit is not None and total > limit:
                        raise _over("the samples decoded", total, "max_samples", limit)
                    if end is not None and t is not None and t > end + margin:
                        break
                else:
                    continue
                break
        except DecodeError:
            raise
        except Exception as exn:
            raise _failed(exn, "decoding the audio (a truncated or damaged field?)") from exn
        if not chunks:
            raise DecodeError("the audio stream holds no samples (an empty or truncated field?)")
        if end is None:
            _check_whole(
                self.media, float(first or 0.0) + total / self.channels / self.rate, "samples"
            )
        return np.concatenate(chunks, axis=1), float(first or 0.0)


def _truncated(what: str, declared: int, held: int) -> DecodeError:
    return DecodeError(
        f"the field is truncated: its {what} declares {declared:,} bytes, the field holds {held:,}"
    )


def check_end(data: bytes, format_name: str) -> None:
    """A DecodeError if a WAV, Sox or Ogg field stops before its end: FFmpeg estimates a WAV's
    or Sox file's duration from the bytes present, and an Ogg's from its last page, so the
    duration check cannot see their cut.

    - WAV: the RIFF ``data`` chunk's declared size against the bytes after its header (a size of
      0 or 0xFFFFFFFF, what streaming writers and RF64 put there, is not checked);
    - Sox: the header's sample count (4 bytes each) against the bytes after the header (0 or
      all ones: not checked);
    - Ogg: the pages are walked by their headers: the last must end exactly at the field's end
      (a cut inside a page), and every logical stream begun must have its end-of-stream page (a
      cut between pages). Pages are not CRC-checked: damage inside the field that keeps the
      page lengths is not caught.
    """
    if format_name == "wav":
        _check_wav(data)
    elif format_name == "sox":
        _check_sox(data)
    elif format_name == "ogg":
        _check_ogg(data)


def _check_wav(data: bytes) -> None:
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return  # RF64, or something FFmpeg reads otherwise
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if chunk == b"data":
            held = len(data) - pos - 8
            if size not in (0, 0xFFFFFFFF) and held < size:
                raise _truncated("RIFF data chunk", size, held)
            return
        pos += 8 + size + (size & 1)


def _check_sox(data: bytes) -> None:
    order = {b".SoX": "<", b"XoS.": ">"}.get(data[:4])
    if order is None or len(data) < 28:
        return
    header, samples, _, channels = struct.unpack_from(order + "IQdI", data, 4)
    if samples in (0, (1 << 64) - 1):
        return
    held = len(data) - header
    if held < samples * 4:
        raise _truncated("Sox header's sample count", samples * 4, max(held, 0))


def _check_ogg(data: bytes) -> None:
    pos, begun, ended = 0, set(), set()
    while pos < len(data):
        if data[pos : pos + 4] != b"OggS" or pos + 27 > len(data):
            break  # not a page here: FFmpeg resyncs or fails; nothing to judge
        flags = data[pos + 5]
        serial = struct.unpack_from("<I", data, pos + 14)[0]
        segments = data[pos + 26]
        lacing = data[pos + 27 : pos + 27 + segments]
        size = 27 + segments + sum(lacing)
        if pos + size > len(data) or len(lacing) < segments:
            raise DecodeError(
                f"the field is truncated: its Ogg page at byte {pos:,} declares {size:,} bytes, "
                f"the field holds {len(data) - pos:,} of them"
            )
        if flags & 2:
            begun.add(serial)
        if flags & 4:
            ended.add(serial)
        pos += size
    if pos >= len(data) and begun - ended:
        raise DecodeError(
            "the field is truncated: its Ogg stream has no end-of-stream page (the field was "
            "cut between pages)"
        )


def resample(samples: Any, rate: int, to_rate: int, mono: bool) -> Any:
    """``samples`` (float32 channels x N at ``rate``) through FFmpeg's resampler to ``to_rate``
    (and one channel when ``mono``); float32 channels x M."""
    import numpy as np

    av = import_av()
    channels = samples.shape[0]
    if (to_rate == rate and not (mono and channels > 1)) or samples.shape[1] == 0:
        return samples
    layout = {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="fltp", layout="mono" if mono else layout, rate=to_rate)
    outs = [f.to_ndarray() for f in resampler.resample(frame)]
    outs += [f.to_ndarray() for f in resampler.resample(None)]
    return (
        np.concatenate(outs, axis=1) if outs else np.zeros((1 if mono else channels, 0), np.float32)
    )
