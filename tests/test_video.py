"""Video fields on the PyAV backend: torch_video as read_video was, the clip decoder's frames
pixel for pixel against PyAV's sequential decode, its draws through workers, threads and
resume, and every bad input a DecodeError at bounded memory (tests/bombs.py measures it)."""

import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import webds
from webds.errors import DecodeError
from webds.stages import avio
from webds.stages.codecs import torch_video

sys.path.insert(0, str(Path(__file__).parent))
av = pytest.importorskip("av")
from bombs import GiB, MiB, run_limited  # noqa: E402
from media import h264_claiming, make_audio, make_video  # noqa: E402

FORMATS = {
    "h264-mp4": dict(codec="libx264", container="mp4"),
    "h264-bframes": dict(codec="libx264", container="mp4", bframes=2),
    "mpeg4-mkv": dict(codec="mpeg4", container="matroska"),
    "vp9-webm": dict(codec="libvpx-vp9", container="webm"),
}


def sequential(data: bytes) -> dict:
    """pts seconds -> H x W x 3 frame, every frame decoded in order by plain PyAV."""
    with av.open(io.BytesIO(data)) as c:
        return {round(f.time, 6): f.to_ndarray(format="rgb24") for f in c.decode(video=0)}


def sample_of(data: bytes, key: str, ext: str = "mp4") -> dict:
    return {"__key__": key, "__url__": "shard.tar", ext: data}


def clips_of(decoder, data, key="k", ext="mp4"):
    return decoder.bind_pass(None, 0)("." + ext, data, sample_of(data, key, ext))


@pytest.fixture(scope="module")
def videos():
    return {name: make_video(seconds=2, fps=30, gop=15, **kw) for name, kw in FORMATS.items()}


# -- torch_video ---------------------------------------------------------------------------------


def test_torch_video_returns_what_read_video_returned(videos):
    for name, data in videos.items():
        video, audio, info = torch_video(".mp4", data)
        ref = sequential(data)
        assert video.dtype == torch.uint8 and video.shape == (60, 48, 64, 3), name
        assert np.array_equal(video.numpy(), np.stack(list(ref.values()))), name
        assert audio.shape == (1, 0) and audio.dtype == torch.float32
        assert info == {"video_fps": 30.0}
    video, audio, info = torch_video(".webm", make_video(seconds=1, audio=True))
    assert video.shape[0] == 30 and info == {"video_fps": 30.0, "audio_fps": 16000}
    assert audio.dtype == torch.float32 and audio.shape[0] == 1 and audio.shape[1] >= 16000
    assert 0.4 < float(audio.abs().max()) < 0.6  # the 0.5 tone, as floats
    assert torch_video(".flac", b"x") is None and torch_video(".jpg", b"x") is None


def test_webdataset_style_pipeline_from_a_real_shard(tmp_path, videos):
    import webds as wds

    url = str(tmp_path / "v.tar")
    with webds.TarWriter(url) as w:
        for i, data in enumerate(videos.values()):
            w.write({"__key__": f"{i:03d}", "mp4": data, "cls": str(i).encode()})
    out = list(
        wds.WebDataset(url, shardshuffle=False).decode(wds.torch_video).to_tuple("mp4", "cls")
    )
    assert [c for _, c in out] == [0, 1, 2, 3]
    for ((video, _, info), _), data in zip(out, videos.values()):
        assert video.shape == (60, 48, 64, 3) and info["video_fps"] == 30.0
        assert np.array_equal(video[7].numpy(), list(sequential(data).values())[7])


# -- the clip decoder --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("sampling", ["random", "uniform", "center"])
def test_clip_frames_equal_pyav_sequential_frames(videos, name, sampling):
    data = videos[name]
    ref = sequential(data)
    decoder = webds.VideoClipDecoder(5, stride=3, clips=3, sampling=sampling, seed=1, layout="THWC")
    out = clips_of(decoder, data)
    assert out["video"].shape == (3, 5, 48, 64, 3) and out["video"].dtype == torch.uint8
    assert out["video_fps"] == 10.0
    times = out["frame_timestamps"].numpy()
    for c in range(3):
        np.testing.assert_allclose(np.diff(times[c]), 0.1, atol=2e-3)  # every third frame
        for f in range(5):
            assert np.array_equal(out["video"][c, f].numpy(), ref[round(times[c, f], 6)])
    assert np.allclose(out["video_timestamps"][:, 0], times[:, 0])
    # each clip stands for frames / video_fps seconds (its frames every 1 / video_fps of them)
    assert np.allclose(out["video_timestamps"][:, 1], times[:, 0] + 5 / 10.0, atol=2e-3)
    starts = times[:, 0]
    assert list(starts) == sorted(starts)
    if sampling == "uniform":  # first frame to last possible start
        assert starts[0] == 0 and abs(starts[-1] - (59 - 12) / 30) < 2e-3
    if sampling == "center":  # back to back around the middle
        np.testing.assert_allclose(np.diff(starts), 13 / 30, atol=2e-3)


