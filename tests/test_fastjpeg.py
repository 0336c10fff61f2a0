"""The JPEG fast path (simplejpeg) gives exactly what Pillow gives, or steps aside."""

import io
import warnings

import numpy as np
import pytest
from PIL import Image, ImageCms

import webds
from webds.stages import fastjpeg
from webds.stages.codecs import decode_image

simplejpeg = pytest.importorskip("simplejpeg")


def photo(width: int = 321, height: int = 239, seed: int = 0) -> Image.Image:
    """A photo-like RGB image: smooth gradients, edges and grain (odd sizes, to exercise the
    chroma upsampling at the borders)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 128 + 100 * np.sin(x / 17.0) * np.cos(y / 23.0)
    g = 255 * (x / width) * (y > height / 3)
    b = 255 * ((x - width / 2) ** 2 + (y - height / 2) ** 2 < (height / 3) ** 2)
    a = np.stack([r, g, b], axis=-1) + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def jpeg(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", **kw)
    return buf.getvalue()


VARIANTS = {
    "baseline 4:2:0": dict(quality=90),
    "baseline 4:4:4": dict(quality=95, subsampling=0),
    "baseline 4:2:2": dict(quality=85, subsampling=1),
    "progressive": dict(quality=90, progressive=True),
    "optimized, low quality": dict(quality=30, optimize=True),
    "restart markers": dict(quality=90, restart_marker_rows=2),
}


def pillow(data: bytes, spec: str = "pil"):
    return decode_image(data, spec, fast_jpeg=False)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", ["pil", "rgb8", "rgb", "torchrgb8", "torchrgb"])
def test_same_pixels_as_pillow(variant, spec):
    data = jpeg(photo(), **VARIANTS[variant])
    assert fastjpeg.decode_rgb(data) is not None  # the fast path really runs
    fast, slow = decode_image(data, spec), pillow(data, spec)
    if spec == "pil":
        assert fast.mode == slow.mode == "RGB" and fast.size == slow.size
        fast, slow = np.asarray(fast), np.asarray(slow)
    assert type(fast) is type(slow) and fast.dtype == slow.dtype and fast.shape == slow.shape
    assert (np.asarray(fast) == np.asarray(slow)).all()


def test_grayscale_jpeg_to_rgb_same_as_pillow():
    data = jpeg(photo().convert("L"), quality=90)
    fast = fastjpeg.decode_rgb(data)
    assert fast is not None and fast.shape == (239, 321, 3)
    assert (fast == np.asarray(pillow(data))).all()
    assert (np.asarray(decode_image(data, "pil")) == np.asarray(pillow(data))).all()


def test_pil_result_keeps_info_and_format():
    """EXIF (what ImageOps.exif_transpose reads), the ICC profile and DPI survive the fast path."""
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    data = jpeg(photo(), quality=90, exif=exif, icc_profile=icc, dpi=(300, 300))
    fast, slow = decode_image(data, "pil"), pillow(data)
    assert fast.format == slow.format == "JPEG"
    assert fast.info["exif"] == slow.info["exif"]
    assert fast.info["icc_profile"] == slow.info["icc_profile"] == icc
    assert fast.info["dpi"] == slow.info["dpi"]
    assert fast.getexif()[0x0112] == 6
    from PIL import ImageOps

    a, b = ImageOps.exif_transpose(fast), ImageOps.exif_transpose(slow)
    assert a.size == b.size == (239, 321)
    assert (np.asarray(a) == np.asarray(b)).all()


def test_cmyk_jpeg_is_left_to_pillow():
    data = jpeg(photo().convert("CMYK"), quality=90)
    assert fastjpeg.decode_rgb(data) is None
    assert (np.asarray(decode_image(data, "pil")) == np.asarray(pillow(data))).all()


def test_non_jpeg_is_left_to_pillow():
    buf = io.BytesIO()
    photo().save(buf, "PNG")
    assert fastjpeg.decode_rgb(buf.getvalue()) is None
    assert fastjpeg.pil_rgb(buf.getvalue()) is None


def test_truncated_jpeg_fails_as_pillow_fails():
    data = jpeg(photo(), quality=90)[:3000]
    assert fastjpeg.decode_rgb(data) is None
    with pytest.raises(OSError) as slow:
        pillow(data)
    with pytest.raises(OSError) as fast:
        decode_image(data, "pil")
    assert str(fast.value) == str(slow.value)


def test_truncated_jpeg_in_a_pipeline_names_the_member(tmp_path):
    good, bad = jpeg(photo(), quality=90), jpeg(photo(seed=1), quality=90)[:2000]
    with webds.TarWriter(str(tmp_path / "s.tar")) as w:
        w.write({"__key__": "a", "jpg": good})
        w.write({"__key__": "b", "jpg": bad})
    ds = webds.WebDataset(str(tmp_path / "s.tar"), shardshuffle=False).decode("pil")
    it = iter(ds)
    assert next(it)["jpg"].size == (321, 239)
    with pytest.raises(webds.DecodeError, match=r"b\.jpg|'jpg'"):
        next(it)


@pytest.mark.parametrize("spec", ["pil", "rgb8", "torchrgb"])
def test_pixel_limit_is_max_pixels_on_both_paths_not_pillows_global(monkeypatch, spec):
    data = jpeg(photo(), quality=90)
    pixels = 321 * 239
    # Pillow's process-global limit is not consulted (it warned between 1x and 2x, refused
    # above): a lowered one changes nothing, and decode never writes it.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", pixels // 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fast in (True, False):
            assert np.asarray(decode_image(data, spec, fast, max_pixels=pixels)).size > 0
            assert np.asarray(decode_image(data, spec, fast)).size > 0
    assert Image.MAX_IMAGE_PIXELS == pixels // 3

    def refuse(*a, **k):
        raise AssertionError("simplejpeg decoded an image over the limit")

    monkeypatch.setattr(simplejpeg, "decode_jpeg", refuse)
    for fast in (True, False):
        with pytest.raises(webds.DecodeError, match=r"321x239 = 76,719 pixels.*max_pixels=76,718"):
            decode_image(data, spec, fast, max_pixels=pixels - 1)


def test_without_simplejpeg_pillow_decodes(monkeypatch):
    data = jpeg(photo(), quality=90)
    expected = np.asarray(decode_image(data, "pil"))
    monkeypatch.setattr(fastjpeg, "_simplejpeg", lambda: None)
    assert not fastjpeg.available()
    assert fastjpeg.decode_rgb(data) is None
    assert (np.asarray(decode_image(data, "pil")) == expected).all()


def test_fast_jpeg_false_never_calls_simplejpeg(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("simplejpeg used although fast_jpeg=False")

    monkeypatch.setattr(simplejpeg, "decode_jpeg", refuse)
    handler = webds.imagehandler("rgb8", fast_jpeg=False)
    assert handler(".jpg", jpeg(photo(), quality=90)).shape == (239, 321, 3)
    assert repr(handler) == "imagehandler('rgb8', fast_jpeg=False)"


def test_pil_decode_skips_the_convert_copy_only_when_the_mode_is_right():
    buf = io.BytesIO()
    photo().convert("P").save(buf, "PNG")
    img = decode_image(buf.getvalue(), "pil")
    assert img.mode == "RGB"  # a palette image is still converted
    buf = io.BytesIO()
    photo().save(buf, "PNG")
    img = decode_image(buf.getvalue(), "pil")
    assert img.mode == "RGB" and img.size == (321, 239)
    img.putpixel((0, 0), (1, 2, 3))  # writable, not a closed or read-only image
    assert img.getpixel((0, 0)) == (1, 2, 3)
