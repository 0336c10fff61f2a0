"""Video and audio clips from shards (issue 52): ``video`` and ``audio``.

``video``: H.264 in mp4, 640x360, 10 s at 30 fps, a keyframe every 2 s (60 frames), encoded by
libx264 with its default preset (``medium``: B-frames, CABAC, several reference frames) from a
pan and zoom over one of the source photos (scikit-image's, as the image data; see
:mod:`benchmarks.data`), 4 videos per shard written by ``webds.ShardWriter``. Each contestant
gives 4 clips of 16 frames at stride 2 (31 source frames a clip) from every video, as one uint8
tensor clips x frames x H x W x 3 (``read_video``'s layout), the same clips for all: webds draws
them (``sampling="random"``, seed 0), and every other contestant is handed the same start
frames.

- ``webds VideoClipDecoder``: ``WebDataset(urls, seed=0).decode(VideoClipDecoder(16, stride=2,
  clips=4, layout="THWC"))``: seeks to the keyframe before each clip and decodes up to its last
  frame, converting only the frames kept;
- ``whole decode + slice``: ``decode(webds.torch_video)`` (``read_video``'s result: every frame
  decoded and converted to RGB), then ``video[s : s + 31 : 2]`` for each clip: what
  ``torchvision.io.read_video`` users did;
- ``Energon AVDecoder``: Megatron-Energon's ``AVDecoder(io.BytesIO(data)).get_clips(
  video_clip_ranges=[(s, s + 30), ...], video_unit="frames")`` (the end is inclusive; frames are
  mp4's native unit there), every 2nd frame kept: Energon ranges have no stride, so it converts
  all 31 frames of a clip to RGB;
- ``decord VideoReader``: ``VideoReader(io.BytesIO(data), num_threads=1).get_batch(indices)``
  (one decoding thread, as webds's decoder and a DataLoader worker use);
- ``TorchCodec VideoDecoder``: ``VideoDecoder(data, seek_mode="exact",
  num_ffmpeg_threads=1).get_frames_at(indices)``, where it imports and its FFmpeg loads (it is
  skipped with the reason otherwise).

Before measuring, one pass of each contestant is compared with webds's clips: the whole decode
must give the same pixels (an error otherwise); the others' agreement is reported.

``audio``: 60 s of audio at 44.1 kHz, stereo, as FLAC and as MP3 (128 kb/s, libmp3lame), 4 to a
shard; one random 5 s clip a file, mono at 16 kHz through FFmpeg's resampler:

- ``webds AudioClipDecoder``: ``decode(AudioClipDecoder(5.0, rate=16000))``: decodes from the
  packet before the clip (less a 50 ms margin) to just past its end;
- ``full decode + slice``: ``decode(webds.torch_audio)`` (``torchaudio.load``'s result: the whole
  file at its own rate), the clip sliced out and resampled by the same FFmpeg resampler;
- ``Energon AVDecoder``: ``get_audio_clips(audio_clip_ranges=[(t, t + 5)])`` (at the file's
  rate), then the same resampler.

A tone, not speech or music: FLAC compresses it far better than real audio, so FLAC's decode
(and the saving from decoding less of it) is cheaper here than on real files; MP3's decode costs
the same whatever the content. Everything made is kept under the data root and reused.
"""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from .harness import ROOT, Variant, has_module, measure, stderr

if TYPE_CHECKING:
    from .workloads import Suite

#: Bump when the way the media are made changes (rebuilds kept data).
VERSION = 1

WIDTH, HEIGHT, SECONDS, FPS, GOP = 640, 360, 10, 30, 60
PRESET = "medium"
FRAMES, STRIDE, CLIPS = 16, 2, 4
SPAN = (FRAMES - 1) * STRIDE + 1  # source frames a clip covers
PER_SHARD = 4
#: Audio passes shorter than this are repeated within a round (harness.measure's min_time).
MIN_TIME = 0.25

