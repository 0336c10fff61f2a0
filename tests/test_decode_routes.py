"""The decoder's routes (each field name's handlers worked out once): whatever the chain, a
decoder that routes gives what the same chain called handler by handler gives, errors included."""

from __future__ import annotations

import gzip
import io
import pickle
import random

import numpy as np
import pytest
import torch
from PIL import Image

from webds.errors import DecodeError
from webds.stages.codecs import BasicHandlers, imagehandler
from webds.stages.decode import Decoder, Decompress, gzfilter, handle_extension


def _image(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3)).save(buf, format=fmt)
    return buf.getvalue()


def _torch_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save(torch.arange(3), buf)
    return buf.getvalue()


_VALUES = {
    "bin": b"\x00\x01raw",
    "cls": b"7",
    "CLS": b"8",
    "txt": b"hello",
    "json": b'{"a": [1, 2]}',
    "jpg": _image("JPEG"),
    "Png": _image("PNG"),
    "seg.png": _image("PNG"),
    "npy": None,  # filled below
    "pth": _torch_bytes(),
    "pkl": pickle.dumps({"x": 1}),
    "xyz": b"unknown extension",
    "a.b.c": b"many dots",
    "cls.gz": gzip.compress(b"9"),
    "txt.gz": gzip.compress(b"zipped"),
    "odd": b"12345",  # an odd length: the ExtensionHandler below declines it
    "even": b"1234",
}
_npy = io.BytesIO()
np.save(_npy, np.arange(5))
_VALUES["npy"] = _npy.getvalue()


def _reverse_even(data: bytes):
    return None if len(data) % 2 else data[::-1]  # None: the chain goes on


def _random_chain(rng: random.Random) -> dict:
    handlers = []
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(["image", "extension", "extension-str", "user"])
        if kind == "image":
            exts = rng.choice([None, "png", "jpg seg.png"])
            spec = rng.choice(["pil", "rgb8", "torchl8", "l"])
            handlers.append(imagehandler(spec) if exts is None else imagehandler(spec, exts))
        elif kind == "extension":
            handlers.append(handle_extension(rng.choice(["odd even", "cls", "b.c"]), _reverse_even))
        elif kind == "extension-str":
            handlers.append(handle_extension("txt", lambda data: data.decode().upper()))
        else:
            handlers.append(lambda key, data: b"user" if key.endswith("even") else None)
    pre = rng.choice([None, [gzfilter], [Decompress(1 << 20)], []])
    post = rng.choice([None, [BasicHandlers(allow_pickle=True)], [BasicHandlers()], []])
    only = rng.choice([None, None, "cls txt jpg", ["Png", "odd"]])
    return dict(handlers=handlers, pre=pre, post=post, only=only)


def _unrouted(chain: dict) -> Decoder:
    """The same chain with every handler hidden behind a plain function (no decode_route):
    called handler by handler, as before routes existed."""

    def hide(hs):
        return None if hs is None else [lambda k, d, h=h: h(k, d) for h in hs]

    default_pre, default_post = Decoder([]).handlers[0], Decoder([]).handlers[-1]
    pre = hide([default_pre] if chain["pre"] is None else chain["pre"])
    post = hide([default_post] if chain["post"] is None else chain["post"])
    return Decoder(hide(chain["handlers"]), pre=pre, post=post, only=chain["only"])


def _normal(value):
    if isinstance(value, Image.Image):
        return ("pil", value.mode, np.asarray(value).tolist())
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return (type(value).__name__, str(value.dtype), np.asarray(value).tolist())
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


def _outcome(decoder: Decoder, sample: dict):
    try:
        return ("ok", _normal(decoder(sample)))
    except Exception as exn:  # the same error, said the same way
        return ("error", type(exn).__name__, str(exn))


@pytest.mark.parametrize("seed", range(60))
def test_routes_give_what_the_chain_gives(seed):
    rng = random.Random(seed)
    chain = _random_chain(rng)
    routed, reference = Decoder(**chain), _unrouted(chain)
    names = rng.sample(sorted(_VALUES), rng.randint(1, 6))
    for _ in range(3):  # the second and third samples take the routes worked out on the first
        sample = {"__key__": f"s{seed}", "__url__": "shard.tar"}
        sample.update({name: _VALUES[name] for name in names})
        assert _outcome(routed, sample) == _outcome(reference, sample), (chain, names)


def test_a_chain_changed_in_place_is_routed_afresh():
    decoder = Decoder([])
    assert decoder({"cls": b"3"}) == {"cls": 3}
    decoder.handlers.insert(0, handle_extension("cls", lambda data: "mine"))
    assert decoder({"cls": b"3"}) == {"cls": "mine"}
    decoder.handlers[0] = handle_extension("cls", lambda data: "theirs")
    assert decoder({"cls": b"3"}) == {"cls": "theirs"}


def test_a_used_decoder_pickles_without_its_routes():
    decoder = Decoder([handle_extension("odd even", _reverse_even)])
    assert decoder({"even": b"ab", "cls": b"1"}) == {"even": b"ba", "cls": 1}
    copy = pickle.loads(pickle.dumps(decoder))
    assert "_routed" not in copy.__dict__
    assert copy({"even": b"ab", "cls": b"1"}) == {"even": b"ba", "cls": 1}


def test_a_handler_without_a_route_is_called_for_every_field():
    seen = []

    def spy(key, data):
        seen.append(key)
        return None

    decoder = Decoder([spy])
    for _ in range(2):
        assert decoder({"cls": b"1", "bin": b"x"}) == {"cls": 1, "bin": b"x"}
    assert seen == [".cls", ".bin", ".cls", ".bin"]


def test_pickles_are_still_refused_per_call():
    decoder = Decoder([])
    for _ in range(2):
        with pytest.raises(DecodeError, match="allow_pickle"):
            decoder({"__key__": "k", "pkl": pickle.dumps(1)})
