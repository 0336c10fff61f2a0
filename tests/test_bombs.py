"""Decompression bombs at decode: codec fields past ``max_field_bytes`` and images past
``max_pixels`` are DecodeErrors naming the sample, the field, the limit and the knob, raised at
bounded memory (measured in a subprocess under an address-space limit: see tests/bombs.py)."""

import bz2
import contextlib
import functools
import gzip
import io
import lzma
import struct
import warnings
import zlib

import numpy as np
import pytest
from bombs import _ZEROS, GiB, MiB, png_claiming, png_zeros, run_limited, zero_bomb
from PIL import Image

import webds
from webds.stages.codecs import decode_image
from webds.stages.decode import Decoder
from webds.stages.limits import MAX_FIELD_BYTES, MAX_PIXELS

# The fastest level of each: what the limit tests check does not depend on the level.
COMPRESS = {
    "gz": functools.partial(gzip.compress, compresslevel=1),
    "bz2": functools.partial(bz2.compress, compresslevel=1),
    "xz": functools.partial(lzma.compress, preset=0),
}

# Decode a shard's samples without importing torch (webds.WebDataset would): its address space
# would dwarf what is measured. Prints the DecodeError and exits 0, or exits 1 without one.
DECODE_SHARD = """
import sys, webds
samples = webds.tarfile_to_samples()(iter([{{"url": {url!r}}}]))
try:
    for sample in webds.decode({args})(samples):
        print("decoded", sample["__key__"], {{k: len(v) for k, v in sample.items() if k[0] != "_"}})
except webds.DecodeError as exn:
    print("DecodeError:", exn)
    sys.exit(0)
sys.exit(1)
"""


@functools.cache
def zeros(codec, size):
    """``zero_bomb(codec, size)``, the same bytes, built once for this module's tests (a second
    each). bz2 and xz bombs are zero_bomb's 256 MiB stream repeated: built from one; gz bombs
    by :func:`gz_zeros`."""
    stream = 256 * MiB
    if codec == "gz":
        return gz_zeros(size)
    if size > stream and size % stream == 0:
        return zeros(codec, stream) * (size // stream)
    return zero_bomb(codec, size)


def _affine(cols, x):
    """The 32x32 bit matrix ``cols`` (a column per bit) times ``x``."""
    out = 0
    for col in cols:
        if not x:
            break
        if x & 1:
            out ^= col
        x >>= 1
    return out


def crc32_zeros(crc, n):
    """``zlib.crc32(bytes(n), crc)`` without ``n`` bytes: appending a zero byte changes a CRC by
    an affine map (x -> L x ^ c), so ``n`` of them are that map raised to ``n`` (by squaring)."""
    one = zlib.crc32(b"\0", 0)
    step = ([zlib.crc32(b"\0", 1 << i) ^ one for i in range(32)], one)  # one zero byte
    while n:
        (cols, c) = step
        if n & 1:
            crc = _affine(cols, crc) ^ c
        step = ([_affine(cols, col) for col in cols], _affine(cols, c) ^ c)  # twice as many
        n >>= 1
    return crc


assert all(
    crc32_zeros(c, n) == zlib.crc32(bytes(n), c)
    for c in (0, 7, 0xFFFFFFFF)
    for n in (0, 1, 5, 70_001)
)


@functools.cache
def _gz_zero_block():
    """What zero_bomb's gzip body repeats: ``_ZEROS`` zero bytes deflated, then a full flush
    (after which deflate starts afresh, so the block is the same wherever it stands)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS, 9, zlib.Z_RLE)
    return c.compress(bytes(_ZEROS)) + c.flush(zlib.Z_FULL_FLUSH)


def gz_zeros(size, prefix=b"", suffix=b""):
    """``zero_bomb("gz", size, prefix, suffix)``, the same bytes (checked for every bomb this
    module builds), in a tenth of the time: the repeated block deflated once per module (not
    twice per bomb) and the CRC of the zeros computed (not run over 4 GiB)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS, 9, zlib.Z_RLE)
    body = [c.compress(prefix), c.flush(zlib.Z_FULL_FLUSH)]
    repeats, rest = divmod(size, _ZEROS)
    if repeats:
        body.append(_gz_zero_block() * repeats)
    body += [c.compress(bytes(rest)), c.compress(suffix), c.flush()]
    crc = zlib.crc32(suffix, crc32_zeros(zlib.crc32(prefix), size))
    total = len(prefix) + size + len(suffix)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return header + b"".join(body) + struct.pack("<II", crc, total & 0xFFFFFFFF)


