"""Encoders and decoders: write-then-read round trips for every extension, image specs, errors."""

from __future__ import annotations

import bz2
import fractions
import gzip
import io
import lzma
import pickle
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from webds.base.handlers import ignore_and_continue
from webds.errors import ArgumentError, DecodeError, EncodeError
from webds.stages.codecs import (
    AUDIO_EXTENSIONS,
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    BasicHandlers,
    basichandlers,
    imagehandler,
    imagespecs,
    torch_audio,
    torch_loads,
    torch_video,
)
from webds.stages.decode import (
    Continue,
    Decoder,
    DecodingError,
    decode,
    default_decoder,
    gzfilter,
    handle_extension,
    make_decoder,
)
from webds.stages.encode import (
    cbor_dumps,
    default_handlers,
    encode_sample,
    imageencoder,
    make_encoder,
    mp_dumps,
    numpy_dumps,
    numpy_npz_dumps,
    tenbin_dumps,
    torch_dumps,
)
from webds.tar.samples import tarfile_to_samples
from webds.writer import TarWriter

# -- helpers ----------------------------------------------------------------------------------


def read_with_tarfile(path: Path) -> list:
    """Samples from a shard, grouped with Python's tarfile (independent of webds's reader)."""
    samples: list = []
    with tarfile.open(path) as tf:
        for m in tf:
            if not m.isfile():
                continue
            folder, _, base = m.name.rpartition("/")
            stem, _, ext = base.partition(".")
            key = f"{folder}/{stem}" if folder else stem
            if not samples or samples[-1]["__key__"] != key:
                samples.append({"__key__": key, "__url__": str(path)})
            samples[-1][ext] = tf.extractfile(m).read()
    return samples


def write_then_read(tmp_path: Path, sample: dict, name: str = "rt.tar") -> dict:
    """Write one sample with TarWriter; read it back raw, checking both readers agree."""
    path = tmp_path / name
    with TarWriter(str(path)) as sink:
        sink.write(sample)
    (raw,) = read_with_tarfile(path)
    (ours,) = list(tarfile_to_samples()([{"url": str(path)}]))
    assert {k: v for k, v in ours.items() if not k.startswith("__")} == {
        k: v for k, v in raw.items() if not k.startswith("__")
    }
    assert ours["__key__"] == raw["__key__"]
    return raw


