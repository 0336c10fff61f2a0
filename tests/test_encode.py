"""SampleEncoder's inlined common cases give what encode_value gives, errors included.

(The encoders of each extension are tested, with their decoders, in test_codecs.py.)
"""

from __future__ import annotations

import enum
import gzip

import numpy as np
import pytest

from webds.errors import EncodeError
from webds.stages.encode import (
    SampleEncoder,
    default_handlers,
    encode_value,
    int_dumps,
    make_encoder,
)


class Label(enum.IntEnum):
    CAT = 3


FIELDS = [
    ("cls", 3),
    ("cls", -12),
    ("cls", 10**30),
    ("CLS", 4),  # extensions are case-insensitive
    ("a.b.cls", 5),
    ("id", 0),
    ("cls", Label.CAT),
    ("cls", np.int64(7)),
    ("json", 3),  # an int under another extension: JSON
    ("txt", "héllo"),
    ("png", "text is UTF-8 whatever the extension"),
    ("bin", b"raw"),
    ("bin", b""),
    ("bin", bytearray(b"array")),
    ("bin", memoryview(b"view")),
    ("txt.gz", "zipped"),
    ("TXT.GZ", "zipped"),
    ("bin.gz", b"zipped bytes"),
    ("bin.gz", gzip.compress(b"already", mtime=0)),
    ("cls.gz", 8),
    ("_meta", "metadata stays str"),
    ("__key__", "k"),
]


@pytest.mark.parametrize("field, value", FIELDS)
def test_sample_encoder_matches_encode_value(field, value):
    expected = encode_value(field, value, default_handlers())
    got = SampleEncoder()({"__key__": "k", field: value})[field]
    assert type(got) is type(expected) and got == expected


ERRORS = [
    ("cls", True, "integer class label"),
    ("cls", 1.5, "integer class label"),
    ("cls", 10**5000, "ValueError"),  # past Python's int-to-str digit limit
    ("txt", "\udcff", "UnicodeEncodeError"),
    ("bin", 5, "no encoder for extension 'bin'"),
    ("_meta", 5, "must be a str"),
    ("_meta", b"bytes", "must be a str"),
]


@pytest.mark.parametrize("field, value, message", ERRORS, ids=[f"{f}-{m}" for f, _, m in ERRORS])
def test_sample_encoder_errors_name_the_field(field, value, message):
    with pytest.raises(EncodeError, match=message) as info:
        SampleEncoder()({"__key__": "k7", field: value})
    assert info.value.key == "k7" and info.value.member == f"k7.{field}"
    assert f"cannot encode field {field!r}" in str(info.value)


def test_int_shortcut_only_for_the_default_int_encoder():
    # A table that maps "cls" elsewhere is used, including one edited after construction.
    assert make_encoder({"cls": lambda x: b"<%d>" % x})({"__key__": "k", "cls": 3})["cls"] == (
        b"<3>"
    )
    encoder = SampleEncoder()
    assert encoder({"__key__": "k", "cls": 3})["cls"] == b"3"
    encoder.handlers["cls"] = lambda x: b"%d!" % x
    assert encoder({"__key__": "k", "cls": 3})["cls"] == b"3!"
    encoder.handlers["cls"] = int_dumps
    assert encoder({"__key__": "k", "cls": 3})["cls"] == b"3"
    # No encoder for the extension: the same error as ever.
    with pytest.raises(EncodeError, match="no encoder for extension 'cls'"):
        make_encoder({})({"__key__": "k", "cls": 3})


def test_identity_encoder_still_checks_every_field():
    ident = make_encoder(False)
    sample = {"__key__": "k", "a": b"x", "b": bytearray(b"y"), "_m": "meta", "_n": b"meta"}
    assert ident(sample) == sample
    with pytest.raises(EncodeError, match="encoder=False") as info:
        ident({"__key__": "k", "a": b"x", "cls": 3})
    assert info.value.member == "k.cls"
    with pytest.raises(EncodeError, match="str or bytes"):
        ident({"__key__": "k", "_m": 3})
