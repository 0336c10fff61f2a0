"""Clip shards from long videos (webds.convert.clips, webds.convert.clipshards, ``webds clips``),
on real media encoded by PyAV (tests/media.py): every clip decodes to the source's own frames
over its time range, the clips cover each source frame exactly once, their packets are the
source's bytes (nothing re-encoded), audio is cut with the video, and bad videos are named."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

import webds
from webds.cli import main
from webds.errors import DecodeError
from webds.parallel import MapShardsError

av = pytest.importorskip("av", reason="PyAV is not installed")

from media import make_audio, make_video  # noqa: E402

FPS, GOP = 30, 15  # a keyframe every 0.5 s
LENGTHS = {"a": 3.0, "b": 3.5, "sub/c": 4.0}


def decoded(data: bytes) -> List[Tuple[float, np.ndarray]]:
    """(time, RGB pixels) of every video frame, decoded sequentially."""
    with av.open(io.BytesIO(data)) as c:
        return [(float(f.time), f.to_ndarray(format="rgb24")) for f in c.decode(video=0)]


def packets(data: bytes, kind: str = "video") -> List[Tuple[bytes, float]]:
    """(bytes, time in seconds) of the packets of the first ``kind`` stream, in file order."""
    with av.open(io.BytesIO(data)) as c:
        streams = [s for s in c.streams if s.type == kind][:1]
        if not streams:
            return []
        return [
            (bytes(p), float(p.pts * p.time_base))
            for p in c.demux(streams[0])
            if p.dts is not None and p.size
        ]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Dict[str, bytes]:
    """Three H.264 mp4 videos by key; 'b' has an AAC track."""
    return {
        key: make_video(seconds=s, fps=FPS, gop=GOP, audio=key == "b") for key, s in LENGTHS.items()
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory, sources) -> Path:
    root = tmp_path_factory.mktemp("videos")
    for key, data in sources.items():
        path = root / f"{key}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "notes.txt").write_text("not a video: ignored")
    return root


@pytest.fixture(scope="module")
def shard(tmp_path_factory, sources) -> Path:
    path = tmp_path_factory.mktemp("shard") / "raw-000000.tar"
    with webds.TarWriter(str(path)) as sink:
        for i, (key, data) in enumerate(sources.items()):
            sink.write({"__key__": key.replace("/", "_"), "mp4": data, "cls": i + 7})
    return path


def read_clips(where: Any) -> List[Dict[str, Any]]:
    """The samples of one shard, or of every shard in a folder."""
    path = Path(where)
    urls = [str(path)] if path.is_file() else sorted(str(p) for p in path.glob("*.tar"))
    return list(webds.DataPipeline(webds.SimpleShardList(urls), webds.tarfile_to_samples()))


def by_source(clips: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    grouped: Dict[str, List[Dict[str, Any]]] = {}
    for clip in clips:
        clip["info"] = json.loads(clip["json"])
        grouped.setdefault(clip["info"]["key"], []).append(clip)
    return grouped


def check_clips(source: bytes, clips: List[Dict[str, Any]], key: str, seconds: float) -> None:
    """The clips of one source: keys, starts at the first keyframe >= start + seconds, frames
    pixel for pixel the source's over [start, end), together every frame once, packets the
    source's bytes."""
    frames = decoded(source)
    assert [c["__key__"] for c in clips] == [f"{key}_{i:04d}" for i in range(len(clips))]
    got: List[Tuple[float, np.ndarray]] = []
    for i, clip in enumerate(clips):
        info = clip["info"]
        assert info["clip"] == i and info["codec"] == "h264" and info["fps"] == FPS
        assert (info["width"], info["height"]) == (64, 48)
        if i:
            assert info["start"] == clips[i - 1]["info"]["end"]
        mine = decoded(clip["mp4"])
        assert len(mine) == info["frames"] > 0
        for t, _ in mine:  # the clip's own time + its start = the source's time
            assert info["start"] <= info["start"] + t < info["end"]
        got += [(info["start"] + t, pixels) for t, pixels in mine]
    assert [c["info"]["start"] for c in clips] == [float(i) for i in range(len(clips))]
    assert len(got) == len(frames)  # no frame lost or repeated
    for (t, pixels), (ts, expected) in zip(got, frames):
        assert t == pytest.approx(ts, abs=1e-9)
        assert np.array_equal(pixels, expected)
    # Not re-encoded: the clips' packets are the source's, byte for byte, in order.
    assert [p for c in clips for p, _ in packets(c["mp4"])] == [p for p, _ in packets(source)]


