"""Property tests: the tar reader on valid shards, and on shards damaged in every way.

Valid shards (written by our writer or by Python's tarfile, plain or gzipped) must round-trip
exactly. Damaged ones (bytes flipped, headers scribbled on, truncated, spliced, padded with
junk) may only yield well-formed members or raise a WebdsError: never another exception, never a
hang, never unbounded memory.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import tracemalloc
from typing import List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from webds.errors import WebdsError
from webds.tar.reader import read_members
from webds.tar.samples import tarfile_to_samples
from webds.tar.writing import END_OF_ARCHIVE, member_bytes

FUZZ = settings(
    max_examples=300,
    derandomize=True,  # the same examples on every run: CI is reproducible
    database=None,
    deadline=2000,  # a hang or a pathological slowdown fails the example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

name_part = st.text(alphabet=st.sampled_from("abcXYZ019_-.ü日 "), min_size=1, max_size=12).filter(
    lambda s: s.strip(".")
)
names = st.builds(
    lambda parts, ext, long: "/".join(parts) + ("x" * long) + "." + ext,
    st.lists(name_part, min_size=1, max_size=3),
    st.sampled_from(["jpg", "cls", "seg.png", "TXT", "json"]),
    st.sampled_from([0, 0, 0, 90, 250]),  # some names need the ustar prefix, GNU 'L' or pax
)
member = st.tuples(names, st.binary(max_size=1500) | st.sampled_from([b"", b"x" * 512, b"y" * 513]))
members = st.lists(member, max_size=8)
# Damage is more telling in a shard of several members (past the first header).
several_members = st.lists(member, min_size=3, max_size=8)
formats = st.sampled_from(["webds", "ustar", "gnu", "pax"])


def build(items: List[Tuple[str, bytes]], fmt: str, gz: bool) -> bytes:
    if fmt == "webds":
        raw = b"".join(member_bytes(n, d, mtime=1_600_000_000) for n, d in items) + END_OF_ARCHIVE
    else:
        fmt_id = {
            "ustar": tarfile.USTAR_FORMAT,
            "gnu": tarfile.GNU_FORMAT,
            "pax": tarfile.PAX_FORMAT,
        }
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt_id[fmt]) as tf:
            for n, d in items:
                info = tarfile.TarInfo(n)
                info.size = len(d)
                tf.addfile(info, io.BytesIO(d))
        # Drop tarfile's padding to a 10 KiB record, so that damage lands on real content.
        raw = buf.getvalue().rstrip(b"\0")
        raw += b"\0" * (-len(raw) % 512) + END_OF_ARCHIVE
    return gzip.compress(raw, mtime=0) if gz else raw


def usable(items: List[Tuple[str, bytes]], fmt: str) -> str:
    """``fmt``, or "pax" where Python's tarfile can't write these names as ustar."""
    if fmt == "ustar":
        try:
            build(items, fmt, False)
        except ValueError:
            return "pax"
    return fmt


def check_read(data: bytes) -> List[Tuple[str, bytes]]:
    """Read ``data`` fully; assert the contract; return what came out before any error."""
    out = []
    try:
        for item in read_members(io.BytesIO(data), "fuzz.tar"):
            name, blob, offset = item
            assert isinstance(name, str) and name
            assert isinstance(blob, bytes)
            assert isinstance(offset, int) and offset >= 0 and offset % 512 == 0
            out.append((name, blob))
    except WebdsError as exn:
        assert exn.url == "fuzz.tar"
        assert str(exn)
    return out


def check_samples(data: bytes) -> None:
    shard = {"url": "fuzz.tar", "stream": io.BytesIO(data)}
    try:
        for sample in tarfile_to_samples()(iter([shard])):
            assert isinstance(sample["__key__"], str)
            assert all(isinstance(v, bytes) for k, v in sample.items() if not k.startswith("__"))
    except WebdsError:
        pass
    assert shard["stream"].closed


@pytest.mark.timeout(120)
@FUZZ
@given(items=members, fmt=formats, gz=st.booleans())
def test_valid_shards_round_trip(items, fmt, gz) -> None:
    data = build(items, usable(items, fmt), gz)
    assert list((n, d) for n, d, _ in read_members(io.BytesIO(data), "fuzz.tar")) == items


# Positions: anywhere, or on a block boundary (where headers start). Hypothesis favours small
# integers; scatter them so that damage doesn't pile up on the first header.
spread = st.integers(0, 2**20).map(lambda i: ((i + 1) * 2654435761) % 2**20)
position = spread | spread.map(lambda i: i // 512 * 512)
mutation = st.one_of(
    st.tuples(
        st.just("flip"),
        st.lists(st.tuples(spread, st.integers(1, 255)), min_size=1, max_size=4),
    ),
    st.tuples(
        st.just("header"),  # scribble inside one header's fields
        st.tuples(spread, st.integers(0, 511), st.binary(min_size=1, max_size=16)),
    ),
    st.tuples(st.just("truncate"), position),
    st.tuples(st.just("splice"), st.tuples(position, position)),
    st.tuples(st.just("junk"), st.tuples(position, st.binary(max_size=700))),
    st.tuples(
        st.just("size"),  # a huge or malformed size field
        st.tuples(
            spread,
            st.sampled_from(
                [b"77777777777\0", b"\x80" + (10**15).to_bytes(11, "big"), b"\xff" * 12, b"9x"]
            ),
        ),
    ),
)


def mutate(data: bytes, other: bytes, op) -> bytes:
    kind, arg = op
    buf = bytearray(data)
    if not buf:
        return bytes(buf)
    if kind == "flip":
        for pos, bits in arg:
            buf[pos % len(buf)] ^= bits
    elif kind == "header":
        block, off, blob = arg
        start = (block * 512) % len(buf) // 512 * 512 + off
        buf[start : start + len(blob)] = blob
    elif kind == "truncate":
        del buf[arg % (len(buf) + 1) :]
    elif kind == "splice":
        a, b = arg
        return bytes(buf[: a % (len(buf) + 1)]) + other[b % (len(other) + 1) :]
    elif kind == "junk":
        pos, blob = arg
        pos %= len(buf) + 1
        buf[pos:pos] = blob
    elif kind == "size":
        block, field = arg
        start = (block * 512) % len(buf) // 512 * 512 + 124
        buf[start : start + len(field)] = field
        # Keep the checksum valid half of the time, so the size itself gets parsed.
        if block % 2 == 0 and start - 124 + 512 <= len(buf):
            hdr = buf[start - 124 : start - 124 + 512]
            hdr[148:156] = b" " * 8
            buf[start - 124 + 148 : start - 124 + 156] = b"%06o\0 " % sum(hdr)
    return bytes(buf)


@pytest.mark.timeout(120)
@FUZZ
@given(
    items=several_members,
    other_items=several_members,
    fmt=formats,
    gz=st.booleans(),
    ops=st.lists(mutation, min_size=1, max_size=3),
)
def test_damaged_shards_fail_cleanly(items, other_items, fmt, gz, ops) -> None:
    data = build(items, usable(items, fmt), False)
    other = build(other_items, usable(other_items, fmt), False)
    for op in ops:
        data = mutate(data, other, op)
    if gz:
        data = gzip.compress(data, mtime=0)
        if ops[0][0] == "flip":  # damage the compressed stream itself, too
            data = mutate(data, other, ops[0])
    tracemalloc.start()
    try:
        check_read(data)
        check_samples(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The shards are tiny; a reader that believed a corrupt size would allocate far more.
    assert peak < 16 * 1024 * 1024


# Only WebdsError reaches a user, past the reader too: `webds proc`, `webds cat` and the writers
# on hostile member names (a pax path record may hold any byte, NUL and ".." included).


def pax_member(path: bytes, data: bytes) -> bytes:
    """A member whose pax header gives ``path`` (any bytes), after a plain ustar header."""
    body = b"path=" + path + b"\n"
    length = len(body) + 2
    while len(str(length).encode()) + 1 + len(body) != length:
        length += 1
    record = str(length).encode() + b" " + body
    header = tarfile.TarInfo("PaxHeaders/x")
    header.type = tarfile.XHDTYPE
    header.size = len(record)
    pax = header.tobuf(tarfile.USTAR_FORMAT) + record + b"\0" * (-len(record) % 512)
    return pax + member_bytes("placeholder.txt", data, mtime=0)


def hostile_shard(path: bytes) -> bytes:
    return (
        member_bytes("0000.txt", b"before", mtime=0)
        + pax_member(path, b"hostile")
        + member_bytes("0002.txt", b"after", mtime=0)
        + END_OF_ARCHIVE
    )


hostile_paths = st.lists(
    st.sampled_from([b"a", b"..", b".", b"", b"\0", b"b\0c", b"/", b"\\", b"x.txt", b"\xff"]),
    min_size=1,
    max_size=5,
).map(b"".join)


@pytest.mark.timeout(300)
@settings(FUZZ, max_examples=60)
@given(path=hostile_paths)
def test_hostile_member_names_give_webds_errors_in_proc_and_writers(path) -> None:
    from webds.cli.procrun import SampleCommand
    from webds.cli.shardio import write_samples
    from webds.tarwriter import TarWriter

    data = hostile_shard(path)
    samples = []
    try:
        samples = list(tarfile_to_samples()(iter([{"url": "h.tar", "stream": io.BytesIO(data)}])))
    except WebdsError:
        pass
    command = SampleCommand("cat sample.* > sample.out")
    for sample in samples:
        try:
            command.run(sample)
        except WebdsError as exn:
            assert exn.url == "h.tar"
    try:
        with TarWriter(io.BytesIO()) as writer:
            write_samples(writer, samples, "cat")
    except WebdsError as exn:
        if exn.key is not None:  # a refused key: the shard at fault is the input
            assert exn.url == "h.tar" and exn.member is not None


def test_webds_proc_on_a_nul_member_name_says_what_is_wrong(tmp_path) -> None:
    from clitools import run_webds

    (tmp_path / "nul.tar").write_bytes(hostile_shard(b"a\0b.txt"))
    for extra in ([], ["--keep-going"]):
        proc = run_webds(
            "proc",
            *extra,
            "-o",
            "out.tar",
            "-c",
            "cp sample.txt sample.out",
            "nul.tar",
            cwd=tmp_path,
        )
        assert proc.returncode == 1
        assert "Traceback" not in proc.stderr and "embedded null byte" not in proc.stderr
        assert "NUL" in proc.stderr and "nul.tar" in proc.stderr and "'a\\x00b'" in proc.stderr
    # --keep-going leaves the sample out and keeps the others.
    with tarfile.open(tmp_path / "out.tar") as tf:
        assert sorted(tf.getnames()) == ["0000.out", "0000.txt", "0002.out", "0002.txt"]


@pytest.mark.parametrize("output", ["out.tar", "out/", "out-%03d.tar"])
def test_webds_cat_names_the_input_of_a_refused_key(tmp_path, output) -> None:
    from clitools import run_webds

    (tmp_path / "in.tar").write_bytes(hostile_shard(b"../evil.txt"))
    proc = run_webds("cat", "in.tar", "-o", output, cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "shard 'in.tar'" in proc.stderr and "member '../evil.txt'" in proc.stderr
    assert f"shard '{output}'" not in proc.stderr


_WRITE_INTO_LOCKED = """
import sys
from webds import ShardWriter, WebdsError
try:
    with ShardWriter(sys.argv[1], maxcount=2) as writer:
        writer.write({"__key__": "a", "txt": "x"})
except WebdsError as exn:
    assert isinstance(exn, PermissionError), type(exn).__mro__
    print("WebdsError:", exn)
"""


def test_shard_writer_in_an_unsearchable_folder_gives_a_webds_error(tmp_path) -> None:
    import shutil
    import subprocess
    import sys

    from clitools import cli_env

    locked = tmp_path / "locked"
    locked.mkdir()
    pattern = str(locked / "sub" / "s-%03d.tar")
    command = [sys.executable, "-c", _WRITE_INTO_LOCKED, pattern]
    if os.geteuid() == 0:
        # root passes permission checks: drop that power (CAP_DAC_*) for the writer process.
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    locked.chmod(0o600)  # readable and writable, but not searchable
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=cli_env(), timeout=60)
    finally:
        locked.chmod(0o700)
    if os.geteuid() == 0 and "setpriv" in proc.stderr:
        pytest.skip(f"setpriv can't drop capabilities here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{locked / 'sub'}" in proc.stdout and "permission denied" in proc.stdout
    assert not list(tmp_path.rglob("*.tmp-*"))
