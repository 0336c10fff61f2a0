"""The fused crop decoders: torchvision's crops, drawn from the header, decoded only as needed.

Pixel tolerances (mean absolute difference, 0-255 levels, against decode("pil") + torchvision's
own crop and resize of the full image): none when the crop is under twice the output size (no DCT
scaling: the same pixels as torchvision's PIL path with resizer="pil", as its tensor path with
resizer="torch", 0.11 from the PIL path), under 4 levels when the decoder scales by 1/2-1/8 in
the DCT domain (measured 0.3-1.1 on photos, 2.1 on skimage's grainy ``camera`` scaled by 1/2),
under 2 levels for CenterCropDecoder against Resize(256) + CenterCrop(224).
"""

import io
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import webds
from webds.stages import fastjpeg
from webds.stages.crop import center_crop_box, random_resized_crop_params

sys.path.insert(0, str(Path(__file__).parent))
from torchvision_cpu import import_torchvision  # noqa: E402

skdata = pytest.importorskip("skimage.data")
scipy_stats = pytest.importorskip("scipy.stats")
tv = import_torchvision()
from torchvision.transforms import CenterCrop, RandomResizedCrop, Resize  # noqa: E402
from torchvision.transforms import functional as TF  # noqa: E402

BILINEAR = Image.Resampling.BILINEAR


def encode(image: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def coffee() -> Image.Image:
    return Image.fromarray(skdata.coffee())  # a public-domain photo, 600x400


def large() -> Image.Image:
    return coffee().resize((2000, 1500), Image.Resampling.BICUBIC)


def reference(data: bytes, box, size=(224, 224)) -> np.ndarray:
    """decode("pil") then torchvision's resized_crop: what the fused decoder replaces."""
    image = webds.Decoder([webds.imagehandler("pil")]).decode1("jpg", data)
    left, top, right, bottom = box
    out = TF.resized_crop(image, top, left, bottom - top, right - left, list(size), BILINEAR)
    return np.asarray(out).astype(np.int16)


def drawn_box(decoder, data, sample, width, height, field=".jpg"):
    """The crop ``decoder`` draws for ``sample`` (from the same generator it uses)."""
    i, j, h, w = random_resized_crop_params(
        decoder.rng(field, data, sample), width, height, decoder.scale, decoder.ratio
    )
    return (j, i, j + w, i + h)


def sample_of(data: bytes, key: str, ext: str = "jpg") -> dict:
    return {"__key__": key, "__url__": "shard.tar", ext: data}


def write_shard(path: Path, images) -> str:
    with webds.TarWriter(str(path)) as w:
        for i, data in enumerate(images):
            w.write({"__key__": f"{i:04d}", "jpg": data, "cls": str(i).encode()})
    return str(path)


@pytest.fixture(params=["simplejpeg", "pillow"])
def jpeg_path(request, monkeypatch):
    """Run a test with simplejpeg, and again as if it were not installed (Pillow's draft)."""
    if request.param == "simplejpeg":
        pytest.importorskip("simplejpeg")
    else:
        monkeypatch.setattr(fastjpeg, "_simplejpeg", lambda: None)
    return request.param


@pytest.fixture(params=["pil", "torch"])
def resizer(request):
    """Resize with Pillow (torchvision's PIL path) and with torch's uint8 kernel (its tensor
    path)."""
    return request.param


# -- the crop parameters -------------------------------------------------------------------


class TorchDraws:
    """random.Random's interface over torch's global generator, drawing as get_params draws."""

    def uniform(self, a: float, b: float) -> float:
        return torch.empty(1).uniform_(a, b).item()

    def randint(self, a: int, b: int) -> int:
        return int(torch.randint(a, b + 1, size=(1,)).item())


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (2000, 90), (64, 64), (3, 1)])
def test_params_follow_get_params_draw_for_draw(size):
    # Fed torch's own random numbers, the algorithm gives get_params' crops (float32 rounding
    # may move a crop by one pixel once in a few thousand draws), the fallback included.
    width, height = size
    img = torch.empty(3, height, width)
    torch.manual_seed(0)
    theirs = [RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(2000)]
    torch.manual_seed(0)
    draws = TorchDraws()
    ours = [random_resized_crop_params(draws, width, height) for _ in range(2000)]
    same = sum(a == b for a, b in zip(ours, theirs))
    assert same >= 1990, (same, [(a, b) for a, b in zip(ours, theirs) if a != b][:5])


