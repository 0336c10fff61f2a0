"""webds.tar.reader against GNU tar and Python's tarfile, and webds.tar.writing's primitives."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import shutil
import subprocess
import tarfile
import tracemalloc
from pathlib import Path
from typing import List, Tuple

import pytest

from webds.errors import ArgumentError, ShardReadError, WebdsError
from webds.tar.reader import EndWithoutMarker, read_members
from webds.tar.writing import (
    END_OF_ARCHIVE,
    encode_header,
    header_encoder,
    member_bytes,
    write_member,
)

GNU_TAR = shutil.which("tar")
needs_gnu_tar = pytest.mark.skipif(
    GNU_TAR is None
    or b"GNU tar"
    not in subprocess.run([GNU_TAR or "tar", "--version"], capture_output=True).stdout,
    reason="GNU tar not installed",
)

LONG_DIR = "d/" + "deep_directory_" * 5 + "/"  # makes names longer than 100 characters
LONG_NAME = LONG_DIR + "n" * 200 + ".txt"  # longer than 256: needs GNU 'L' or pax
SPLIT_NAME = "d/" + "p" * 90 + "/" + "q" * 80 + ".seg.png"  # > 100 but fits the ustar prefix
UNICODE_NAME = "d/ünïcödé-日本.jpg"


def ours(data: bytes, url: str = "mem") -> List[Tuple[str, bytes]]:
    return [(n, d) for n, d, _ in read_members(io.BytesIO(data), url)]


def ours_path(path: Path) -> List[Tuple[str, bytes]]:
    with open(path, "rb") as f:
        return [(n, d) for n, d, _ in read_members(f, str(path))]


def tarfile_reads(path: Path) -> List[Tuple[str, bytes]]:
    """What Python's tarfile reads: the regular members, in order."""
    out = []
    with tarfile.open(str(path), "r:*") as tf:
        for m in tf:
            if m.isreg():
                out.append((m.name, tf.extractfile(m).read()))
    return out


def tarfile_offsets(data: bytes) -> List[int]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        return [m.offset for m in tf if m.isreg()]


def fix_checksum(hdr: bytearray) -> bytearray:
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    return hdr


def tarinfo_block(name: str, size: int, fmt: int = tarfile.USTAR_FORMAT, **kw) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    for k, v in kw.items():
        setattr(info, k, v)
    return info.tobuf(format=fmt)


