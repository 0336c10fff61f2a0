"""The bulk grouping (webds.tar.bulk) gives what reading member by member gives, item for item:
the same samples, sample starts and end, the same warnings, and the same error at the same
place after the same samples, on random shards from several writers, damaged ones, shards cut
short, streams that fail, pipes that deliver a few bytes at a time, and with buffers small
enough that every shard crosses many of them."""

from __future__ import annotations

import hashlib
import io
import random
import tarfile
from pathlib import Path
from typing import Any, List, Optional, Set, Tuple

import pytest
from conftest import write_tar
from test_access import FORMATS, random_members, tarfile_shard

import webds
from webds.base.handlers import ErrorPolicy, reraise_exception, warn_and_continue
from webds.stages.probe import READING
from webds.tar import bulk, scan
from webds.tar.grouper import END, Grouping, ShardNotes, group_members
from webds.tar.reader import read_members
from webds.tar.samples import tarfile_samples


class Chunky(io.RawIOBase):
    """A stream that hands out at most ``most`` bytes a read (a pipe), and may fail at byte
    ``fail_at``."""

    def __init__(self, data: bytes, most: int, fail_at: Optional[int] = None) -> None:
        self.data, self.most, self.pos, self.fail_at = data, most, 0, fail_at

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.fail_at is not None and self.pos >= self.fail_at:
            raise OSError("connection reset")
        n = min(len(b), self.most, len(self.data) - self.pos)
        if self.fail_at is not None:
            n = min(n, max(self.fail_at - self.pos, 0)) or n
        b[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def outcome(grouped: Any, notes: ShardNotes) -> Tuple[List[Any], Any]:
    """Everything a grouping gives: its items, then the error that ended it (type, message,
    offset), with what ``notes`` holds."""
    items: List[Any] = []
    error = None
    try:
        for done, start in grouped:
            items.append((done, "END" if start is END else start))
    except Exception as exn:
        error = (type(exn), str(exn), getattr(exn, "offset", None))
    unmarked = None if notes.unmarked is None else str(notes.unmarked)
    return items, (error, notes.dotless, notes.first_dotless, unmarked)


def both(data: bytes, most: int, fail_at: Optional[int] = None, **how: Any) -> Any:
    """(member by member, bulk) outcomes of grouping ``data``."""
    rules = Grouping(lcase=how.pop("lcase", True), unmarked_end=True)
    handler = how.pop("handler", reraise_exception)
    got = []
    for grouped in ("members", "bulk"):
        notes = ShardNotes()
        policy = ErrorPolicy(handler, "test")
        stream = io.BufferedReader(Chunky(data, most, fail_at), buffer_size=most)
        if grouped == "members":
            members = read_members(stream, "s.tar", how.get("max_member_size"))
            it = group_members(members, "s.tar", rules, policy, notes, how.get("local_path"))
        else:
            it = bulk.bulk_groups(
                stream, "s.tar", rules, policy, notes, how.get("local_path"),
                how.get("max_member_size"),
            )  # fmt: skip
        got.append(outcome(it, notes))
    return got


@pytest.fixture(params=[(1024, 1024), (8192, 4096), (bulk._CHUNK, bulk._SMALL)], ids=str)
def buffers(request, monkeypatch):
    """Buffers as small as two headers (every sample crosses one), and the real ones."""
    chunk, small = request.param
    monkeypatch.setattr(bulk, "_FIRST", min(chunk, bulk._FIRST))
    monkeypatch.setattr(bulk, "_CHUNK", chunk)
    monkeypatch.setattr(bulk, "_SMALL", small)
    return chunk


def random_shard(tmp_path: Path, rng: random.Random, k: int) -> bytes:
    path = tmp_path / f"r{k}.tar"
    fmt = rng.choice(FORMATS + (None, None))  # mostly the plain ustar bulk takes
    members = random_members(rng, k, long_names=fmt is not None)
    if rng.random() < 0.5:  # and mostly plain names
        members = [(n, d) for n, d in members if "/" not in n and "." in n]
    if rng.random() < 0.1 and members:
        members.append(rng.choice(members))  # an extension twice, or a key that comes back
    if fmt is None:
        write_tar(path, members)
    else:
        tarfile_shard(path, members, fmt, rng)
    return path.read_bytes()


@pytest.mark.parametrize("case", range(80))
def test_random_shards_group_alike(tmp_path, buffers, case):
    rng = random.Random(case)
    data = random_shard(tmp_path, rng, case)
    most = rng.choice([1 << 20, 100, 4096])
    handler = rng.choice([reraise_exception, warn_and_continue])
    members, bulked = both(data, most, handler=handler, lcase=rng.random() < 0.8,
                           local_path=rng.choice([None, "/x/s.tar"]))  # fmt: skip
    assert bulked == members


@pytest.mark.parametrize("case", range(120))
def test_damaged_shards_fail_alike(tmp_path, buffers, case, monkeypatch):
    """A flipped byte, a cut, a zeroed block, a failing read: the same samples before the same
    error."""
    handed = watch_handovers(monkeypatch)
    rng = random.Random(1000 + case)
    data = bytearray(random_shard(tmp_path, rng, case))
    fail_at = None
    damage = case % 4
    if damage == 0 and data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif damage == 1:
        data = data[: rng.randrange(len(data) + 1)]
    elif damage == 2 and len(data) >= 512:
        at = rng.randrange(len(data) // 512) * 512
        data[at : at + 512] = bytes(512)
    else:
        fail_at = rng.randrange(len(data) + 1)
    most = rng.choice([1 << 20, 512, 700])
    members, bulked = both(bytes(data), most, fail_at)
    if fail_at is None:
        assert bulked == members
    else:
        # How much a read that fails takes with it depends on how much it asks for (the member
        # reader asks for 1 MiB at a time): both give a part of what the whole shard gives,
        # and then the same error.
        bulk_handed = bool(handed)
        whole = both(bytes(data), most)[0][0]
        assert bulked[1][0] == members[1][0]  # (what else they noticed: as far as each read)
        for items in (members[0], bulked[0]):
            assert items == whole[: len(items)]
        if not bulk_handed:
            # The bulk path read it all itself, a chunk at a time: the failing read loses at
            # most a chunk and the stream's buffer; every sample that ended before those it
            # gave (a sample ends where the next starts).
            lost = max(bulk._FIRST, bulk._CHUNK) + most + 1024
            starts = [start for _, start in whole[1:] if start != "END"]
            assert len(bulked[0]) >= sum(end <= fail_at - lost for end in starts)


def watch_handovers(monkeypatch: Any) -> List[int]:
    """The stream offsets where the bulk path hands over to the member reader, as it does."""
    handed: List[int] = []
    real = bulk._handed_over

    def handed_over(shard: Any, rest: bytes, offset: int, *args: Any) -> Any:
        handed.append(offset)
        return real(shard, rest, offset, *args)

    monkeypatch.setattr(bulk, "_handed_over", handed_over)
    return handed


@pytest.mark.parametrize("small", [True, False])
def test_small_records_are_grouped_in_bulk(tmp_path, monkeypatch, small):
    """Not a vacuous comparison: on shards of plain small members the bulk path makes the
    samples, and hands over only for the end."""
    if small:  # many rounds, each sample carried over once
        monkeypatch.setattr(bulk, "_FIRST", 8192)
        monkeypatch.setattr(bulk, "_CHUNK", 8192)
        monkeypatch.setattr(bulk, "_SMALL", 4096)
    rng = random.Random(7)
    members = [(f"{i:05d}.{ext}", rng.randbytes(rng.randint(0, 1500)))
               for i in range(300) for ext in ("bin", "cls")]  # fmt: skip
    path = write_tar(tmp_path / "s.tar", members)
    handed = watch_handovers(monkeypatch)
    members_, bulked = both(path.read_bytes(), 1 << 20)
    assert bulked == members_ and len(bulked[0]) == 301
    assert handed == [bulked[0][-2][1]]  # at the last sample
    ds = webds.WebDataset(str(path)).to_tuple("__key__", "bin")
    assert [k for k, _ in ds] == [f"{i:05d}" for i in range(300)]


def test_large_members_are_read_one_by_one(tmp_path, monkeypatch):
    members = [(f"{i:03d}.bin", bytes(100_000)) for i in range(40)]
    path = write_tar(tmp_path / "s.tar", members)
    handed = watch_handovers(monkeypatch)
    members_, bulked = both(path.read_bytes(), 1 << 20)
    assert bulked == members_ and handed == [0]


def test_webdataset_shards_in_bulk_and_compressed_ones_one_by_one(tmp_path, monkeypatch):
    """webdataset writes a pax header with a float mtime before every member: those are taken
    in bulk. A gzipped shard is read member by member."""
    members = [(f"{i:03d}.txt", b"x" * i) for i in range(100)]
    handed = watch_handovers(monkeypatch)
    for compress, fmt in [(None, tarfile.PAX_FORMAT), ("gz", tarfile.USTAR_FORMAT)]:
        path = tmp_path / f"s-{compress}.tar"
        if compress is None:
            tarfile_shard(path, members, fmt, random.Random(0))
            with tarfile.open(path) as tf:
                assert "mtime" in tf.getmembers()[0].pax_headers
        else:
            write_tar(path, members, format=fmt, compress=compress)
        handed.clear()
        members_, bulked = both(path.read_bytes(), 1 << 20)
        assert bulked == members_ and len(bulked[0]) == 101
        assert handed == ([bulked[0][-2][1]] if compress is None else [0])
    wds = pytest.importorskip("webdataset")
    with wds.TarWriter(str(tmp_path / "w.tar")) as sink:
        for i in range(50):
            sink.write({"__key__": f"{i:03d}", "txt": b"y" * i, "cls": str(i).encode()})
    handed.clear()
    members_, bulked = both((tmp_path / "w.tar").read_bytes(), 1 << 20)
    assert bulked == members_ and len(bulked[0]) == 51 and handed == [bulked[0][-2][1]]


def test_a_member_past_max_member_size_fails_alike(tmp_path, buffers):
    members = [(f"{i:03d}.txt", b"x" * (10 * i)) for i in range(50)]
    data = write_tar(tmp_path / "s.tar", members).read_bytes()
    got = both(data, 1 << 20, max_member_size=250)
    assert got[1] == got[0] and got[0][1][0][0].__name__ == "ShardReadError"


def test_streams_that_are_not_io_objects_are_read_through_their_read(tmp_path):
    """A wrapper that hands its other attributes on to the stream it wraps (readinto among
    them) is read through its own read(); an io.RawIOBase that defines only read() too."""
    path = write_tar(tmp_path / "s.tar", [(f"{i:03d}.txt", b"x" * i) for i in range(100)])

    class Counting:
        def __init__(self, stream: Any) -> None:
            self.stream, self.seen = stream, 0

        def read(self, n: int = -1) -> bytes:
            data = self.stream.read(n)
            self.seen += len(data)
            return data

        def __getattr__(self, name: str) -> Any:
            return getattr(self.stream, name)

    class ReadOnly(io.RawIOBase):
        def __init__(self, stream: Any) -> None:
            self.stream, self.seen = stream, 0

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1) -> bytes:
            data = self.stream.read(n)
            self.seen += len(data)
            return data

    for wrap in (Counting, ReadOnly):
        with open(path, "rb") as f:
            stream = wrap(f)
            samples = tarfile_samples([{"url": str(path), "stream": stream}], readahead=False)
            assert [s["txt"] for s in samples] == [b"x" * i for i in range(100)]
            assert stream.seen == path.stat().st_size, wrap


def test_stats_time_the_bulk_reads(tmp_path, monkeypatch):
    """stats=True wraps each shard stream to time its reads: the bulk path still reads it, and
    the reading share counts every byte."""
    members = [(f"{i:05d}.{ext}", b"y" * 100) for i in range(200) for ext in ("bin", "cls")]
    path = write_tar(tmp_path / "s.tar", members)
    handed = watch_handovers(monkeypatch)
    ds = webds.WebDataset(str(path), stats=True)
    assert sum(1 for _ in ds) == 200
    assert len(handed) == 1 and handed[0] > 0  # in bulk, up to the last sample
    (reading,) = [s for s in ds.stats().stages if s.name == READING]
    assert reading.nbytes == path.stat().st_size


# -- one step off: cut at a block boundary, entered at an index's offsets, resumed, remote ----


@pytest.mark.parametrize("writer", ["ustar", "pax"])
def test_a_shard_cut_at_every_block_boundary_fails_alike(tmp_path, buffers, writer):
    """Cut at each 512-byte boundary (a member boundary among them: no end-of-archive marker;
    with a pax header before each member, as webdataset writes, also between a pax header and
    its member), the bulk path ends as the member reader does: the same samples, the same
    unmarked end or error."""
    members = [(f"{i:03d}.{ext}", b"z" * (i * 37 % 700)) for i in range(12) for ext in "ab"]
    path = tmp_path / "s.tar"
    if writer == "ustar":
        write_tar(path, members)
    else:
        tarfile_shard(path, members, tarfile.PAX_FORMAT, random.Random(0))
    data = path.read_bytes()
    for cut in range(0, len(data) + 1, 512):
        members_, bulked = both(data[:cut], 1 << 20)
        assert bulked == members_, cut


def _resummed(header: bytes) -> bytes:
    """``header`` with its checksum made right, written as writers write it (``%06o``, NUL,
    space)."""
    out = bytearray(header)
    out[148:156] = b" " * 8
    out[148:156] = b"%06o\0 " % sum(out)
    return bytes(out)


#: Header bytes and the values each is set to: the name, mode, size (its digits and the NUL or
#: space after them), checksum, type flag, magic and prefix fields, at the values their checks
#: turn on ("0" - 1, "0", "7", "8", NUL, space, ".", "/", "_", 0xff, ...).
_FIELD_BYTES = [*range(0, 14), 98, 99, 100, 107, *range(124, 136), *range(148, 156), 156,
                *range(257, 265), 345, 346]  # fmt: skip
_VALUES = [0x00, 0x20, 0x2E, 0x2F, 0x30, 0x37, 0x38, 0x5F, 0x78, 0xFF]


def _mid_shard(tmp_path: Path, writer: str) -> Tuple[bytearray, int]:
    """A shard of 24 two-member samples and the offset of a header in mid-shard: the 10th
    sample's first member's (``"ustar"``: webds's test writer), or in a shard with a pax header
    before every member (as webdataset writes it), that pax header's (``"pax-header"``) or the
    member's after it (``"pax-member"``)."""
    members = [(f"{i:03d}.{ext}", b"v" * (i * 53 % 900)) for i in range(24) for ext in "ab"]
    path = tmp_path / "s.tar"
    if writer == "ustar":
        write_tar(path, members)
        entries = 2 * 9
    else:
        tarfile_shard(path, members, tarfile.PAX_FORMAT, random.Random(0))
        entries = 4 * 9 + (writer == "pax-member")
    data = bytearray(path.read_bytes())
    at = 0
    for _ in range(entries):
        at += 512 + (int(data[at + 124 : at + 135], 8) + 511) // 512 * 512
    assert data[at + 156] == (ord("x") if writer == "pax-header" else ord("0"))
    return data, at


WRITERS = ["ustar", "pax-header", "pax-member"]


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("summed", [True, False], ids=["sum-right", "sum-wrong"])
def test_every_header_field_byte_changed_reads_alike(tmp_path, buffers, summed, writer):
    """Each byte of each field the bulk path checks (in numpy, eight bytes at a time), set to
    each value a check turns on, in a header in mid-shard (a member's, or a pax header's before
    it); with its checksum made right (so that the field checks themselves decide) or left
    wrong; through buffers as small as two headers and the real ones: what the member reader
    reads, the same samples then the same error."""
    data, at = _mid_shard(tmp_path, writer)
    for offset in _FIELD_BYTES:
        for value in _VALUES:
            damaged = bytearray(data)
            damaged[at + offset] = value
            if summed and not 148 <= offset < 156:
                damaged[at : at + 512] = _resummed(damaged[at : at + 512])
            seen = (buffers, hashlib.sha256(damaged).digest())
            if seen in _READ_ALIKE:
                continue  # this very shard, through these buffers, already read alike
            members_, bulked = both(bytes(damaged), 1 << 20)
            assert bulked == members_, (offset, value)
            _READ_ALIKE.add(seen)


#: (buffers, SHA-256 of a damaged shard) that the test above has read alike: a byte set to the
#: value it had, and the checksum's own bytes (not remade with the sum right), give shards it
#: has read already (15% of them), which are not read again.
_READ_ALIKE: Set[Tuple[int, bytes]] = set()


@pytest.mark.parametrize("writer", ["ustar", "pax-member"])
@pytest.mark.parametrize(
    "name",
    ["__meta__.json", "__index__/x.json", "__k.json", "_k.json", "a/__k__.b", "x/y.z/009.a",
     "x/y.z/009", "009.", ".a", "009..a", "009.a/b", "009.a\0x", "009\0.a", "/009.a",
     "009.\xff\xfe", "\xc3.a", "9" * 99 + "a", "009.A"],
)  # fmt: skip
def test_a_header_of_every_name_kind_reads_alike(tmp_path, name, writer):
    """A name of each kind the grouping rules tell apart (metadata, folders with dots, no key,
    no extension, a NUL inside, bytes that are not UTF-8, the longest), its checksum right, in
    a sample in mid-shard (after a pax header too): what the member reader reads."""
    data, at = _mid_shard(tmp_path, writer)
    data[at : at + 100] = name.encode("latin-1").ljust(100, b"\0")
    data[at : at + 512] = _resummed(data[at : at + 512])
    members_, bulked = both(bytes(data), 1 << 20)
    assert bulked == members_


def small_buffers(monkeypatch: Any) -> None:
    monkeypatch.setattr(bulk, "_FIRST", 2048)
    monkeypatch.setattr(bulk, "_CHUNK", 2048)
    monkeypatch.setattr(bulk, "_SMALL", 1024)


@pytest.mark.parametrize("case", range(6))
def test_index_windows_read_alike_with_buffers_samples_cross(tmp_path, monkeypatch, case):
    """Planned segments entered at an index's offsets, through buffers most samples cross:
    what the member reader reads, for every rank and worker."""
    from test_access import random_shards
    from test_windows import read_plan

    from webds.shards.index import ShardIndex
    from webds.tar import samples as tar_samples

    rng = random.Random(case)
    index = ShardIndex.build(random_shards(tmp_path, rng, rng.randint(1, 4)))
    small_buffers(monkeypatch)
    where = dict(seed=3, epoch=1, world_size=2, num_workers=2, balance="pad", granule=2)
    for rank, worker in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        got = read_plan(index, offsets=True, rank=rank, worker=worker, **where)
        with monkeypatch.context() as m:
            m.setattr(tar_samples, "takes_rules", lambda rules: False)
            want = read_plan(index, offsets=True, rank=rank, worker=worker, **where)
        assert got == want


@pytest.mark.parametrize("k", [0, 1, 7, 150, 299])
def test_a_resume_through_buffers_samples_cross_is_exact(tmp_path, monkeypatch, k):
    """Interrupted after k samples, saved, resumed in a new pipeline: the rest of the epoch,
    each sample once, and the next epoch as it would be (shards of small records, buffers of
    a few samples)."""
    from test_resume import assert_exact

    small_buffers(monkeypatch)
    urls = []
    for s in range(3):
        members = [(f"s{s}-{i:04d}.{ext}", bytes([i % 256]) * (i % 300))
                   for i in range(100) for ext in ("bin", "cls")]  # fmt: skip
        urls.append(str(write_tar(tmp_path / f"r{s}.tar", members)))
    handed = watch_handovers(monkeypatch)
    assert_exact(
        lambda: (
            webds.WebDataset(urls, shardshuffle=True, seed=5)
            .shuffle(20)
            .map(lambda s: (s["__key__"], s["bin"]))
        ),
        k,
    )
    assert handed and all(offset > 0 for offset in handed)  # read in bulk up to the last sample


def test_small_records_over_http_that_cuts_its_bodies(flaky_http_server, monkeypatch):
    """Remote shards of small records, the server closing bodies mid-way (the reader resumes
    them with range requests): read in bulk, every sample once, as the local copies read."""
    urls, local = [], []
    for s in range(2):
        members = [(f"s{s}-{i:04d}.{ext}", random.Random(i).randbytes(i % 1500))
                   for i in range(200) for ext in ("bin", "cls")]  # fmt: skip
        path = write_tar(flaky_http_server.root / f"h{s}.tar", members)
        urls.append(flaky_http_server.url(path.name))
        local.append(str(path))
    want = [(s["__key__"], s["bin"], s["cls"]) for s in webds.WebDataset(local)]
    handed = watch_handovers(monkeypatch)
    flaky_http_server.cut_each([70_000, 200_000, 5_000])
    got = [(s["__key__"], s["bin"], s["cls"]) for s in webds.WebDataset(urls, readahead=False)]
    assert got == want and flaky_http_server.faults_left["cut"] == 0  # every cut was met
    assert len(handed) == 2 and all(offset > 0 for offset in handed)


# -- the names of a uniform chunk: read in fewer steps, as the general rules read them ---------


def _headers(names: List[bytes], types: List[bytes]) -> Any:
    """A chunk's headers as the bulk path gathers them (rows of 512 bytes), each with ``name``
    and type flag, its checksum right."""
    np = pytest.importorskip("numpy")
    template = bytearray(tarfile.TarInfo("x").tobuf(tarfile.USTAR_FORMAT))
    rows = []
    for name, typ in zip(names, types):
        header = bytearray(template)
        header[0:100] = name[:100].ljust(100, b"\0")
        header[156:157] = typ
        rows.append(_resummed(header))
    return np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), 512).copy()