def test_folder_into_clip_shards(tmp_path, folder, sources):
    # 0.8 s: the first keyframe at or after 0.8 s from a clip's start is 1.0 s after it.
    out = str(tmp_path / "out" / "clips-%06d.tar")
    results = webds.pack_clips(folder, out, 0.8, workers=0, progress=False)
    assert [r.samples_in for r in results] == [3] and results[0].samples_out == 11
    grouped = by_source(read_clips(tmp_path / "out"))
    assert sorted(grouped) == sorted(LENGTHS)
    for key, clips in grouped.items():
        check_clips(sources[key], clips, key, 0.8)
        assert clips[0]["info"]["source"] == str(folder / f"{key}.mp4")
        assert clips[0]["info"]["member"] is None
    assert len(grouped["b"]) == 4 and grouped["b"][-1]["info"]["end"] == 3.5  # the tail kept
    # A rerun finds the shard complete and leaves it.
    again = webds.pack_clips(folder, out, 0.8, workers=0, progress=False)
    assert again[0].skipped


def test_shards_of_videos_carry_fields_and_two_processes_match_one(tmp_path, shard, sources):
    outs = []
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        # maxsize does not group shard inputs: one output per input shard.
        webds.pack_clips(
            [str(shard), str(shard)],
            f"{out}/c-%06d.tar",
            1,
            workers=workers,
            progress=False,
            maxsize=1,
        )
        outs.append(sorted(out.iterdir()))
    assert [p.name for p in outs[0]] == ["c-000000.tar", "c-000001.tar"]
    assert [p.read_bytes() for p in outs[0]] == [p.read_bytes() for p in outs[1]]
    # A folder of shards (no video files in it), one output per input shard, threads.
    webds.pack_clips(shard.parent, f"{tmp_path}/f/", 1, executor="threads", progress=False)
    assert (tmp_path / "f" / shard.name).read_bytes() == outs[0][0].read_bytes()
    grouped = by_source(read_clips(str(outs[0][0])))
    for i, (key, data) in enumerate(sources.items()):
        clips = grouped[key.replace("/", "_")]
        check_clips(data, clips, key.replace("/", "_"), 1)
        assert {c["cls"] for c in clips} == {str(i + 7).encode()}
        assert clips[0]["info"]["source"] == str(shard)
        assert clips[0]["info"]["member"] == f"{key.replace('/', '_')}.mp4"


@pytest.mark.parametrize(
    "codec,container,ext",
    [("libvpx-vp9", "webm", "webm"), ("libx264", "matroska", "mkv"), ("mpeg4", "mp4", "mp4")],
)
def test_other_codecs_and_containers(codec, container, ext):
    data = make_video(seconds=2.5, fps=FPS, gop=GOP, codec=codec, container=container)
    clips = list(webds.split_video(data, 1, ext=ext))
    assert clips and {c.ext for c in clips} == {ext}
    frames, got = decoded(data), []
    for clip in clips:
        got += [(clip.start + t, pixels) for t, pixels in decoded(clip.data)]
    assert len(got) == len(frames)
    for (t, pixels), (ts, expected) in zip(got, frames):
        assert t == pytest.approx(ts, abs=1e-3) and np.array_equal(pixels, expected)
    assert [p for c in clips for p, _ in packets(c.data)] == [p for p, _ in packets(data)]


def test_audio_is_cut_with_the_video():
    data = make_video(seconds=3, fps=FPS, gop=GOP, audio=True, bframes=2)
    clips = list(webds.split_video(data, 1))
    assert [c.info["audio"] for c in clips] == [["aac"]] * 3
    # Every audio packet once, byte for byte, in the clip holding its time.
    assert [p for c in clips for p, _ in packets(c.data, "audio")] == [
        p for p, _ in packets(data, "audio")
    ]
    for clip in clips[1:]:
        times = [clip.start + t for _, t in packets(clip.data, "audio")]
        assert clip.start <= min(times) and max(times) < clip.end
    with av.open(io.BytesIO(clips[1].data)) as c:
        assert len(list(c.decode(audio=0))) > 0
    silent = list(webds.split_video(data, 1, video_only=True))
    assert [packets(c.data, "audio") for c in silent] == [[]] * 3
    assert [c.data for c in silent] != [c.data for c in clips]


def test_min_seconds_and_the_command(tmp_path, folder, sources, capsys):
    out = tmp_path / "cli"
    status = main(
        [
            "clips",
            str(folder),
            "-o",
            f"{out}/c-%06d.tar",
            "--seconds",
            "1",
            "--min-seconds",
            "0.6",
            "-w",
            "0",
            "--maxsize",
            "1",
        ]
    )
    assert status == 0
    assert "3 videos cut into 10 clips" in capsys.readouterr().err
    grouped = by_source(read_clips(out))
    assert len(list(out.iterdir())) == 3  # --maxsize 1: one shard per video
    assert [len(grouped[k]) for k in ("a", "b", "sub/c")] == [3, 3, 4]  # b's 0.5 s tail dropped
    assert grouped["b"][-1]["info"]["end"] == 3.0


