"""Old WebDataset keywords: webdataset 1.x's and the 0.1 style, against the fluent equivalents."""

from __future__ import annotations

import io
import itertools
import os
import warnings

import numpy as np
import pytest
import torch
from conftest import write_tar
from PIL import Image
from torch.utils.data import DataLoader

from webds.errors import ArgumentError
from webds.fluent import WebDataset
from webds.shards import ResampledShards, SimpleShardList
from webds.stages.batching import batched
from webds.stages.decode import handle_extension


def image_bytes(i: int, fmt: str) -> bytes:
    rng = np.random.default_rng(i)
    img = Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture
def url(tmp_path):
    """Three shards of 8 samples: a .jpg (or, for every third sample, a .png) and a .cls."""
    for s in range(3):
        members = []
        for i in range(8):
            key = f"k{s}{i:03d}"
            if i % 3 == 0:
                members.append((f"{key}.png", image_bytes(s * 8 + i, "PNG")))
            else:
                members.append((f"{key}.jpg", image_bytes(s * 8 + i, "JPEG")))
            members.append((f"{key}.cls", str(i % 5).encode()))
        write_tar(tmp_path / f"img-{s}.tar", members)
    return str(tmp_path / "img-{0..2}.tar")


def augment(x):
    return ("augmented", x)


def minus_one(y):
    return int(y) - 1


def plain(x):
    """Make decoded values comparable with ==."""
    if isinstance(x, Image.Image):
        return ("PIL", x.mode, x.size, x.tobytes())
    if isinstance(x, torch.Tensor):
        return ("torch", str(x.dtype), tuple(x.shape), x.numpy().tobytes())
    if isinstance(x, np.ndarray):
        return ("numpy", str(x.dtype), x.shape, x.tobytes())
    if isinstance(x, tuple):
        return tuple(plain(v) for v in x)
    return x


def legacy(url, **kw):
    with pytest.warns(DeprecationWarning) as record:
        ds = WebDataset(url, **kw)
    deprecations = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1
    return ds, str(deprecations[0].message)


@pytest.mark.parametrize("decoder", ["pil", "torch", "rgb8", "l", "torchrgb8", None])
def test_01_style_matches_fluent_equivalent(url, decoder):
    transforms = [None, augment, minus_one]
    extensions = "__key__ jpg;png cls"
    ds, message = legacy(url, extensions=extensions, decoder=decoder, transforms=transforms)
    fluent = WebDataset(url)
    if decoder is not None:
        fluent = fluent.decode(decoder)
    fluent = fluent.to_tuple("__key__", "jpg;png", "cls").map_tuple(None, augment, minus_one)
    got = [plain(s) for s in ds]
    assert got == [plain(s) for s in fluent]
    assert len(got) == 24
    assert all(s[1][0] == "augmented" for s in got)
    assert [s[2] for s in got[:5]] == [-1, 0, 1, 2, 3]
    decode_call = "" if decoder is None else f'.decode("{decoder}")'
    assert message.endswith(
        f'write WebDataset(url){decode_call}.to_tuple("__key__", "jpg;png", "cls")'
        ".map_tuple(None, augment, minus_one)"
    )
    images = [s[1][1] for s in got]
    if decoder is None:
        assert all(isinstance(img, bytes) for img in images)
    else:
        kind = {"pil": "PIL", "torch": "torch", "torchrgb8": "torch"}.get(decoder, "numpy")
        assert {img[0] for img in images} == {kind}


def test_01_decoder_none_leaves_bytes(url):
    ds, _ = legacy(url, extensions="jpg;png cls", decoder=None)
    img, cls = next(iter(ds))
    assert isinstance(img, bytes) and cls == b"0"


def test_01_default_decoder_is_rgb_as_in_01(url):
    ds, message = legacy(url, extensions="jpg;png cls")
    img, cls = next(iter(ds))
    assert img.dtype == np.float32 and img.shape == (12, 10, 3) and cls == 0
    assert '.decode("rgb")' in message


def test_01_shuffle_warning_and_same_samples(url):
    extensions = "__key__ jpg;png cls"
    transforms = [None, augment]
    ds, message = legacy(
        url, extensions=extensions, decoder="pil", transforms=transforms, shuffle=100
    )
    assert message.endswith(
        'write WebDataset(url, shardshuffle=True).shuffle(100).decode("pil")'
        '.to_tuple("__key__", "jpg;png", "cls").map_tuple(None, augment)'
    )
    assert "webdataset 0.1 style" in message
    assert isinstance(ds.pipeline[0], SimpleShardList) and ds.pipeline[0].seed is not None
    fluent = (
        WebDataset(url).decode("pil").to_tuple("__key__", "jpg;png", "cls").map_tuple(None, augment)
    )
    got = [plain(s) for s in ds]
    want = [plain(s) for s in fluent]
    assert got != want  # shuffled
    assert sorted(got) == sorted(want)


