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
from typing import Iterator, Optional

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
) -> bytes:
    """A video file's bytes: ``seconds`` at ``fps`` of :func:`frame_pixels`, a keyframe every
    ``gop`` frames, with an audio track of :func:`tone` when ``audio``."""
    av_ = _av()
    buf = io.BytesIO()
    with av_.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        options = {}
        if codec == "libx264":
            options = {"preset": "ultrafast", "keyint_min": str(gop), "sc_threshold": "0"}
            if bframes is not None:
                options["bf"] = str(bframes)
        elif codec.startswith("libvpx"):
            options = {"deadline": "realtime", "cpu-used": "8"}
        stream.options = options
        sound = _add_audio(out, audio_codec, audio_rate, 1) if audio else None
        n = int(round(seconds * fps))
        for pixels in _frames(n, width, height):
            for packet in stream.encode(av_.VideoFrame.from_ndarray(pixels, format="rgb24")):
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
    ``libopus``/``ogg`` (rate 48000), ``pcm_s16le``/``wav``."""
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
