"""Video fields: :func:`read_video` (what ``torchvision.io.read_video(pts_unit="sec")``
returned, from the bytes in memory) and :class:`VideoClipDecoder`, the video counterpart of
:class:`~webds.stages.crop.RandomResizedCropDecoder`: N clips of F frames, resized (and cropped)
while decoding, optionally with the audio under each clip; on the PyAV backend of
:mod:`webds.stages.avio`.

    decoder = webds.VideoClipDecoder(16, stride=2, clips=4, size=112)
    ds = webds.WebDataset(url, seed=0).decode(decoder)
    # sample["mp4"]["video"]: uint8 clips x frames x 3 x H x W

How a clip is decoded: the field's packets are read once without decoding (their timestamps are
the frame times, their keyframe flags say where decoding of each frame must start); the clip's
frames are chosen from those times; decoding seeks to the keyframe before the clip's first frame
and stops at its last frame (clips that overlap, or that a seek would not shorten, share one
run). Only the frames a clip keeps are converted to RGB, at the output size (FFmpeg's scaler).
"""

from __future__ import annotations

import bisect
import random
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from ..errors import ArgumentError
from .audio import audio_clips
from .avaudio import audio_track
from .avio import (
    MAX_FRAME_PIXELS,
    MAX_SAMPLES,
    MAX_SECONDS,
    MAX_VIDEO_PIXELS,
    Limits,
    VideoTrack,
    open_media,
)
from .clips import SAMPLINGS, SeededHandler, clip_starts, crop_origin, pair, positive_int

__all__ = ["LAYOUTS", "VIDEO_EXTENSIONS", "VideoClipDecoder", "read_video"]

#: The extensions webdataset's ``torch_video`` decodes, and ``mkv``.
VIDEO_EXTENSIONS: List[str] = "mp4 ogv mjpeg avi mov h264 mpg webm wmv mkv".split()

#: Clip layouts: frames x channels x height x width (torchvision's v2 transforms, TorchCodec),
#: or frames x height x width x channels (``read_video``'s).
LAYOUTS = ("TCHW", "THWC")


#: The default ``max_pixels`` of a whole video (:func:`read_video`, :func:`torch_video`): 2**28
#: pixels, 768 MiB as the uint8 RGB array it returns (a 720p video of 9.7 s at 30 fps, 360p of
#: 38 s); decode longer videos as clips (:class:`VideoClipDecoder`), or give ``limits``.
MAX_WHOLE_VIDEO_PIXELS = 1 << 28


def read_video(data: bytes, limits: Optional[Limits] = None) -> Tuple[Any, Any, Dict[str, Any]]:
    """``(video, audio, info)`` as ``torchvision.io.read_video(path, pts_unit="sec")`` returned
    them: uint8 T x H x W x 3, float32 channels x samples (1 x 0 without audio), and
    ``{"video_fps": float, "audio_fps": int}`` (``audio_fps`` only with audio). Every frame is
    decoded, so ``limits.max_pixels`` (width x height x frames; by default
    :data:`MAX_WHOLE_VIDEO_PIXELS`) bounds the whole video.

        video, audio, info = read_video(mp4_bytes)
    """
    import numpy as np

    with open_media(data, limits or Limits(max_pixels=MAX_WHOLE_VIDEO_PIXELS)) as media:
        track = media.video()
        frames = np.empty((len(track), track.height, track.width, 3), np.uint8)
        for i, (_, frame) in enumerate(track.frames(track.pts)):
            frames[i] = frame.to_ndarray(format="rgb24")  # one copy of the video, not two
        info: Dict[str, Any] = {"video_fps": track.fps}
        sound = audio_track(media, required=False)
        samples = np.zeros((1, 0), np.float32)
        if sound is not None:
            samples, _ = sound.samples(0.0, None)
            info["audio_fps"] = sound.rate
    import torch  # (after decoding: a refused field costs no torch import)

    return torch.from_numpy(frames), torch.from_numpy(samples), info


def _output_size(width: int, height: int, size: Any) -> Tuple[int, int]:
    """(height, width) of the frames after resizing to ``size``: None keeps them, an int is the
    short side (the aspect kept, as torchvision's ``Resize(int)``), a pair is exact."""
    if size is None:
        return height, width
    if isinstance(size, int):
        if width <= height:
            return max(1, int(size * height / width)), size
        return size, max(1, int(size * width / height))
    return size


