"""xdecode: pattern-based decoders that read a stream."""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
from conftest import write_tar

from webds.base.handlers import ignore_and_continue
from webds.errors import DecodeError
from webds.pipeline import DataPipeline
from webds.shards import SimpleShardList
from webds.stages.xdecode import decode_pickle, find_decoder, xdecode
from webds.tar.samples import tarfile_to_samples


def _samples(tmp_path, members):
    url = str(write_tar(tmp_path / "x.tar", members))
    return DataPipeline(SimpleShardList(url), tarfile_to_samples())


def test_xdecode_defaults_on_real_tar(tmp_path):
    pipe = _samples(tmp_path, [("a.txt", "héllo".encode()), ("a.bin", b"\x00\x01")]).compose(
        xdecode()
    )
    (sample,) = list(pipe)
    assert sample["txt"] == "héllo" and sample["bin"] == b"\x00\x01"
    assert sample["__key__"] == "a" and sample["__url__"].endswith("x.tar")


def test_xdecode_user_patterns_and_keywords(tmp_path):
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    buf = io.BytesIO()
    np.save(buf, arr)
    members = [
        ("k.npy", buf.getvalue()),
        ("k.meta.json", json.dumps({"a": 1}).encode()),
        ("k.txt", b"plain"),
    ]
    pipe = _samples(tmp_path, members).compose(
        xdecode(("*.json", json.load), npy=lambda s: np.load(s, allow_pickle=False))
    )
    (sample,) = list(pipe)
    np.testing.assert_array_equal(sample["npy"], arr)
    assert sample["meta.json"] == {"a": 1} and sample["txt"] == "plain"


def test_xdecode_later_entries_win_and_false_keeps_raw():
    src = [{"__key__": "a", "txt": b"abc", "bin": b"xyz"}]
    upper = list(xdecode(("*.txt", lambda s: s.read().upper()))(src))
    assert upper[0]["txt"] == b"ABC"
    raw = list(xdecode(txt=False)(src))
    assert raw[0]["txt"] == b"abc" and raw[0]["bin"] == b"xyz"


def test_xdecode_must_decode(tmp_path):
    src = [{"__key__": "a", "__url__": "u.tar", "jpg": b"...", "txt": b"t"}]
    with pytest.raises(DecodeError, match="no xdecode pattern") as info:
        list(xdecode()(src))
    assert info.value.key == "a" and info.value.url == "u.tar" and "jpg" in str(info.value)
    out = list(xdecode(must_decode=False)(src))
    assert out[0]["jpg"] == b"..." and out[0]["txt"] == "t"


def test_xdecode_pickle_only_when_enabled():
    payload = pickle.dumps({"x": [1, 2]})
    src = [{"__key__": "a", "pyd": payload}]
    with pytest.raises(DecodeError, match="allow_pickle=True"):
        list(xdecode()(src))
    assert list(xdecode(allow_pickle=True)(src))[0]["pyd"] == {"x": [1, 2]}
    # Naming decode_pickle yourself is not an opt-in either.
    with pytest.raises(DecodeError):
        list(xdecode(("*.pkl", decode_pickle))([{"__key__": "b", "pkl": payload}]))


def test_xdecode_metadata_passes_through_and_handler():
    src = [
        {"__key__": "a", "__extra__": b"raw", "txt": b"\xff\xfe"},  # not UTF-8
        {"__key__": "b", "txt": b"ok"},
    ]
    out = list(xdecode(handler=ignore_and_continue)(src))
    assert out == [{"__key__": "b", "txt": "ok"}]
    good = list(xdecode()([{"__key__": "c", "__extra__": b"raw"}]))
    assert good == [{"__key__": "c", "__extra__": b"raw"}]


def test_find_decoder_matches_basename_and_dot_forms():
    decoders = [("*.txt", str), ("*.seg.png", int)]
    assert find_decoder(decoders, "TXT") is str
    assert find_decoder(decoders, "dir/x.txt") is str
    assert find_decoder(decoders, "seg.png") is int
    assert find_decoder(decoders, "png") is None


def test_xdecode_bad_arguments():
    with pytest.raises(ValueError):
        xdecode("*.txt")([{"txt": b""}])
    with pytest.raises(ValueError):
        xdecode(("*.txt", 3))([{"txt": b""}])


def test_pillow_bomb_error_in_a_users_decoder_is_a_decode_error_with_advice(tmp_path):
    from bombs import png_claiming
    from PIL import Image

    # Pillow refuses above twice its process-global limit; the user's own Image.open does.
    png = png_claiming(20000, 20000)
    pipe = _samples(tmp_path, [("a.png", png)]).compose(xdecode(png=Image.open))
    with pytest.raises(DecodeError) as info:
        list(pipe)
    message = str(info.value)
    assert "Pillow refused it as a possible decompression bomb" in message
    assert "PIL.Image.MAX_IMAGE_PIXELS" in message and "max_pixels=N" in message
    assert info.value.member == "a.png"