@pytest.mark.parametrize("size", [(500, 375), (2000, 90)])
def test_params_distribution_matches_torchvision(size):
    # With our own generator (random.Random, seeded per sample) the distribution is
    # torchvision's: two-sample KS tests on area, aspect ratio and position, fixed seeds.
    width, height = size
    img = torch.empty(3, height, width)
    torch.manual_seed(1)
    theirs = np.array(
        [RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(4000)]
    )
    ours = np.array(
        [random_resized_crop_params(random.Random(k), width, height) for k in range(4000)]
    )

    def stats(p):
        i, j, h, w = p.T.astype(float)
        return {
            "area": h * w / (width * height),
            "log ratio": np.log(w / h),
            "top": (i + h / 2) / height,
            "left": (j + w / 2) / width,
        }

    for name, a in stats(ours).items():
        b = stats(theirs)[name]
        result = scipy_stats.ks_2samp(a, b)
        assert result.pvalue > 0.001, (name, result)
    # a fair coin would not pass this: the area of a 0.08-1.0 crop averages 0.54
    assert abs(stats(ours)["area"].mean() - stats(theirs)["area"].mean()) < 0.02


def test_center_crop_box_is_resize_then_center_crop():
    # 600x400 -> Resize(256) = 384x256 -> CenterCrop(224) at (80, 16): source box x1.5625
    assert center_crop_box(600, 400, 224, 256) == pytest.approx(
        (80 * 1.5625, 16 * 1.5625, 304 * 1.5625, 240 * 1.5625)
    )


# -- pixels --------------------------------------------------------------------------------


def test_small_crops_are_pixel_identical_to_torchvision(jpeg_path, resizer):
    # No crop of a 600x400 image reaches 448x448, so nothing is DCT-scaled: the same pixels as
    # torchvision's resized_crop of the decoded image, on its PIL path or on its tensor path.
    from torchvision.transforms.v2 import functional as F2

    data = encode(coffee(), quality=90)
    decoder = webds.RandomResizedCropDecoder(224, seed=5, resizer=resizer).bind_pass(None, 0)
    tensor = torch.from_numpy(webds.Decoder([webds.imagehandler("rgb8")]).decode1("jpg", data))
    for k in range(10):
        sample = sample_of(data, f"k{k}")
        got = decoder(".jpg", data, sample)
        assert got.shape == (224, 224, 3) and got.dtype == np.uint8
        box = drawn_box(decoder, data, sample, 600, 400)
        if resizer == "pil":
            assert np.array_equal(got, reference(data, box))
        else:
            left, top, right, bottom = box
            want = F2.resized_crop(
                tensor.permute(2, 0, 1), top, left, bottom - top, right - left, [224, 224]
            )
            assert np.array_equal(got, want.permute(1, 2, 0).numpy())
            assert np.abs(got - reference(data, box)).mean() < 0.25  # and near the PIL path


def test_auto_resizes_with_torch_only_where_torch_runs_one_thread():
    data = encode(coffee(), quality=90)
    sample = sample_of(data, "k")
    out = {
        r: webds.RandomResizedCropDecoder(224, seed=5, resizer=r).bind_pass(None, 0)(
            ".jpg", data, sample
        )
        for r in ("pil", "torch", "auto")
    }
    assert not np.array_equal(out["pil"], out["torch"])  # the two kernels round differently
    threads = torch.get_num_threads()
    try:
        for n, want in ((1, "torch"), (2, "pil")):
            torch.set_num_threads(n)
            auto = webds.RandomResizedCropDecoder(224, seed=5).bind_pass(None, 0)
            assert np.array_equal(auto(".jpg", data, sample), out[want]), n
    finally:
        torch.set_num_threads(threads)


def test_large_crops_are_dct_scaled_within_tolerance(jpeg_path, resizer, monkeypatch):
    data = encode(large(), quality=90)
    scaled = []
    if jpeg_path == "simplejpeg":
        sj = fastjpeg._simplejpeg()
        real = sj.decode_jpeg

        def spy(*args, **kw):
            out = real(*args, **kw)
            scaled.append(out.shape[1])
            return out

        monkeypatch.setattr(sj, "decode_jpeg", spy)
    else:
        from PIL.JpegImagePlugin import JpegImageFile

        real_draft = JpegImageFile.draft

        def spy_draft(self, mode, size):
            result = real_draft(self, mode, size)
            scaled.append(self.size[0])
            return result

        monkeypatch.setattr(JpegImageFile, "draft", spy_draft)
    decoder = webds.RandomResizedCropDecoder(224, seed=5, resizer=resizer).bind_pass(None, 0)
    diffs = []
    for k in range(12):
        sample = sample_of(data, f"k{k}")
        box = drawn_box(decoder, data, sample, 2000, 1500)
        got = decoder(".jpg", data, sample)
        diffs.append(np.abs(got - reference(data, box)).mean())
    print(jpeg_path, resizer, "DCT-scaled crops, mean abs diff:", max(diffs))
    assert max(diffs) < 4.0, diffs
    assert scaled and min(scaled) <= 1000, scaled  # at least one decode at 1/2 or less


