"""Audio fields on the PyAV backend: torch_audio as torchaudio.load was (AAC, MP3, FLAC, Opus,
WAV), the audio clip decoder against the whole decode, its resampling, its draws through
workers and resume, and bad input as DecodeErrors naming shard and member."""

import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import webds
from webds.errors import DecodeError
from webds.stages.audio import load_audio
from webds.stages.codecs import torch_audio

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("av")
from media import make_audio, make_video, tone  # noqa: E402

FORMATS = {  # extension: (codec, container, rate)
    "flac": ("flac", "flac", 16000),
    "wav": ("pcm_s16le", "wav", 16000),
    "mp3": ("libmp3lame", "mp3", 16000),
    "m4a": ("aac", "mp4", 16000),
    "opus": ("libopus", "ogg", 48000),
}


def audio_of(ext: str, seconds: float = 2.0, channels: int = 1) -> bytes:
    codec, container, rate = FORMATS[ext]
    return make_audio(
        seconds=seconds, rate=rate, channels=channels, codec=codec, container=container
    )


@pytest.mark.parametrize("ext", list(FORMATS))
def test_torch_audio_returns_what_torchaudio_load_returned(ext):
    rate = FORMATS[ext][2]
    waveform, got_rate = torch_audio("." + ext, audio_of(ext, channels=2))
    assert got_rate == rate and waveform.dtype == torch.float32 and waveform.shape[0] == 2
    assert abs(waveform.shape[1] - 2 * rate) <= 0.05 * rate  # codec padding at most
    want = tone(2.0, rate, 2)
    if ext in ("flac", "wav"):  # lossless: the tone, quantised to 16 bits
        assert waveform.shape[1] == 2 * rate
        assert np.abs(waveform.numpy() - want).max() < 2 / 32767
    else:
        assert 0.4 < float(waveform.abs().max()) < 0.6


def test_a_clip_is_the_same_stretch_of_the_whole_decode():
    data = audio_of("flac", seconds=3)
    whole, rate = torch_audio(".flac", data)
    out = webds.AudioClipDecoder(0.5, clips=3, rate=None, seed=2).bind_pass(None, 0)(
        ".flac", data, {"__key__": "k", "__url__": "u"}
    )
    assert out["audio"].shape == (3, 1, 8000) and out["audio_fps"] == 16000
    for c in range(3):
        at = int(round(float(out["audio_timestamps"][c, 0]) * rate))
        assert torch.equal(out["audio"][c, 0], whole[0, at : at + 8000]), c
    assert torch.allclose(
        out["audio_timestamps"][:, 1] - out["audio_timestamps"][:, 0],
        torch.tensor(0.5, dtype=torch.float64),
    )


@pytest.mark.parametrize("ext", ["mp3", "m4a", "opus"])
def test_resampled_clips_keep_the_tone(ext):
    out = webds.AudioClipDecoder(1.0, clips=2, rate=8000, sampling="uniform", mono=False)(
        "." + ext, audio_of(ext, seconds=3, channels=2)
    )
    assert out["audio"].shape == (2, 2, 8000) and out["audio_fps"] == 8000
    for c in range(2):
        for ch, freq in ((0, 440), (1, 880)):
            spectrum = np.abs(np.fft.rfft(out["audio"][c, ch].numpy()))
            assert abs(int(np.argmax(spectrum)) - freq) <= 2, (ext, c, ch)  # 1 Hz bins
    mono = webds.AudioClipDecoder(1.0, rate=8000, sampling="center")("." + ext, audio_of(ext, 3, 2))
    assert mono["audio"].shape == (1, 1, 8000)
    assert float(out["audio_timestamps"][0, 0]) == pytest.approx(0.0, abs=0.1)  # mp3: 69 ms
    assert float(out["audio_timestamps"][1, 1]) == pytest.approx(3.0, abs=0.1)


def test_a_file_shorter_than_a_clip_is_padded_with_silence():
    out = webds.AudioClipDecoder(2.0)(".wav", audio_of("wav", seconds=0.5))
    a = out["audio"][0, 0]
    assert a.shape == (32000,) and float(a[:7000].abs().max()) > 0.4
    assert float(a[8100:].abs().max()) == 0.0


