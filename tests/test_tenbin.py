"""The tenbin format: round trips, the byte layout, peer files, and corrupt input."""

from __future__ import annotations

import io
import random
import struct
import tarfile

import numpy as np
import pytest
import torch

from webds import tenbin
from webds.errors import ArgumentError, DecodeError, EncodeError

ALL_DTYPES = list(tenbin.SUPPORTED_DTYPES)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_round_trip_every_dtype(dtype):
    rng = np.random.default_rng(0)
    a = (rng.random((3, 5)) * 100).astype(dtype)
    (b,) = tenbin.decode_buffer(tenbin.encode_buffer([a]))
    assert b.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(a, b)


def test_uint32_full_range():
    # webdataset's table spelt it "unit32", so uint32 arrays could not be written at all.
    a = np.array([0, 1, 2**31, 2**32 - 1], dtype=np.uint32)
    (b,) = tenbin.decode_buffer(tenbin.encode_buffer([a]))
    assert b.dtype == np.uint32
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 0, 3), (1, 2, 3, 4, 5), (2,) * 12])
def test_round_trip_shapes(shape):
    a = np.arange(int(np.prod(shape)), dtype="i4").reshape(shape)
    (b,) = tenbin.decode_buffer(tenbin.encode_buffer([a]))
    assert b.shape == shape
    np.testing.assert_array_equal(a, b)


def test_several_arrays_with_infos():
    arrays = [np.ones((2, 2), "f4"), np.arange(3, dtype="u1"), np.zeros(0, "f8")]
    buf = tenbin.encode_buffer(arrays, infos=["img", "ids", "12345678"])
    out, infos = tenbin.decode_buffer(buf, infos=True)
    assert infos == ["img", "ids", "12345678"]
    for a, b in zip(arrays, out):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype


def test_required_infos_are_checked():
    buf = tenbin.encode_buffer([np.ones(2), np.zeros(3)], infos=["x", "y"])
    # webdataset raised unconditionally here; a matching list now returns the arrays.
    out = tenbin.decode_buffer(buf, infos=["x", "y"])
    assert [a.shape for a in out] == [(2,), (3,)]
    with pytest.raises(DecodeError, match="do not match"):
        tenbin.decode_buffer(buf, infos=["x", "z"])
    with pytest.raises(DecodeError):
        tenbin.decode_buffer(buf, infos=["x"])
    with pytest.raises(ArgumentError):
        tenbin.decode_buffer(buf, infos="x")


def test_byte_layout():
    a = np.arange(3, dtype="<f4")
    buf = tenbin.encode_buffer([a], infos=["ab"])
    # header chunk: magic, length 32 (4 int64: dtype, info, ndim, dim), payload padded to 64
    assert buf[:8] == b"~TenBin~"
    assert struct.unpack("<q", buf[8:16])[0] == 32
    header = np.frombuffer(buf[16:48], "<i8")
    assert header[0:1].tobytes().rstrip(b"\0") == b"f4"
    assert header[1:2].tobytes().rstrip(b"\0") == b"ab"
    assert list(header[2:]) == [1, 3]  # ndim, shape
    assert buf[48:80] == b"\0" * 32
    # data chunk starts at 16 + 64
    assert buf[80:88] == b"~TenBin~"
    assert struct.unpack("<q", buf[88:96])[0] == 12
    assert buf[96:108] == a.tobytes()
    assert buf[108:160] == b"\0" * 52
    assert len(buf) == 160


def test_big_endian_input_is_stored_little_endian():
    a = np.arange(4, dtype=">i4")
    buf = tenbin.encode_buffer([a])
    (b,) = tenbin.decode_buffer(buf)
    np.testing.assert_array_equal(a, b)
    assert buf.find(np.arange(4, dtype="<i4").tobytes()) > 0


def test_torch_tensors_are_accepted():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    (b,) = tenbin.decode_buffer(tenbin.encode_buffer([t]))
    assert b.dtype == np.int16
    np.testing.assert_array_equal(b, t.numpy())


def test_decoded_arrays_are_views_of_the_buffer():
    buf = bytearray(tenbin.encode_buffer([np.zeros(4, "u1")]))
    (b,) = tenbin.decode_buffer(buf)
    b[0] = 7  # writable because the buffer is
    assert 7 in buf


def test_encode_errors():
    with pytest.raises(EncodeError, match="dtype"):
        tenbin.encode_buffer([np.array([True, False])])
    with pytest.raises(EncodeError, match="8 characters"):
        tenbin.encode_buffer([np.ones(1)], infos=["too-long-info"])
    with pytest.raises(ArgumentError, match="one string per array"):
        tenbin.encode_buffer([np.ones(1), np.ones(2)], infos=["a"])
    with pytest.raises(ArgumentError, match="list of arrays"):
        tenbin.encode_buffer(np.ones(3))


def test_stream_write_read_and_n():
    arrays = [np.full(i + 1, i, dtype="i8") for i in range(5)]
    stream = io.BytesIO()
    tenbin.write(stream, arrays, infos=list("abcde"))
    assert stream.getvalue() == tenbin.encode_buffer(arrays, infos=list("abcde"))
    stream.seek(0)
    first = tenbin.read(stream, n=2)
    assert [len(a) for a in first] == [1, 2]
    rest, infos = tenbin.read(stream, infos=True)
    assert [len(a) for a in rest] == [3, 4, 5]
    assert infos == ["c", "d", "e"]