def test_fps_sampling_takes_the_frame_shown_at_each_tick(videos):
    data = videos["h264-mp4"]
    ref = sequential(data)
    out = clips_of(webds.VideoClipDecoder(6, fps=12.0, clips=2, sampling="uniform"), data)
    assert out["video"].shape == (2, 6, 3, 48, 64) and out["video_fps"] == 12.0
    for c in range(2):
        t0 = float(out["frame_timestamps"][c, 0])
        for k in range(6):
            shown = max(t for t in ref if t <= t0 + k / 12 + 1e-6)
            assert float(out["frame_timestamps"][c, k]) == pytest.approx(shown, abs=1e-6)
            assert np.array_equal(out["video"][c, k].permute(1, 2, 0).numpy(), ref[shown])


def test_a_clip_decodes_from_its_keyframe_to_its_last_frame_only(monkeypatch):
    data = make_video(seconds=3, fps=30, gop=15)  # 90 frames, a keyframe every 15
    tracks = []
    real = avio.VideoTrack.frames

    def spy(self, targets):
        tracks.append(self)
        return real(self, targets)

    monkeypatch.setattr(avio.VideoTrack, "frames", spy)
    out = clips_of(webds.VideoClipDecoder(4, stride=1, clips=1, sampling="center"), data)
    first = round(float(out["frame_timestamps"][0, 0]) * 30)
    assert first == 43  # frames 43-46: from keyframe 30 to frame 46
    assert tracks[0].decoded == 46 - 30 + 1
    # two clips far apart: two seeks, never the frames between them or after the last
    tracks.clear()
    clips_of(webds.VideoClipDecoder(2, stride=1, clips=2, sampling="uniform"), data)
    assert tracks[0].decoded == 2 + (89 - 75 + 1)  # frames 0-1, then 75-89


def test_size_crop_and_layout(videos):
    data = videos["h264-mp4"]
    kw = dict(frames=3, stride=2, clips=2, sampling="uniform")
    full = clips_of(webds.VideoClipDecoder(**kw, layout="THWC"), data)["video"]
    small = clips_of(webds.VideoClipDecoder(**kw, size=24, layout="THWC"), data)["video"]
    assert small.shape == (2, 3, 24, 32, 3)  # the short side 24, the aspect kept
    with av.open(io.BytesIO(data)) as c:  # FFmpeg's scaler, as PyAV's reformat gives it
        frame0 = next(c.decode(video=0)).reformat(width=32, height=24, format="rgb24").to_ndarray()
    assert np.array_equal(small[0, 0].numpy(), frame0)
    exact = clips_of(webds.VideoClipDecoder(**kw, size=(20, 40)), data)["video"]
    assert exact.shape == (2, 3, 3, 20, 40)
    centre = clips_of(webds.VideoClipDecoder(**kw, crop=(16, 32), layout="THWC"), data)["video"]
    assert np.array_equal(centre.numpy(), full[:, :, 16:32, 16:48].numpy())
    tchw = clips_of(webds.VideoClipDecoder(**kw), data)["video"]
    assert tchw.is_contiguous() and torch.equal(tchw, full.permute(0, 1, 4, 2, 3))
    crops = clips_of(webds.VideoClipDecoder(2, clips=8, crop=8, seed=3, layout="THWC"), data)
    v = crops["video"].numpy()
    assert v.shape == (8, 2, 8, 8, 3)
    # random sampling: one crop place a clip, drawn (not all the centre)
    whole = sequential(data)
    found = []
    for c in range(8):
        ref = whole[round(float(crops["frame_timestamps"][c, 0]), 6)]
        hits = [
            (y, x)
            for y in range(41)
            for x in range(57)
            if np.array_equal(ref[y : y + 8, x : x + 8], v[c, 0])
        ]
        assert hits, c
        found.append(hits[0])
    assert len(set(found)) > 1


