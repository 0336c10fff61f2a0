"""``webds ls``, ``show``, ``tsv``, ``first`` and ``stats`` on real shards: written by webds,
GNU ``tar`` and Python's ``tarfile``, with real JPEG/PNG images made by Pillow; run in-process
(``webds.cli.main``) for the many cases and as real subprocesses and pipes for each command."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from clitools import PY, WEBDS, run_shell, run_webds, tar_contents, tar_names
from conftest import write_tar

from webds import TarWriter
from webds.cli import main
from webds.cli.contact import CROSS, LABEL, PAD, cell_origin, sheet_size
from webds.cli.fields import human_size

Image = pytest.importorskip("PIL.Image")

COLORS = [(220, 30, 30), (30, 200, 40), (20, 40, 220), (240, 220, 30), (200, 40, 200)]


def image_bytes(color: Tuple[int, int, int], size=(64, 48), fmt: str = "JPEG") -> bytes:
    """A real image: a solid color with a darker diagonal stripe (so it is not uniform)."""
    im = Image.new("RGB", size, color)
    for i in range(min(size)):
        im.putpixel((i, i), (0, 0, 0))
    buf = io.BytesIO()
    im.save(buf, fmt, quality=95) if fmt == "JPEG" else im.save(buf, fmt)
    return buf.getvalue()


def gradient16() -> bytes:
    """A 16-bit grayscale PNG (mode I;16), a mode a contact sheet has to stretch."""
    im = Image.new("I;16", (40, 40))
    for x in range(40):
        for y in range(40):
            im.putpixel((x, y), x * 1000)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def caption(i: int) -> bytes:
    return f"caption {i}\twith a tab\nand a newline".encode()


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    """photos.tar written by webds: 5 samples with jpg (a different color each), cls, json, txt;
    sample 0003 also has a PNG segmentation mask, sample 0004 has no txt."""
    path = tmp_path / "photos.tar"
    with TarWriter(str(path), encoder=False) as w:
        for i, color in enumerate(COLORS):
            sample = {
                "__key__": f"{i:04d}",
                "jpg": image_bytes(color, size=(64 + 8 * i, 48)),
                "cls": str(i).encode(),
                "json": json.dumps({"label": f"label{i}", "w": 64 + 8 * i}).encode(),
            }
            if i != 4:
                sample["txt"] = caption(i)
            if i == 3:
                sample["seg.png"] = image_bytes((9, 99, 199), size=(32, 32), fmt="PNG")
            w.write(sample)
    return path


def cls_shards(tmp_path: Path, n: int = 3, per: int = 4) -> List[Path]:
    """shard-{0..n-1}.tar (Python tarfile) with samples s{shard}-{i}, cls = shard * per + i."""
    paths = []
    for s in range(n):
        members = []
        for i in range(per):
            key = f"s{s}-{i}"
            members += [(f"{key}.cls", str(s * per + i).encode()), (f"{key}.txt", key.encode())]
        paths.append(write_tar(tmp_path / f"shard-{s}.tar", members))
    return paths


def run(capsys, *argv: str) -> Tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# ---------------------------------------------------------------------------------------------
# ls
# ---------------------------------------------------------------------------------------------


def test_human_size() -> None:
    assert [human_size(n) for n in (0, 45, 999, 1000, 67_123, 999_949, 999_950, 3_400_000)] == [
        "0",
        "45",
        "999",
        "1.0k",
        "67.1k",
        "999.9k",
        "1.0M",
        "3.4M",
    ]
    assert human_size(12 * 10**9) == "12.0G"


def ls_size(n: int) -> str:
    """What ``webds ls`` prints for a field of n bytes: ``1 B``, ``67.1 kB``."""
    short = human_size(n)
    return f"{n} B" if n < 1000 else f"{short[:-1]} {short[-1]}B"


def test_ls_sizes_carry_their_unit(tmp_path: Path) -> None:
    sizes = {"cls": 1, "txt": 999, "json": 1000, "jpg": 95_312, "npy": 3_400_000}
    write_tar(tmp_path / "s.tar", [(f"k.{ext}", b"7" * n) for ext, n in sizes.items()])
    human = run_webds("ls", "s.tar", cwd=tmp_path)
    assert human.returncode == 0, human.stderr
    assert human.stdout.decode() == "k  cls 1 B, txt 999 B, json 1.0 kB, jpg 95.3 kB, npy 3.4 MB\n"
    exact = run_webds("ls", "s.tar", "--bytes", "--fields", "jpg,cls", cwd=tmp_path)
    assert exact.stdout.decode() == "k  jpg 95312 B, cls 1 B\n"


def test_ls_matches_gnu_tar_listing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    long_dir = "d" * 60 + "/" + "e" * 60  # > 100 characters: GNU tar writes a long-name header
    (src / long_dir).mkdir(parents=True)
    names = []
    for i, color in enumerate(COLORS[:3]):
        key = f"{long_dir}/img{i}" if i == 2 else f"img{i}"
        for ext, data in (
            ("cls", str(i).encode()),
            ("jpg", image_bytes(color, size=(200 + 50 * i, 120))),
            ("json", json.dumps({"i": i, "pad": "x" * (100 * i)}).encode()),
        ):
            (src / f"{key}.{ext}").write_bytes(data)
            names.append(f"{key}.{ext}")
    subprocess.run(["tar", "cf", str(tmp_path / "gnu.tar"), "-C", str(src), *names], check=True)

    listing = subprocess.run(
        ["tar", "tvf", "gnu.tar"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    expected: Dict[str, List[Tuple[str, int]]] = {}
    for line in listing.splitlines():
        _perm, _owner, size, _date, _time, name = line.split(None, 5)
        key, ext = name.rsplit("/", 1)[-1].split(".", 1)
        key = name[: len(name) - len(ext) - 1]
        expected.setdefault(key, []).append((ext, int(size)))
    assert len(expected) == 3

    exact = run_webds("ls", "--bytes", "gnu.tar", cwd=tmp_path)
    assert exact.returncode == 0, exact.stderr
    got = {}
    for line in exact.stdout.decode().splitlines():
        key, fields = line.split("  ")
        got[key] = []
        for field in fields.split(", "):
            ext, size, unit = field.split(" ")
            assert unit == "B"
            got[key].append((ext, int(size)))
    assert got == expected
    assert list(got) == list(expected)  # in tar order

    human = run_webds("ls", "gnu.tar", "--long", cwd=tmp_path)
    lines = human.stdout.decode().splitlines()
    key0 = next(iter(expected))
    assert lines[0] == (
        f"{key0}  " + ", ".join(f"{e} {ls_size(s)}" for e, s in expected[key0]) + "  gnu.tar"
    )
    assert all(line.endswith("  gnu.tar") for line in lines) and len(lines) == 3


def test_ls_options_in_process(capsys, photos: Path) -> None:
    status, out, _ = run(capsys, "ls", str(photos), "--count", "2", "-b")
    assert status == 0
    jpg0 = len(image_bytes(COLORS[0], size=(64, 48)))
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"0000  cls 1 B, jpg {jpg0} B, json ")
    assert lines[0].endswith(f", txt {len(caption(0))} B")
    status, out, _ = run(capsys, "ls", str(photos), "--fields", "seg.png,cls", "--where", "cls > 2")
    assert (
        status == 0
        and out
        == "0003  seg.png "
        + ls_size(len(image_bytes((9, 99, 199), size=(32, 32), fmt="PNG")))
        + ", cls 1 B\n0004  cls 1 B\n"
    )


def test_ls_in_pipes(tmp_path: Path, photos: Path) -> None:
    direct = run_webds("ls", "photos.tar", cwd=tmp_path)
    piped = run_shell(f"cat photos.tar | {WEBDS} ls -", cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout.decode() and len(piped.stdout.splitlines()) == 5
    assert piped.stdout.splitlines()[0].startswith("0000  cls 1 B, jpg ")

    # The reader goes away early: no traceback, no error line.
    many = write_tar(tmp_path / "many.tar", [(f"{i:06d}.cls", b"1") for i in range(20000)])
    head = run_shell(f"{WEBDS} ls {many.name} | head -n 2", cwd=tmp_path)
    assert head.stdout == "000000  cls 1 B\n000001  cls 1 B\n"
    assert "Traceback" not in head.stderr and "error" not in head.stderr


def test_ls_truncated_shard_prints_good_samples_then_fails(tmp_path: Path) -> None:
    shards = cls_shards(tmp_path, n=2, per=30)
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2 + 100])  # inside a member's data
    out = run_webds("ls", "shard-0.tar", "shard-1.tar", cwd=tmp_path)
    assert out.returncode == 1
    keys = [line.split()[0] for line in out.stdout.decode().splitlines()]
    assert keys[:30] == [f"s0-{i}" for i in range(30)]
    assert 30 < len(keys) < 60 and keys[30:] == [f"s1-{i}" for i in range(len(keys) - 30)]
    last = out.stderr.splitlines()[-1]
    assert last.startswith("webds ls: error: shard is truncated") and "shard-1.tar" in last
    assert "Traceback" not in out.stderr


def test_ls_stops_reading_an_endless_pipe(tmp_path: Path) -> None:
    endless = write_endless_tar_script(tmp_path)
    out = run_webds("ls", f"pipe:{PY} {endless}", "--count", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == "000000  cls 1 B\n000001  cls 1 B\n000002  cls 1 B\n"


def write_endless_tar_script(tmp_path: Path) -> Path:
    """A script that writes an endless tar stream (samples 000000, 000001, ... with a cls)."""
    script = tmp_path / "endless.py"
    script.write_text(
        "import io, itertools, sys, tarfile\n"
        "tf = tarfile.open(fileobj=sys.stdout.buffer, mode='w|')\n"
        "for i in itertools.count():\n"
        "    data = str(i % 10).encode()\n"
        "    info = tarfile.TarInfo(f'{i:06d}.cls')\n"
        "    info.size = len(data)\n"
        "    tf.addfile(info, io.BytesIO(data))\n"
    )
    return script


# ---------------------------------------------------------------------------------------------
# show
# ---------------------------------------------------------------------------------------------


def test_show_blocks(capsys, photos: Path) -> None:
    status, out, _ = run(capsys, "show", str(photos))
    assert status == 0
    blocks = out.split("\n\n")
    assert len(blocks) == 3  # --count defaults to 3
    jpg0 = len(image_bytes(COLORS[0], size=(64, 48)))
    assert blocks[0].splitlines() == [
        "__key__  0000",
        f"__url__  {photos}",
        "cls      0",
        f"jpg      <{jpg0} bytes> JPEG 64x48",
        'json     {"label":"label0","w":64}',
        "txt      caption 0 with a tab and a newline",
    ]
    status, out, _ = run(
        capsys,
        "show",
        str(photos),
        "--where",
        "key >= '0003'",
        "--fields",
        "seg.png,json.label,txt,nope",
        "--width",
        "12",
        "--count",
        "5",
    )
    blocks = out.rstrip("\n").split("\n\n")
    assert len(blocks) == 2
    seg = len(image_bytes((9, 99, 199), size=(32, 32), fmt="PNG"))
    assert blocks[0].splitlines()[2:] == [
        f"seg.png     <{seg} bytes> PNG 32x32",
        "json.label  label3",
        "txt         caption 3...",
        "nope        <missing>",
    ]
    assert blocks[1].splitlines()[2] == "seg.png     <missing>"


def test_show_contact_sheet(tmp_path: Path, photos: Path) -> None:
    # Add a sample whose jpg is not an image and one with a 16-bit PNG, via Python's tarfile.
    with tarfile.open(photos, "a") as tf:
        for name, data in (("0005.jpg", b"not a jpeg at all"), ("0006.png", gradient16())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    out = run_webds(
        "show", "photos.tar", "--images", "grid.png", "--thumb", "40", "--columns", "3",
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "field 'jpg' of sample '0005' is not a readable image" in out.stderr
    assert "wrote a contact sheet of 7 images to grid.png" in out.stderr
    assert out.stdout == b""  # the sheet only: no text blocks (all 7 samples: --count 16)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".grid")]  # no temp left

    sheet = Image.open(tmp_path / "grid.png").convert("RGB")
    assert sheet.size == sheet_size(7, 3, 40) == (3 * 44 + 4, 3 * (40 + LABEL + 4) + 4)
    for i, color in enumerate(COLORS):
        x, y = cell_origin(i, 3, 40)
        # The image's color at the thumbnail's centre (the stripe is on the diagonal only).
        got = sheet.getpixel((x + 20, y + 12))
        assert all(abs(a - b) <= 24 for a, b in zip(got, color)), (i, got, color)
        label = sheet.crop((x, y + 40, x + 40, y + 40 + LABEL)).convert("L")
        assert label.getextrema()[0] < 100  # the key is written under the thumbnail
    x, y = cell_origin(5, 3, 40)
    assert sheet.getpixel((x + 20, y + 20)) == CROSS  # placeholder for the broken image
    x, y = cell_origin(6, 3, 40)
    row = [sheet.getpixel((x + c, y + 20))[0] for c in range(40)]
    assert row[0] < 20 and row[-1] > 230 and row == sorted(row)  # 16-bit gradient, stretched

    # --fields picks the image: only sample 0003 has seg.png.
    out = run_webds(
        "show", "photos.tar", "--fields", "seg.png", "--images", "seg.jpg", "--thumb", "40",
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    seg = Image.open(tmp_path / "seg.jpg")
    assert seg.format == "JPEG" and seg.size == sheet_size(1, 1, 40)
    got = seg.convert("RGB").getpixel((PAD + 14, PAD + 24))  # off the black diagonal
    assert all(abs(a - b) <= 24 for a, b in zip(got, (9, 99, 199)))


def test_show_bad_arguments(capsys, tmp_path: Path, photos: Path) -> None:
    status, _, err = run(capsys, "show", str(photos), "--images", str(tmp_path / "g.xyz"))
    assert status == 2 and "cannot write '.xyz' images" in err
    status, _, err = run(capsys, "show", str(photos), "--images", "-")
    assert status == 2 and "--images needs a file name" in err
    status, _, err = run(
        capsys, "show", str(photos), "--fields", "cls", "--images", str(tmp_path / "g.png")
    )
    assert status == 1 and "no images in the samples shown" in err
    assert not (tmp_path / "g.png").exists()


# ---------------------------------------------------------------------------------------------
# tsv
# ---------------------------------------------------------------------------------------------


def test_tsv_subprocess(tmp_path: Path, photos: Path) -> None:
    out = run_webds("tsv", "photos.tar", "--fields", "cls,json.label,txt,json.w,jpg", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in out.stdout.decode().splitlines()]
    assert rows[0] == ["__key__", "cls", "json.label", "txt", "json.w", "jpg"]
    assert len(rows) == 6 and all(len(row) == 6 for row in rows)
    for i, row in enumerate(rows[1:]):
        jpg = len(image_bytes(COLORS[i], size=(64 + 8 * i, 48)))
        txt = "" if i == 4 else f"caption {i} with a tab and a newline"
        assert row == [f"{i:04d}", str(i), f"label{i}", txt, str(64 + 8 * i), f"<{jpg} bytes>"]


def test_tsv_options(capsys, tmp_path: Path) -> None:
    shards = cls_shards(tmp_path, n=2, per=3)
    status, out, _ = run(
        capsys,
        "tsv",
        *map(str, shards),
        "--fields",
        "cls",
        "--no-header",
        "--no-key",
        "--count",
        "4",
    )
    assert (status, out) == (0, "0\n1\n2\n3\n")
    status, out, _ = run(capsys, "tsv", str(shards[1]), "--fields", "txt,missing", "--header")
    assert out == "__key__\ttxt\tmissing\ns1-0\ts1-0\t\ns1-1\ts1-1\t\ns1-2\ts1-2\t\n"
    status, out, err = run(capsys, "tsv", str(tmp_path / "nope.tar"), "--fields", "cls")
    assert status == 1 and out == "" and "no such file" in err  # no header before the error


# ---------------------------------------------------------------------------------------------
# first
# ---------------------------------------------------------------------------------------------


def test_first_where_over_pipes_and_stdin(tmp_path: Path) -> None:
    cls_shards(tmp_path, n=3, per=4)  # cls 0..11: s0 has 0-3, s1 4-7, s2 8-11
    out = run_webds(
        "first", "pipe:cat shard-0.tar", "pipe:cat shard-1.tar", "-",
        "--where", "cls % 3 == 2", "--count", "3", "-o", "out.tar",
        cwd=tmp_path, input=(tmp_path / "shard-2.tar").read_bytes(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    listing = tar_names(tmp_path / "out.tar")
    # cls 2, 5, 8: one from each input, the last from stdin.
    assert listing == ["s0-2.cls", "s0-2.txt", "s1-1.cls", "s1-1.txt", "s2-0.cls", "s2-0.txt"]
    tar_contents(tmp_path / "out.tar", tmp_path / "x")
    assert (tmp_path / "x" / "s1-1.cls").read_bytes() == b"5"
    assert (tmp_path / "x" / "s2-0.txt").read_bytes() == b"s2-0"
    assert "wrote 3 sample(s) to out.tar" in out.stderr

    # Default: the first sample, to stdout, in a pipe to GNU tar.
    piped = run_shell(f"{WEBDS} first shard-1.tar -q | tar tvf -", cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert [line.split()[-1] for line in piped.stdout.splitlines()] == ["s1-0.cls", "s1-0.txt"]


def test_first_never_opens_a_later_shard(tmp_path: Path) -> None:
    cls_shards(tmp_path, n=2, per=4)
    marker = tmp_path / "opened"
    out = run_webds(
        "first", "shard-0.tar", f"pipe:touch {marker}; cat shard-1.tar", "--where", "cls == 1",
        "-o", "one.tar", "-q", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not marker.exists()
    with tarfile.open(tmp_path / "one.tar") as tf:
        assert tf.getnames() == ["s0-1.cls", "s0-1.txt"]
    # The same with a match in the second shard does open it (the check above can fail).
    out = run_webds(
        "first", "shard-0.tar", f"pipe:touch {marker}; cat shard-1.tar", "--where", "cls == 6",
        "-o", "six.tar", "-q", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0 and marker.exists()


def test_first_stops_reading_an_endless_pipe(tmp_path: Path) -> None:
    endless = write_endless_tar_script(tmp_path)
    out = run_webds(
        "first", f"pipe:{PY} {endless}", "--where", "cls == 7", "--count", "2", "-o", "-",
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tf:
        assert tf.getnames() == ["000007.cls", "000017.cls"]


def test_first_no_match_and_bad_where(capsys, tmp_path: Path) -> None:
    shards = cls_shards(tmp_path, n=2, per=3)
    target = tmp_path / "none.tar"
    status, _, err = run(
        capsys, "first", *map(str, shards), "--where", "clss == 3", "-o", str(target), "-q"
    )
    assert status == 1
    lines = err.splitlines()
    assert lines[0] == (
        "webds first: warning: --where uses clss, which no sample read had as a field (a typo?)"
    )
    assert lines[-1].startswith("webds first: error: no sample matched --where 'clss == 3' in")
    assert not target.exists() and not list(tmp_path.glob(".none.tar*"))

    # Fewer than --count: what was found is written, and the summary says so.
    status, _, err = run(
        capsys, "first", str(shards[0]), "--where", "cls >= 1", "--count", "5", "-o", str(target)
    )
    assert status == 0 and "wrote 2 sample(s) (only 2 of --count 5)" in err
    with tarfile.open(target) as tf:
        assert tf.getnames() == ["s0-1.cls", "s0-1.txt", "s0-2.cls", "s0-2.txt"]

    out = run_webds("first", "shard-0.tar", "--where", "cls ==", "-o", "x.tar", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("webds first: error: --where 'cls ==' is not a Python expression")
    assert len(out.stderr.splitlines()) == 1 and not (tmp_path / "x.tar").exists()


# ---------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def known(tmp_path: Path) -> List[Path]:
    """Two shards (Python tarfile, pax) with known sizes: 10 samples; jpg sizes 100..1000,
    cls of 1 byte in all but k3; json in k0 and k1 only; k2 and k5 appear twice."""
    members_a, members_b = [], []
    keys = ["k0", "k1", "k2", "k3", "k4", "k5", "k2", "k5", "k6", "k5"]
    for i, key in enumerate(keys):
        members = members_a if i < 5 else members_b
        members.append((f"{key}.jpg", bytes(100 * (i + 1))))
        if key != "k3":
            members.append((f"{key}.cls", b"7"))
        if i < 2:
            members.append((f"{key}.json", b"{}" * (i + 1)))
    return [
        write_tar(tmp_path / "a.tar", members_a, format=tarfile.PAX_FORMAT),
        write_tar(tmp_path / "b.tar", members_b),
    ]


def test_stats_exact_json(tmp_path: Path, known: List[Path]) -> None:
    out = run_webds("stats", "a.tar", "b.tar", "--json", "-q", cwd=tmp_path)
    assert out.returncode == 0 and out.stderr == ""
    report = json.loads(out.stdout)
    assert report["samples"] == 10 and report["shards"] == 2
    assert report["bytes"] == sum(100 * (i + 1) for i in range(10)) + 9 + 2 + 4
    assert report["fields"]["jpg"] == {
        "samples": 10,
        "frequency": 1.0,
        "min": 100,
        "median": 550,
        "mean": 550.0,
        "p95": 1000,
        "max": 1000,
    }
    assert report["fields"]["cls"] == {
        "samples": 9,
        "frequency": 0.9,
        "min": 1,
        "median": 1,
        "mean": 1.0,
        "p95": 1,
        "max": 1,
    }
    assert report["fields"]["json"]["median"] == 3 and report["fields"]["json"]["p95"] == 4
    assert report["duplicate_keys"] == {"keys": 2, "examples": {"k2": 2, "k5": 3}}
    assert report["missing"] == {"cls": {"samples": 1, "examples": ["k3"]}}


def test_stats_table(capsys, known: List[Path]) -> None:
    status, out, _ = run(capsys, "stats", *map(str, known), "-q")
    assert status == 0
    assert out.splitlines() == [
        "samples  10",
        "shards   2",
        "bytes    5,515 (5.5k) in fields",
        "",
        "field  samples    freq  min  median   mean   p95   max",
        "cls          9   90.0%    1       1    1.0     1     1",
        "jpg         10  100.0%  100     550  550.0  1000  1000",
        "json         2   20.0%    2       3    3.0     4     4",
        "",
        "duplicate keys: 2 keys occur more than once: k2 (2 times), k5 (3 times)",
        "missing cls: 1 samples lack it (90.0% have it): k3",
    ]


def test_stats_missing_examples_include_samples_before_the_field(capsys, tmp_path: Path) -> None:
    members = [("a.txt", b"x"), ("b.txt", b"x")]
    members += [(f"c{i}.{ext}", b"xy") for i in range(5) for ext in ("txt", "cls")]
    path = write_tar(tmp_path / "late.tar", members)
    status, out, _ = run(capsys, "stats", str(path), "--json", "-q")
    report = json.loads(out)
    assert report["fields"]["cls"]["median"] == 2
    assert report["missing"] == {"cls": {"samples": 2, "examples": ["a", "b"]}}
    assert report["duplicate_keys"] == {"keys": 0, "examples": {}}


def test_stats_errors(tmp_path: Path, known: List[Path]) -> None:
    data = known[1].read_bytes()
    known[1].write_bytes(data[:700])
    out = run_webds("stats", "a.tar", "b.tar", cwd=tmp_path)
    assert out.returncode == 1 and out.stdout == b""
    last = out.stderr.splitlines()[-1]
    assert last.startswith("webds stats: error: shard is truncated") and "b.tar" in last


# ---------------------------------------------------------------------------------------------
# help
# ---------------------------------------------------------------------------------------------


def test_help_has_examples(capsys) -> None:
    for command in ("ls", "show", "tsv", "first", "stats"):
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "example:" in out and f"webds {command} " in out