AUDIO_SECONDS, AUDIO_RATE, AUDIO_CHANNELS = 60.0, 44100, 2
CLIP_SECONDS, CLIP_RATE = 5.0, 16000
#: codec name -> (encoder, container, field extension)
AUDIO_CODECS = {"flac": ("flac", "flac", "flac"), "mp3": ("libmp3lame", "mp3", "mp3")}

#: The row names the targets refer to.
WEBDS_VIDEO = "webds VideoClipDecoder"
WHOLE_VIDEO = "whole decode + slice"
ENERGON_VIDEO = "Energon AVDecoder"
DECORD_VIDEO = "decord VideoReader"
TORCHCODEC_VIDEO = "TorchCodec VideoDecoder"
WEBDS_AUDIO = "webds AudioClipDecoder"
FULL_AUDIO = "full decode + slice"
ENERGON_AUDIO = "Energon AVDecoder"


def _done(folder: Path, facts: Dict[str, Any]) -> bool:
    marker = folder / "done.json"
    return marker.exists() and json.loads(marker.read_text()) == facts


def _finish(folder: Path, facts: Dict[str, Any]) -> None:
    (folder / "done.json").write_text(json.dumps(facts) + "\n")


def test_media() -> Any:
    """tests/media.py (PyAV's encoders, as the tests make their media), imported by path."""
    spec = importlib.util.spec_from_file_location("webds_test_media", ROOT / "tests" / "media.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the data -----------------------------------------------------------------------------------


def pan_frames(photo: Any, seed: int, n: int) -> Callable[[int, int, int], np.ndarray]:
    """Frame ``i`` of a camera panning across ``photo`` (PIL RGB) and zooming in from 70% to
    45% of its shorter side, as ``pixels(i, width, height)`` for ``make_video``."""
    from PIL import Image

    rng = np.random.default_rng([VERSION, seed])
    w, h = photo.size
    x0, y0, x1, y1 = rng.uniform(0, 1, 4)

    def pixels(i: int, width: int, height: int) -> np.ndarray:
        t = i / max(n - 1, 1)
        ch = min(h, w * height / width) * (0.7 - 0.25 * t)
        cw = ch * width / height
        x = (x0 + (x1 - x0) * t) * (w - cw)
        y = (y0 + (y1 - y0) * t) * (h - ch)
        box = (x, y, x + cw, y + ch)
        return np.asarray(photo.resize((width, height), Image.BILINEAR, box=box))

    return pixels


def video_shards(suite: "Suite", n: int) -> List[str]:
    """``n`` videos (``NNNNNN.mp4`` + ``NNNNNN.cls``) in webds shards of 4, made once."""
    import webds

    from .data import load_photos

    source = suite.data.meta["source"]
    folder = suite.data.root / "media" / f"video-{n}"
    paths = [str(folder / f"video-{s:06d}.tar") for s in range(-(-n // PER_SHARD))]
    facts = {"version": VERSION, "n": n, "source": source, "preset": PRESET}
    if _done(folder, facts):
        return paths
    stderr(f"  video: encoding {n} videos ({WIDTH}x{HEIGHT}, {SECONDS} s, {PRESET}) in {folder}")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    media = test_media()
    photos = load_photos(source)
    frames = SECONDS * FPS
    with webds.ShardWriter(str(folder / "video-%06d.tar"), maxcount=PER_SHARD) as sink:
        for i in range(n):
            data = media.make_video(
                seconds=SECONDS,
                fps=FPS,
                width=WIDTH,
                height=HEIGHT,
                gop=GOP,
                preset=PRESET,
                pixels=pan_frames(photos[i % len(photos)], i, frames),
            )
            sink.write({"__key__": f"{i:06d}", "mp4": data, "cls": i % len(photos)})
    _finish(folder, facts)
    return paths


def audio_shards(suite: "Suite", codec: str, n: int) -> List[str]:
    """``n`` 60 s files of ``codec`` in webds shards of 4, made once."""
    import webds

    encoder, container, ext = AUDIO_CODECS[codec]
    folder = suite.data.root / "media" / f"audio-{codec}-{n}"
    paths = [str(folder / f"audio-{s:06d}.tar") for s in range(-(-n // PER_SHARD))]
    facts = {"version": VERSION, "n": n, "codec": codec}
    if _done(folder, facts):
        return paths
    stderr(f"  audio: encoding {n} files of {AUDIO_SECONDS:.0f} s as {codec} in {folder}")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    data = test_media().make_audio(
        seconds=AUDIO_SECONDS,
        rate=AUDIO_RATE,
        channels=AUDIO_CHANNELS,
        codec=encoder,
        container=container,
    )
    with webds.ShardWriter(str(folder / "audio-%06d.tar"), maxcount=PER_SHARD) as sink:
        for i in range(n):
            sink.write({"__key__": f"{i:06d}", ext: data, "cls": i})
    _finish(folder, facts)
    return paths


def _field_facts(urls: Sequence[str], ext: str) -> Dict[str, Any]:
    import webds

    sizes = [len(s[ext]) for s in webds.WebDataset(list(urls), shardshuffle=False)]
    return {"files": len(sizes), "shards": len(urls), "mean_bytes": sum(sizes) / len(sizes)}


# -- the video contestants ----------------------------------------------------------------------


def _frame_index(data: bytes) -> Dict[float, int]:
    """Presentation time (s, rounded to 1 us) -> frame number, from webds's packet index."""
    from webds.stages.avio import open_media

    with open_media(data) as media:
        track = media.video()
        return {round(track.seconds(p), 6): i for i, p in enumerate(track.pts)}


def webds_video_clips(urls: Sequence[str]) -> Any:
    import webds

    decoder = webds.VideoClipDecoder(FRAMES, stride=STRIDE, clips=CLIPS, layout="THWC")
    # A new dataset each pass: its epoch, hence its draws, are the same every time.
    return webds.WebDataset(list(urls), shardshuffle=False, seed=0).decode(decoder)


def video_starts(urls: Sequence[str]) -> Tuple[Dict[str, List[int]], Dict[str, Any]]:
    """Each video's clip start frames as webds drew them, and webds's clips (by key)."""
    import webds

    index = {
        s["__key__"]: _frame_index(s["mp4"])
        for s in webds.WebDataset(list(urls), shardshuffle=False)
    }
    starts, clips = {}, {}
    for s in webds_video_clips(urls):
        key, got = s["__key__"], s["mp4"]
        starts[key] = [index[key][round(t, 6)] for t in got["frame_timestamps"][:, 0].tolist()]
        clips[key] = got["video"]
    return starts, clips


def whole_video_clips(video: Any, starts: Sequence[int]) -> Any:
    import torch

    return torch.stack([video[s : s + SPAN : STRIDE] for s in starts])


def energon_clips(data: bytes, starts: Sequence[int]) -> Any:
    import torch
    from megatron.energon.av import AVDecoder

    got = AVDecoder(io.BytesIO(data)).get_clips(
        video_clip_ranges=[(s, s + SPAN - 1) for s in starts], video_unit="frames"
    )
    # frames x 3 x H x W (a permuted view of frames x H x W x 3): back to read_video's layout
    return torch.stack([c[::STRIDE].permute(0, 2, 3, 1) for c in got.video_clips])


def decord_clips(data: bytes, starts: Sequence[int]) -> Any:
    import decord

    reader = decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0), num_threads=1)
    batch = reader.get_batch([s + k * STRIDE for s in starts for k in range(FRAMES)])
    return batch.reshape(len(starts), FRAMES, *batch.shape[1:])


def torchcodec_clips(data: bytes, starts: Sequence[int]) -> Any:
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(data, seek_mode="exact", num_ffmpeg_threads=1, dimension_order="NHWC")
    frames = decoder.get_frames_at([s + k * STRIDE for s in starts for k in range(FRAMES)]).data
    return frames.reshape(len(starts), FRAMES, *frames.shape[1:])


def torchcodec_works(data: bytes) -> Tuple[bool, str]:
    """Whether TorchCodec imports and decodes here, and if not, why."""
    try:
        torchcodec_clips(data, [0])
    except Exception as e:  # ImportError, or its FFmpeg libraries failing to load
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        return False, f"{type(e).__name__}: {why}"
    return True, ""


def _peer_pass(urls: Sequence[str], ext: str, starts: Dict[str, Any], clips: Callable) -> Any:
    import webds

    return webds.WebDataset(list(urls), shardshuffle=False).map(
        lambda s: {"__key__": s["__key__"], ext: clips(s[ext], starts[s["__key__"]])}
    )


def video(suite: "Suite") -> None:
    """The clip decoders side by side on the same shards (see the module's docstring)."""
    import torch

    import webds

    n = 2 if suite.quick else 16
    urls = video_shards(suite, n)
    facts = _field_facts(urls, "mp4")
    starts, reference = video_starts(urls)
    clips_per_pass = n * CLIPS
    suite.notes.append(
        f"video: {n} H.264 videos {WIDTH}x{HEIGHT}, {SECONDS} s at {FPS} fps, keyframe every "
        f"{GOP} frames, libx264 preset {PRESET} (mean {facts['mean_bytes'] / 1e3:.0f} kB), "
        f"{PER_SHARD} per shard; {CLIPS} clips of {FRAMES} frames at stride {STRIDE} a video, "
        f"uint8 clips x {FRAMES} x {HEIGHT} x {WIDTH} x 3, the same start frames for all"
    )

    def whole_pass() -> Any:
        ds = webds.WebDataset(list(urls), shardshuffle=False).decode(webds.torch_video)
        return ds.map(
            lambda s: {
                "__key__": s["__key__"],
                "mp4": whole_video_clips(s["mp4"][0], starts[s["__key__"]]),
            }
        )

    passes: Dict[str, Callable[[], Any]] = {
        WEBDS_VIDEO: lambda: webds_video_clips(urls),
        WHOLE_VIDEO: whole_pass,
    }
    if has_module("megatron.energon"):
        passes[ENERGON_VIDEO] = lambda: _peer_pass(urls, "mp4", starts, energon_clips)
    else:
        suite.notes.append(
            "video: Energon skipped: megatron-energon is not installed "
            "(pip install megatron-energon==7.4.1)"
        )
    if has_module("decord"):
        import decord

        decord.bridge.set_bridge("torch")
        passes[DECORD_VIDEO] = lambda: _peer_pass(urls, "mp4", starts, decord_clips)
    else:
        suite.notes.append("video: decord skipped: decord is not installed (pip install decord)")
    first = next(iter(webds.WebDataset([urls[0]], shardshuffle=False)))["mp4"]
    works, why = torchcodec_works(first)
    if works:
        passes[TORCHCODEC_VIDEO] = lambda: _peer_pass(urls, "mp4", starts, torchcodec_clips)
    else:
        suite.notes.append(f"video: TorchCodec skipped: {why}")

    # The same clips from every contestant: webds's must equal the whole decode's, pixel for
    # pixel; how far the others are from them is reported.
    agree: Dict[str, Any] = {}
    for name, make in passes.items():
        if name != WEBDS_VIDEO:
            got = {s["__key__"]: _video_of(s["mp4"]) for s in make()}
            agree[name] = _agreement(reference, got, name)
    if not agree[WHOLE_VIDEO]["equal"]:
        raise AssertionError(f"video: webds's clips differ from the whole decode's: {agree}")
    suite.info["video"] = {**facts, "starts": starts, "agreement_with_webds": agree}
    for name, a in agree.items():
        suite.notes.append(f"video: {name} vs webds's clips: {_agreement_text(a)}")

    def counted(make: Callable[[], Any], name: str) -> Callable[[], int]:
        def run() -> int:
            k = sum(
                s["mp4"]["video"].shape[0] if isinstance(s["mp4"], dict) else s["mp4"].shape[0]
                for s in make()
            )
            if k != clips_per_pass:
                raise AssertionError(f"video/{name}: {k} clips, expected {clips_per_pass}")
            return k

        return run

    v = {name: Variant(counted(make, name)) for name, make in passes.items()}
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    try:
        suite.results["video"] = measure(
            v, suite.config.reps, workload="video", unit="clips/s", log=stderr
        )
    finally:
        torch.set_num_threads(torch_threads)


def _video_of(field: Any) -> Any:
    return field["video"] if isinstance(field, dict) else field


def _agreement(reference: Dict[str, Any], got: Dict[str, Any], name: str) -> Dict[str, Any]:
    """Whether ``got`` holds the same clips as ``reference`` (shape, then pixels)."""
    if reference.keys() != got.keys():
        raise AssertionError(f"video/{name}: samples {sorted(got)} != {sorted(reference)}")
    worst, mean, equal = 0, 0.0, True
    for key, ref in reference.items():
        x = got[key]
        if tuple(x.shape) != tuple(ref.shape) or str(x.dtype) != str(ref.dtype):
            raise AssertionError(
                f"video/{name}: sample {key}: {tuple(x.shape)} {x.dtype}, webds gave "
                f"{tuple(ref.shape)} {ref.dtype}"
            )
        diff = (x.int() - ref.int()).abs()
        equal = equal and bool((diff == 0).all())
        worst = max(worst, int(diff.max()))
        mean += float(diff.float().mean()) / len(reference)
    return {"equal": equal, "max_abs_diff": worst, "mean_abs_diff": mean}


def _agreement_text(a: Dict[str, Any]) -> str:
    if a["equal"]:
        return "the same pixels"
    return f"differ by up to {a['max_abs_diff']} (mean {a['mean_abs_diff']:.3f}) of 255"


# -- audio --------------------------------------------------------------------------------------


def webds_audio_clips(urls: Sequence[str]) -> Any:
    import webds

    decoder = webds.AudioClipDecoder(CLIP_SECONDS, rate=CLIP_RATE, mono=True)
    return webds.WebDataset(list(urls), shardshuffle=False, seed=0).decode(decoder)


def first_sample_time(data: bytes) -> float:
    """The stream time of an audio file's first decoded sample (MP3's is not 0: the encoder's
    delay), to turn webds's clip times into indices of ``torch_audio``'s waveform."""
    from webds.stages.avaudio import audio_track
    from webds.stages.avio import open_media

    with open_media(data) as media:
        return audio_track(media).samples(0.0, 0.01)[1]


def full_audio_clip(loaded: Tuple[Any, int], start: float) -> Any:
    """``torch_audio``'s (waveform, rate), the clip from ``start`` (seconds after the first
    sample) sliced out and resampled."""
    import torch

    from webds.stages.avaudio import resample

    waveform, rate = loaded
    at = int(round(start * rate))
    piece = waveform[:, at : at + int(round(CLIP_SECONDS * rate))].numpy()
    return torch.from_numpy(_clip_length(resample(piece, rate, CLIP_RATE, True)))[None]


def energon_audio_clip(data: bytes, start: float) -> Any:
    import torch
    from megatron.energon.av import AVDecoder

    from webds.stages.avaudio import resample

    got = AVDecoder(io.BytesIO(data)).get_audio_clips(
        audio_clip_ranges=[(start, start + CLIP_SECONDS)]
    )
    (clip,) = got[0]
    samples = clip.numpy()
    if samples.dtype.kind == "i":  # the decoder's own format: FLAC's is s16
        samples = samples / float(-np.iinfo(samples.dtype).min)
    rate = AUDIO_RATE  # the files' own rate; Energon does not resample
    out = resample(np.ascontiguousarray(samples, np.float32), rate, CLIP_RATE, True)
    return torch.from_numpy(_clip_length(out))[None]


def _clip_length(samples: Any) -> Any:
    """channels x exactly ``CLIP_SECONDS * CLIP_RATE`` samples (cut, or padded with zeros), as
    webds's clips are: the resampler may give a sample more or less."""
    want = int(round(CLIP_SECONDS * CLIP_RATE))
    return np.pad(samples[:, :want], ((0, 0), (0, max(want - samples.shape[1], 0))))


def audio(suite: "Suite") -> None:
    """5 s clips at 16 kHz from 60 s FLAC and MP3: webds's clip decoder against a full decode +
    slice (and Energon's audio clips), one table per codec."""
    import webds

    n = 3 if suite.quick else 12
    info: Dict[str, Any] = {}
    for codec, (_, _, ext) in AUDIO_CODECS.items():
        urls = audio_shards(suite, codec, n)
        facts = _field_facts(urls, ext)
        starts = {
            x["__key__"]: float(x[ext]["audio_timestamps"][0, 0]) for x in webds_audio_clips(urls)
        }
        raw = webds.WebDataset(list(urls), shardshuffle=False)
        offsets = {x["__key__"]: starts[x["__key__"]] - first_sample_time(x[ext]) for x in raw}

        def full_pass(urls: Sequence[str] = urls, ext: str = ext, at: Dict = offsets) -> Any:
            ds = webds.WebDataset(list(urls), shardshuffle=False).decode(webds.torch_audio)
            return ds.map(
                lambda one: {
                    "__key__": one["__key__"],
                    ext: full_audio_clip(one[ext], at[one["__key__"]]),
                }
            )

        passes: Dict[str, Callable[[], Any]] = {
            WEBDS_AUDIO: lambda urls=urls: webds_audio_clips(urls),
            FULL_AUDIO: full_pass,
        }
        if has_module("megatron.energon"):
            passes[ENERGON_AUDIO] = lambda urls=urls, ext=ext, starts=starts: _peer_pass(
                urls, ext, starts, energon_audio_clip
            )
        got = {
            name: {x["__key__"]: _audio_of(x[ext]) for x in make()} for name, make in passes.items()
        }
        agree = {
            name: _audio_agreement(got[WEBDS_AUDIO], clips, name)
            for name, clips in got.items()
            if name != WEBDS_AUDIO
        }
        info[codec] = {**facts, "starts": starts, "agreement_with_webds": agree}
        for name, a in agree.items():
            suite.notes.append(
                f"audio-{codec}: {name} vs webds's clips: max abs diff {a['max_abs_diff']:.2g} "
                f"({a['max_abs_diff_inside']:.2g} beyond the first and last 10 ms; samples in "
                f"[-0.5, 0.5])"
            )

        def counted(make: Callable[[], Any], name: str, ext: str = ext) -> Callable[[], int]:
            def run() -> int:
                k = sum(_audio_of(x[ext]).shape[0] for x in make())
                if k != n:
                    raise AssertionError(f"audio/{name}: {k} clips, expected {n}")
                return k

            return run

        v = {name: Variant(counted(make, name)) for name, make in passes.items()}
        suite.results[f"audio-{codec}"] = measure(
            v,
            suite.config.reps,
            workload=f"audio-{codec}",
            unit="clips/s",
            min_time=MIN_TIME,
            log=stderr,
        )
    suite.notes.append(
        f"audio: {n} files a codec of {AUDIO_SECONDS:.0f} s, {AUDIO_RATE} Hz, {AUDIO_CHANNELS} "
        f"channels (a tone), {PER_SHARD} per shard; one {CLIP_SECONDS:.0f} s clip a file, mono "
        f"{CLIP_RATE} Hz, the same start for all"
    )
    suite.info["audio"] = info


def _audio_of(field: Any) -> Any:
    return field["audio"] if isinstance(field, dict) else field


def _audio_agreement(reference: Dict[str, Any], got: Dict[str, Any], name: str) -> Dict[str, Any]:
    edge = int(0.01 * CLIP_RATE)
    worst = inside = 0.0
    for key, ref in reference.items():
        x = got[key]
        if tuple(x.shape) != tuple(ref.shape):
            raise AssertionError(f"audio/{name}: {key}: {tuple(x.shape)}, webds {tuple(ref.shape)}")
        diff = (x - ref).abs()
        worst = max(worst, float(diff.max()))
        inside = max(inside, float(diff[..., edge:-edge].max()))
    return {"max_abs_diff": worst, "max_abs_diff_inside": inside}