def assert_same(a, b):
    """Structural equality that understands arrays and tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


ARR = np.arange(12, dtype=np.float32).reshape(3, 4) / 7

# (extension, value written, value expected after decode)
ROUND_TRIPS = [
    *[(ext, 7, 7) for ext in "cls cls2 class count index inx id".split()],
    ("cls", -3, -3),
    ("cls", np.int64(5), 5),
    ("cls", torch.tensor(9), 9),
    *[(ext, "héllo ✓\nline", "héllo ✓\nline") for ext in "txt text transcript html htm".split()],
    *[(ext, {"a": [1, 2.5, None, "x"], "b": True}, None) for ext in ("json", "jsn")],
    ("npy", ARR, None),
    ("npy", np.array([[True, False]]), None),
    ("npy", torch.arange(4), np.arange(4)),
    ("npz", {"a": ARR, "b": np.arange(3, dtype=np.uint16)}, None),
    ("pth", {"w": torch.ones(2, 3), "n": 3}, None),
    *[(ext, [ARR, np.arange(5, dtype="u4")], None) for ext in ("ten", "tenbin", "tb")],
    ("ten", ARR, [ARR]),
    *[(ext, {"a": [1, "s", b"bin"], "f": 1.5}, None) for ext in ("mp", "msgpack", "msg")],
    ("bin", b"\x00\x01\xff", b"\x00\x01\xff"),
    ("foo", "plain str", b"plain str"),
    ("seg.txt", "nested ext", "nested ext"),
]


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
@pytest.mark.parametrize(
    "ext, value, expected", ROUND_TRIPS, ids=[f"{r[0]}-{i}" for i, r in enumerate(ROUND_TRIPS)]
)
def test_round_trip(tmp_path, ext, value, expected, gz):
    field = ext + ".gz" if gz else ext
    raw = write_then_read(tmp_path, {"__key__": "s0", field: value})
    if gz:
        assert raw[field][:2] == b"\x1f\x8b"
        assert raw[field][4:8] == b"\0\0\0\0"  # gzip mtime 0: deterministic
    decoded = Decoder([])(raw)
    assert set(decoded) == {"__key__", "__url__", field}
    assert_same(value if expected is None else expected, decoded[field])


@pytest.mark.parametrize("ext", ["pyd", "pickle", "pkl"])
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_pickle_round_trip_needs_opt_in(tmp_path, ext, gz):
    field = ext + ".gz" if gz else ext
    value = {"frac": fractions.Fraction(1, 3), "set": {1, 2}}
    raw = write_then_read(tmp_path, {"__key__": "p", field: value})
    with pytest.raises(DecodeError, match="allow_pickle=True") as info:
        Decoder([])(raw)
    assert info.value.member == f"p.{field}"
    assert Decoder([], allow_pickle=True)(raw)[field] == value
    (out,) = list(decode(allow_pickle=True)([raw]))
    assert out[field] == value
    with pytest.raises(DecodeError, match="arbitrary code"):
        list(decode()([raw]))


def test_pth_weights_only(tmp_path):
    raw = write_then_read(tmp_path, {"__key__": "t", "pth": {"frac": fractions.Fraction(1, 3)}})
    with pytest.raises(DecodeError, match="weights_only=False"):
        Decoder([])(raw)
    assert Decoder([], weights_only=False)(raw)["pth"] == {"frac": fractions.Fraction(1, 3)}
    (out,) = list(decode(weights_only=False)([raw]))
    assert out["pth"]["frac"] == fractions.Fraction(1, 3)
    # plain tensors load with the safe default, onto the CPU
    assert torch.equal(torch_loads(torch_dumps(torch.arange(3))), torch.arange(3))


def test_cbor_round_trip(tmp_path):
    pytest.importorskip("cbor2")
    raw = write_then_read(tmp_path, {"__key__": "c", "cbor": {"a": [1, 2]}, "x.cbor.gz": [3]})
    out = Decoder([])(raw)
    assert out["cbor"] == {"a": [1, 2]} and out["x.cbor.gz"] == [3]


def _block_import(monkeypatch, *names):
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError


def test_missing_msgpack_and_cbor_say_what_to_install(monkeypatch):
    packed = mp_dumps({"a": 1})
    _block_import(monkeypatch, "msgpack", "cbor2", "cbor")
    with pytest.raises(DecodeError, match="pip install msgpack") as info:
        Decoder([])({"__key__": "k", "__url__": "u.tar", "mp": packed})
    assert info.value.url == "u.tar" and info.value.member == "k.mp"
    with pytest.raises(DecodeError, match="pip install cbor2"):
        Decoder([])({"__key__": "k", "cbor": b"\xa0"})
    with pytest.raises(EncodeError, match="pip install msgpack"):
        encode_sample({"__key__": "k", "mp": {"a": 1}})
    with pytest.raises(EncodeError, match="pip install cbor2"):
        cbor_dumps({})


# -- images -----------------------------------------------------------------------------------


def _rgba_image() -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, size=(6, 9, 4), dtype=np.uint8)


def _expected(spec: str, rgba: np.ndarray):
    """What each spec should give for a PNG of ``rgba``, computed with PIL directly."""
    atype, etype, mode = imagespecs[spec]
    pil = Image.fromarray(rgba, "RGBA").convert(mode.upper())
    if atype == "pil":
        return pil
    a = np.array(pil)
    if etype == "float":
        a = a.astype(np.float32) / 255.0
    if atype == "torch":
        t = torch.from_numpy(a)
        return t.permute(2, 0, 1) if t.ndim == 3 else t
    return a


SPEC_SHAPES = {
    "l8": ("numpy", np.uint8, (6, 9)),
    "rgb8": ("numpy", np.uint8, (6, 9, 3)),
    "rgba8": ("numpy", np.uint8, (6, 9, 4)),
    "l": ("numpy", np.float32, (6, 9)),
    "rgb": ("numpy", np.float32, (6, 9, 3)),
    "rgba": ("numpy", np.float32, (6, 9, 4)),
    "torchl8": ("torch", torch.uint8, (6, 9)),
    "torchrgb8": ("torch", torch.uint8, (3, 6, 9)),
    "torchrgba8": ("torch", torch.uint8, (4, 6, 9)),
    "torchl": ("torch", torch.float32, (6, 9)),
    "torchrgb": ("torch", torch.float32, (3, 6, 9)),
    "torch": ("torch", torch.float32, (3, 6, 9)),
    "torchrgba": ("torch", torch.float32, (4, 6, 9)),
    "pil": ("pil", "RGB", (9, 6)),
    "pilrgb": ("pil", "RGB", (9, 6)),
    "pill": ("pil", "L", (9, 6)),
    "pilrgba": ("pil", "RGBA", (9, 6)),
}


def test_all_specs_are_covered():
    assert set(SPEC_SHAPES) == set(imagespecs)
    assert len(imagespecs) == 17


@pytest.mark.parametrize("spec", list(SPEC_SHAPES))
def test_image_specs_after_round_trip(tmp_path, spec):
    rgba = _rgba_image()
    raw = write_then_read(tmp_path, {"__key__": "im", "png": rgba, "seg.png": rgba[:, :, 0]})
    out = Decoder([imagehandler(spec)])(raw)
    kind, dtype, shape = SPEC_SHAPES[spec]
    value, expected = out["png"], _expected(spec, rgba)
    if kind == "pil":
        assert isinstance(value, Image.Image) and value.mode == dtype and value.size == shape
        assert np.array_equal(np.array(value), np.array(expected))
    elif kind == "torch":
        assert isinstance(value, torch.Tensor) and value.dtype == dtype
        assert tuple(value.shape) == shape and value.is_contiguous()
        assert torch.equal(value, expected)
    else:
        assert isinstance(value, np.ndarray) and value.dtype == dtype and value.shape == shape
        np.testing.assert_array_equal(value, expected)
    # multi-dot field: decided by the last extension
    assert not isinstance(out["seg.png"], bytes)


def test_image_encoders_round_trip_float_and_uint8(tmp_path):
    rgb = _rgba_image()[:, :, :3]
    sample = {
        "__key__": "x",
        "png": rgb,
        "webp": rgb,  # lossless
        "tiff": rgb,
        "tif": rgb[:, :, 0],
        "bmp": rgb,
        "ppm": rgb,
        "pgm": rgb[:, :, 0],
        "a.png": rgb.astype(np.float32) / 255.0,  # float in [0, 1]
        "b.png": torch.from_numpy(rgb).permute(2, 0, 1).contiguous(),  # CxHxW tensor
        "c.png": Image.fromarray(rgb),
        "d.png": rgb[:, :, :1],  # HxWx1
        "e.png": rgb.astype(np.int64),  # integer values in 0..255
        "jpg": rgb,
        "jpeg.gz": rgb,
    }
    raw = write_then_read(tmp_path, sample)
    assert raw["png"][:8] == b"\x89PNG\r\n\x1a\n" and raw["jpg"][:2] == b"\xff\xd8"
    assert raw["webp"][8:12] == b"WEBP" and raw["bmp"][:2] == b"BM"
    assert raw["ppm"][:2] == b"P6" and raw["pgm"][:2] == b"P5"
    out = Decoder([imagehandler("rgb8")])(raw)
    for field in ("png", "webp", "tiff", "bmp", "ppm", "a.png", "b.png", "c.png", "e.png"):
        np.testing.assert_array_equal(out[field], rgb, err_msg=field)
    gray = np.stack([rgb[:, :, 0]] * 3, axis=2)
    for field in ("tif", "pgm", "d.png"):
        np.testing.assert_array_equal(out[field], gray, err_msg=field)
    for field in ("jpg", "jpeg.gz"):  # quality 100: lossy, but close
        assert out[field].shape == rgb.shape
        assert np.abs(out[field].astype(int) - rgb.astype(int)).mean() < 8


def test_float_decode_then_encode_is_exact(tmp_path):
    rgb = _rgba_image()[:, :, :3]
    first = Decoder([imagehandler("torchrgb")])(
        write_then_read(tmp_path, {"__key__": "f", "png": rgb})
    )
    again = write_then_read(tmp_path, {"__key__": "f", "png": first["png"]}, name="again.tar")
    assert np.array_equal(Decoder([imagehandler("rgb8")])(again)["png"], rgb)


@pytest.mark.parametrize(
    "value, match",
    [
        (np.zeros((4, 4, 2), np.uint8), "C in 1, 3, 4"),
        (np.zeros((4, 4), np.float32) + 2.0, r"\[0, 1\]"),
        (np.full((4, 4), np.nan, np.float32), r"\[0, 1\]"),
        (np.full((4, 4), 300, np.int32), "0..255"),
        (np.zeros((4, 4), np.complex64), "uint8 or float"),
        (torch.zeros(5, 4, 4), "CxHxW"),
    ],
)
def test_bad_images_are_refused(value, match):
    with pytest.raises(EncodeError, match=match) as info:
        encode_sample({"__key__": "bad", "png": value})
    assert info.value.member == "bad.png"


def test_jpeg_refuses_alpha_but_png_keeps_it():
    rgba = _rgba_image()
    with pytest.raises(EncodeError, match="alpha"):
        encode_sample({"__key__": "a", "jpg": rgba})
    png = imageencoder(rgba, "png")
    assert np.array_equal(np.array(Image.open(io.BytesIO(png))), rgba)


def test_unknown_image_spec_lists_valid_ones():
    with pytest.raises(ArgumentError, match="rgb8.*torchrgba.*pilrgba") as info:
        imagehandler("rgb16")
    assert "rgb16" in str(info.value)
    with pytest.raises(ArgumentError, match="valid specs"):
        list(decode("nope")([{"__key__": "a"}]))


def test_images_stay_bytes_without_a_spec(tmp_path):
    raw = write_then_read(tmp_path, {"__key__": "a", "png": np.zeros((2, 2), np.uint8)})
    assert isinstance(default_decoder(raw)["png"], bytes)


def test_image_extension_table():
    for ext in ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm", "pgm", "pbm"):
        assert ext in IMAGE_EXTENSIONS
    assert "mp4" in VIDEO_EXTENSIONS and "wav" in AUDIO_EXTENSIONS
    # every extension the image encoder writes is one the image decoder reads
    for ext in ("jpg", "jpeg", "img", "image", "png", "ppm", "pgm", "pbm", "tif", "tiff", "webp"):
        assert ext in IMAGE_EXTENSIONS


def test_peer_sample_tgz_pngs(peer_dir):
    with tarfile.open(peer_dir / "sample.tgz") as tf:
        members = {m.name: tf.extractfile(m).read() for m in tf if m.isfile()}
    keys = sorted({name.split(".")[0] for name in members})
    assert len(keys) == 90
    decoder = Decoder([imagehandler("torchrgb8")])
    for key in keys:
        sample = {"__key__": key, "cls": members[f"{key}.cls"], "png": members[f"{key}.png"]}
        out = decoder(sample)
        assert isinstance(out["cls"], int)
        assert out["png"].dtype == torch.uint8 and out["png"].shape[0] == 3


# -- the decoder machinery --------------------------------------------------------------------


def test_peer_gz_and_msgpack_fields(peer_dir):
    with tarfile.open(peer_dir / "testgz.tar") as tf:
        texts = [tf.extractfile(m).read() for m in tf if m.isfile()]
    assert len(texts) == 1000
    for data in texts[:50]:
        assert isinstance(Decoder([])({"__key__": "k", "txt.gz": data})["txt.gz"], str)
    with tarfile.open(peer_dir / "mpdata.tar") as tf:
        packed = [tf.extractfile(m).read() for m in tf if m.isfile()]
    assert len(packed) == 100
    first = Decoder([])({"__key__": "k", "mp": packed[0]})["mp"]
    assert first == {"x": 0, "y": 0}


def test_gz_key_is_kept_and_inner_extension_decides():
    data = gzip.compress(b"42")
    out = Decoder([])({"__key__": "k", "cls.gz": data, "bin.gz": gzip.compress(b"\x00")})
    assert out["cls.gz"] == 42 and out["bin.gz"] == b"\x00"
    assert isinstance(gzfilter(".cls.gz", data), Continue)
    assert gzfilter(".cls", b"1") is None


def test_handler_chain_and_continue():
    calls = []

    def upper(key, data):
        calls.append(key)
        if key.endswith(".shout"):
            return Continue(key[: -len(".shout")] + ".txt", data.upper())
        return None

    out = Decoder([upper])({"__key__": "k", "a.shout": b"hi", "txt": b"lo"})
    assert out["a.shout"] == "HI" and out["txt"] == "lo"
    assert sorted(calls) == [".a.shout", ".txt"]


def test_handle_extension_matches_trailing_parts():
    h = handle_extension("seg.png  FOO", lambda data: ("hit", data))
    assert h(".seg.png", b"1") == ("hit", b"1")
    assert h(".x.SEG.png", b"2") == ("hit", b"2")
    assert h(".png", b"3") is None
    assert h(".foo", b"4") == ("hit", b"4")
    assert h(".foo.bar", b"5") is None
    out = Decoder([h])({"__key__": "k", "seg.png": b"6", "png": b"7"})
    assert out["seg.png"] == ("hit", b"6") and out["png"] == b"7"


def test_only_and_partial():
    sample = {"__key__": b"k", "__url__": "u", "cls": b"1", "txt": b"t", "json": b"{}"}
    out = Decoder([], only="cls json")(sample)
    assert out == {"__key__": "k", "__url__": "u", "cls": 1, "txt": b"t", "json": {}}
    assert Decoder([], only=["txt"])(sample)["cls"] == b"1"
    decoded_once = Decoder([])(sample)
    with pytest.raises(DecodeError, match="partial=True"):
        Decoder([])(decoded_once)
    assert Decoder([], partial=True)(decoded_once) == decoded_once
    # memoryview / bytearray values are accepted as bytes
    assert Decoder([])({"__key__": "k", "cls": bytearray(b"5"), "txt": memoryview(b"m")}) == {
        "__key__": "k",
        "cls": 5,
        "txt": "m",
    }


def test_decoder_returns_a_new_dict():
    sample = {"__key__": "k", "cls": b"1"}
    out = Decoder([])(sample)
    assert sample == {"__key__": "k", "cls": b"1"} and out is not sample


def test_decode_error_names_url_key_field_and_what_to_do():
    sample = {
        "__key__": "shard/0007",
        "__url__": "s3://b/shard-01.tar",
        "json": b"{bad",
        "cls": b"1",
    }
    with pytest.raises(DecodeError) as info:
        Decoder([])(sample)
    exn = info.value
    assert exn.url == "s3://b/shard-01.tar" and exn.key == "shard/0007"
    assert exn.member == "shard/0007.json"
    text = str(exn)
    assert "s3://b/shard-01.tar" in text and "shard/0007.json" in text and "'json'" in text
    assert "JSONDecodeError" in text and "handler=warn_and_continue" in text
    assert isinstance(exn.__cause__, ValueError)
    assert DecodingError is DecodeError
    # survives pickling (DataLoader workers send exceptions back to the main process)
    again = pickle.loads(pickle.dumps(exn))
    assert str(again) == text


@pytest.mark.parametrize(
    "field, data",
    [
        ("cls", b"seven"),
        ("txt", b"\xff\xfe"),
        ("npy", b"not npy"),
        ("npz", b"PK\x03\x04junk"),
        ("ten", b"~TenBin~junk"),
        ("txt.gz", b"\x1f\x8bnot gzip"),
        ("pth", b"not a torch file"),
        ("mp", b"\xc1"),
        ("png", b"not a png"),
    ],
)
def test_corrupt_fields_raise_decode_error(field, data):
    sample = {"__key__": "k1", "__url__": "a.tar", field: data}
    with pytest.raises(DecodeError) as info:
        Decoder([imagehandler("rgb8")])(sample)
    assert info.value.url == "a.tar" and info.value.member == f"k1.{field}"


def test_decode_stage_error_policy_and_non_dict_samples():
    good = {"__key__": "a", "cls": b"1"}
    bad = {"__key__": "b", "cls": b"x"}
    out = list(decode(handler=ignore_and_continue)([good, bad, good]))
    assert [s["cls"] for s in out] == [1, 1]
    with pytest.raises(DecodeError, match="before to_tuple"):
        list(decode()([(b"1", b"2")]))


def test_decode_stage_accepts_specs_handlers_and_a_decoder():
    png = imageencoder(np.zeros((2, 3), np.uint8), "png")
    sample = {"__key__": "a", "png": png, "x": b"1"}
    (out,) = list(decode("l8", handle_extension("x", lambda d: "X"))([sample]))
    assert out["png"].shape == (2, 3) and out["x"] == "X"
    (out,) = list(decode(Decoder([imagehandler("pill")]))([sample]))
    assert isinstance(out["png"], Image.Image) and out["png"].mode == "L"
    with pytest.raises(ArgumentError, match="on its own"):
        make_decoder(Decoder([]), "rgb8")
    with pytest.raises(ArgumentError, match="image specs"):
        make_decoder(3)
    (out,) = list(decode(only="x", post=[handle_extension("x", lambda d: "P")])([sample]))
    assert out == {"__key__": "a", "png": png, "x": "P"}


def test_decoders_and_stages_pickle():
    stage = decode("torchrgb", handler=ignore_and_continue, allow_pickle=True)
    restored = pickle.loads(pickle.dumps(stage))
    png = imageencoder(np.full((2, 2, 3), 255, np.uint8), "png")
    (out,) = list(restored([{"__key__": "a", "png": png, "pkl": pickle.dumps(5)}]))
    assert out["png"].shape == (3, 2, 2) and float(out["png"].max()) == 1.0 and out["pkl"] == 5
    decoder = pickle.loads(pickle.dumps(Decoder([imagehandler("l8")], only="png")))
    assert decoder({"__key__": "a", "png": png})["png"].shape == (2, 2)
    assert pickle.loads(pickle.dumps(basichandlers)).allow_pickle is False
    assert pickle.loads(pickle.dumps(BasicHandlers(allow_pickle=True))).allow_pickle is True


def test_video_and_audio_handlers(monkeypatch):
    # Other extensions pass on; without PyAV the error names the extra to install (the media
    # themselves are decoded in tests/test_video.py and tests/test_audio.py).
    assert torch_video(".jpg", b"x") is None
    assert torch_audio(".txt", b"x") is None
    from webds.stages import avio

    monkeypatch.setattr(avio, "_av", None)
    _block_import(monkeypatch, "av")
    with pytest.raises(DecodeError, match=r"pip install 'webds\[av\]'"):
        torch_audio(".wav", b"RIFF")
    with pytest.raises(DecodeError, match=r"pip install 'webds\[av\]'"):
        torch_video(".mp4", b"\0\0\0\x18ftyp")
    with pytest.raises(DecodeError) as info:
        Decoder([torch_audio])({"__key__": "k", "__url__": "a.tar", "flac": b"fLaC"})
    assert info.value.member == "k.flac"


# -- the encoder machinery --------------------------------------------------------------------


def test_make_encoder_specs():
    sample = {"__key__": "k", "cls": 3, "raw": b"r"}
    assert make_encoder(True)(sample) == {"__key__": "k", "cls": b"3", "raw": b"r"}
    ident = make_encoder(False)
    assert make_encoder(None)({"__key__": "k", "raw": b"r"}) == {"__key__": "k", "raw": b"r"}
    with pytest.raises(EncodeError, match="encoder=False") as info:
        ident(sample)
    assert info.value.member == "k.cls"
    custom = make_encoder(
        lambda s: {k: (str(v).encode() if k == "cls" else v) for k, v in s.items()}
    )
    assert custom(sample)["cls"] == b"3"
    table = make_encoder({"cls": lambda x: b"<%d>" % x, ".foo": lambda x: b"foo"})
    assert table({"__key__": "k", "cls": 3, "a.foo": 1}) == {
        "__key__": "k",
        "cls": b"<3>",
        "a.foo": b"foo",
    }
    with pytest.raises(ArgumentError):
        make_encoder(42)
    with pytest.raises(ArgumentError):
        make_encoder({"cls": "not callable"})
    extended = default_handlers()
    extended["frac"] = lambda x: str(x).encode()
    assert (
        encode_sample({"__key__": "k", "frac": fractions.Fraction(1, 3)}, extended)["frac"]
        == b"1/3"
    )


def test_unknown_extension_error_names_key_field_and_known_extensions():
    with pytest.raises(EncodeError) as info:
        encode_sample({"__key__": "k9", "weird": object()})
    text = str(info.value)
    assert info.value.key == "k9" and info.value.member == "k9.weird"
    assert "'weird'" in text and "cls" in text and "npy" in text and "png" in text


def test_value_rules():
    with pytest.raises(EncodeError, match="must be a str"):
        encode_sample({"__key__": 5, "cls": 1})
    with pytest.raises(EncodeError, match="integer"):
        encode_sample({"__key__": "k", "cls": 1.5})
    with pytest.raises(EncodeError, match="integer"):
        encode_sample({"__key__": "k", "cls": True})
    with pytest.raises(EncodeError, match="JSON"):
        encode_sample({"__key__": "k", "json": {"a": np.ones(2)}})
    with pytest.raises(EncodeError, match="object array"):
        numpy_dumps(np.array([None, 1], dtype=object))
    with pytest.raises(EncodeError, match="dict of arrays"):
        numpy_npz_dumps(np.ones(2))
    with pytest.raises(EncodeError, match="a str"):
        encode_sample({"__key__": "k", "txt": 5})
    # str is UTF-8 whatever the extension; bytes pass through untouched
    assert encode_sample({"__key__": "k", "png": "text", "npy": b"raw"})["png"] == b"text"
    assert encode_sample({"__key__": "k", "npy": b"raw"})["npy"] == b"raw"


def test_gzip_is_deterministic_and_not_applied_twice():
    once = encode_sample({"__key__": "k", "txt.gz": "hello"})["txt.gz"]
    assert once == encode_sample({"__key__": "k", "txt.gz": "hello"})["txt.gz"]
    assert gzip.decompress(once) == b"hello"
    assert once[3] & 0x08 == 0  # no FNAME in the gzip header
    # raw gzipped bytes copied from another shard are kept as they are
    assert encode_sample({"__key__": "k", "txt.gz": once})["txt.gz"] == once
    assert (
        gzip.decompress(encode_sample({"__key__": "k", "bin.gz": b"\x00\x01"})["bin.gz"])
        == b"\x00\x01"
    )


def test_helper_encoders():
    assert tenbin_dumps(np.ones(2)) == tenbin_dumps([np.ones(2)])
    buf = io.BytesIO(numpy_dumps(ARR))
    np.testing.assert_array_equal(np.load(buf), ARR)
    assert torch.equal(
        torch.load(io.BytesIO(torch_dumps(torch.ones(2))), weights_only=True), torch.ones(2)
    )
    assert imageencoder(Image.new("P", (2, 2)), "JPEG")[:2] == b"\xff\xd8"


def test_decode_stage_in_spawned_dataloader_worker():
    from torch.utils.data import DataLoader

    from webds.pipeline import DataPipeline

    png = imageencoder(np.full((2, 3, 3), 255, np.uint8), "png")
    source = [
        {"__key__": f"{i}", "png": png, "cls": b"%d" % i, "pkl": pickle.dumps(i)} for i in range(4)
    ]
    # a tuple, because DataPipeline splices a list argument in as stages
    dataset = DataPipeline(
        tuple(source), decode("torchrgb8", allow_pickle=True, only="png cls pkl")
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    out = list(loader)
    assert [s["cls"] for s in out] == [0, 1, 2, 3] and [s["pkl"] for s in out] == [0, 1, 2, 3]
    assert all(s["png"].shape == (3, 2, 3) and s["png"].dtype == torch.uint8 for s in out)


def test_bz2_and_xz_fields_decode_by_their_inner_extension():
    sample = {
        "__key__": "k",
        "json.bz2": bz2.compress(b'{"a": 1}'),
        "cls.xz": lzma.compress(b"7"),
        "empty.bz2": b"",
    }
    out = Decoder([])(sample)
    assert out["json.bz2"] == {"a": 1} and out["cls.xz"] == 7
    assert out["empty.bz2"] == b""