def simple_tar(members, fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def expect_error(data: bytes, *fragments: str) -> ShardReadError:
    with pytest.raises(ShardReadError) as info:
        ours(data, url="shard.tar")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert info.value.url == "shard.tar"
    return info.value


# ---------------------------------------------------------------------------------------------
# Archives written by GNU tar
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A directory with long, split-able, non-ASCII and empty files, a symlink and a hard link."""
    root = tmp_path / "src"
    files = {
        "d/a.txt": b"hello",
        "d/empty.bin": b"",
        "d/sub/big.bin": os.urandom(3 * 1024 * 1024 + 7),  # spans several read chunks
        SPLIT_NAME: b"split",
        LONG_NAME: b"long",
        UNICODE_NAME: b"unicode",
        "d/exact.bin": os.urandom(1024),
    }
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "d/emptydir").mkdir()
    os.symlink("a.txt", root / "d/link.txt")
    os.link(root / "d/a.txt", root / "d/hard.txt")
    return root


@needs_gnu_tar
@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar", "v7"])
@pytest.mark.parametrize("compress", [None, "-z"])
def test_gnu_tar_formats(tree: Path, tmp_path: Path, fmt: str, compress) -> None:
    names = ["d"]
    if fmt in ("ustar", "v7"):
        # These formats cannot store the long (and, for v7, the split) names; leave them out.
        names = [
            str(p.relative_to(tree))
            for p in sorted(tree.rglob("*"))
            if not p.is_dir() and len(str(p.relative_to(tree))) <= (256 if fmt == "ustar" else 99)
        ]
    out = tmp_path / f"gnu-{fmt}.tar"
    cmd = [GNU_TAR, f"--format={fmt}", "-c", "-f", str(out), "-C", str(tree)]
    if compress:
        cmd.insert(1, compress)
    subprocess.run(cmd + names, check=True, capture_output=True)
    if compress:
        # A link names a member that is read again at its offset: not in a compressed shard.
        with pytest.raises(ShardReadError, match="link to .*--(hard-)?dereference"):
            ours_path(out)
        return
    got = ours_path(out)
    links = ("d/link.txt", "d/hard.txt", "d/a.txt")
    assert [m for m in got if m[0] not in links] == [
        m for m in tarfile_reads(out) if m[0] not in links
    ]
    got_names = {n for n, _ in got}
    assert "d/sub/big.bin" in got_names
    # Whichever of the two hard-linked names comes first is the file, the other a link: both
    # read as its bytes (as `tar x` gives them), and so does the symbolic link to one of them.
    assert [d for n, d in got if n in links] == [b"hello"] * 3
    assert "d/emptydir" not in got_names
    assert not any(n.endswith("/") for n in got_names)
    if fmt in ("gnu", "pax"):
        assert {LONG_NAME, SPLIT_NAME, UNICODE_NAME} <= got_names
    if fmt == "ustar":
        assert SPLIT_NAME in got_names  # read through the 155-byte prefix field
    data = dict(got)
    assert data["d/sub/big.bin"] == (tree / "d/sub/big.bin").read_bytes()
    assert data["d/empty.bin"] == b""


@needs_gnu_tar
def test_gnu_tar_through_a_real_pipe(tree: Path) -> None:
    proc = subprocess.Popen(
        # (Without the links: a link in a stream that is not an uncompressed local file is
        # refused, tests/test_links.py.)
        [GNU_TAR, "--format=pax", "--exclude=link.txt", "--exclude=hard.txt", "-cz", "-f", "-"]
        + ["-C", str(tree), "d"],
        stdout=subprocess.PIPE,
    )
    try:
        got = [(n, d) for n, d, _ in read_members(proc.stdout, "pipe:tar")]
    finally:
        proc.stdout.close()
        proc.wait()
    assert proc.returncode == 0
    assert dict(got)[LONG_NAME] == b"long"
    assert dict(got)["d/sub/big.bin"] == (tree / "d/sub/big.bin").read_bytes()


def test_file_through_cat_pipe(tmp_path: Path) -> None:
    members = [(f"{i:04d}.bin", os.urandom(i * 37)) for i in range(200)]
    path = tmp_path / "a.tar"
    path.write_bytes(simple_tar(members))
    proc = subprocess.Popen(["cat", str(path)], stdout=subprocess.PIPE, bufsize=0)
    try:
        got = [(n, d) for n, d, _ in read_members(proc.stdout, "pipe:cat")]
    finally:
        proc.stdout.close()
        proc.wait()
    assert got == members


@needs_gnu_tar
def test_empty_archive_from_gnu_tar(tmp_path: Path) -> None:
    out = tmp_path / "empty.tar"
    subprocess.run([GNU_TAR, "-cf", str(out), "-T", "/dev/null"], check=True)
    assert ours_path(out) == []


# GNU sparse members and links: tests/test_links.py.


# ---------------------------------------------------------------------------------------------
# Archives written by Python's tarfile
# ---------------------------------------------------------------------------------------------

FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}


def tarfile_members(fmt: str) -> list:
    members = [
        ("000001.jpg", os.urandom(1000)),
        ("000001.cls", b"7"),
        ("000002.empty", b""),
        ("a/b.c/d.seg.png", os.urandom(512)),
        ("000003.big", os.urandom(2 * 1024 * 1024 + 100)),
        (SPLIT_NAME, b"split"),
    ]
    if fmt != "ustar":
        members += [(LONG_NAME, b"long"), (UNICODE_NAME, b"unicode")]
    return members


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("compress", [None, "gz", "bz2", "xz"])
def test_tarfile_formats_and_compressions(tmp_path: Path, fmt: str, compress) -> None:
    path = tmp_path / f"tf-{fmt}.tar"
    mode = "w" if compress is None else f"w:{compress}"
    members = tarfile_members(fmt)
    with tarfile.open(str(path), mode, format=FORMATS[fmt]) as tf:
        d = tarfile.TarInfo("a/dir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        s = tarfile.TarInfo("a/symlink.jpg")
        s.type = tarfile.SYMTYPE
        s.linkname = "../000001.jpg"
        tf.addfile(s)
        h = tarfile.TarInfo("a/hard.jpg")
        h.type = tarfile.LNKTYPE
        h.linkname = "000001.jpg"
        tf.addfile(h)
        fifo = tarfile.TarInfo("a/fifo")
        fifo.type = tarfile.FIFOTYPE
        tf.addfile(fifo)
    if compress is not None:
        with pytest.raises(ShardReadError, match="symbolic link to '../000001.jpg'"):
            ours_path(path)
        return
    got = ours_path(path)
    # The links read as the member they name (tarfile skips them).
    linked = [("a/symlink.jpg", members[0][1]), ("a/hard.jpg", members[0][1])]
    assert got == tarfile_reads(path) + linked
    assert got == members + linked
    if compress is None:
        raw = path.read_bytes()
        with open(path, "rb") as f:
            offsets = [o for _, _, o in read_members(f, local_path=str(path))]
            with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
                links = [m.offset for m in tf if m.islnk() or m.issym()]
            assert offsets == tarfile_offsets(raw) + links


def test_pax_global_header_keeps_member_names(tmp_path: Path) -> None:
    path = tmp_path / "g.tar"
    # A global header with only a comment, like `git archive` writes.
    members = [("k1.txt", b"one"), ("k2.txt", b"two")]
    glob = tarfile.TarInfo.create_pax_global_header({"comment": "x"})
    path.write_bytes(glob + simple_tar(members))
    assert ours_path(path) == members == tarfile_reads(path)


def test_pax_global_path_and_member_override() -> None:
    # POSIX: a global 'path' applies to following members until a member's own 'x' overrides it.
    g = tarfile.TarInfo.create_pax_global_header({"path": "global.txt"})
    own = tarfile.TarInfo("own-name-is-long-" + "x" * 120 + ".txt")
    own.size = 3
    own_block = own.tobuf(format=tarfile.PAX_FORMAT) + b"abc" + b"\0" * 509
    plain = tarinfo_block("plain.txt", 2) + b"hi" + b"\0" * 510
    got = ours(g + plain + own_block + END_OF_ARCHIVE)
    assert got == [("global.txt", b"hi"), (own.name, b"abc")]


def test_concatenated_gzip_and_bzip2_streams() -> None:
    members = [(f"{i:03d}.txt", os.urandom(700)) for i in range(40)]
    raw = simple_tar(members)
    cut = 512 * 17 + 100  # in the middle of a member
    two_gz = gzip.compress(raw[:cut]) + gzip.compress(raw[cut:])
    assert ours(two_gz) == members
    assert ours(two_gz + b"\0" * 64) == members  # zero padding after the last gzip member
    two_bz = bz2.compress(raw[:cut]) + bz2.compress(raw[cut:])
    assert ours(two_bz) == members
    assert ours(lzma.compress(raw)) == members


def test_base256_size_and_signed_checksum() -> None:
    data = os.urandom(700)
    hdr = bytearray(tarinfo_block("b256.bin", len(data), tarfile.GNU_FORMAT))
    hdr[124:136] = b"\x80" + len(data).to_bytes(11, "big")
    fix_checksum(hdr)
    assert ours(bytes(hdr) + data + b"\0" * 324 + END_OF_ARCHIVE) == [("b256.bin", data)]

    # Old tars summed the header as signed chars; a name byte >= 128 makes the sums differ.
    hdr = bytearray(tarinfo_block("x.bin", 3))
    hdr[0:5] = b"\xe9t\xe9.b"
    hdr[148:156] = b" " * 8
    signed = sum(b - 256 if b > 127 else b for b in hdr)
    hdr[148:156] = b"%06o\0 " % signed
    assert ours(bytes(hdr) + b"abc" + b"\0" * 509 + END_OF_ARCHIVE) == [("\udce9t\udce9.b", b"abc")]


@pytest.mark.parametrize(
    "layout", [b"%06o\0 ", b"%07o\0", b"%o\0      ", b"%6o\0 ", b"%07o ", b"%08o"]
)
def test_checksum_layouts_writers_use(layout: bytes) -> None:
    """Whatever way a writer lays out the checksum field, a right sum is accepted and a wrong
    one refused (the fast check parses six digits; other layouts take the exact check)."""
    hdr = bytearray(tarinfo_block("k.bin", 3))
    hdr[148:156] = b" " * 8
    total = sum(hdr)
    field = (layout % total)[:8].ljust(8, b"\0")
    hdr[148:156] = field
    assert ours(bytes(hdr) + b"abc" + b"\0" * 509 + END_OF_ARCHIVE) == [("k.bin", b"abc")]
    hdr[148:156] = (layout % (total + 1))[:8].ljust(8, b"\0")
    expect_error(bytes(hdr) + b"abc" + b"\0" * 509, "not a tar archive")
    # A flipped bit anywhere else changes the sum by at most 128: always caught.
    hdr[148:156] = field
    for at in (0, 3, 124, 200, 300, 511):
        bad = bytearray(hdr)
        bad[at] ^= 0x80
        expect_error(bytes(bad) + b"abc" + b"\0" * 509, "not a tar archive")


class Dribble(io.RawIOBase):
    """A stream that returns at most ``step`` bytes per read, like a socket or a pipe."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.pos, self.step = data, 0, step

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.step if n < 0 else min(n, self.step)
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out


@pytest.mark.parametrize("step", [None, 777_777, 65_536 + 3])
def test_members_crossing_read_chunks(step) -> None:
    """Members of 0.1-2.5 MiB cross the reader's 1 MiB chunks at every possible phase; names,
    bytes and header offsets are tarfile's, whatever size the stream's reads come in."""
    rng = __import__("random").Random(step or 0)
    members = []
    for i in range(24):
        size = rng.choice([rng.randrange(100_000, 300_000), rng.randrange(1 << 20, 5 << 19), 511])
        members.append((f"{i:04d}.bin", rng.randbytes(size)))
    data = simple_tar(members)
    stream = io.BytesIO(data) if step is None else Dribble(data, step)
    got = list(read_members(stream, "mem"))
    assert [(n, d) for n, d, _ in got] == members
    assert [o for _, _, o in got] == tarfile_offsets(data)
    assert all(type(d) is bytes for _, d, _ in got)


def test_v7_directory_and_unknown_types_are_skipped() -> None:
    v7dir = bytearray(tarinfo_block("olddir/", 0))
    v7dir[156:157] = b"\0"
    v7dir[257:265] = b"\0" * 8  # no magic: a v7 header
    fix_checksum(v7dir)
    unknown = bytearray(tarinfo_block("dumpdir", 600))
    unknown[156:157] = b"D"
    fix_checksum(unknown)
    body = bytes(unknown) + os.urandom(600) + b"\0" * 424
    reg = tarinfo_block("r.txt", 2) + b"ok" + b"\0" * 510
    assert ours(bytes(v7dir) + body + reg + END_OF_ARCHIVE) == [("r.txt", b"ok")]


# ---------------------------------------------------------------------------------------------
# Ends of archives, and malformed input
# ---------------------------------------------------------------------------------------------


def test_archive_ends() -> None:
    members = [("a.txt", b"aaa"), ("b.txt", b"b" * 512)]
    raw = simple_tar(members)
    body = raw[: 512 * 4]  # two members, without any end-of-archive block
    # EOF at a header boundary: the members read are whole, but whole members may be missing
    # after them (a copy cut at a block boundary): an error after the last member read.
    got = []
    with pytest.raises(EndWithoutMarker, match="without its end-of-archive marker") as info:
        for name, data, _ in read_members(io.BytesIO(body), "cut.tar"):
            got.append((name, data))
    assert got == members
    assert isinstance(info.value, ShardReadError)
    assert info.value.offset == 2048 and info.value.member == "b.txt"
    assert ours(body + b"\0" * 512) == members  # a single zero block
    assert ours(body + b"\0" * 100) == members  # a cut end-of-archive marker loses nothing
    assert ours(raw) == members
    assert ours(raw + b"\0" * 100_000) == members  # padding to a large record size
    assert ours(END_OF_ARCHIVE) == []


def test_zero_block_followed_by_data() -> None:
    """A zero block that is not the end: a header zeroed by a hole, or archives concatenated."""
    members = [("a.txt", b"aaa"), ("b.txt", b"b" * 512), ("c.txt", b"ccc")]
    raw = bytearray(simple_tar(members))
    hole = bytearray(raw)
    hole[1024:1536] = bytes(512)  # b.txt's header
    err = expect_error(bytes(hole), "follows the zero block at offset 1024")
    assert err.offset == 1536
    start = bytearray(raw)
    start[0:2048] = bytes(2048)  # a 2 KiB hole at the start, over a and b
    assert expect_error(bytes(start), "follows the zero block at offset 0").offset == 2048
    expect_error(bytes(raw) + b"garbage after the end" * 50, "archives were concatenated")
    expect_error(bytes(raw) + simple_tar([("d.txt", b"ddd")]), "follows the zero block")
    # An unfinished preallocated copy: the rest of the file is zeros, far more than padding.
    expect_error(bytes(raw[:1024]) + bytes(3 << 20), "more than 1048576 zero bytes")
    for opener in (gzip.compress, bz2.compress, lzma.compress):
        expect_error(opener(bytes(hole)), "follows the zero block")


def test_empty_and_non_tar_inputs() -> None:
    err = expect_error(b"", "empty shard")
    assert err.offset == 0
    expect_error(gzip.compress(b""), "empty shard")
    err = expect_error(b"PK\x03\x04" + os.urandom(2000), "not a tar archive")
    assert err.offset == 0
    expect_error(b"just some text\n", "not a tar archive")
    expect_error(b"\0" * 100, "not a tar archive")
    expect_error(b"\x1f\x8b" + os.urandom(100), "gzip")


def test_corrupt_header_later_in_the_shard() -> None:
    raw = bytearray(simple_tar([("a.txt", b"aaa"), ("b.txt", b"bbb"), ("c.txt", b"ccc")]))
    raw[1024 + 3] ^= 0x20  # the second member's header
    with pytest.raises(ShardReadError, match="corrupt header") as info:
        list(read_members(io.BytesIO(bytes(raw)), "s.tar"))
    assert info.value.offset == 1024


def test_members_before_an_error_are_yielded() -> None:
    raw = bytearray(simple_tar([("a.txt", b"aaa"), ("b.txt", b"bbb")]))
    raw[1024 + 3] ^= 0x20
    it = read_members(io.BytesIO(bytes(raw)), "s.tar")
    assert next(it)[:2] == ("a.txt", b"aaa")
    with pytest.raises(ShardReadError):
        next(it)


def test_truncated_everywhere() -> None:
    """Cut a shard at every byte: complete members come out, then a precise error (at a member
    boundary too: only the end-of-archive marker says that no member is missing)."""
    members = [("a.txt", b"A" * 100), ("b.bin", os.urandom(1500)), ("c.txt", b"C" * 512)]
    raw = simple_tar(members)
    # Layout: a header 0, data 512..612, pad ..1024; b header 1024, data 1536..3036, pad ..3072;
    # c header 3072, data 3584..4096; then the end-of-archive blocks.
    expected = [
        (512, "not a tar archive", 0),
        (612, "needs 100 bytes", 0),
        (1024, "padding", 1),
        (1536, "inside a header", 1),
        (3036, "needs 1500 bytes", 1),
        (3072, "padding", 2),
        (3584, "inside a header", 2),
        (4096, "needs 512 bytes", 2),
    ]
    for cut in range(1, 4097):
        got = []
        try:
            for name, data, _ in read_members(io.BytesIO(raw[:cut]), "cut.tar"):
                got.append((name, data))
        except EndWithoutMarker as exn:
            # A cut at a member boundary: every member before it, then an error.
            assert cut in (1024, 3072, 4096), cut
            assert got == members[: [1024, 3072, 4096].index(cut) + 1]
            assert exn.offset == cut
        except ShardReadError as exn:
            assert cut not in (1024, 3072, 4096), cut
            limit, fragment, complete = next(e for e in expected if cut < e[0])
            assert fragment in str(exn), (cut, str(exn))
            assert got == members[:complete], cut
            assert exn.url == "cut.tar" and exn.offset is not None
            if fragment.startswith("needs"):
                assert exn.member == members[complete][0]
                assert exn.offset == [0, 1024, 3072][complete]
        else:
            raise AssertionError(f"a cut at {cut} read as a whole shard")


def test_invalid_numeric_fields_and_absurd_sizes() -> None:
    hdr = bytearray(tarinfo_block("bad.txt", 3))
    hdr[124:136] = b"12345678x9\0\0"
    fix_checksum(hdr)
    err = expect_error(bytes(hdr) + b"abc" + b"\0" * 509, "not an octal number")
    assert err.member == "bad.txt"

    neg = bytearray(tarinfo_block("neg.txt", 3))
    neg[124:136] = b"\xff" * 12
    fix_checksum(neg)
    expect_error(bytes(neg) + END_OF_ARCHIVE, "impossible")

    pax = tarfile.TarInfo("huge.bin")
    pax.pax_headers = {"size": str(10**30)}
    expect_error(pax.tobuf(format=tarfile.PAX_FORMAT) + END_OF_ARCHIVE, "impossible")


def pax_with(records: bytes) -> bytes:
    hdr = tarinfo_block("././@PaxHeader", len(records), type=tarfile.XHDTYPE)
    return hdr + records + b"\0" * (-len(records) % 512)


@pytest.mark.parametrize(
    "records",
    [
        b"garbage without structure\n",
        b"99 path=too-long-for-the-record\n",
        b"12 path\n",
        b"5 =a\n",
        b"13 size=12x3\n",
        b"-5 path=x\n",
    ],
)
def test_invalid_pax_records(records: bytes) -> None:
    data = pax_with(records) + tarinfo_block("m.txt", 0) + END_OF_ARCHIVE
    expect_error(data, "pax header")


def test_extended_header_without_member() -> None:
    expect_error(pax_with(b"12 path=abc\n"), "extended header")
    expect_error(pax_with(b"12 path=abc\n") + END_OF_ARCHIVE, "extended header")
    long_hdr = tarinfo_block(
        "././@LongLink", 10**9, tarfile.GNU_FORMAT, type=tarfile.GNUTYPE_LONGNAME
    )
    expect_error(long_hdr + END_OF_ARCHIVE, "extended header")


def test_gzip_truncated_and_corrupted() -> None:
    members = [(f"{i:03d}.bin", os.urandom(2000)) for i in range(30)]
    gz = gzip.compress(simple_tar(members))
    for cut in (10, len(gz) // 3, len(gz) // 2):
        with pytest.raises(ShardReadError) as info:
            got = []
            for name, data, _ in read_members(io.BytesIO(gz[:cut]), "t.tgz"):
                got.append((name, data))
        assert "truncated" in str(info.value)
        assert got == members[: len(got)]
    for pos in (30, len(gz) // 2):
        bad = bytearray(gz)
        bad[pos] ^= 0xFF
        with pytest.raises(ShardReadError):
            ours(bytes(bad))
    bz = bz2.compress(simple_tar(members))
    with pytest.raises(ShardReadError, match="bzip2"):
        ours(bz[: len(bz) // 2])
    xz = lzma.compress(simple_tar(members))
    with pytest.raises(ShardReadError, match="xz"):
        ours(xz[: len(xz) // 2])


def test_huge_claimed_size_on_a_short_stream_has_bounded_memory() -> None:
    hdr = bytearray(tarinfo_block("huge.bin", 0, tarfile.GNU_FORMAT))
    hdr[124:136] = b"\x80" + (50 * 10**9).to_bytes(11, "big")
    fix_checksum(hdr)
    data = bytes(hdr) + os.urandom(3 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(ShardReadError, match="needs 50000000000 bytes"):
            ours(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 1024 * 1024


def test_a_failing_stream_becomes_a_shard_read_error(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    path.write_bytes(simple_tar([("a.txt", b"a")]))
    f = open(path, "rb")
    f.close()
    with pytest.raises(ShardReadError, match="reading the shard failed"):
        list(read_members(f, str(path)))


def test_the_stream_is_not_closed(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    path.write_bytes(simple_tar([("a.txt", b"a")]))
    with open(path, "rb") as f:
        list(read_members(f))
        assert not f.closed


def test_errors_are_webds_errors_and_pickle() -> None:
    import pickle

    try:
        ours(b"not a tar" * 100)
    except WebdsError as exn:
        again = pickle.loads(pickle.dumps(exn))
        assert type(again) is ShardReadError and again.offset == 0 and again.url == "mem"
    else:
        raise AssertionError("expected an error")


# ---------------------------------------------------------------------------------------------
# Writing primitives
# ---------------------------------------------------------------------------------------------

WRITE_CASES = [
    ("plain.txt", b"hello"),
    ("empty.bin", b""),
    ("block.bin", os.urandom(512)),
    ("block1.bin", os.urandom(513)),
    (SPLIT_NAME, b"split into prefix"),
    (LONG_NAME, b"long name via pax"),
    ("d/" + "z" * 300, b"one very long component"),
    (UNICODE_NAME, "ünïcödé".encode()),
    ("big.bin", os.urandom(200_000)),
]


@pytest.fixture
def written(tmp_path: Path) -> Path:
    path = tmp_path / "written.tar"
    with open(path, "wb") as f:
        total = 0
        for i, (name, data) in enumerate(WRITE_CASES):
            total += write_member(f, name, data, mtime=1_700_000_000 + i, mode=0o640)
        f.write(END_OF_ARCHIVE)
    assert path.stat().st_size == total + 1024
    return path


def test_writer_output_read_by_tarfile_and_us(written: Path) -> None:
    assert tarfile_reads(written) == WRITE_CASES
    assert ours_path(written) == WRITE_CASES
    with tarfile.open(str(written)) as tf:
        infos = tf.getmembers()
    assert [m.mtime for m in infos] == [1_700_000_000 + i for i in range(len(WRITE_CASES))]
    assert {m.mode for m in infos} == {0o640}
    assert {m.uname for m in infos} == {"bigdata"}


@needs_gnu_tar
def test_writer_output_read_by_gnu_tar(written: Path) -> None:
    listing = subprocess.run(
        [GNU_TAR, "-tvf", str(written)], check=True, capture_output=True, env={"LC_ALL": "C.UTF-8"}
    )
    assert listing.stderr == b""
    lines = listing.stdout.decode("utf-8").splitlines()
    assert len(lines) == len(WRITE_CASES)
    for line, (name, data) in zip(lines, WRITE_CASES):
        assert line.endswith(" " + name)
        assert f" {len(data)} " in line
        assert "bigdata/bigdata" in line
    for name, data in WRITE_CASES:
        out = subprocess.run(
            [GNU_TAR, "-xOf", str(written), name],
            check=True,
            capture_output=True,
            env={"LC_ALL": "C.UTF-8"},
        )
        assert out.stdout == data, name


def test_member_bytes_layout() -> None:
    blob = member_bytes("x.txt", b"abc", mtime=5)
    assert len(blob) == 1024
    assert blob[512:515] == b"abc" and blob[515:] == b"\0" * 509
    assert blob[:512] == encode_header("x.txt", 3, mtime=5)
    assert member_bytes("m.bin", memoryview(b"12345678")[::1]) == member_bytes("m.bin", b"12345678")
    hdr = tarfile.TarInfo.frombuf(encode_header("x.txt", 3, mtime=5), "utf-8", "strict")
    assert (hdr.name, hdr.size, hdr.mtime, hdr.mode) == ("x.txt", 3, 5, 0o644)


def test_header_for_a_size_over_8_gib() -> None:
    size = 9 * 2**30 + 123
    hdr = encode_header("huge.bin", size)
    assert len(hdr) % 512 == 0 and len(hdr) > 512  # a pax header precedes the ustar block
    with tarfile.open(fileobj=io.BytesIO(hdr + END_OF_ARCHIVE), mode="r:") as tf:
        first = tf.next()
        assert (first.name, first.size) == ("huge.bin", size)
    # Our reader parses the same size: it asks for exactly that many bytes.
    with pytest.raises(ShardReadError, match=f"needs {size} bytes, only 1000 remain"):
        ours(hdr + os.urandom(1000))
    # The ustar block alone (for readers that ignore pax) carries it in GNU base-256.
    block = tarfile.TarInfo.frombuf(hdr[-512:], "utf-8", "strict")
    assert block.size == size


@needs_gnu_tar
def test_gnu_tar_lists_an_over_8_gib_header(tmp_path: Path) -> None:
    path = tmp_path / "huge.tar"
    path.write_bytes(encode_header("huge.bin", 9 * 2**30) + END_OF_ARCHIVE)
    out = subprocess.run([GNU_TAR, "-tvf", str(path)], capture_output=True)
    # GNU tar lists the member, then complains that its data is missing.
    assert b" 9663676416 " in out.stdout and b"huge.bin" in out.stdout


def test_writer_rejects_bad_arguments() -> None:
    with pytest.raises(ArgumentError):
        encode_header("", 1)
    with pytest.raises(ArgumentError):
        encode_header("a\0b", 1)
    with pytest.raises(ArgumentError):
        encode_header("a.txt", -1)
    with pytest.raises(ArgumentError):
        encode_header("a.txt", 1, typeflag=b"00")
    with pytest.raises(ArgumentError):
        member_bytes("a.txt", "text is not bytes")  # type: ignore[arg-type]


def test_writer_pax_for_other_fields() -> None:
    hdr = encode_header("a.txt", 1, mtime=2**40, uid=2**30, uname="ü" * 5, gname="g" * 40)
    with tarfile.open(fileobj=io.BytesIO(hdr + b"x" + b"\0" * 511 + END_OF_ARCHIVE)) as tf:
        m = tf.next()
        assert (m.mtime, m.uid, m.uname, m.gname) == (2**40, 2**30, "ü" * 5, "g" * 40)
        assert tf.extractfile(m).read() == b"x"


def test_compression_is_detected_from_a_slow_raw_pipe(tmp_path: Path) -> None:
    """A raw pipe may hand over the first byte alone; detection must wait for the magic."""
    members = [(f"{i:03d}.txt", os.urandom(300)) for i in range(20)]
    path = tmp_path / "slow.tgz"
    path.write_bytes(gzip.compress(simple_tar(members)))
    script = f"head -c 1 '{path}'; sleep 0.2; tail -c +2 '{path}'"
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, bufsize=0)
    try:
        got = [(n, d) for n, d, _ in read_members(proc.stdout, "pipe:slow")]
    finally:
        proc.stdout.close()
        proc.wait()
    assert got == members


# The fixed header fields a writer may use; the last ones need pax records in every header.
HEADER_FIELDS = [
    {},
    {"mtime": 1_700_000_000, "mode": 0o600, "uid": 1000, "gid": 100, "uname": "u", "gname": ""},
    {"typeflag": b"5", "uname": "x" * 32, "gname": "y" * 32},
    {"mtime": 8**11},  # past the octal range
    {"uid": 8**7, "gid": -1},
    {"uname": "ü", "gname": "g" * 33},
]
HEADER_NAMES = [
    "a",
    "000001.jpg",
    "d/" * 49 + "xy",  # exactly 100 bytes
    "n" * 100,
    "n" * 101,  # no slash to split at: pax
    SPLIT_NAME,
    LONG_NAME,
    UNICODE_NAME,
    "\udcff.bin",  # surrogate-escaped bytes from a non-UTF-8 name
]
HEADER_SIZES = [0, 1, 511, 512, 1500, 8**11 - 1, 8**11, 9 * 2**40]


@pytest.mark.parametrize("fields", HEADER_FIELDS)
def test_header_encoder_gives_the_bytes_of_encode_header(fields: dict) -> None:
    header = header_encoder(**fields)
    for name in HEADER_NAMES:
        for size in HEADER_SIZES:
            assert header(name, size) == encode_header(name, size, **fields), (name, size)
    # Other int types take the general path, with the same result.
    assert header("b.cls", True) == encode_header("b.cls", True, **fields)


def test_header_encoder_refuses_what_encode_header_refuses() -> None:
    header = header_encoder()
    for name, size in [("", 1), ("a\0b", 1), ("a.txt", -1), ("a.txt", 1.5), (b"a.txt", 1)]:
        with pytest.raises(ArgumentError):
            header(name, size)  # type: ignore[arg-type]
    # The fixed fields are checked when the function is made.
    for bad in [{"mode": 8**7}, {"mtime": 1.5}, {"typeflag": b"00"}, {"mtime": 2**100}]:
        with pytest.raises(ArgumentError):
            header_encoder(**bad)


def test_header_encoder_output_read_by_tarfile(tmp_path: Path) -> None:
    header = header_encoder(mtime=1_700_000_000, mode=0o640)
    data = [("k/000001.jpg", os.urandom(700)), ("000002.cls", b"7"), ("e.bin", b"")]
    path = tmp_path / "t.tar"
    path.write_bytes(
        b"".join(header(n, len(d)) + d + b"\0" * (-len(d) % 512) for n, d in data) + END_OF_ARCHIVE
    )
    assert tarfile_reads(path) == data


# ---------------------------------------------------------------------------------------------
# Pax headers that change nothing are skipped on the fast path; those that do are honoured
# ---------------------------------------------------------------------------------------------


def test_pax_blocks_seen_before_are_honoured_when_their_records_differ() -> None:
    """The same pax header block (same size) once with a time, once with a path: the fast path
    recognises the first again only with the same record key, so the path is honoured."""
    mtime, path = b"27 mtime=1795631126.262537\n", b"27 path=renamed/file-x.txt\n"
    assert len(mtime) == len(path) == 27
    data = (
        pax_with(mtime) + tarinfo_block("a.txt", 1) + b"a" + bytes(511)
        + pax_with(mtime) + tarinfo_block("b.txt", 1) + b"b" + bytes(511)
        + pax_with(path) + tarinfo_block("c.txt", 1) + b"c" + bytes(511)
        + pax_with(b"27 size=2" + b"0" * 17 + b"\n") + tarinfo_block("d.txt", 1) + b"d" + bytes(511)
        + END_OF_ARCHIVE
    )  # fmt: skip
    members = []
    with pytest.raises(ShardReadError, match="claims 200000000000000000 bytes") as info:
        for member in read_members(io.BytesIO(data), "mixed.tar"):
            members.append(member)
    assert info.value.member == "d.txt"  # its pax size is honoured too
    assert [(n, d) for n, d, _ in members] == [
        ("a.txt", b"a"),
        ("b.txt", b"b"),
        ("renamed/file-x.txt", b"c"),
    ]
    # Each member's offset is that of its pax header, skipped or not.
    assert [o for _, _, o in members] == [0, 2048, 4096]


_RECORDS = [
    {},
    {"mtime": "1700000000.25"},
    {"atime": "1700000000.5", "ctime": "1700000001.125"},
    {"path": "renamed/{i}.bin"},
    {"comment": "a comment\nwith path=evil/{i} inside"},
    {"uname": "someone", "uid": "12345678901", "mtime": "1.5"},
    {"SCHILY.xattr.user.path": "x"},
    {"linkpath": "elsewhere"},
]


@pytest.mark.parametrize("seed", range(40))
def test_random_pax_archives_read_as_tarfile_reads_them(tmp_path: Path, seed: int) -> None:
    """Archives of members whose pax records are drawn at random (harmless or not, in any
    order): names, data and offsets as Python's tarfile reads them."""
    import random

    rng = random.Random(seed)
    path = tmp_path / "r.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(rng.randrange(1, 30)):
            info = tarfile.TarInfo(f"{i:04d}.{rng.choice(['bin', 'txt', 'seg.png'])}")
            data = os.urandom(rng.randrange(0, 1500))
            info.size = len(data)
            info.mtime = rng.choice([1700000000, 1700000000.5 + i / 7])
            info.pax_headers = {k: v.format(i=i) for k, v in rng.choice(_RECORDS).items()}
            tf.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tf:
        want = [
            (m.name, tf.extractfile(m).read(), m.offset)  # type: ignore[union-attr]
            for m in tf.getmembers()
            if m.isreg()
        ]
    with open(path, "rb") as f:
        got = list(read_members(f, str(path)))
    assert got == want


@pytest.mark.parametrize("step", [None, 1000, 1536, 4099])
def test_repeated_pax_blocks_across_read_chunks(tmp_path: Path, step) -> None:
    """tarfile's PAX members with float mtimes (27- and 28-byte records, so two alternating pax
    blocks, as webdataset writes them), now and then a pax path or size among them, read through
    reads of odd sizes: the blocks recognised in place never hide a path and offsets stay exact."""
    import random

    rng = random.Random(step or 1)
    path = tmp_path / "w.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(400):
            data = rng.randbytes(rng.choice([0, 1, 511, 512, 513, 1500]))
            info = tarfile.TarInfo(f"{i // 2:05d}.{'bin' if i % 2 else 'cls'}")
            info.size = len(data)
            info.mtime = 1795639586 + rng.choice([0.25, 0.299383, 0.2995424])
            if rng.random() < 0.05:
                info.pax_headers = {"path": f"renamed/{i}.bin"}
            tf.addfile(info, io.BytesIO(data))
    raw = path.read_bytes()
    with tarfile.open(path) as tf:
        want = [(m.name, tf.extractfile(m).read(), m.offset) for m in tf.getmembers()]  # type: ignore[union-attr]
    stream = io.BytesIO(raw) if step is None else Dribble(raw, step)
    assert list(read_members(stream, "w.tar")) == want
