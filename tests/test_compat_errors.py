"""Code written for webdataset catches the exception types webdataset raised; webds raises its
own (naming shard, member, offset), each also an instance of webdataset's type in that
situation. Each case runs both libraries side by side on the same input."""

from __future__ import annotations

import tarfile
import warnings

import pytest
from conftest import sample_members, write_tar

import webds


@pytest.fixture
def files(tmp_path):
    write_tar(tmp_path / "good.tar", sample_members(3))
    (tmp_path / "bad.tar").write_bytes(b"this is not a tar file" * 30)
    (tmp_path / "empty.tar").write_bytes(bytes(10240))
    data = (tmp_path / "good.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2 + 100])
    return tmp_path


CASES = {
    "a missing file": (lambda d: str(d / "missing.tar"), FileNotFoundError),
    "not a tar file": (lambda d: str(d / "bad.tar"), tarfile.ReadError),
    "no samples at all": (lambda d: str(d / "empty.tar"), ValueError),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reading_raises_what_webdataset_raised(files, case):
    import webdataset

    url, expected = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(expected):
            list(webdataset.WebDataset(url(files), shardshuffle=False))
        with pytest.raises(expected) as info:
            list(webds.WebDataset(url(files), shardshuffle=False))
    assert isinstance(info.value, webds.WebdsError)
    assert info.value.url == url(files) or url(files) in str(info.value)


def test_a_truncated_shard_is_a_tar_read_error(files):
    # webdataset 1.0.2 yields what it can of this one without an error; webds raises, and code
    # that catches tarfile.ReadError for damaged shards catches it.
    with pytest.raises(tarfile.ReadError) as info:
        list(webds.WebDataset(str(files / "cut.tar"), shardshuffle=False))
    assert "truncated" in str(info.value) and "cut.tar" in str(info.value)


def test_a_missing_field_in_map_dict_is_a_key_error():
    import webdataset

    samples = [{"__key__": "k", "a": 1}]
    with pytest.raises(KeyError):
        list(webdataset.filters.map_dict(b=str)(iter(samples)))
    with pytest.raises(KeyError) as info:
        list(webds.map_dict(b=str)(iter(samples)))
    assert isinstance(info.value, webds.SampleError) and "no field 'b'" in str(info.value)


def test_the_error_classes_keep_their_place_in_the_hierarchy():
    assert issubclass(webds.ShardReadError, (webds.WebdsError, OSError, tarfile.ReadError))
    assert issubclass(webds.NotFoundError, webds.OpenError)
    assert issubclass(webds.NotFoundError, FileNotFoundError)
    assert issubclass(webds.MissingFieldError, webds.SampleError)
    assert issubclass(webds.MissingFieldError, ValueError)
    assert issubclass(webds.NoSamplesError, ValueError)
    assert issubclass(webds.SecureModeError, ValueError)
    # The message (with where) is webds's, not KeyError's quoted repr.
    e = webds.MissingFieldError("no field 'b'", url="a.tar", key="k")
    assert str(e) == "no field 'b' [shard 'a.tar', sample 'k']"