def test_a_video_shorter_than_a_clip_repeats_its_last_frame():
    data = make_video(seconds=0.2, fps=30, gop=30)  # 6 frames
    out = clips_of(webds.VideoClipDecoder(5, stride=2, clips=2, layout="THWC"), data)
    times = out["frame_timestamps"].numpy()
    assert np.allclose(times, [[0, 2 / 30, 4 / 30, 5 / 30, 5 / 30]] * 2, atol=1e-3)
    assert torch.equal(out["video"][0, 3], out["video"][0, 4])
    assert not torch.equal(out["video"][0, 2], out["video"][0, 3])


def test_clips_with_their_audio():
    data = make_video(seconds=2, fps=30, gop=15, audio=True)
    out = clips_of(
        webds.VideoClipDecoder(8, stride=2, clips=2, audio=True, sampling="uniform"), data
    )
    assert out["audio"].shape == (2, 1, int(round(16 / 30 * 16000))) and out["audio_fps"] == 16000
    assert torch.allclose(out["audio_timestamps"][:, 0], out["video_timestamps"][:, 0])
    _, whole, info = torch_video(".mp4", data)
    for c in range(2):  # the same samples as the whole decode at the clip's start
        at = int(round(float(out["audio_timestamps"][c, 0]) * 16000))
        want = whole[0, at : at + out["audio"].shape[-1]]
        assert float((out["audio"][c, 0] - want).abs().mean()) < 0.01, c
    with pytest.raises(DecodeError, match="no audio stream"):
        clips_of(webds.VideoClipDecoder(2, audio=True), make_video(seconds=1))


# -- repeatable draws ----------------------------------------------------------------------------


def write_shard(path: Path, n: int) -> str:
    data = make_video(seconds=1, fps=30, gop=10)
    with webds.TarWriter(str(path)) as w:
        for i in range(n):
            w.write({"__key__": f"{i:04d}", "mp4": data})  # one video, many keys: many draws
    return str(path)


def drawn(dataset):
    return [(k, tuple(v["frame_timestamps"][:, 0].tolist())) for k, v in dataset]


def test_draws_repeat_through_workers_threads_and_resume(tmp_path):
    urls = [write_shard(tmp_path / "a.tar", 4), write_shard(tmp_path / "b.tar", 4)]
    decoder = webds.VideoClipDecoder(3, stride=2, clips=2, size=16)

    def make(threads=0, seed=5):
        ds = webds.WebDataset(urls, shardshuffle=False, seed=seed)
        return ds.decode(decoder, threads=threads).to_tuple("__key__", "mp4")

    plain = drawn(make())
    assert len(plain) == 8 and len(set(s for _, s in plain)) > 4  # keys draw apart
    assert drawn(make(threads=2)) == plain
    loader = webds.WebLoader(make(), batch_size=None, num_workers=2)
    assert sorted(drawn(loader)) == sorted(plain)
    assert drawn(make(seed=6)) != plain
    a = make()
    it = iter(a)
    before = [next(it) for _ in range(3)]
    state = a.state_dict()
    whole = drawn(before) + drawn(it)
    next_epoch = drawn(a)
    assert whole == plain and next_epoch != plain  # a new epoch, new clips
    b = make()
    b.load_state_dict(state)
    assert drawn(b) == plain[3:] and drawn(b) == next_epoch


# -- bounds and bad input ------------------------------------------------------------------------