@pytest.fixture(autouse=True, scope="module")
def _let_the_bombs_go():
    yield
    zeros.cache_clear()
    _gz_zero_block.cache_clear()


def shard(path, fields):
    with webds.TarWriter(str(path)) as w:
        w.write({"__key__": "0001", **fields})
    return str(path)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Peak RSS of the subprocess decoding a shard with a small gz field and a small PNG."""
    buf = io.BytesIO()
    Image.new("L", (64, 64)).save(buf, "PNG")
    url = shard(
        tmp_path_factory.mktemp("small") / "s.tar",
        {"txt.gz": gzip.compress(b"hello"), "png": buf.getvalue()},
    )
    rc, out, peak = run_limited(DECODE_SHARD.format(url=url, args='"rgb8"'), 1 * GiB)
    assert rc == 1 and "decoded 0001" in out, out  # no error: it ran to the end
    return peak


def run_shard(tmp_path, fields, args, as_limit):
    url = shard(tmp_path / "bomb.tar", fields)
    return run_limited(DECODE_SHARD.format(url=url, args=args), as_limit)


# -- codec fields ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["gz", "bz2", "xz"])
def test_4gib_field_bomb_stops_at_the_knob_at_bounded_memory(tmp_path, baseline, codec):
    bomb = zeros(codec, 4 * GiB)
    assert len(bomb) < 5 * MiB
    rc, out, peak = run_shard(
        tmp_path, {f"txt.{codec}": bomb}, "max_field_bytes=64 << 20", as_limit=1 * GiB
    )
    assert rc == 0, out  # a DecodeError, not a MemoryError, not a kill
    assert f"DecodeError: cannot decode field 'txt.{codec}'" in out
    assert "expands past max_field_bytes=67,108,864 (64 MiB)" in out
    assert "decode(..., max_field_bytes=N)" in out and "member '0001.txt." in out
    assert peak - baseline < 64 * MiB + 32 * MiB, (peak, baseline)


@pytest.mark.parametrize("codec", ["gz", "bz2", "xz"])
def test_default_limit_stops_any_field_bomb_under_512mb(tmp_path, baseline, codec):
    # The default is Pillow's scale: a 4 GiB bomb stops after 256 MiB, the process under 512 MB
    # (it peaked at +1.0 GB with the 1 GiB default: issue 36).
    rc, out, peak = run_shard(
        tmp_path, {f"json.{codec}": zeros(codec, 4 * GiB)}, "", as_limit=3 * GiB
    )
    assert rc == 0, out
    assert f"expands past max_field_bytes={MAX_FIELD_BYTES:,} (256 MiB)" in out
    assert 200 * MiB < peak - baseline < 512 * 1000 * 1000 - baseline, (peak, baseline)


@pytest.mark.parametrize("codec", ["gz", "bz2", "xz"])
def test_field_at_the_limit_decodes_one_byte_over_raises(codec):
    payload = np.random.default_rng(0).integers(0, 4, 3 * MiB + 17, dtype=np.uint8).tobytes()
    # Two concatenated members/streams: the limit is the field's, not each stream's.
    packed = COMPRESS[codec](payload[: 2 * MiB]) + COMPRESS[codec](payload[2 * MiB :])
    sample = {"__key__": "k7", "__url__": "s.tar", f"bin.{codec}": packed}
    limit = len(payload)
    assert Decoder([], max_field_bytes=limit)(sample)[f"bin.{codec}"] == payload
    assert Decoder([], max_field_bytes=None)(sample)[f"bin.{codec}"] == payload
    with pytest.raises(webds.DecodeError) as info:
        Decoder([], max_field_bytes=limit - 1)(sample)
    assert info.value.member == f"k7.bin.{codec}" and info.value.url == "s.tar"
    assert f"max_field_bytes={limit - 1:,}" in str(info.value)
    # The stage's knob, and a skipping handler that goes on with the next sample.
    small = {"__key__": "k8", "bin.gz": gzip.compress(b"ok")}
    stage = webds.decode(max_field_bytes=limit - 1, handler=webds.ignore_and_continue)
    assert [s["__key__"] for s in stage(iter([sample, small]))] == ["k8"]


def test_out_of_memory_reads_as_out_of_memory_not_as_bad_data(tmp_path):
    # With the limit off, a 4 GiB field meets a 512 MiB address space.
    rc, out, _ = run_shard(
        tmp_path, {"txt.gz": zeros("gz", 4 * GiB)}, "max_field_bytes=None", as_limit=512 * MiB
    )
    assert rc == 0, out
    assert "out of memory while decoding it (MemoryError)" in out
    assert "holds valid" not in out and "member '0001.txt.gz'" in out


def test_xz_field_asking_for_a_huge_dictionary_is_refused_before_allocating(tmp_path, baseline):
    # A .lzma header names the dictionary the decoder allocates up front: 1.5 GiB here, for 5
    # bytes of data. Under a 1 GiB address space lzma.decompress dies with a MemoryError.
    data = lzma.compress(b"hello", format=lzma.FORMAT_ALONE)
    bomb = data[:1] + struct.pack("<I", 0x60000000) + data[5:]
    rc, out, peak = run_shard(tmp_path, {"txt.xz": bomb}, "", as_limit=1 * GiB)
    assert rc == 0, out
    assert "asks for a decoder dictionary over its memory limit (256 MiB" in out
    assert peak - baseline < 32 * MiB
    sample = {"__key__": "k", "txt.xz": bomb}
    assert Decoder([], max_field_bytes=2 * GiB)(sample)["txt.xz"] == "hello"


def test_limits_must_be_positive_or_none():
    for bad in (0, -1, "1GB", 1.5, True):
        with pytest.raises(webds.ArgumentError, match="max_field_bytes must be a positive"):
            Decoder([], max_field_bytes=bad)
        with pytest.raises(webds.ArgumentError, match="max_pixels must be a positive"):
            webds.imagehandler("rgb8", max_pixels=bad)


# -- images ------------------------------------------------------------------------------------


def jpeg_claiming(width, height):
    """A small JPEG whose frame header claims ``width`` x ``height`` pixels: a decoder allocates
    the whole image before it finds the data short."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def test_png_bomb_is_refused_from_its_header_at_bounded_memory(tmp_path, baseline):
    bomb = png_zeros(13000, 13000)
    assert len(bomb) < 200_000
    rc, out, peak = run_shard(tmp_path, {"png": bomb}, '"rgb8"', as_limit=1 * GiB)
    assert rc == 0, out
    assert "DecodeError: cannot decode field 'png': the image is 13000x13000 = 169,000,000" in out
    assert f"over max_pixels={MAX_PIXELS:,}" in out and "decode(..., max_pixels=N)" in out
    assert "member '0001.png'" in out
    assert peak - baseline < 16 * MiB, (peak, baseline)