def test_draws_repeat_through_workers_and_resume(tmp_path):
    data = audio_of("flac", seconds=2)
    url = str(tmp_path / "a.tar")
    with webds.TarWriter(url) as w:
        for i in range(6):
            w.write({"__key__": f"{i:03d}", "flac": data})

    def make():
        ds = webds.WebDataset(url, shardshuffle=False, seed=9)
        return ds.decode(webds.AudioClipDecoder(0.25, clips=2)).to_tuple("__key__", "flac")

    def drawn(it):
        return [(k, tuple(v["audio_timestamps"][:, 0].tolist())) for k, v in it]

    plain = drawn(make())
    assert len(set(s for _, s in plain)) == 6
    assert drawn(webds.WebLoader(make(), batch_size=None, num_workers=2)) == plain
    a = make()
    it = iter(a)
    first = [next(it) for _ in range(2)]
    state = a.state_dict()
    assert drawn(first) + drawn(it) == plain
    b = make()
    b.load_state_dict(state)
    assert drawn(b) == plain[2:]


def failure(data: bytes, handler, ext: str = "flac") -> DecodeError:
    with pytest.raises(DecodeError) as info:
        webds.Decoder([handler]).decode({"__key__": "0003", "__url__": "s.tar", ext: data})
    assert info.value.url == "s.tar" and info.value.member == f"0003.{ext}"
    return info.value


