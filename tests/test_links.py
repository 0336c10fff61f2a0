"""Hard links, symbolic links and GNU sparse members in shards written by GNU tar: every reader
path (the member reader, the bulk reader, reads entered at an index's offsets, random access)
yields the bytes `tar x` extracts, or refuses loudly; never a sample without a field."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any, Dict, List

import pytest

import webds
from webds.errors import NoSamplesError, ShardReadError
from webds.shards.index import ShardIndex
from webds.tar.reader import read_members
from webds.tar.samples import tarfile_samples

GNU_TAR = shutil.which("tar")
pytestmark = pytest.mark.skipif(
    GNU_TAR is None
    or "GNU tar"
    not in subprocess.run([GNU_TAR or "tar", "--version"], capture_output=True, text=True).stdout,
    reason="needs GNU tar",
)


def gnu_tar(out: Path, folder: Path, names: List[str], *options: str) -> None:
    subprocess.run([GNU_TAR, *options, "-cf", str(out), "-C", str(folder), *names], check=True)


def extracted(shard: Path, tmp_path: Path) -> Dict[str, bytes]:
    """What `tar x` makes of ``shard``: each file's bytes (links followed), by member name."""
    into = tmp_path / f"x-{shard.stem}"
    into.mkdir()
    subprocess.run([GNU_TAR, "-xf", str(shard), "-C", str(into)], check=True)
    return {
        str(p.relative_to(into)): p.read_bytes() for p in sorted(into.rglob("*")) if p.is_file()
    }


def as_samples(files: Dict[str, bytes], url: str) -> List[Dict[str, Any]]:
    out: Dict[str, Dict[str, Any]] = {}
    for name, data in files.items():
        key, _, ext = name.partition(".")
        out.setdefault(key, {"__key__": key, "__url__": url})[ext] = data
    return [out[k] for k in sorted(out)]


def every_path(shard: Path, access: bool = True) -> List[List[Dict[str, Any]]]:
    """The samples of ``shard`` read by the bulk reader, the member reader, and sample by sample
    entered at the index's offsets (windows), and by random access."""
    url = str(shard)
    plain = lambda s: {k: v for k, v in s.items() if k != "__local_path__"}  # noqa: E731
    bulk = [plain(s) for s in tarfile_samples([{"url": url}], readahead=False)]
    member = [
        plain(s)
        for s in tarfile_samples([{"url": url}], readahead=False, select_files=lambda n: True)
    ]
    entry = ShardIndex.build([url]).shards[0]
    assert entry.offsets is not None
    windows = []
    for k in range(entry.samples):
        d = {"url": url, "start": k, "stop": k + 1, "samples": entry.samples}
        d["offsets"] = entry.offsets
        windows += [plain(s) for s in tarfile_samples([d], readahead=False)]
    if not access:
        return [bulk, member, windows]
    index = shard.parent / f"{shard.stem}.index.json"
    ShardIndex.build([url]).save(str(index))
    dataset = webds.ShardListDataset(str(index))
    return [bulk, member, windows, [plain(dataset[i]) for i in range(len(dataset))]]


@pytest.fixture
def linked(tmp_path: Path) -> Path:
    """A folder of samples where ``0001.png`` is a hard link to ``0001.jpg`` (the same sample)
    and ``0003.jpg`` to ``0001.jpg`` (an earlier sample), ``0004.jpg`` a symbolic link to
    ``0002.jpg``; enough small samples around them for the bulk reader to take."""
    folder = tmp_path / "src"
    folder.mkdir()
    rng = random.Random(7)
    for i in range(60):
        (folder / f"{i:04d}.cls").write_bytes(b"%d" % i)
        if i not in (3, 4):
            (folder / f"{i:04d}.jpg").write_bytes(rng.randbytes(rng.randrange(1, 3000)))
    os.link(folder / "0001.jpg", folder / "0001.png")
    os.link(folder / "0001.jpg", folder / "0003.jpg")
    os.symlink("0002.jpg", folder / "0004.jpg")
    return folder