def test_center_crop_matches_resize_and_center_crop(jpeg_path, resizer):
    for image in (coffee(), large(), coffee().transpose(Image.Transpose.ROTATE_90)):
        data = encode(image, quality=90)
        got = webds.CenterCropDecoder(224, resizer=resizer)(".jpg", data)
        pil = webds.Decoder([webds.imagehandler("pil")]).decode1("jpg", data)
        want = np.asarray(CenterCrop(224)(Resize(256)(pil))).astype(np.int16)
        assert got.shape == (224, 224, 3)
        assert np.abs(got - want).mean() < 2.0


def test_outputs_numpy_torch_pil(resizer):
    data = encode(coffee(), quality=90)
    kw = dict(resize=240, resizer=resizer)
    a = webds.CenterCropDecoder((160, 200), **kw)(".jpg", data)
    t = webds.CenterCropDecoder((160, 200), output="torch", **kw)(".jpg", data)
    p = webds.CenterCropDecoder((160, 200), output="pil", **kw)(".jpg", data)
    assert a.shape == (160, 200, 3) and a.flags.writeable
    assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == (3, 160, 200)
    assert p.size == (200, 160) and p.mode == "RGB"
    assert np.array_equal(t.permute(1, 2, 0).numpy(), a) and np.array_equal(np.asarray(p), a)


# -- kinds of images -----------------------------------------------------------------------


def test_grayscale_progressive_cmyk_and_tiny_jpegs(jpeg_path, resizer):
    photo = coffee()
    cases = {
        "grayscale": encode(Image.fromarray(skdata.camera()), quality=90),
        "progressive": encode(large(), quality=85, progressive=True),
        "cmyk": encode(photo.convert("CMYK"), quality=95),
        "tiny": encode(photo.resize((9, 6)), quality=95),
    }
    decoder = webds.RandomResizedCropDecoder(96, seed=1, resizer=resizer).bind_pass(None, 0)
    for name, data in cases.items():
        width, height = Image.open(io.BytesIO(data)).size
        for k in range(4):
            sample = sample_of(data, f"{name}{k}")
            box = drawn_box(decoder, data, sample, width, height)
            got = decoder(".jpg", data, sample)
            assert got.shape == (96, 96, 3), name
            err = np.abs(got - reference(data, box, (96, 96))).mean()
            assert err < 4.0, (name, err)
    gray = webds.CenterCropDecoder(64, resizer=resizer)(".jpg", cases["grayscale"])
    assert np.array_equal(gray[..., 0], gray[..., 2])  # grey stays grey, as three channels


def test_png_and_webp_take_the_plain_path():
    photo = coffee()
    decoder = webds.RandomResizedCropDecoder(128, seed=2, resizer="pil").bind_pass(None, 0)
    for ext, data in (("png", encode(photo, "PNG")), ("webp", encode(photo, "WEBP"))):
        for k in range(4):
            sample = sample_of(data, f"k{k}", ext)
            got = decoder("." + ext, data, sample)
            box = drawn_box(decoder, data, sample, 600, 400, "." + ext)
            assert np.array_equal(got, reference(data, box, (128, 128))), ext
    rgba = encode(Image.new("RGBA", (50, 40), (10, 20, 30, 0)), "PNG")
    assert webds.CenterCropDecoder(32)(".png", rgba).shape == (32, 32, 3)


def test_other_fields_pass_to_the_next_handlers(tmp_path):
    url = write_shard(tmp_path / "s.tar", [encode(coffee(), quality=90)])
    (sample,) = webds.WebDataset(url, shardshuffle=False).decode(webds.RandomResizedCropDecoder(32))
    assert sample["cls"] == 0 and sample["jpg"].shape == (32, 32, 3)


def test_exif_orientation_is_left_as_decode_pil_leaves_it():
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees to display"
    data = encode(coffee(), quality=90, exif=exif)
    assert webds.Decoder([webds.imagehandler("pil")]).decode1("jpg", data).size == (600, 400)
    got = webds.CenterCropDecoder(224)(".jpg", data)
    plain = webds.CenterCropDecoder(224)(".jpg", encode(coffee(), quality=90))
    assert np.array_equal(got, plain)


# -- damaged and oversized images ----------------------------------------------------------