def failure(data: bytes, ext: str = "mp4", handler=torch_video) -> DecodeError:
    """The DecodeError the decode stage raises for a field, with its shard and member."""
    sample = {"__key__": "0007", "__url__": "shard-000.tar", ext: data}
    with pytest.raises(DecodeError) as info:
        webds.Decoder([handler]).decode(sample)
    assert info.value.url == "shard-000.tar" and info.value.member == f"0007.{ext}"
    return info.value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_truncated_fields(container):
    data = make_video(seconds=2, fps=30, gop=15, container=container)
    for cut in (0, 50, len(data) // 4, len(data) // 2, 3 * len(data) // 4):
        err = failure(data[:cut])
        assert "truncated" in str(err) or "empty" in str(err) or "opening the media" in str(err)


def test_corrupt_and_empty_fields():
    assert "empty (0 bytes)" in str(failure(b""))
    assert "opening the media" in str(failure(bytes(range(256)) * 40))
    data = bytearray(make_video(seconds=1, container="matroska"))
    data[200:2000] = bytes(1800)  # the first keyframe's data zeroed
    err = failure(bytes(data))
    assert "cannot decode field 'mp4'" in str(err)


def test_no_video_stream_and_no_decoder():
    assert "no video stream (its streams: audio)" in str(
        failure(make_audio(codec="aac", container="mp4"))
    )
    # a WAV whose format tag names no codec FFmpeg has
    wav = bytearray(make_audio(codec="pcm_s16le", container="wav"))
    wav[20:22] = (0x7777).to_bytes(2, "little")
    err = failure(bytes(wav), "wav", webds.AudioClipDecoder(0.5))
    assert "this FFmpeg build has no decoder for the field's audio codec" in str(err)


def test_pixel_and_duration_budgets_refuse_before_decoding(monkeypatch):
    data = make_video(seconds=2, fps=30, gop=15)
    decoded = []
    real = avio.VideoTrack._decode_span
    monkeypatch.setattr(avio.VideoTrack, "_decode_span", lambda *a: decoded.append(1) or real(*a))
    # uniform (not random) clips: frames 0-7 and 52-59, decoded from keyframes 0 and 45: 23
    # frames (random clips that both start on a keyframe need 16, under the budget: it flaked)
    clips = dict(stride=1, clips=2, sampling="uniform")
    err = failure(data, handler=webds.VideoClipDecoder(8, max_pixels=64 * 48 * 20, **clips))
    assert "over max_pixels=61,440" in str(err) and "max_pixels=N" in str(err)
    err = failure(data, handler=webds.VideoClipDecoder(8, max_seconds=1.5))
    assert "over max_seconds=1.5" in str(err)
    err = failure(data, handler=webds.VideoClipDecoder(8, max_frame_pixels=64 * 47))
    assert "64x48 frame" in str(err)
    assert not decoded
    # within the budget: the same clips decode at 23 frames' pixels
    out = webds.VideoClipDecoder(8, max_pixels=64 * 48 * 23, **clips)("a.mp4", data)
    assert decoded and out["video"].shape[:2] == (2, 8)


@pytest.mark.timeout(30)
def test_playlists_that_never_end_or_reach_elsewhere_are_refused(tmp_path):
    loop = tmp_path / "loop.ffconcat"
    loop.write_text(f"ffconcat version 1.0\nfile '{loop}'\nfile '{loop}'\n")
    assert "opening the media" in str(failure(loop.read_bytes()))
    hls = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nhttp://127.0.0.1:9/x.ts\n#EXT-X-ENDLIST\n"
    assert "opening the media" in str(failure(hls))


def test_a_stream_of_endless_frames_stops_at_the_pixel_budget():
    # A raw H.264 stream declares no length: the frames are counted from its packets, and the
    # whole decode torch_video asks for is refused past max_pixels before any is decoded.
    data = make_video(seconds=10, fps=30, gop=300, container="h264")
    with pytest.raises(DecodeError, match="300 frames of 64x48"):
        webds.stages.video.read_video(data, avio.Limits(max_pixels=64 * 48 * 100))


HUGE = """
import sys, webds
sys.path.insert(0, {tests!r})
from media import h264_claiming
data = h264_claiming()
try:
    webds.Decoder([{handler}]).decode({{"__key__": "k", "__url__": "u.tar", "{ext}": data}})
except webds.DecodeError as exn:
    print("DecodeError:", exn, "torch" in sys.modules)
    sys.exit(0)
sys.exit(1)
"""


@pytest.mark.parametrize("handler", ["webds.torch_video", "webds.VideoClipDecoder(4)"])
def test_an_sps_declaring_15872x15872_is_refused_at_bounded_memory(handler):
    code = HUGE.format(tests=str(Path(__file__).parent), handler=handler, ext="h264")
    rc, out, peak = run_limited(code, 1 * GiB, timeout=120)
    assert rc == 0, out  # a DecodeError: not a MemoryError, not a kill
    assert "15872x15872 frame" in out and "max_frame_pixels" in out and "member 'k.h264'" in out
    assert peak < 400 * MiB, peak
    assert len(h264_claiming()) < 20_000


def test_frames_not_wanted_that_nothing_refers_to_are_skipped_and_the_rest_is_exact():
    # libx264's medium preset: B-frames, some of them references (b-pyramid). A frame not
    # wanted is skipped before decoding only when no frame refers to it: the frames wanted are
    # those of a sequential decode, pixel for pixel, from fewer frames decoded.
    import random

    import av

    data = make_video(seconds=2, fps=30, width=96, height=64, gop=60, preset="medium")
    with av.open(io.BytesIO(data)) as container:
        sequential = {f.pts: f.to_ndarray(format="rgb24") for f in container.decode(video=0)}
    pts = sorted(sequential)
    rng = random.Random(0)
    skipped = 0
    for _ in range(6):
        targets = sorted(rng.sample(pts[:60], 8))  # one run, from the first keyframe
        with avio.open_media(data) as media:
            track = media.video()
            got = {p: f.to_ndarray(format="rgb24") for p, f in track.frames(targets)}
            skipped += pts.index(targets[-1]) + 1 - track.decoded
        assert sorted(got) == targets
        for p in targets:
            assert np.array_equal(got[p], sequential[p]), p
    assert skipped > 0  # B-frames no frame refers to were not decoded


def sequential_by_time(data: bytes) -> dict:
    import av

    with av.open(io.BytesIO(data)) as container:
        return {round(f.time, 3): f.to_ndarray(format="rgb24") for f in container.decode(video=0)}


@pytest.mark.parametrize(
    "codec,container",
    [("mpeg1video", "mpeg"), ("mpeg2video", "mpegts"), ("wmv2", "asf"), ("libx264", "mpegts")],
)
def test_program_transport_and_asf_streams_give_the_frames_they_are_stamped_with(codec, container):
    # After a seek, MPEG-1/2 and ASF packets' pts need not be their frames': clips came out a
    # frame early under the right stamps (MPEG-1 in PS), or failed ("12 of 8 found").
    data = make_video(seconds=2, fps=25, codec=codec, container=container, gop=10)
    reference = sequential_by_time(data)
    for sampling in ("uniform", "random", "center"):
        out = webds.VideoClipDecoder(4, stride=2, clips=2, sampling=sampling, layout="THWC")(
            "a.mpg", data
        )
        for c, times in enumerate(out["frame_timestamps"].tolist()):
            for f, t in enumerate(times):
                assert np.array_equal(out["video"][c, f].numpy(), reference[round(t, 3)]), (c, f)


def test_a_matroska_stream_that_starts_late_is_not_called_truncated():
    # Matroska's Duration counts from 0: a stream starting at 5 s was "truncated" (declared
    # 5 + 7 s, ending at 7 s).
    from fractions import Fraction

    import av
    from media import frame_pixels

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        for i in range(50):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, 64, 48), format="rgb24")
            frame.pts, frame.time_base = 5000 + 40 * i, Fraction(1, 1000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    data = buf.getvalue()
    reference = sequential_by_time(data)
    out = webds.VideoClipDecoder(8, stride=1, clips=2, layout="THWC")("a.mkv", data)
    t = round(float(out["frame_timestamps"][1, 0]), 3)
    assert t >= 5.0 and np.array_equal(out["video"][1, 0].numpy(), reference[t])
    with pytest.raises(DecodeError, match="truncated"):
        webds.VideoClipDecoder(8, stride=1, clips=2)("a.mkv", data[: len(data) // 2])


WHOLE = """
import resource, sys, webds
sys.path.insert(0, {tests!r})
from media import make_video
data = make_video(seconds=100, fps=30, width=16, height=16, gop=300)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
video, audio, info = webds.torch_video("a.mp4", data)
print(tuple(video.shape), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_torch_video_holds_no_frame_it_has_converted():
    # 3,000 16x16 frames (a 150 KB field, 2.3 MB decoded): a list of decoded frames held 290 KB
    # each in FFmpeg's buffers, 883 MB in all.
    import subprocess

    code = WHOLE.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    shape, grown_mib = out.stdout.rsplit(")", 1)
    assert shape.startswith("(3000, 16, 16, 3"), out.stdout + out.stderr
    assert int(grown_mib) < 100, out.stdout