@pytest.mark.parametrize("spec", ["rgb8", "pil", "l8", "rgb"])
@pytest.mark.parametrize("fast_jpeg", [True, False])
def test_jpeg_bomb_is_refused_before_decoding(monkeypatch, spec, fast_jpeg):
    simplejpeg = pytest.importorskip("simplejpeg")

    def refuse(*a, **k):
        raise AssertionError("the JPEG was decoded")

    bomb = jpeg_claiming(20000, 10000)
    monkeypatch.setattr(simplejpeg, "decode_jpeg", refuse)
    monkeypatch.setattr(Image.Image, "load", refuse)
    decoder = Decoder([webds.imagehandler(spec, fast_jpeg=fast_jpeg)])
    with pytest.raises(webds.DecodeError, match=r"20000x10000 = 200,000,000 pixels, over"):
        decoder({"__key__": "k", "jpg": bomb})


def test_image_at_max_pixels_decodes_one_pixel_more_raises():
    sample = {"__key__": "k", "png": png_zeros(64, 50, "RGB"), "jpg": jpeg_claiming(16, 16)}
    out = webds.decode("rgb8", max_pixels=64 * 50)(iter([sample]))
    assert next(out)["png"].shape == (50, 64, 3)
    with pytest.raises(webds.DecodeError, match="64x50 = 3,200 pixels, over max_pixels=3,199"):
        next(webds.decode("rgb8", max_pixels=64 * 50 - 1)(iter([sample])))
    assert decode_image(png_zeros(64, 50), "l8", max_pixels=None).shape == (50, 64)


def test_pillow_warning_band_is_an_error_and_pillows_global_is_untouched():
    # 100 Mpx: over Pillow's limit, under twice it, where Pillow only warns and decodes.
    header = png_claiming(10000, 10000)
    before = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(webds.DecodeError, match="10000x10000 = 100,000,000 pixels"):
            Decoder([webds.imagehandler("pil")])({"__key__": "k", "png": header})
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert Image.MAX_IMAGE_PIXELS == before


