"""The shared pieces of the ``webds`` command: field specs, ``--where``, sizes, inputs, outputs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import ROOT, tar_names
from conftest import sample_members, write_tar

from webds.cli.common import byte_size, input_urls, open_output, positive_int, read_samples
from webds.cli.fields import MISSING, Where, decode_field, field_value, format_value
from webds.errors import ArgumentError

SAMPLE = {
    "__key__": "dir/0001",
    "__url__": "a.tar",
    "cls": b"3\n",
    "json": b'{"label": "cat", "boxes": [[1, 2], [3, 4]], "meta": {"w": 640}}',
    "seg.png": b"\x89PNG\r\n\x1a\n\x00\x00",
    "txt": b"a photo\tof a cat\n",
    "score": b"0.75",
}


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("cls", 3),
        ("json.label", "cat"),
        ("json.meta.w", 640),
        ("json.boxes.1.0", 3),
        ("json.boxes.-1", [3, 4]),
        ("seg.png", b"\x89PNG\r\n\x1a\n\x00\x00"),
        ("txt", "a photo\tof a cat\n"),
        ("score", 0.75),
        ("key", "dir/0001"),
        ("__key__", "dir/0001"),
        ("__url__", "a.tar"),
    ],
)
def test_field_value(spec: str, expected: object) -> None:
    assert field_value(SAMPLE, spec) == expected


@pytest.mark.parametrize("spec", ["nope", "json.nope", "json.boxes.7", "json.boxes.x", "cls.x"])
def test_missing_fields_are_missing(spec: str) -> None:
    assert field_value(SAMPLE, spec) is MISSING
    assert not MISSING
    assert format_value(MISSING) == ""


def test_decode_field_rules() -> None:
    assert decode_field("cls", b" 12 ") == 12
    assert decode_field("txt", b"12") == "12"  # text extensions stay text
    assert decode_field("json", b"not json") == b"not json"
    assert decode_field("bin", b"\xff\xfe") == b"\xff\xfe"
    assert decode_field("dat", b"a\x00b") == b"a\x00b"
    assert decode_field("id", b"nan") == "nan"  # not a number we would compare


def test_format_value_is_one_line() -> None:
    assert format_value(field_value(SAMPLE, "txt")) == "a photo of a cat"
    assert format_value(field_value(SAMPLE, "json.boxes")) == "[[1,2],[3,4]]"
    assert format_value(field_value(SAMPLE, "seg.png")) == "<10 bytes>"
    assert format_value("x" * 50, limit=10) == "xxxxxxx..."


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("cls == 3", True),
        ("cls == 4", False),
        ('json.label == "cat"', True),
        ("json.meta.w > 600 and cls in (1, 3)", True),
        ("json.boxes[1][0] == 3", True),
        ("len(json.boxes) == 2", True),
        ("len(seg.png) == 10", True),
        ('key.startswith("dir/")', True),
        ('sample["seg.png"][:4] == b"\\x89PNG"', True),
        ("'cat' in txt", True),
        ("missing is None", True),
        ("score < 0.5", False),
    ],
)
def test_where(expression: str, expected: bool) -> None:
    assert Where(expression)(SAMPLE) is expected


def test_where_reports_names_never_seen() -> None:
    where = Where("json.label == 'x' or clss == 3 or len(jpg) > 0")
    assert where(SAMPLE) is False
    assert where.unseen() == ["clss", "jpg"]


def test_where_errors_name_the_sample() -> None:
    with pytest.raises(ArgumentError, match="not a Python expression"):
        Where("cls ==")
    with pytest.raises(ArgumentError, match=r"failed on sample 'dir/0001'.*TypeError"):
        Where("cls + 'a'")(SAMPLE)


@pytest.mark.parametrize(
    "text, value", [("1e9", 10**9), ("500M", 5 * 10**8), ("2G", 2 * 10**9), ("64kb", 64000)]
)
def test_byte_size(text: str, value: int) -> None:
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["0", "-5", "big", ""])
def test_bad_sizes_and_counts(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)
    with pytest.raises(argparse.ArgumentTypeError):
        positive_int(text)


def test_inputs_expand_and_read(tmp_path: Path) -> None:
    for i in range(3):
        write_tar(tmp_path / f"s-{i}.tar", sample_members(2, prefix=f"s{i}-"))
    urls = input_urls([str(tmp_path / "s-{0..1}.tar"), str(tmp_path / "*2.tar")])
    assert [os.path.basename(u) for u in urls] == ["s-0.tar", "s-1.tar", "s-2.tar"]
    keys = [s["__key__"] for s in read_samples(urls)]
    assert keys == ["s0-000000", "s0-000001", "s1-000000", "s1-000001", "s2-000000", "s2-000001"]
    with pytest.raises(ArgumentError, match="only once"):
        input_urls(["-", "-"])
    with pytest.raises(ArgumentError, match="found no"):
        input_urls([str(tmp_path / "none-*.tar")])


def test_a_tar_is_not_written_to_a_terminal() -> None:
    # A real pseudo-terminal as stdout: the command refuses before writing anything.
    import pty

    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from webds.cli.common import open_output\n"
        "from webds.errors import ArgumentError\n"
        "try:\n    open_output('-')\nexcept ArgumentError as e:\n    print('refused:', e)\n"
    )
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script, str(ROOT)],
            stdout=follower,
            stderr=subprocess.PIPE,
            timeout=60,
        )
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
    assert proc.returncode == 0, proc.stderr
    assert b"refused: refusing to write a tar archive to the terminal" in out


def test_open_output_writes_raw_samples(tmp_path: Path) -> None:
    with open_output(str(tmp_path / "o.tar")) as writer:
        writer.write({"__key__": "a", "cls": b"1", "txt": b"x"})
    names = tar_names(tmp_path / "o.tar")
    assert names == ["a.cls", "a.txt"]
