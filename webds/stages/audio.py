"""Audio fields: :func:`load_audio` (what ``torchaudio.load`` returned, from the bytes in memory)
and :class:`AudioClipDecoder` (clips of S seconds, resampled by FFmpeg's resampler), on the PyAV
backend of :mod:`webds.stages.avio`.

    ds = webds.WebDataset(url, seed=0).decode(webds.AudioClipDecoder(seconds=5.0, rate=16000))
    # sample["flac"] = {"audio": float32 clips x 1 x 80000, "audio_timestamps": clips x 2, ...}

A clip is decoded from the codec's pre-roll before it (minus a 50 ms margin the resampler's
filter needs on each side; :mod:`webds.stages.avaudio`) to just past its end, never the whole
file, and positioned by its frames' own timestamps, so that it equals the whole decode at the same
stream time; it is cut at the source rate, resampled with the margins, and cut again, so each clip
has exactly ``round(seconds * rate)`` samples. Clips are decoded in time order, those whose
pre-roll overlaps the one before in one run. Past the end of the stream (a file shorter than a
clip) a clip is padded with zeros (silence).
"""

from __future__ import annotations

import random
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ArgumentError, DecodeError
from .avaudio import AudioTrack, audio_track, resample
from .avio import MAX_SAMPLES, MAX_SECONDS, Limits, open_media
from .clips import SAMPLINGS, SeededHandler, clip_starts, positive_int

__all__ = ["AUDIO_EXTENSIONS", "AudioClipDecoder", "audio_clip", "audio_clips", "load_audio"]

#: The extensions webdataset's ``torch_audio`` decodes, and ``opus``.
AUDIO_EXTENSIONS: List[str] = "flac mp3 sox wav m4a ogg wma opus".split()

# The resampler's filter reads this far past each end of a clip: decoded and cut off after.
_MARGIN = 0.05


def load_audio(data: bytes, limits: Optional[Limits] = None) -> Tuple[Any, int]:
    """``(waveform, sample_rate)`` as ``torchaudio.load`` returned them: float32 channels x
    samples in [-1, 1] at the file's own rate, from an audio file's bytes.

        waveform, rate = load_audio(flac_bytes)   # (tensor 1 x 48000, 16000)
    """
    import torch

    with open_media(data, limits) as media:
        track = audio_track(media)
        samples, _ = track.samples(0.0, None)
        return torch.from_numpy(samples), track.rate


def audio_clip(
    track: AudioTrack, start: float, seconds: float, rate: Optional[int], mono: bool
) -> Any:
    """float32 channels x ``round(seconds * rate)`` samples of ``track`` from ``start`` (stream
    seconds), resampled to ``rate`` (None: the track's) and mixed down when ``mono``; zeros
    where the stream has no samples."""
    return audio_clips(track, [start], seconds, rate, mono)[0]


def audio_clips(
    track: AudioTrack, starts: Sequence[float], seconds: float, rate: Optional[int], mono: bool
) -> List[Any]:
    """:func:`audio_clip` for each of ``starts``, decoded in time order: a clip whose pre-roll
    begins before the last one's end continues its run instead of seeking (no dearer, and a
    decoder that seeks back to the stream's start is not the fresh one the whole decode used)."""
    src = track.rate
    margin = _MARGIN if (rate or src) != src or (mono and track.channels > 1) else 0.0
    runs: List[Tuple[float, float, List[int]]] = []
    for i in sorted(range(len(starts)), key=lambda i: starts[i]):
        t = starts[i]
        if runs and t - margin - track.preroll.back <= runs[-1][1] + margin:
            runs[-1] = (runs[-1][0], max(runs[-1][1], t + seconds), runs[-1][2] + [i])
        else:
            runs.append((t, t + seconds, [i]))
    out: List[Any] = [None] * len(starts)
    for lo, hi, members in runs:
        samples, first = track.samples(lo, hi, margin)
        for i in members:
            out[i] = _cut(samples, first, starts[i], seconds, src, rate or src, mono, margin)
    return out


def _cut(
    samples: Any,
    first: float,
    start: float,
    seconds: float,
    src: int,
    rate: int,
    mono: bool,
    margin: float,
) -> Any:
    """The clip at ``start`` out of ``samples`` (whose first sample is at ``first``)."""
    import numpy as np

    at = int(round((start - margin - first) * src))  # index of start - margin in samples
    want = int(round((seconds + 2 * margin) * src))
    seg = samples[:, max(at, 0) : max(at + want, 0)]
    before = max(-at, 0)
    seg = np.pad(seg, ((0, 0), (before, max(want - before - seg.shape[1], 0))))
    out = resample(seg, src, rate, mono)
    skip, length = int(round(margin * rate)), int(round(seconds * rate))
    out = out[:, skip : skip + length]
    if mono and out.shape[0] > 1:
        out = out[:1]  # (resample mixed down already; a one-channel source is passed through)
    return np.pad(out, ((0, 0), (0, length - out.shape[1])))