@pytest.mark.parametrize("handler", [torch_audio, webds.AudioClipDecoder(0.5)])
def test_bad_audio_fields(handler):
    data = audio_of("flac", seconds=2)
    assert "empty (0 bytes)" in str(failure(b"", handler))
    for cut in (10, len(data) // 3, 2 * len(data) // 3):
        failure(data[:cut], handler)
    video = make_video(seconds=1)
    assert "no audio stream (its streams: video)" in str(failure(video, handler, "m4a"))
    assert "opening the media" in str(failure(bytes(range(256)) * 10, handler, "mp3"))


def test_sample_and_duration_limits():
    data = audio_of("wav", seconds=2)
    err = failure(data, webds.AudioClipDecoder(1.0, max_samples=8000), "wav")
    assert "over max_samples=8,000" in str(err)
    err = failure(data, webds.AudioClipDecoder(1.0, max_seconds=1.0), "wav")
    assert "over max_seconds=1" in str(err)


def test_a_clip_from_the_intact_part_of_a_truncated_field_is_refused_too():
    # The clip at the centre of a 2 s FLAC cut at 9/10 lies in what is left: without the check
    # of the packets' end it decoded, and the same field failed in another epoch's draw.
    data = audio_of("flac", seconds=2)
    cut = data[: 9 * len(data) // 10]
    assert "truncated" in str(failure(cut, webds.AudioClipDecoder(0.5, sampling="center")))
    webds.AudioClipDecoder(0.5, sampling="center")("a.flac", data)  # whole: decodes


def test_sox_fields_decode():
    # .sox is in webdataset's extension list: FFmpeg's sox demuxer is allowed for it
    data = make_audio(seconds=1, codec="pcm_s32le", container="sox")
    waveform, rate = torch_audio("a.sox", data)
    assert rate == 16000 and waveform.shape == (1, 16000)
    assert abs(float(waveform.abs().max()) - 0.5) < 1e-3  # the tone, amplitude 0.5


def test_clips_from_the_same_start_are_the_same():
    # A clip longer than the field starts at 0 each time: AAC's decoder carried its overlap from
    # one clip into the next (clips 1 and 2 differed from clip 0 by up to 0.13).
    data = make_audio(seconds=3, codec="aac", container="mp4")
    out = webds.AudioClipDecoder(5.0, clips=3, rate=None)("a.m4a", data)["audio"]
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


def first_sample_time(data: bytes) -> float:
    """The stream time of the whole decode's first sample (MP3's is the encoder's delay)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return float(next(container.decode(audio=0)).time)


def clip_errors(data: bytes, out: dict) -> list:
    """Each clip's largest difference from the whole decode at the same stream times."""
    whole, rate = load_audio(data)
    t0 = first_sample_time(data)
    errors = []
    for c, start in enumerate(out["audio_timestamps"][:, 0].tolist()):
        clip = out["audio"][c]
        at = int(round((start - t0) * rate))
        assert at >= 0, (start, t0)
        want = whole[:, at : at + clip.shape[1]]
        assert want.shape[1] > clip.shape[1] // 2
        errors.append(float((clip[:, : want.shape[1]] - want).abs().max()))
    return errors


# The largest difference from the whole decode a clip may have (rate=None: no resampling). MP3 and
# AAC decoders are deterministic after their pre-roll (AAC without noise-coded bands, as these
# 16 kHz tones); Opus converges gradually (measured: 5e-4 after the 250 ms pre-roll).
LOSSY = {"mp3": 0.0, "m4a": 0.0, "opus": 1e-3}


@pytest.mark.parametrize("ext", list(LOSSY))
def test_lossy_clips_equal_the_whole_decode_at_their_times(ext):
    # Clips were decoded from the packet before them: MP3's began with 80-90 ms of zeros and
    # wrong samples (the bit reservoir), Opus's was wrong for 125 ms, AAC's for up to 55 ms.
    data = audio_of(ext, seconds=3, channels=2)
    for sampling in ("uniform", "random"):
        decoder = webds.AudioClipDecoder(0.5, clips=4, sampling=sampling, rate=None, mono=False)
        errors = clip_errors(data, decoder(f"a.{ext}", data))
        assert max(errors) <= LOSSY[ext], (sampling, errors)


@pytest.mark.parametrize("codec, rate, tolerance", [("flac", 44100, 0.0), ("libopus", 48000, 1e-3)])
def test_matroska_clips_are_placed_to_the_sample(codec, rate, tolerance):
    # Matroska stamps frames in milliseconds: FLAC's 4,608-sample frames at 44.1 kHz (104.49 ms)
    # and Opus's after its 6.5 ms pre-skip were placed up to 22 samples off (errors of 0.6).
    data = make_audio(seconds=3, rate=rate, codec=codec, container="matroska")
    out = webds.AudioClipDecoder(0.5, clips=4, sampling="random", rate=None, mono=False)
    assert max(clip_errors(data, out("a.ogg", data))) <= tolerance  # (the key picks the handler)


@pytest.mark.parametrize(
    "codec, container", [("libmp3lame", "mp4"), ("aac", "mp4"), ("libmp3lame", "matroska")]
)
def test_audio_under_video_clips_equals_the_whole_decode(codec, container):
    # MP3 under a video clip began with 1,200-1,800 zeros (75-110 ms at 16 kHz). Matroska's
    # timestamps are milliseconds: a frame placed by its own was a sample off.
    data = make_video(seconds=3, audio=True, audio_codec=codec, container=container)
    for sampling in ("uniform", "random"):
        decoder = webds.VideoClipDecoder(
            8,
            stride=2,
            clips=3,
            sampling=sampling,
            size=16,
            audio=True,
            audio_rate=None,
            mono=False,
        )
        errors = clip_errors(data, decoder(".mp4", data))
        assert max(errors) == 0.0, (sampling, errors)


def wav_data_at(data: bytes) -> int:
    """The offset of a WAV's data chunk header."""
    return data.index(b"data")


@pytest.mark.parametrize("handler", [torch_audio, webds.AudioClipDecoder(0.1)])
def test_a_truncated_wav_or_sox_is_refused(handler):
    # FFmpeg estimates a WAV's duration from the bytes present: a WAV cut to 10% decoded to a
    # 0.3 s waveform. The RIFF data chunk declares its size; Sox's header its sample count.
    data = audio_of("wav", seconds=2)
    at = wav_data_at(data)
    for cut in (at + 8 + 2, len(data) // 10, len(data) // 2, len(data) - 2):
        assert "RIFF data chunk declares 64,000 bytes" in str(failure(data[:cut], handler, "wav"))
    sox = make_audio(seconds=1, codec="pcm_s32le", container="sox")
    assert "Sox header's sample count" in str(failure(sox[: len(sox) // 2], handler, "sox"))


def test_a_streaming_wav_without_a_data_size_still_decodes():
    data = bytearray(audio_of("wav", seconds=1))
    at = wav_data_at(bytes(data))
    data[at + 4 : at + 8] = b"\xff\xff\xff\xff"  # what a writer that cannot seek back leaves
    waveform, rate = torch_audio(".wav", bytes(data))
    assert waveform.shape == (1, 16000) and rate == 16000


def test_a_truncated_ogg_is_refused():
    # Ogg declares no length (FFmpeg's duration is the last page's): a cut inside a page, or
    # between pages (the end-of-stream page is gone), decoded quietly to the cut.
    data = audio_of("opus", seconds=3)
    pages = [i for i in range(len(data)) if data[i : i + 4] == b"OggS"]
    assert len(pages) >= 4
    for cut in (len(data) // 2, len(data) - 10, pages[-1]):
        err = failure(data[:cut], torch_audio, "opus")
        assert "truncated" in str(err) and "Ogg" in str(err), cut
    torch_audio(".opus", data)  # whole: decodes
