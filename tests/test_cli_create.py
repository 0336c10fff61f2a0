"""``webds create``: plans and folders to tars, checked with GNU ``tar`` and the webds reader."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

import pytest
from clitools import run_webds, tar_contents, tar_names

from webds.cli import main
from webds.tar.samples import base_plus_ext, tarfile_samples


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_plan_groups_samples_and_reads_every_source(cwd: Path) -> None:
    (cwd / "photos").mkdir()
    (cwd / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 not really a jpeg \x00\x01")
    (cwd / "plan.txt").write_text(
        "# name        source\n"
        "0001.jpg       photos/cat.jpg\n"
        "\n"
        "0002.txt       text:two\\nlines\\tand a \\\\ backslash  \n"
        "   0001.cls    text:3\n"
        "0002.cls       pipe:printf 5\n"
        "sub/0003.seg.png pipe:printf 'a b' | tr ab xy\n"
        '0002.json      text:{"label": "dog"}\n'
    )
    assert main(["create", "plan.txt", "-o", "out.tar", "-q"]) == 0
    # One sample's members together, samples in first-appearance order, fields sorted.
    assert tar_names(cwd / "out.tar") == [
        "0001.cls",
        "0001.jpg",
        "0002.cls",
        "0002.json",
        "0002.txt",
        "sub/0003.seg.png",
    ]
    assert tar_contents(cwd / "out.tar", cwd / "x") == {
        "0001.cls": b"3",
        "0001.jpg": b"\xff\xd8 not really a jpeg \x00\x01",
        "0002.cls": b"5",
        "0002.json": b'{"label": "dog"}',
        "0002.txt": b"two\nlines\tand a \\ backslash  ",
        "sub/0003.seg.png": b"x y",
    }
    samples = list(tarfile_samples([{"url": "out.tar"}]))
    assert [s["__key__"] for s in samples] == ["0001", "0002", "sub/0003"]
    assert samples[2]["seg.png"] == b"x y"


def test_plan_sort_and_stdin_to_stdout_subprocess(tmp_path: Path) -> None:
    plan = "b.txt text:B\na.txt text:A\nb.cls text:2\nc.txt text:C\na.cls text:1\n"
    with open(tmp_path / "out.tar", "wb") as out:
        done = run_webds(
            "create", "-", "--sort", "-q", cwd=tmp_path, input=plan.encode(), stdout=out
        )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert tar_names(tmp_path / "out.tar") == ["a.cls", "a.txt", "b.cls", "b.txt", "c.txt"]
    with open(tmp_path / "unsorted.tar", "wb") as out:
        done = run_webds("create", "-", cwd=tmp_path, input=plan.encode(), stdout=out)
    assert done.returncode == 0
    assert tar_names(tmp_path / "unsorted.tar") == ["b.cls", "b.txt", "a.cls", "a.txt", "c.txt"]
    assert done.stderr.splitlines()[-1] == "created -: 3 samples, 5 files"


def test_failing_pipe_names_the_plan_line(cwd: Path, capsys: pytest.CaptureFixture) -> None:
    (cwd / "plan.txt").write_text(
        "a.txt text:ok\nb.txt pipe:echo oops >&2; exit 3\nc.txt text:never\n"
    )
    assert main(["create", "plan.txt", "-o", "out.tar", "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("webds create: error: plan.txt line 2 (b.txt): command ")
    assert "exited with status 3" in err and "oops" in err
    assert not (cwd / "out.tar").exists()  # nothing half-written under the final name
    assert [p.name for p in cwd.iterdir()] == ["plan.txt"]


@pytest.mark.parametrize(
    "line, status, message",
    [
        ("0001.txt", 2, "line 2: expected 'ARCHIVE-NAME SOURCE'"),
        ("README text:x", 2, "line 2: archive name 'README' is not KEY.EXT"),
        ("/abs/0001.txt text:x", 2, "line 2: archive name '/abs/0001.txt': refusing sample key"),
        ("../0001.txt text:x", 2, "'..' path component"),
        ("0002.txt text:a\\qb", 2, "line 2: unknown escape '\\q'"),
        ("0001.TXT text:again", 2, "line 2: '0001.TXT' is a second 'TXT' member of sample '0001'"),
        ("0002.txt missing/file.txt", 1, "line 2 (0002.txt): no such file 'missing/file.txt'"),
    ],
)
def test_bad_plan_lines(
    cwd: Path, capsys: pytest.CaptureFixture, line: str, status: int, message: str
) -> None:
    (cwd / "plan.txt").write_text(f"0001.txt text:first\n{line}\n")
    assert main(["create", "plan.txt", "-o", "out.tar", "-q"]) == status
    err = capsys.readouterr().err
    assert err.startswith("webds create: error: plan.txt ") and message in err, err
    assert len(err.splitlines()) == 1
    assert not (cwd / "out.tar").exists()


def test_arguments(cwd: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["create", "-o", "out.tar"]) == 2
    assert "give either a PLAN file" in capsys.readouterr().err
    (cwd / "d").mkdir()
    (cwd / "plan.txt").write_text("a.txt text:x\n")
    assert main(["create", "plan.txt", "--from-dir", "d", "-o", "out.tar"]) == 2
    assert main(["create", "--from-dir", "nowhere", "-o", "out.tar"]) == 1
    assert "'nowhere' is not a folder" in capsys.readouterr().err
    assert main(["create", "--from-dir", "d", "-o", "out.tar"]) == 2
    assert "nothing to write: d lists no files" in capsys.readouterr().err
    (cwd / "empty.txt").write_text("# nothing\n\n")
    assert main(["create", "empty.txt", "-o", "out.tar"]) == 2
    assert main(["create", "missing-plan.txt", "-o", "out.tar"]) == 1
    assert "cannot read the plan 'missing-plan.txt'" in capsys.readouterr().err
    assert not (cwd / "out.tar").exists()


def make_tree(root: Path) -> Dict[str, bytes]:
    """A folder of sample files (and files create must skip); returns the files it should pack."""
    files = {
        "train/0001.jpg": b"jpeg 1",
        "train/0001.cls": b"1",
        "train/0001.seg.png": b"png 1",
        "train/0002.JPG": b"jpeg 2",
        "train/0002.cls": b"2",
        "v1.2/a.txt": b"dots in folders are fine",
        "top.json": b"{}",
    }
    skipped = {
        "README": b"no extension",
        "train/LICENSE": b"no extension either",
        ".hidden.txt": b"hidden",
        "train/.cache/0009.txt": b"in a hidden folder",
    }
    for name, data in {**files, **skipped}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def test_from_dir_matches_gnu_tar_and_reader(cwd: Path, capsys: pytest.CaptureFixture) -> None:
    files = make_tree(cwd / "data")
    # The output inside the folder itself must not be packed (nor on a second run).
    for _ in range(2):
        assert main(["create", "--from-dir", "data", "-o", "data/all.tar"]) == 0
        err = capsys.readouterr().err
        assert "skipped 2 file(s) without an extension in 'data' (first: 'README')" in err
        assert err.splitlines()[-1] == "created data/all.tar: 4 samples, 7 files"
    names = tar_names(cwd / "data" / "all.tar")
    assert names == [
        "top.json",
        "train/0001.cls",
        "train/0001.jpg",
        "train/0001.seg.png",
        "train/0002.JPG",
        "train/0002.cls",
        "v1.2/a.txt",
    ]
    assert tar_contents(cwd / "data" / "all.tar", cwd / "x") == files
    # Keys follow the reader's rule exactly, samples sorted by key.
    keys = [base_plus_ext(n)[0] for n in names]
    samples = list(tarfile_samples([{"url": "data/all.tar"}]))
    expected = ["top", "train/0001", "train/0002", "v1.2/a"]
    assert [s["__key__"] for s in samples] == sorted(dict.fromkeys(keys)) == expected
    assert samples[1]["seg.png"] == b"png 1" and samples[2]["jpg"] == b"jpeg 2"


def test_from_dir_into_shards(cwd: Path, capsys: pytest.CaptureFixture) -> None:
    make_tree(cwd / "data")
    assert main(["create", "--from-dir", "data", "-o", "all.tar", "-q"]) == 0
    argv = ["create", "--from-dir", "data", "-o", "out/part-%03d.tar", "--maxcount", "2"]
    (cwd / "out").mkdir()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "created out/part-000.tar .. out/part-001.tar (2 shards): 4 samples" in err
    shards = sorted((cwd / "out").glob("part-*.tar"))
    assert [p.name for p in shards] == ["part-000.tar", "part-001.tar"]
    assert sum((tar_names(p) for p in shards), []) == tar_names(cwd / "all.tar")
    index = json.loads((cwd / "out" / "part.index.json").read_text())
    assert [(s["url"], s["samples"]) for s in index["shards"]] == [
        ("part-000.tar", 2),
        ("part-001.tar", 2),
    ]


def test_duplicate_extension_in_folder_is_an_error(
    cwd: Path, capsys: pytest.CaptureFixture
) -> None:
    (cwd / "d").mkdir()
    (cwd / "d" / "a.jpg").write_bytes(b"1")
    (cwd / "d" / "a.JPG").write_bytes(b"2")
    if len(list((cwd / "d").iterdir())) < 2:
        pytest.skip("case-insensitive file system")
    assert main(["create", "--from-dir", "d", "-o", "out.tar"]) == 1
    assert "is a second 'jpg' member of sample 'a'" in capsys.readouterr().err


def test_help_and_terminal_refusal(tmp_path: Path) -> None:
    out = run_webds("create", "--help", cwd=tmp_path, text=True)
    assert out.returncode == 0
    assert "example:" in out.stdout and "webds create plan.txt -o data.tar" in out.stdout
    assert "text:" in out.stdout and "pipe:CMD" in out.stdout
    master, slave = os.openpty()
    try:
        done = run_webds(
            "create",
            "-",
            cwd=tmp_path,
            input=b"a.txt text:x\n",
            stdout=slave,
        )
    finally:
        os.close(slave)
        os.close(master)
    assert done.returncode == 2
    assert done.stderr.startswith(
        "webds create: error: refusing to write a tar archive to the terminal"
    )


def test_from_dir_refuses_a_link_that_leads_out_of_the_folder(
    cwd: Path, capsys: pytest.CaptureFixture
) -> None:
    (cwd / "secret.key").write_bytes(b"do not publish")
    (cwd / "d" / "a").mkdir(parents=True)
    (cwd / "d" / "a" / "0001.txt").write_bytes(b"one")
    (cwd / "d" / "a" / "0002.txt").symlink_to(cwd / "secret.key")
    assert main(["create", "--from-dir", "d", "-o", "out.tar"]) == 2
    err = capsys.readouterr().err
    assert "'a/0002.txt' is a symbolic link to" in err and "secret.key" in err
    assert "--follow-links" in err
    assert not (cwd / "out.tar").exists()
    # Asked for: the linked file's content is packed.
    assert main(["create", "--from-dir", "d", "-o", "out.tar", "--follow-links", "-q"]) == 0
    assert tar_contents(cwd / "out.tar", cwd / "x1")["a/0002.txt"] == b"do not publish"


def test_from_dir_packs_links_inside_the_folder_and_skips_folder_links(
    cwd: Path, capsys: pytest.CaptureFixture
) -> None:
    (cwd / "elsewhere").mkdir()
    (cwd / "elsewhere" / "0009.txt").write_bytes(b"far")
    (cwd / "d" / "a").mkdir(parents=True)
    (cwd / "d" / "a" / "0001.txt").write_bytes(b"one")
    (cwd / "d" / "0002.txt").symlink_to(Path("a") / "0001.txt")  # relative, stays inside
    (cwd / "d" / "linked").symlink_to(cwd / "elsewhere", target_is_directory=True)
    assert main(["create", "--from-dir", "d", "-o", "out.tar"]) == 0
    assert "did not follow 1 symbolic link(s) to folders (first: 'linked')" in (
        capsys.readouterr().err
    )
    assert tar_contents(cwd / "out.tar", cwd / "x2") == {"0002.txt": b"one", "a/0001.txt": b"one"}