# -- members of compressed shards --------------------------------------------------------------

# Read a shard's samples (torch-free); print the ShardReadError and exit 0, or exit 1 without one.
READ_SHARD = """
import sys
from webds.errors import ShardReadError
from webds.tar.samples import tarfile_samples
try:
    for sample in tarfile_samples(iter([{{"url": {url!r}}}]), {args}):
        print("read", sample["__key__"], sorted(sample))
except ShardReadError as exn:
    print("ShardReadError:", exn)
    sys.exit(0)
sys.exit(1)
"""


def member_bomb(path, codec, size):
    """A compressed shard: sample 0000 whole, then 0001.bin of ``size`` zero bytes."""
    import tarfile

    small = tarfile.TarInfo("0000.cls")
    small.size = 1
    big = tarfile.TarInfo("0001.bin")
    big.size = size
    prefix = small.tobuf(tarfile.USTAR_FORMAT) + b"7" + bytes(511) + big.tobuf(tarfile.GNU_FORMAT)
    suffix = bytes(-size % 512) + bytes(1024)
    if codec == "gz":  # one gzip member
        path.write_bytes(gz_zeros(size, prefix, suffix))
    else:  # zero_bomb's streams (the same bytes): the prefix's, the zeros' (cached), the suffix's
        head, tail = zero_bomb(codec, 0, prefix), zero_bomb(codec, 0, b"", suffix)
        path.write_bytes(head + zeros(codec, size) + tail)
    return str(path)


@pytest.mark.parametrize("codec", ["gz", "bz2", "xz"])
def test_a_4gib_member_of_a_compressed_shard_is_refused_before_it_is_read(tmp_path, codec):
    url = member_bomb(tmp_path / f"bomb.tar.{codec}", codec, 4 * GiB)
    assert len(open(url, "rb").read()) < 5 * MiB
    rc, out, peak = run_limited(READ_SHARD.format(url=url, args=""), 1 * GiB)
    assert rc == 0, out  # a ShardReadError, not a MemoryError, not a kill
    name = {"gz": "gzip", "bz2": "bzip2", "xz": "xz"}[codec]
    assert f"more than the 1073741824 bytes allowed for a member of a {name}-compressed" in out
    assert "max_member_size=" in out and "member '0001.bin'" in out
    assert peak < 150 * MiB, peak


def run_here(code):
    """``code`` run in this process (where no memory is measured: no fresh interpreter to
    start): its exit status and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(code, "<run_here>", "exec"), {"__name__": "__main__"})
            rc = 0
        except SystemExit as exn:
            rc = exn.code
    return rc, out.getvalue()


def test_the_member_limit_is_a_knob(tmp_path):
    # (3 MiB members and no memory measured: read in this process, not under a limit)
    url = member_bomb(tmp_path / "m.tar.gz", "gz", 3 * MiB)
    rc, out = run_here(READ_SHARD.format(url=url, args="max_member_size=2 << 20"))
    assert rc == 0 and "more than the 2097152 bytes allowed" in out, out
    rc, out = run_here(READ_SHARD.format(url=url, args="max_member_size=3 << 20"))
    assert rc == 1 and "read 0001 ['__key__', '__local_path__', '__url__', 'bin']" in out, out
    # A plain tar's members are bounded by the file; the knob applies there only when given.
    plain = tmp_path / "m.tar"
    plain.write_bytes(gzip.decompress(open(url, "rb").read()))
    rc, out = run_here(READ_SHARD.format(url=str(plain), args=""))
    assert rc == 1 and "read 0001" in out, out
    rc, out = run_here(READ_SHARD.format(url=str(plain), args="max_member_size=1 << 20"))
    assert rc == 0 and "more than the 1048576 bytes allowed for a member of this shard" in out


@pytest.mark.parametrize("codec", ["bz2", "xz"])
def test_out_of_memory_in_a_compressed_shard_is_not_called_corrupt(tmp_path, codec):
    """With the limit lifted past the address space, the read fails as out of memory (it used
    to say corrupt data, re-download)."""
    url = member_bomb(tmp_path / f"oom.tar.{codec}", codec, 2 * GiB)
    args = "max_member_size=4 << 30, max_sample_bytes=4 << 30"  # both limits lifted
    rc, out, _ = run_limited(READ_SHARD.format(url=url, args=args), 512 * MiB)
    assert rc == 0, out
    assert "out of memory" in out and "corrupt" not in out, out
