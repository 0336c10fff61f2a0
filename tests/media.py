"""Real encoded media for the tests, made by PyAV's encoders (FFmpeg inside the ``av`` wheel).

Each maker returns the bytes of a whole file. The frames are synthetic and every one differs
(a colour ramp, a moving row and column), so a decoder that returns the wrong frame, or a frame
twice, is caught by comparing pixels. Small sizes keep the suite fast: a 2 s 64x48 H.264 clip
encodes in about 20 ms.

    data = make_video(seconds=2, fps=30, gop=30)               # H.264 in mp4
    data = make_video(codec="libvpx-vp9", container="webm")
    data = make_audio(codec="flac", container="flac", seconds=3)
    data = make_video(audio=True)                               # H.264 + AAC in mp4
"""

from __future__ import annotations

import io
from fractions import Fraction
from typing import Callable, Iterator, Optional

import numpy as np

av = None  # imported on first use, so that collecting the tests needs no PyAV


def _av():
    global av
    if av is None:
        import av as module

        av = module
    return av


def frame_pixels(i: int, width: int, height: int) -> np.ndarray:
    """Frame ``i`` of a made video, H x W x 3 uint8: red ramps with i, a green row and a blue
    column move with it (each frame differs from its neighbours everywhere a codec can see)."""
    a = np.zeros((height, width, 3), np.uint8)
    a[..., 0] = (i * 8) % 256
    a[..., 1] = np.linspace(0, 128, width, dtype=np.uint8)[None, :]
    a[i % height, :, 1] = 255
    a[:, (2 * i) % width, 2] = 255
    return a


def _frames(n: int, width: int, height: int) -> Iterator[np.ndarray]:
    for i in range(n):
        yield frame_pixels(i, width, height)


def tone(seconds: float, rate: int, channels: int = 1, freq: float = 440.0) -> np.ndarray:
    """A float32 sine, channels x samples (channel c at ``freq * (c + 1)``), amplitude 0.5."""
    t = np.arange(int(round(seconds * rate))) / rate
    return np.stack([0.5 * np.sin(2 * np.pi * freq * (c + 1) * t) for c in range(channels)]).astype(
        np.float32
    )


_AUDIO_FORMATS = {  # codec -> the sample format its encoder takes (planar floats where it can)
    "aac": "fltp",
    "libmp3lame": "fltp",
    "libopus": "flt",
    "flac": "s16",
    "pcm_s16le": "s16",
    "pcm_s32le": "s32",
    "libvorbis": "fltp",
}


def _audio_frames(stream, samples: np.ndarray, rate: int) -> Iterator["av.AudioFrame"]:
    fmt = _AUDIO_FORMATS.get(stream.codec_context.name, "fltp")
    channels = samples.shape[0]
    layout = "mono" if channels == 1 else "stereo"
    step = stream.codec_context.frame_size or 1024
    for start in range(0, samples.shape[1], step):
        chunk = samples[:, start : start + step]
        if fmt == "s16":
            data = (np.clip(chunk, -1, 1) * 32767).astype(np.int16).T.reshape(1, -1)
        elif fmt == "s32":
            data = (np.clip(chunk, -1, 1) * 2147483647).astype(np.int32).T.reshape(1, -1)
        elif fmt == "flt":
            data = np.ascontiguousarray(chunk.T.reshape(1, -1))
        else:
            data = np.ascontiguousarray(chunk)
        frame = _av().AudioFrame.from_ndarray(data, format=fmt, layout=layout)
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        yield frame


def _add_audio(container, codec: str, rate: int, channels: int):
    stream = container.add_stream(codec, rate=rate)
    stream.layout = "mono" if channels == 1 else "stereo"
    fmt = _AUDIO_FORMATS.get(codec)
    if fmt:
        stream.format = fmt
    return stream