def bad_videos() -> Dict[str, bytes]:
    mp4 = make_video(seconds=2, fps=FPS, gop=GOP)
    mkv = make_video(seconds=2, fps=FPS, gop=GOP, container="matroska")
    return {
        "text.mp4": b"this is not a video",
        "empty.mp4": b"",
        "cut-mp4.mp4": mp4[: len(mp4) // 2],
        "cut-early.mkv": mkv[:100],
        "cut-mkv.mkv": mkv[: len(mkv) // 2],
        "sound.mp4": make_audio(seconds=1, codec="aac", container="mp4"),
    }


@pytest.mark.parametrize("name,data", list(bad_videos().items()), ids=list(bad_videos()))
def test_a_bad_video_is_named(name, data):
    reason = {"sound.mp4": "no video stream", "cut-mkv.mkv": "truncated"}.get(name, "can't read")
    with pytest.raises(DecodeError, match=reason) as info:
        list(webds.split_video(data, 1, ext=name.rsplit(".", 1)[1], url="s.tar", member=name))
    assert info.value.member == name and info.value.url == "s.tar"


def test_bad_videos_fail_their_shard_or_are_skipped(tmp_path, sources, capsys):
    good = sources["a"]
    path = tmp_path / "raw.tar"
    with webds.TarWriter(str(path)) as sink:
        sink.write({"__key__": "good", "mp4": good, "cls": 1})
        bad = bad_videos()
        for name, data in bad.items():
            stem, ext = name.rsplit(".", 1)
            sink.write({"__key__": stem, ext: data, "cls": 2})
        sink.write({"__key__": "novideo", "txt": "caption"})
    out = tmp_path / "out"
    with pytest.raises(MapShardsError, match="text.mp4") as info:
        webds.pack_clips(path, f"{out}/c-%06d.tar", 1, workers=0, progress=False)
    assert len(info.value.failed) == 1
    assert not out.exists() or not list(out.iterdir())  # no partial shard
    results = webds.pack_clips(
        path, f"{out}/c-%06d.tar", 1, workers=0, progress=False, skip_bad=True
    )
    assert results[0].samples_in == 8 and len(results[0].bad) == 7
    for name, line in zip(bad, results[0].bad):
        assert f"member '{name}'" in line and f"shard '{path}'" in line
    assert "no video field" in results[0].bad[6]
    assert {json.loads(c["json"])["key"] for c in read_clips(f"{out}/c-000000.tar")} == {"good"}
    # The command: each bad video named on stderr, counted, exit status 1.
    status = main(["clips", str(path), "-o", f"{tmp_path}/cli/c-%06d.tar", "--skip-bad", "-w", "0"])
    err = capsys.readouterr().err
    assert status == 1 and "7 bad videos skipped" in err and "sound.mp4" in err


def test_arguments_refused(tmp_path, folder, shard):
    with pytest.raises(webds.ArgumentError, match="seconds"):
        webds.pack_clips(folder, str(tmp_path / "c-%06d.tar"), 0)
    with pytest.raises(webds.ArgumentError, match="%-field"):
        webds.pack_clips(folder, str(tmp_path / "c.tar"), 1, maxsize=1)
    with pytest.raises(MapShardsError, match="already has a 'cls' field"):
        webds.pack_clips(
            shard, str(tmp_path / "c-%06d.tar"), 1, info_field="cls", workers=0, progress=False
        )


SPLIT_HUGE = """
import sys, webds
sys.path.insert(0, {tests!r})
from media import h264_claiming
try:
    list(webds.split_video(h264_claiming(), 1, ext="h264", url="s.tar", member="k.h264"))
except webds.DecodeError as exn:
    print("DecodeError:", exn)
    sys.exit(0)
sys.exit(1)
"""


def test_a_stream_declaring_15872x15872_is_refused_at_bounded_memory():
    # Splitting decodes no frame, but FFmpeg's probe decodes one where the header gives no size
    # (a plain av.open takes 1.2 GB here): the probe's decoder is bounded too.
    from bombs import GiB, MiB, run_limited

    code = SPLIT_HUGE.format(tests=str(Path(__file__).parent))
    rc, out, peak = run_limited(code, 1 * GiB, timeout=120)
    assert rc == 0, out
    assert "k.h264" in out and peak < 400 * MiB, (out, peak)