def test_truncated_jpeg_is_a_decode_error_naming_the_member(tmp_path, jpeg_path):
    good = encode(coffee(), quality=90)
    url = write_shard(tmp_path / "s.tar", [good, good[: len(good) // 3]])
    it = iter(webds.WebDataset(url, shardshuffle=False).decode(webds.RandomResizedCropDecoder(64)))
    assert next(it)["jpg"].shape == (64, 64, 3)
    with pytest.raises(webds.DecodeError, match=r"0001\.jpg") as info:
        next(it)
    assert "truncated" in str(info.value)


def test_what_libjpeg_only_warns_about_decodes_as_decode_pil_decodes_it(resizer):
    # simplejpeg (strict) refuses stray bytes before a marker, which Pillow decodes: the crop
    # decoder then decodes with Pillow, as decode("pil") does.
    data = encode(coffee(), quality=90)
    sos = data.index(b"\xff\xda")
    stray = data[:sos] + b"\x00\x00" + data[sos:]
    sj = fastjpeg._simplejpeg()
    if sj is not None:
        with pytest.raises(ValueError, match="extraneous bytes"):
            sj.decode_jpeg(stray)
    decoder = webds.RandomResizedCropDecoder(96, seed=3, resizer=resizer).bind_pass(None, 0)
    sample = sample_of(stray, "k")
    assert np.array_equal(decoder(".jpg", stray, sample), decoder(".jpg", data, sample))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_max_pixels_refuses_from_the_header(monkeypatch, fmt):
    data = encode(coffee(), fmt)

    def refuse(*args, **kw):
        raise AssertionError("decoded an image over max_pixels")

    sj = fastjpeg._simplejpeg()
    if sj is not None:
        monkeypatch.setattr(sj, "decode_jpeg", refuse)
    monkeypatch.setattr(Image.Image, "load", refuse)
    for decoder in (
        webds.RandomResizedCropDecoder(64, max_pixels=600 * 400 - 1),
        webds.CenterCropDecoder(64, max_pixels=1000),
    ):
        with pytest.raises(webds.DecodeError, match=r"600x400 = 240,000 pixels.*max_pixels"):
            decoder(".jpg", data)


def test_arguments_are_checked():
    for bad in (
        lambda: webds.RandomResizedCropDecoder(0),
        lambda: webds.RandomResizedCropDecoder(224, scale=(0.5, 0.1)),
        lambda: webds.RandomResizedCropDecoder(224, output="cv2"),
        lambda: webds.RandomResizedCropDecoder(224, seed="x"),
        lambda: webds.CenterCropDecoder(224, resize=200),
        lambda: webds.CenterCropDecoder(224, resizer="cv2"),
    ):
        with pytest.raises(webds.ArgumentError):
            bad()


# -- seeds and epochs ----------------------------------------------------------------------


def crops(url: str, decoder, seed=None, epochs: int = 1):
    ds = webds.WebDataset(url, shardshuffle=False, seed=seed).decode(decoder)
    return [[s["jpg"] for s in ds] for _ in range(epochs)]


def test_same_seed_same_crops_new_epoch_new_crops(tmp_path):
    url = write_shard(tmp_path / "s.tar", [encode(coffee(), quality=90)] * 4)
    first = crops(url, webds.RandomResizedCropDecoder(48), seed=7, epochs=2)
    again = crops(url, webds.RandomResizedCropDecoder(48), seed=7, epochs=2)
    other = crops(url, webds.RandomResizedCropDecoder(48), seed=8)
    for a, b in zip(first, again):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    # the same image under four keys: four crops; epoch 1 draws again; another seed too
    assert len({x.tobytes() for x in first[0]}) == 4
    assert not any(np.array_equal(x, y) for x, y in zip(first[0], first[1]))
    assert not any(np.array_equal(x, y) for x, y in zip(first[0], other[0]))
    # the decoder's own seed wins over the pipeline's
    mine = [crops(url, webds.RandomResizedCropDecoder(48, seed=1), seed=s)[0] for s in (7, 8)]
    assert all(np.array_equal(x, y) for x, y in zip(*mine))


def test_unseeded_pipelines_differ(tmp_path):
    url = write_shard(tmp_path / "s.tar", [encode(coffee(), quality=90)] * 3)
    a, b = (
        crops(url, webds.RandomResizedCropDecoder(48))[0],
        crops(url, webds.RandomResizedCropDecoder(48))[0],
    )
    assert not all(np.array_equal(x, y) for x, y in zip(a, b))


def test_loader_workers_repeat(tmp_path):
    url = write_shard(tmp_path / "s.tar", [encode(coffee(), quality=90)] * 4)
    urls = [url, write_shard(tmp_path / "t.tar", [encode(large(), quality=80)] * 2)]

    def run():
        ds = webds.WebDataset(urls, shardshuffle=False, seed=3).decode(
            webds.RandomResizedCropDecoder(40)
        )
        loader = webds.WebLoader(ds.to_tuple("__key__", "jpg"), batch_size=None, num_workers=2)
        return sorted((k, x.numpy().tobytes()) for k, x in loader)

    first = run()
    assert len(first) == 6 and first == run()
    # worker 0 reads s.tar, worker 1 t.tar: the same image under other keys, other crops
    assert len({crop for _, crop in first[:4]}) == 4


def test_a_resumed_epoch_draws_the_crops_it_would_have(tmp_path):
    # An unseeded pipeline records its drawn seed in its state: the crops of the rest of the
    # epoch, and of the next one, are those of the uninterrupted run.
    url = write_shard(tmp_path / "s.tar", [encode(coffee(), quality=90)] * 6)

    def make():
        ds = webds.WebDataset(url, shardshuffle=False).decode(webds.RandomResizedCropDecoder(40))
        return ds.to_tuple("__key__", "jpg")

    a = make()
    it = iter(a)
    before = [next(it) for _ in range(2)]
    state = a.state_dict()
    whole = before + list(it)
    next_epoch = list(a)
    b = make()
    b.load_state_dict(state)
    rest, after = list(b), list(b)
    assert [k for k, _ in rest] == [k for k, _ in whole[2:]]
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(rest, whole[2:]))
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(after, next_epoch))
    assert not all(np.array_equal(x, y) for (_, x), (_, y) in zip(after, whole))


@pytest.mark.parametrize("capability", ["AVX2", "AVX512", "DEFAULT", "SVE256"])
def test_auto_resizer_takes_torch_only_where_its_fast_kernel_is(capability, monkeypatch):
    """resizer="auto" in a process where torch runs one thread: torch's kernel where torch has
    its AVX2/AVX-512 uint8 path, Pillow's elsewhere (torch's generic path is slower)."""
    from webds.stages import crop as crop_mod

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    crop_mod._torch_resizes_fast.cache_clear()
    try:
        fast = capability in ("AVX2", "AVX512")
        assert crop_mod._torch_single_thread() is fast
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
        assert crop_mod._torch_single_thread() is False  # intra-op threads: Pillow always
    finally:
        crop_mod._torch_resizes_fast.cache_clear()


AUTO_PIXELS = """
import sys, numpy as np, torch, webds
torch.set_num_threads(1)  # as in a DataLoader worker
data = open(sys.argv[1], "rb").read()
def crop(resizer):
    d = webds.RandomResizedCropDecoder(160, seed=4, resizer=resizer).bind_pass(None, 0)
    return [d(".jpg", data, {"__key__": f"{i}", "__url__": "s.tar"}) for i in range(6)]
auto, torch_px, pil_px = crop("auto"), crop("torch"), crop("pil")
class Crops(torch.utils.data.Dataset):  # "auto" in a real DataLoader worker (fork)
    def __len__(self):
        return 1
    def __getitem__(self, i):
        return crop("auto")
worker = next(iter(torch.utils.data.DataLoader(Crops(), batch_size=None, num_workers=1)))
print(torch.backends.cpu.get_cpu_capability(),
      all(np.array_equal(a, t) for a, t in zip(auto, torch_px)),
      all(np.array_equal(a, p) for a, p in zip(auto, pil_px)),
      all(np.array_equal(w, a) for w, a in zip(worker, auto)))
"""


def test_auto_resizer_in_a_torch_without_its_fast_kernel_gives_pillows_pixels(tmp_path):
    """For real: in a process where torch runs one thread, and in its DataLoader worker, "auto"
    gives torch's pixels where torch has its vectorized kernel, and Pillow's under
    ATEN_CPU_CAPABILITY=default."""
    import os
    import subprocess

    path = tmp_path / "img.jpg"
    path.write_bytes(encode(coffee().resize((300, 200)), quality=90))  # under 2x160: no DCT
    runs = {}
    for env in ({}, {"ATEN_CPU_CAPABILITY": "default"}):
        out = subprocess.run(
            [sys.executable, "-c", AUTO_PIXELS, str(path)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        capability, is_torch, is_pil, worker_alike = out.stdout.split()
        assert worker_alike == "True"  # a worker decides as this process does
        runs[capability] = (is_torch == "True", is_pil == "True")
    assert runs["DEFAULT"] == (False, True)
    native = [c for c in runs if c != "DEFAULT"]
    if native and native[0] in ("AVX2", "AVX512"):
        assert runs[native[0]] == (True, False)