def _random_names(rng: random.Random) -> Tuple[List[bytes], List[bytes]]:
    """Names as a writer names a shard's members (the same key width, a dot, extensions of a
    few kinds), a few of them then changed at a random byte to what the rules look at; pax
    headers among them now and then."""
    width = rng.choice([1, 3, 8, 12, 40, 95])
    prefix = rng.choice([b"", b"", b"dir/", b"a.b/", b"\xc3\xa9/"])
    exts = rng.sample([b"bin", b"cls", b"seg.png", b"JPG", b"t", b"json", b"\xff"], 3)
    names, types = [], []
    for i in range(rng.randint(1, 60)):
        key = prefix + b"%0*d" % (width, i // rng.choice([1, 2, 3]))
        for ext in exts[: rng.randint(1, 3)]:
            if rng.random() < 0.15:
                names.append(b"././@PaxHeader")
                types.append(b"x")
            names.append((key + b"." + ext)[:100])
            types.append(rng.choice([b"0", b"0", b"0", b"\0", b"5"]))
    for _ in range(rng.choice([0, 0, 1, 3])):
        i = rng.randrange(len(names))
        name = bytearray(names[i].ljust(rng.randint(len(names[i]), 100), b"\0"))
        name[rng.randrange(len(name))] = rng.choice(b"\0./_\xff9A")
        names[i] = bytes(name[:100])
    if rng.random() < 0.1:
        names[rng.randrange(len(names))] = b"__meta__." + exts[0]
    return names, types


@pytest.mark.parametrize("case", range(300))
def test_uniform_names_are_read_as_the_general_rules_read_them(case):
    """On random chunks of headers (mostly named alike, some changed at one byte: a dot, a
    slash, a NUL, metadata, bytes that are not UTF-8; pax headers and other types among them):
    where the uniform reading takes the chunk, every regular file is keyed as the general
    reading keys it, and its members' keys, extensions and samples are the same."""
    np = pytest.importorskip("numpy")
    names, types = _random_names(random.Random(case))
    heads = _headers(names, types)
    typ = heads[:, 156]
    regular = (typ == 48) | (typ == 0)
    general = scan._Names(np, heads)
    uniform = scan._UniformNames.of(np, heads, regular)
    if uniform is None:
        return
    assert (uniform.keyed[regular] == general.keyed[regular]).all()
    members = np.flatnonzero(regular & general.keyed)
    for chosen in (members, members[: len(members) // 2]):
        if len(chosen):  # (the bulk path asks for none: it stops first)
            assert uniform.grouped(chosen, len(chosen)) == general.grouped(chosen, len(chosen))
    run = slice(int(np.argmin(regular & general.keyed)) if not (regular & general.keyed).all()
                else len(heads))  # fmt: skip
    if run.stop:
        assert uniform.grouped(run, run.stop) == general.grouped(run, run.stop)


def test_uniform_names_take_most_random_chunks_and_not_the_odd_ones():
    """Not vacuous: the uniform reading takes most chunks the test above draws, and declines
    those where a name breaks the pattern (a dot in the key, a slash after the dot, no dot)."""
    np = pytest.importorskip("numpy")
    taken = 0
    for case in range(300):
        names, types = _random_names(random.Random(case))
        heads = _headers(names, types)
        typ = heads[:, 156]
        taken += scan._UniformNames.of(np, heads, (typ == 48) | (typ == 0)) is not None
    assert 100 < taken < 300
    for odd in [b"0.1.bin", b"00.b/n", b"00bin", b".00bin", b"0\x001.bin"]:
        names = [b"00.bin", b"00.cls", odd, b"01.bin"]
        heads = _headers(names, [b"0"] * 4)
        assert scan._UniformNames.of(np, heads, np.ones(4, bool)) is None, odd
    # Taken, with one name that is not a key.extension file: metadata, a NUL and then more,
    # a folder and no key after it.
    for unkeyed in [b"__.bin", b"00.b\x00n", b"0/.bin"]:
        names = [b"00.bin", b"00.cls", unkeyed, b"01.bin"]
        heads = _headers(names, [b"0"] * 4)
        uniform = scan._UniformNames.of(np, heads, np.ones(4, bool))
        assert uniform is not None and uniform.keyed.tolist() == [True, True, False, True]
        assert scan._Names(np, heads).keyed.tolist() == [True, True, False, True]


def test_every_pax_record_byte_changed_reads_alike(tmp_path):
    """The pax records before a member in mid-shard (``"NN mtime=...\\n"``, as tarfile and
    webdataset write them), each byte and the one after them set to each value the
    recognition looks at (a newline, a space, ``=``, digits, a letter, NUL): what the member
    reader reads (a record the bulk path does not recognise at once is matched as the member
    reader matches it, or handed over). So do records of other keys put in their place."""
    data, at = _mid_shard(tmp_path, "pax-header")
    size = int(data[at + 124 : at + 135], 8)
    assert data[at + 512 : at + 512 + size].split(b" ")[1].startswith(b"mtime=")
    for offset in range(size + 1):
        for value in b"\n =09mx\0":
            damaged = bytearray(data)
            damaged[at + 512 + offset] = value
            members_, bulked = both(bytes(damaged), 1 << 20)
            assert bulked == members_, (offset, chr(value))
    # Records of the same length that do change something (a path, a size, a link), or do not
    # (another time, a user name), one or two of them.
    for key, value in [("path", "p"), ("size", "0"), ("linkpath", "l"), ("atime", "1"),
                       ("uname", "u"), ("mtime", "1\n"), ("mtime", "\n1")]:  # fmt: skip
        for two in (False, True):
            first = b"9 mtime=1\n" if two else b""
            fill = size - len(first) - len(f"{size - len(first)} {key}=\n")
            record = f"{size - len(first)} {key}={value * fill}"[: size - len(first) - 1]
            damaged = bytearray(data)
            damaged[at + 512 : at + 512 + size] = first + record.encode() + b"\n"
            members_, bulked = both(bytes(damaged), 1 << 20)
            assert bulked == members_, (key, value, two)


@pytest.mark.parametrize("writer", ["ustar", "pax"])
def test_keys_that_grow_a_digit_mid_shard_read_alike(tmp_path, buffers, writer):
    """One step off the uniform chunks: unpadded keys (``s9`` then ``s10``, ``s99`` then
    ``s100``), so that a chunk (of every buffer size, the small ones many) is named alike on
    one side of the change of length and not across it; webds's writer and tarfile's pax
    headers before every member: what the member reader reads."""
    members = [(f"s{i}.{ext}", bytes([i % 256]) * (i * 7 % 300)) for i in range(150)
               for ext in ("bin", "cls")]  # fmt: skip
    path = tmp_path / "g.tar"
    if writer == "ustar":
        write_tar(path, members)
    else:
        tarfile_shard(path, members, tarfile.PAX_FORMAT, random.Random(0))
    members_, bulked = both(path.read_bytes(), 1 << 20)
    assert bulked == members_ and len(bulked[0]) == 151