def track_start(track: AudioTrack) -> float:
    """The stream's first timestamp, in seconds (0 when it does not say)."""
    start = track.stream.start_time
    return float(start * track.stream.time_base) if start is not None else 0.0


class AudioClipDecoder(SeededHandler):
    """A decode handler giving ``clips`` clips of ``seconds`` from each audio field, resampled to
    ``rate`` by FFmpeg's resampler (None: the file's rate) and mixed to one channel when
    ``mono``; the audio counterpart of :class:`~webds.stages.video.VideoClipDecoder`.

        ds = webds.WebDataset(url, seed=0).decode(webds.AudioClipDecoder(5.0, clips=2))

    Each field becomes a dict that ``default_collate`` batches: ``"audio"`` (float32 tensor
    clips x channels x samples), ``"audio_timestamps"`` (float64 clips x 2: start and end in
    stream seconds), ``"audio_fps"`` (the rate, an int). ``sampling``: ``"random"`` (drawn
    from ``seed`` or the pipeline's seed, the epoch, the shard, the sample key and the field:
    the same with any number of workers, threads, or after a resume), ``"uniform"`` (evenly from
    the start to the end) or ``"center"`` (back to back around the middle). A file shorter than
    a clip gives clips from its start, padded with silence. Fields declaring more than
    ``max_seconds``, or needing more than ``max_samples`` (channels x samples) decoded, are a
    DecodeError raised before decoding.
    """

    _tag = "audio clips"

    def __init__(
        self,
        seconds: float = 5.0,
        clips: int = 1,
        *,
        sampling: str = "random",
        rate: Optional[int] = 16000,
        mono: bool = True,
        seed: Optional[int] = None,
        extensions: Union[str, Iterable[str]] = AUDIO_EXTENSIONS,
        max_seconds: Optional[float] = MAX_SECONDS,
        max_samples: Optional[int] = MAX_SAMPLES,
    ) -> None:
        super().__init__(seed, extensions)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ArgumentError(f"seconds must be a positive number, got {seconds!r}")
        self.seconds = float(seconds)
        self.clips = positive_int("clips", clips)
        if sampling not in SAMPLINGS:
            raise ArgumentError(f"sampling must be one of {', '.join(SAMPLINGS)}; got {sampling!r}")
        self.sampling = sampling
        self.rate = None if rate is None else positive_int("rate", rate)
        self.mono = bool(mono)
        self.limits = Limits.checked(max_seconds=max_seconds, max_samples=max_samples)

    def __call__(
        self, key: str, data: bytes, sample: Optional[Mapping[str, Any]] = None
    ) -> Optional[Dict[str, Any]]:
        if not self.handles(key):
            return None
        return self.decode_clips(data, self.rng(key, data, sample))

    def decode_clips(self, data: bytes, rng: random.Random) -> Dict[str, Any]:
        """The clips of one field's bytes, positions drawn from ``rng``."""
        import numpy as np
        import torch

        with open_media(data, self.limits) as media:
            track = audio_track(media)
            track.check_whole()
            start = track_start(track)
            duration = track.seconds
            if duration is None:
                raise DecodeError("the audio stream declares no duration: clips need one")
            src = track.rate
            last = int((duration - self.seconds) * src)
            width = int(round(self.seconds * src))
            starts = [
                start + s / src for s in clip_starts(last, self.clips, width, self.sampling, rng)
            ]
            audio = audio_clips(track, starts, self.seconds, self.rate, self.mono)
        rate = self.rate or src
        stamps = [(t, t + self.seconds) for t in starts]
        return {
            "audio": torch.from_numpy(np.stack(audio)),
            "audio_timestamps": torch.tensor(stamps, dtype=torch.float64),
            "audio_fps": rate,
        }

    def __repr__(self) -> str:
        return (
            f"AudioClipDecoder({self.seconds!r}, clips={self.clips!r}, "
            f"sampling={self.sampling!r}, rate={self.rate!r}, mono={self.mono!r}, "
            f"seed={self.seed!r})"
        )