class VideoClipDecoder(SeededHandler):
    """A decode handler giving ``clips`` clips of ``frames`` frames from each video field,
    decoding only what the clips need (see :mod:`webds.stages.video`).

        decoder = webds.VideoClipDecoder(16, stride=2, clips=4, size=112, crop=112)
        ds = webds.WebDataset(url, seed=0).decode(decoder)

    Frames: every ``stride``-th source frame, or with ``fps`` the frame shown at each tick of
    that rate. ``sampling``: ``"random"`` (starts drawn from ``seed`` or the pipeline's seed,
    the epoch, the shard, the sample key and the field: the same clips with any number of
    workers, threads, or after a resume), ``"uniform"`` (evenly from the first frame to the
    last) or ``"center"`` (back to back around the middle); clips come in time order. ``size``:
    an int (the short side; the aspect kept) or (height, width), resized while decoding by
    FFmpeg's bilinear scaler; ``crop``: an int or (height, width) cut from the resized frames,
    at random (one place a clip) when sampling is random, else at the centre. ``layout``:
    ``"TCHW"`` (the default: what torchvision's v2 video transforms and TorchCodec take) or
    ``"THWC"`` (``read_video``'s). ``audio=True`` adds each clip's audio, resampled to
    ``audio_rate`` (mono when ``mono``).

    Each field becomes a dict that ``default_collate`` batches: ``"video"`` (uint8 tensor clips
    x frames x ...), ``"video_timestamps"`` (float64 clips x 2: the start of the first frame and
    the end of the last, stream seconds), ``"frame_timestamps"`` (float64 clips x frames),
    ``"video_fps"`` (the clip's rate, a float); with audio, ``"audio"`` (float32 clips x
    channels x samples, ``round(seconds * audio_rate)`` samples from each clip's start: silence
    where the stream has none), ``"audio_timestamps"`` and ``"audio_fps"``.

    A video shorter than a clip is padded: the clip starts at the first frame and repeats the
    last frame (``frame_timestamps`` say so). A video over ``max_frame_pixels`` a frame, over
    ``max_seconds``, or whose clips need more than ``max_pixels`` (width x height x frames
    decoded) is a DecodeError raised before decoding.
    """

    _tag = "video clips"

    def __init__(
        self,
        frames: int = 16,
        stride: int = 2,
        *,
        fps: Optional[float] = None,
        clips: int = 4,
        sampling: str = "random",
        size: Union[None, int, Tuple[int, int]] = None,
        crop: Union[None, int, Tuple[int, int]] = None,
        layout: str = "TCHW",
        audio: bool = False,
        audio_rate: Optional[int] = 16000,
        mono: bool = True,
        seed: Optional[int] = None,
        extensions: Union[str, Iterable[str]] = VIDEO_EXTENSIONS,
        max_pixels: Optional[int] = MAX_VIDEO_PIXELS,
        max_frame_pixels: Optional[int] = MAX_FRAME_PIXELS,
        max_seconds: Optional[float] = MAX_SECONDS,
        max_samples: Optional[int] = MAX_SAMPLES,
    ) -> None:
        super().__init__(seed, extensions)
        self.frames = positive_int("frames", frames)
        self.stride = positive_int("stride", stride)
        if fps is not None and (
            isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0
        ):
            raise ArgumentError(f"fps must be a positive number or None, got {fps!r}")
        self.fps = None if fps is None else float(fps)
        self.clips = positive_int("clips", clips)
        if sampling not in SAMPLINGS:
            raise ArgumentError(f"sampling must be one of {', '.join(SAMPLINGS)}; got {sampling!r}")
        self.sampling = sampling
        self.size = (
            size
            if isinstance(size, int) and not isinstance(size, bool) and size > 0
            else pair("size", size)
        )
        self.crop = pair("crop", crop)
        if layout not in LAYOUTS:
            raise ArgumentError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
        self.layout = layout
        self.audio = bool(audio)
        self.audio_rate = None if audio_rate is None else positive_int("audio_rate", audio_rate)
        self.mono = bool(mono)
        self.limits = Limits.checked(max_pixels, max_frame_pixels, max_seconds, max_samples)

    def __call__(
        self, key: str, data: bytes, sample: Optional[Mapping[str, Any]] = None
    ) -> Optional[Dict[str, Any]]:
        if not self.handles(key):
            return None
        return self.decode_clips(data, self.rng(key, data, sample))

    def _indices(self, track: VideoTrack, rng: random.Random) -> Tuple[List[List[int]], float]:
        """Each clip's frame indices (into ``track.pts``) and the clips' frame rate."""
        n, f = len(track), self.frames
        if self.fps is None:
            width = (f - 1) * self.stride + 1
            starts = clip_starts(n - width, self.clips, width, self.sampling, rng)
            steps = [[min(s + k * self.stride, n - 1) for k in range(f)] for s in starts]
            return steps, track.fps / self.stride
        times = [track.seconds(p) for p in track.pts]
        span = (f - 1) / self.fps
        last = bisect.bisect_right(times, times[-1] - span + 1e-6) - 1
        width = max(1, int(round(f / self.fps * track.fps)))
        starts = clip_starts(last, self.clips, width, self.sampling, rng)
        ticks = [
            [
                max(bisect.bisect_right(times, times[s] + k / self.fps + 1e-6) - 1, 0)
                for k in range(f)
            ]
            for s in starts
        ]
        return ticks, self.fps

    def decode_clips(self, data: bytes, rng: random.Random) -> Dict[str, Any]:
        """The clips of one field's bytes, their positions drawn from ``rng``."""
        import numpy as np
        import torch

        with open_media(data, self.limits) as media:
            track = media.video()
            indices, rate = self._indices(track, rng)
            out_h, out_w = _output_size(track.width, track.height, self.size)
            targets = sorted({track.pts[i] for clip in indices for i in clip})
            pixels = {
                pts: frame.reformat(width=out_w, height=out_h, format="rgb24").to_ndarray()
                for pts, frame in track.frames(targets)
            }
            clips = []
            for clip in indices:
                stack = np.stack([pixels[track.pts[i]] for i in clip])
                if self.crop is not None:
                    top, left = crop_origin(out_h, out_w, self.crop, self.sampling == "random", rng)
                    stack = stack[:, top : top + self.crop[0], left : left + self.crop[1]]
                clips.append(stack)
            video = torch.from_numpy(np.stack(clips))
            if self.layout == "TCHW":
                video = video.permute(0, 1, 4, 2, 3).contiguous()
            frame_times = [[track.seconds(track.pts[i]) for i in clip] for clip in indices]
            # A clip stands for frames / rate seconds (each frame for 1 / rate of them): the span
            # its audio covers too, and back-to-back clips tile the stream.
            stamps = [(t[0], t[0] + self.frames / rate) for t in frame_times]
            result = {
                "video": video,
                "video_timestamps": torch.tensor(stamps, dtype=torch.float64),
                "frame_timestamps": torch.tensor(frame_times, dtype=torch.float64),
                "video_fps": rate,
            }
            if self.audio:
                result.update(self._audio(media, [t[0] for t in frame_times], rate))
        return result

    def _audio(self, media: Any, starts: List[float], rate: float) -> Dict[str, Any]:
        """The audio under each clip: ``frames / rate`` seconds from each clip's start."""
        import numpy as np
        import torch

        track = audio_track(media)
        seconds = self.frames / rate
        sound = audio_clips(track, starts, seconds, self.audio_rate, self.mono)
        return {
            "audio": torch.from_numpy(np.stack(sound)),
            "audio_timestamps": torch.tensor(
                [(t, t + seconds) for t in starts], dtype=torch.float64
            ),
            "audio_fps": self.audio_rate or track.rate,
        }

    def __repr__(self) -> str:
        how = f"fps={self.fps!r}" if self.fps is not None else f"stride={self.stride!r}"
        return (
            f"VideoClipDecoder({self.frames!r}, {how}, clips={self.clips!r}, "
            f"sampling={self.sampling!r}, size={self.size!r}, crop={self.crop!r}, "
            f"layout={self.layout!r}, audio={self.audio!r}, seed={self.seed!r})"
        )