def test_save_and_load(tmp_path):
    x, y = np.eye(3, dtype="f4"), np.arange(4, dtype="u2")
    tenbin.save(tmp_path / "a.ten", x, y, infos=["x", "y"])
    a, b = tenbin.load(tmp_path / "a.ten")
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(b, y)
    assert tenbin.load(tmp_path / "a.ten", infos=True)[1] == ["x", "y"]
    with pytest.raises(ArgumentError, match=".ten"):
        tenbin.save(tmp_path / "a.bin", x)
    tenbin.save(tmp_path / "a.bin", x, nocheck=True)
    (c,) = tenbin.load(tmp_path / "a.bin", nocheck=True)
    np.testing.assert_array_equal(c, x)
    with pytest.raises(ArgumentError):
        tenbin.load(tmp_path / "a.bin")


def test_reads_peer_tendata(peer_dir):
    with tarfile.open(peer_dir / "tendata.tar") as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]
    assert len(members) == 100
    for name, data in members:
        assert name.endswith(".ten")
        arrays, infos = tenbin.decode_buffer(data, infos=True)
        assert infos == ["xs", "ys"]
        assert [(a.shape, a.dtype) for a in arrays] == [((28, 28), np.float64)] * 2
        assert np.isfinite(arrays[0]).all()
        # Our writer produces the very same bytes.
        assert tenbin.encode_buffer(list(arrays), infos=infos) == data


def _valid_buffer():
    return tenbin.encode_buffer([np.arange(10, dtype="f4").reshape(2, 5), np.ones(3, "u2")])


def test_truncated_input_raises_decode_error():
    arrays = [np.arange(10, dtype="f4").reshape(2, 5), np.ones(3, "u2")]
    buf = tenbin.encode_buffer(arrays)
    first_array_end = len(tenbin.encode_buffer(arrays[:1]))
    for n in range(1, len(buf)):
        if n == first_array_end:
            # The format has no array count: a cut between arrays reads as fewer arrays.
            (only,) = tenbin.decode_buffer(buf[:n])
            np.testing.assert_array_equal(only, arrays[0])
            continue
        with pytest.raises(DecodeError):
            tenbin.decode_buffer(buf[:n])
        with pytest.raises(DecodeError):
            tenbin.read(io.BytesIO(buf[:n]))


def _decoded_or_error(decode, data):
    """``decode(data)``, or the DecodeError it raised; any other exception fails the test."""
    try:
        return decode(data)
    except DecodeError as e:
        return e


def test_corrupt_input_only_raises_decode_error():
    """Each corrupt buffer either raises DecodeError from both readers, or both decode it to the
    same list of arrays (a flipped byte in array data is still a valid file)."""
    buf = _valid_buffer()
    rng = random.Random(1234)
    raised = decoded = 0
    for _ in range(2000):
        corrupt = bytearray(buf)
        for _ in range(rng.randint(1, 4)):
            corrupt[rng.randrange(len(corrupt))] = rng.randrange(256)
        data = bytes(corrupt)
        got = _decoded_or_error(tenbin.decode_buffer, data)
        streamed = _decoded_or_error(lambda b: tenbin.read(io.BytesIO(b)), data)
        if isinstance(got, DecodeError):
            assert isinstance(streamed, DecodeError), (
                f"read() decoded what decode_buffer refused: {got}"
            )
            raised += 1
            continue
        assert isinstance(got, list) and all(isinstance(a, np.ndarray) for a in got), got
        assert not isinstance(streamed, DecodeError), (
            f"read() refused what decode_buffer took: {streamed}"
        )
        assert [(a.dtype, a.shape) for a in streamed] == [(a.dtype, a.shape) for a in got]
        for a, b in zip(streamed, got):
            np.testing.assert_array_equal(a, b)
        decoded += 1
    # Both outcomes must happen, or the corruption has stopped exercising one of them.
    assert raised > 0 and decoded > 0, (raised, decoded)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"not tenbin at all, no", "magic"),
        (b"~TenBin~" + struct.pack("<q", -5), "length|claims"),
        (b"~TenBin~" + struct.pack("<q", 1 << 40), "claims|truncated"),
        ("a str", "bytes-like"),
    ],
)
def test_specific_corruptions(data, match):
    with pytest.raises(DecodeError, match=match):
        tenbin.decode_buffer(data)


def test_header_inconsistencies():
    a = np.zeros(4, "f4")
    header = np.array([tenbin.str64("f4"), 0, 1, 5], "<i8").tobytes()  # says 5 elements
    buf = bytes(tenbin.encode_chunks([header, a.tobytes()]))
    with pytest.raises(DecodeError, match="needs 20 bytes"):
        tenbin.decode_buffer(buf)
    header = np.array([tenbin.str64("c8"), 0, 1, 4], "<i8").tobytes()
    with pytest.raises(DecodeError, match="unknown dtype"):
        tenbin.decode_buffer(bytes(tenbin.encode_chunks([header, a.tobytes()])))
    header = np.array([tenbin.str64("f4"), 0, 3, 4], "<i8").tobytes()
    with pytest.raises(DecodeError, match="ndim"):
        tenbin.decode_buffer(bytes(tenbin.encode_chunks([header, a.tobytes()])))
    with pytest.raises(DecodeError, match="header/data pairs"):
        tenbin.decode_buffer(bytes(tenbin.encode_chunks([header])))