def test_01_single_transform_applies_to_first_element(url):
    ds, message = legacy(url, extensions="cls __key__", decoder=True, transforms=minus_one)
    assert [s for s in itertools.islice(ds, 3)] == [(-1, "k0000"), (0, "k0001"), (1, "k0002")]
    assert message.endswith(
        'write WebDataset(url).decode().to_tuple("cls", "__key__").map_tuple(minus_one)'
    )


def test_01_extension_lists_and_decoder_forms(url):
    ds, _ = legacy(url, extensions=[["jpg", "png"], "cls"], decoder={"cls": lambda b: int(b) * 10})
    img, cls = next(iter(ds))
    assert isinstance(img, bytes) and cls == 0
    assert [c for _, c in itertools.islice(ds, 3)] == [0, 10, 20]
    ds, message = legacy(url, extensions="cls", decoder=lambda sample: {"cls": b"7"})
    assert list(itertools.islice(ds, 2)) == [(b"7",), (b"7",)]
    assert ".map(<lambda>)" in message
    handler = handle_extension("cls", lambda b: -int(b))
    ds, _ = legacy(url, extensions="cls", decoder={"cls": lambda b: -int(b)})
    fluent = WebDataset(url).decode(handler).to_tuple("cls")
    assert list(ds) == list(fluent)


def test_01_pipeline_keyword(url):
    ds, message = legacy(url, extensions="cls", decoder=True, pipeline=batched(5))
    fluent = WebDataset(url).decode().to_tuple("cls").batched(5)
    got, want = list(ds), list(fluent)
    assert len(got) == 5 and all(
        all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(g, w))
        for g, w in zip(got, want)
    )
    assert message.endswith(".compose(batched(5))")


def test_01_in_dataloader_workers(url):
    ds, _ = legacy(url, extensions="__key__ cls", decoder=True, transforms=[None, minus_one])
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = sorted((k, v) for k, v in loader)
    assert got == sorted((f"k{s}{i:03d}", i % 5 - 1) for s in range(3) for i in range(8))


def test_01_bad_values(url):
    with pytest.raises(ArgumentError, match="needs extensions="):
        WebDataset(url, transforms=[augment])
    with pytest.raises(ArgumentError, match="imagespec|image spec|Unknown|unknown"):
        WebDataset(url, extensions="jpg", decoder="no-such-spec")
    with pytest.raises(ArgumentError, match="extensions"):
        WebDataset(url, extensions=42)
    with pytest.raises(ArgumentError, match="element 1"):
        WebDataset(url, extensions="jpg cls", transforms=[None, "x"])
    with pytest.raises(ArgumentError, match="buffer size"):
        WebDataset(url, extensions="jpg", shuffle=-1)
    with pytest.raises(ArgumentError, match="gopen_schemes"):
        WebDataset(url, opener=open)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        WebDataset(url, bogus=1)


def test_mode_resampled(url):
    ds = WebDataset(url, mode="resampled", seed=3)
    assert isinstance(ds.pipeline[0], ResampledShards)
    got = [s["__key__"] for s in itertools.islice(ds, 60)]  # more than the 24 samples there are
    assert len(got) == 60 and set(got) <= {f"k{s}{i:03d}" for s in range(3) for i in range(8)}
    assert WebDataset(url, mode=None).pipeline[0].__class__ is SimpleShardList
    with pytest.raises(ArgumentError, match="only mode is 'resampled'"):
        WebDataset(url, mode="unlink")


def test_cache_keywords(url, tmp_path):
    cache = tmp_path / "cache"
    assert len(list(WebDataset(url, cache_dir=str(cache)))) == 24
    # Local shards are read in place, not copied: the cache stays empty.
    assert os.listdir(cache) == []
    # webdataset's own "no cache" values are accepted.
    assert len(list(WebDataset(url, cache_size=-1, cache_dir=None))) == 24
    assert len(list(WebDataset(url, cache_size=0, cache_dir=str(cache)))) == 24


def test_v1_keywords_without_effect_are_accepted_quietly(url):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = WebDataset(url, verbose=True, detshuffle=True, shardshuffle=100, seed=1)
    plain_ds = WebDataset(url, shardshuffle=100, seed=1)
    assert [s["__key__"] for s in ds] == [s["__key__"] for s in plain_ds]


def test_url_to_name_warns(url):
    with pytest.warns(DeprecationWarning, match="url_to_name.*no effect"):
        ds = WebDataset(url, url_to_name=lambda u: u)
    assert len(list(ds)) == 24


def test_shardshuffle_values(url):
    keys = [s["__key__"] for s in WebDataset(url, shardshuffle=None)]
    assert keys == sorted(keys)
    shuffled = [
        [s["__key__"][:2] for s in WebDataset(url, shardshuffle=True, seed=seed)][::8]
        for seed in range(6)
    ]
    assert any(order != ["k0", "k1", "k2"] for order in shuffled)
    assert all(sorted(order) == ["k0", "k1", "k2"] for order in shuffled)