def make_video(
    seconds: float = 2.0,
    fps: int = 30,
    width: int = 64,
    height: int = 48,
    codec: str = "libx264",
    container: str = "mp4",
    gop: int = 30,
    audio: bool = False,
    audio_codec: str = "aac",
    audio_rate: int = 16000,
    bframes: Optional[int] = None,
    preset: str = "ultrafast",
    pixels: Optional[Callable[[int, int, int], np.ndarray]] = None,
) -> bytes:
    """A video file's bytes: ``seconds`` at ``fps`` of :func:`frame_pixels`, a keyframe every
    ``gop`` frames, with an audio track of :func:`tone` when ``audio``.

    ``preset``: libx264's speed preset (``"ultrafast"`` keeps the tests fast; ``"medium"``,
    libx264's own default, gives the streams real encoders write: B-frames, CABAC, several
    reference frames). ``pixels(i, width, height)``: frame ``i`` as H x W x 3 uint8, in place of
    :func:`frame_pixels` (the benchmarks pan over a photo)."""
    av_ = _av()
    buf = io.BytesIO()
    with av_.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        options = {}
        if codec == "libx264":
            options = {"preset": preset, "keyint_min": str(gop), "sc_threshold": "0"}
            if bframes is not None:
                options["bf"] = str(bframes)
        elif codec.startswith("libvpx"):
            options = {"deadline": "realtime", "cpu-used": "8"}
        stream.options = options
        sound = _add_audio(out, audio_codec, audio_rate, 1) if audio else None
        n = int(round(seconds * fps))
        source = pixels or frame_pixels
        for i in range(n):
            image = source(i, width, height)
            for packet in stream.encode(av_.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            for frame in _audio_frames(sound, tone(seconds, audio_rate), audio_rate):
                for packet in sound.encode(frame):
                    out.mux(packet)
            for packet in sound.encode():
                out.mux(packet)
    return buf.getvalue()


def make_audio(
    seconds: float = 3.0,
    rate: int = 16000,
    channels: int = 1,
    codec: str = "flac",
    container: str = "flac",
) -> bytes:
    """An audio file's bytes: :func:`tone` for ``seconds`` at ``rate``, ``channels`` channels.
    ``codec``/``container``: ``flac``/``flac``, ``libmp3lame``/``mp3``, ``aac``/``mp4`` (m4a),
    ``libopus``/``ogg`` (rate 48000), ``pcm_s16le``/``wav``, ``pcm_s32le``/``sox``."""
    av_ = _av()
    buf = io.BytesIO()
    with av_.open(buf, "w", format=container) as out:
        stream = _add_audio(out, codec, rate, channels)
        for frame in _audio_frames(stream, tone(seconds, rate, channels), rate):
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


# -- a stream whose SPS claims a huge frame ------------------------------------------------------


class _Bits:
    """Read an H.264 RBSP bit by bit, with exp-Golomb codes."""

    def __init__(self, data: bytes) -> None:
        self.bits = "".join(f"{b:08b}" for b in data)
        self.at = 0

    def u(self, n: int) -> int:
        value = int(self.bits[self.at : self.at + n] or "0", 2)
        self.at += n
        return value

    def ue(self) -> int:
        zeros = 0
        while self.bits[self.at] == "0":
            zeros += 1
            self.at += 1
        return self.u(zeros + 1) - 1


def _ue(value: int) -> str:
    code = f"{value + 1:b}"
    return "0" * (len(code) - 1) + code


def _unescape(nal: bytes) -> bytes:
    return nal.replace(b"\x00\x00\x03", b"\x00\x00")


def _escape(rbsp: bytes) -> bytes:
    out = bytearray()
    zeros = 0
    for b in rbsp:
        if zeros >= 2 and b <= 3:
            out.append(3)
            zeros = 0
        out.append(b)
        zeros = zeros + 1 if b == 0 else 0
    return bytes(out)


def _rewrite_sps(nal: bytes, width_mbs: int, height_mbs: int) -> bytes:
    """The SPS NAL unit ``nal`` (header byte included) with its frame size set in macroblocks."""
    r = _Bits(_unescape(nal[1:]))
    profile = r.u(8)
    r.u(16)  # constraint flags, level
    r.ue()  # seq_parameter_set_id
    if profile in (100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135):
        if r.ue() == 3:  # chroma_format_idc
            r.u(1)
        r.ue(), r.ue(), r.u(1)  # bit depths, transform bypass
        assert r.u(1) == 0, "scaling matrices are not handled"
    r.ue()  # log2_max_frame_num_minus4
    poc = r.ue()
    assert poc in (0, 2), "pic_order_cnt_type 1 is not handled"
    if poc == 0:
        r.ue()
    r.ue(), r.u(1)  # max_num_ref_frames, gaps_in_frame_num_allowed
    head = r.bits[: r.at]
    r.ue(), r.ue()  # the size being replaced
    bits = head + _ue(width_mbs - 1) + _ue(height_mbs - 1) + r.bits[r.at :]
    bits = bits.rstrip("0")  # the old trailing bits, then aligned again
    bits = bits[:-1] if bits.endswith("1") else bits
    bits += "1"
    bits += "0" * (-len(bits) % 8)
    rbsp = int(bits, 2).to_bytes(len(bits) // 8, "big")
    return nal[:1] + _escape(rbsp)


def h264_claiming(width: int = 15872, height: int = 15872, seconds: float = 1.0) -> bytes:
    """A raw H.264 (Annex B) stream of a few KB whose SPS declares ``width`` x ``height``
    (multiples of 16): its slices code a 64x48 picture, but a decoder trusting the SPS allocates
    every frame at the declared size (1.2-1.6 GB a frame at 15872x15872)."""
    data = make_video(seconds=seconds, fps=30, container="h264")
    parts = data.split(b"\x00\x00\x01")
    out = [parts[0]]
    for nal in parts[1:]:
        if nal and nal[0] & 0x1F == 7:
            trail = len(nal) - len(nal.rstrip(b"\x00"))  # the next start code's leading zero
            nal = _rewrite_sps(nal[: len(nal) - trail], width // 16, height // 16) + b"\x00" * trail
        out.append(nal)
    return b"\x00\x00\x01".join(out)