def names_of(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar"])
def test_hard_and_symbolic_links_read_as_tar_x_extracts_them(linked, tmp_path, fmt) -> None:
    shard = tmp_path / f"links-{fmt}.tar"
    gnu_tar(shard, linked, names_of(linked), f"--format={fmt}")
    with tarfile.open(shard) as tf:  # (GNU tar wrote the links as links)
        kinds = {m.name: m.type for m in tf}
    assert kinds["0001.png"] == kinds["0003.jpg"] == tarfile.LNKTYPE
    assert kinds["0004.jpg"] == tarfile.SYMTYPE
    want = as_samples(extracted(shard, tmp_path), str(shard))
    assert want[1]["png"] == want[1]["jpg"] == want[3]["jpg"] and want[4]["jpg"] == want[2]["jpg"]
    for got in every_path(shard, access=False):
        assert got == want
    # Random access reads a sample's bytes alone: a link in it is refused, never a half sample.
    ShardIndex.build([str(shard)]).save(str(tmp_path / "i.json"))
    dataset = webds.ShardListDataset(str(tmp_path / "i.json"))
    assert dataset[0]["jpg"] == want[0]["jpg"]
    with pytest.raises(ShardReadError, match="cannot find the member a link names"):
        dataset[1]


def test_a_link_whose_target_is_gone_is_refused_naming_it(tmp_path: Path) -> None:
    """A hard link that names no earlier member (tarfile writes what it is told): an error
    naming the link, its target and the fix, on every path; no sample without its field."""
    shard = tmp_path / "dangling.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(20):
            info = tarfile.TarInfo(f"{i:04d}.cls")
            info.size = 1
            tf.addfile(info, __import__("io").BytesIO(b"x"))
        link = tarfile.TarInfo("0020.jpg")
        link.type, link.linkname = tarfile.LNKTYPE, "elsewhere.jpg"
        tf.addfile(link)
    for select in (None, lambda n: True):
        with pytest.raises(ShardReadError, match="hard link to 'elsewhere.jpg'.*hard-dereference"):
            list(tarfile_samples([{"url": str(shard)}], readahead=False, select_files=select))


@pytest.mark.parametrize("how", ["gzip", "pipe"])
def test_a_link_where_its_target_cannot_be_read_again_is_refused(linked, tmp_path, how) -> None:
    """Only an uncompressed local shard can be read again at the target's offset: elsewhere an
    error names the shard, the link, its target and `tar --hard-dereference`."""
    names = [n for n in names_of(linked) if n != "0004.jpg"]
    shard = tmp_path / "links.tar"
    gnu_tar(shard, linked, names, "--format=gnu")
    url = str(shard)
    if how == "gzip":
        url = str(tmp_path / "links.tar.gz")
        subprocess.run(f"gzip -c {shard} > {url}", shell=True, check=True)
    else:
        url = f"pipe:cat {shard}"
    with pytest.raises(ShardReadError, match="hard link to '0001.jpg'.*--hard-dereference") as info:
        list(webds.WebDataset(url, shardshuffle=False))
    assert info.value.member == "0001.png" and info.value.url == url
    # The hard-dereferenced shard reads whole.
    deref = tmp_path / "deref.tar"
    gnu_tar(deref, linked, names, "--format=gnu", "--hard-dereference")
    assert len([s for s in webds.WebDataset(str(deref), shardshuffle=False) if "jpg" in s]) == 59


@pytest.mark.parametrize("fmt", ["gnu", "pax-0.0", "pax-0.1", "pax-1.0"])
def test_gnu_sparse_members_read_with_holes_as_zeros(tmp_path: Path, fmt: str) -> None:
    folder = tmp_path / "src"
    folder.mkdir()
    rng = random.Random(3)
    for i in range(30):
        (folder / f"{i:04d}.cls").write_bytes(b"%d" % i)
        with open(folder / f"{i:04d}.bin", "wb") as f:
            # Many data runs in some (an old GNU header holds 4, then extension blocks).
            for _ in range(1 if i % 3 else 9):
                f.seek(rng.randrange(0, 1 << 20))
                f.write(rng.randbytes(rng.randrange(1, 5000)))
            f.truncate(rng.choice([1 << 20, (1 << 20) + 123]))
    shard = tmp_path / f"sparse-{fmt}.tar"
    options = ["--sparse", f"--format={fmt[:3]}"]
    if fmt.startswith("pax"):
        options.append(f"--sparse-version={fmt[4:]}")
    gnu_tar(shard, folder, names_of(folder), *options)
    if shard.stat().st_size > 8 << 20:
        pytest.skip("this filesystem reports no holes, so GNU tar wrote plain members")
    with tarfile.open(shard) as tf:
        assert any(m.sparse for m in tf)  # (GNU tar wrote sparse members)
    files = extracted(shard, tmp_path)
    want = as_samples(files, str(shard))
    assert len(want) == 30
    with open(shard, "rb") as f:
        assert dict((n, d) for n, d, _ in read_members(f)) == files
    for got in every_path(shard):
        assert got == want


def test_a_sparse_member_claiming_a_huge_size_is_bounded(tmp_path: Path) -> None:
    """A few bytes of old GNU sparse header can declare gigabytes of holes: refused before
    anything is allocated, as a compressed shard's member would be; max_member_size= raises
    the bound."""
    info = tarfile.TarInfo("0000.bin")
    info.type, info.size = tarfile.GNUTYPE_SPARSE, 3
    hdr = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    hdr[386:410] = b"%011o\0%011o\0" % (5, 3)  # one run: 3 bytes at offset 5
    hdr[483:495] = b"%011o\0" % (1 << 32)  # the real size: 4 GiB
    hdr[148:156] = b"%06o\0 " % (sum(hdr[:148]) + sum(hdr[156:]) + 256)
    shard = tmp_path / "bomb.tar"
    shard.write_bytes(bytes(hdr) + b"abc".ljust(512, b"\0") + bytes(1024))
    with pytest.raises(ShardReadError, match="sparse member declares 4294967296 bytes"):
        list(read_members(open(shard, "rb"), str(shard)))
    hdr[483:495] = b"%011o\0" % 10
    hdr[148:156] = b"%06o\0 " % (sum(hdr[:148]) + sum(hdr[156:]) + 256)
    shard.write_bytes(bytes(hdr) + b"abc".ljust(512, b"\0") + bytes(1024))
    assert [d for _, d, _ in read_members(open(shard, "rb"))] == [bytes(5) + b"abc" + bytes(2)]
    with pytest.raises(ShardReadError, match="sparse member declares 10 bytes"):
        list(read_members(open(shard, "rb"), max_member_size=9))


def test_links_and_sparse_members_count_in_the_sample_budget(tmp_path: Path) -> None:
    """A link's bytes and a sparse member's real size are not the bytes on disk at their place:
    they count in their sample's budget, in a plain shard too (against the default 512 MiB
    where max_sample_bytes is not given), before they are read; other members of a plain shard
    count only where max_sample_bytes is given. A link or sparse member of another sample starts
    the count afresh."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.f0.bin").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    for i in range(1, 6):
        os.link(folder / "a.f0.bin", folder / f"a.f{i}.bin")
    with open(folder / "b.f0.bin", "wb") as f:
        f.truncate(3 << 20)  # sparse, 3 MiB of holes
    (folder / "b.cls").write_bytes(b"1")
    with open(folder / "b.f1.bin", "wb") as f:
        f.truncate(3 << 20)
    names = [f"a.f{i}.bin" for i in range(6)] + ["b.f0.bin", "b.cls", "b.f1.bin"]
    shard = tmp_path / "budget.tar"
    gnu_tar(shard, folder, names, "--format=gnu", "--sparse")
    got = [s for s in tarfile_samples([{"url": str(shard)}], readahead=False)]
    assert [len(s) - 3 for s in got] == [6, 3] and got[0]["f5.bin"] == got[0]["f0.bin"]
    with pytest.raises(webds.SampleTooLargeError, match="'a.f4.bin'") as info:
        list(tarfile_samples([{"url": str(shard)}], max_sample_bytes=(5 << 20) - 1))
    assert info.value.key == "a"
    with pytest.raises(webds.SampleTooLargeError, match="'b.f1.bin'") as info:
        list(tarfile_samples([{"url": str(shard)}], max_sample_bytes=6 << 20))
    # Without max_sample_bytes: the sparse members alone, against the default.
    (folder / "b.f1.bin").unlink()
    with open(folder / "b.f1.bin", "wb") as f:
        f.truncate(510 << 20)
    gnu_tar(shard, folder, names, "--format=gnu", "--sparse")
    if shard.stat().st_size > 64 << 20:
        pytest.skip("this filesystem reports no holes: GNU tar wrote plain members")
    with pytest.raises(webds.SampleTooLargeError, match="max_sample_bytes=536,870,912") as info:
        list(read_members(open(shard, "rb"), str(shard)))
    assert info.value.member == "b.f1.bin" and info.value.key == "b"


def test_a_corrupt_first_header_is_one_error_with_or_without_an_index(tmp_path: Path) -> None:
    """With a skipping handler, a shard whose first header is corrupt leaves nothing to yield:
    NoSamplesError (a ValueError) whether or not an index plans the epoch (it was a
    LengthError, a TypeError, through the index)."""
    with webds.ShardWriter(str(tmp_path / "s-%02d.tar"), maxcount=5) as sink:
        for i in range(5):
            sink.write({"__key__": f"k{i}", "cls": i})
    shard = tmp_path / "s-00.tar"
    index = tmp_path / "s.index.json"
    ShardIndex.build([str(shard)]).save(str(index))
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    for url in (str(index), str(shard)):
        ds = webds.WebDataset(url, handler=webds.ignore_and_continue, shardshuffle=False)
        with pytest.raises(NoSamplesError):
            list(ds)
