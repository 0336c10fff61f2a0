"""The package as users and packagers get it: the sdist and the wheel are built from this
checkout, carry what they should (the licence, the changelog, the tests in the sdist), pass
``twine check``, the sdist builds a wheel and its tests run, and the wheel installed into a
fresh virtualenv (with constraints.txt) runs ``webds --help`` and reads a shard."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run(*args: str, cwd: Path = ROOT, env: dict = None, timeout: int = 600) -> str:
    out = subprocess.run(
        list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"{args}: {out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def niced(*args: str, **kw) -> str:
    """:func:`run` at low priority: the builds run beside the rest of the suite."""
    return run("nice", "-n", "15", *args, **kw)


class Builds(NamedTuple):
    """What the slow steps made, in the background: the sdist and wheel (``dist``), a fresh
    virtualenv with the wheel installed (``venv``), and the sdist's own build and test run."""

    dist: "Future[Path]"
    venv: "Future[Path]"
    sdist_run: "Future[Tuple[str, str, List[Path]]]"


_builds: List[Builds] = []
SDIST_TESTS = ["tests/test_tario.py", "tests/test_writer.py"]


def start_builds(root: Path, items: Optional[List[Any]] = None) -> Builds:
    """Start the builds (once per session) in folders under ``root``: the sdist and wheel, and
    what the selected test ``items`` of this module use of the rest (all of it without
    ``items``). tests/conftest.py calls this as the session starts when these tests are
    selected: they are subprocesses at low priority on the core that pytest, running on one,
    leaves idle for most of the suite."""
    if _builds:
        return _builds[0]
    names = None if items is None else {item.name for item in items}
    pool = ThreadPoolExecutor(max_workers=2)

    def later(test: str, work: Callable[[], Any]) -> Future:
        if names is None or test in names:
            return pool.submit(work)
        skipped: Future = Future()
        skipped.set_exception(RuntimeError(f"not built: {test} was not selected"))
        return skipped

    dist = pool.submit(_build, root / "dist")
    venv = later(
        "test_the_wheel_installs_into_a_fresh_virtualenv",
        lambda: _install(dist.result(), root / "venv"),
    )
    sdist_run = later(
        "test_the_sdist_builds_and_its_tests_run",
        lambda: _sdist_run(dist.result(), root / "sdist"),
    )
    pool.shutdown(wait=False)
    _builds.append(Builds(dist, venv, sdist_run))
    return _builds[0]


def _build(out: Path) -> Path:
    # A copy of the checkout without its build leftovers (egg-info, build/), as a clean clone.
    src = out / "src"
    ignore = shutil.ignore_patterns(".venv", ".git", "site", "build", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, src, ignore=ignore)
    niced(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src))
    return out


def _install(dist: Path, venv: Path) -> Path:
    niced(sys.executable, "-m", "venv", str(venv))
    constraints = str(ROOT / "constraints.txt")
    wheel = str(_one(dist, "webds-*.whl"))
    niced(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", constraints, wheel,
          timeout=900)  # fmt: skip
    return venv


def _sdist_run(dist: Path, folder: Path) -> Tuple[str, str, List[Path]]:
    """The sdist unpacked, built into a wheel, and SDIST_TESTS run from it: (pytest's output
    collecting them in this checkout, its output running them from the sdist, the wheels)."""
    folder.mkdir(parents=True)
    with tarfile.open(_one(dist, "webds-*.tar.gz")) as tf:
        tf.extractall(folder, filter="data")
    src = _one(folder, "webds-*")
    niced(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(folder / "wheels"), str(src))  # fmt: skip
    pytest_q = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    collected = niced(*pytest_q, "--collect-only", *SDIST_TESTS)
    env = dict(os.environ, PYTHONPATH=str(src))
    ran = niced(*pytest_q, *SDIST_TESTS, cwd=src, env=env)
    return collected, ran, sorted((folder / "wheels").glob("webds-*.whl"))


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> Builds:
    pytest.importorskip("build", reason="pip install build (in the test extra)")
    return start_builds(tmp_path_factory.mktemp("package"))


@pytest.fixture(scope="module")
def dist(builds: Builds) -> Path:
    return builds.dist.result(timeout=900)


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def test_sdist_carries_licence_changelog_and_tests(dist: Path) -> None:
    with tarfile.open(_one(dist, "webds-*.tar.gz")) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for needed in (
        "LICENSE",
        "CHANGELOG.md",
        "README.md",
        "constraints.txt",
        "setup.cfg",
        "webds/__init__.py",
        "webds/py.typed",
        "tests/conftest.py",
        "tests/test_tario.py",
        "tests/clients/open_clip_data.py",
        "examples/data/fashion-mnist/LICENSE",
        "examples/demo.py",
    ):
        assert needed in names, needed
    assert not any(n.startswith((".venv/", "site/", ".git/")) for n in names)
    assert not any("__pycache__" in n for n in names)


def test_wheel_carries_the_package_and_licence_only(dist: Path) -> None:
    with zipfile.ZipFile(_one(dist, "webds-*.whl")) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "webds/py.typed" in names and "webds/cli/bench.py" in names
    assert "webds/__init__.pyi" in names  # the stub type checkers read for the lazy names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith("/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)
    assert "License-Expression: BSD-3-Clause" in metadata or "License: BSD-3-Clause" in metadata
    assert "Requires-Python: >=3.9" in metadata


def test_twine_check(dist: Path) -> None:
    pytest.importorskip("twine", reason="pip install twine (in the test extra)")
    files = [str(_one(dist, "webds-*.tar.gz")), str(_one(dist, "webds-*.whl"))]
    out = run(sys.executable, "-m", "twine", "check", "--strict", *files)
    assert out.count("PASSED") == 2


def test_the_sdist_builds_and_its_tests_run(builds: Builds) -> None:
    collected_out, ran_out, wheels = builds.sdist_run.result(timeout=900)
    assert wheels
    # All the checkout's tests of these files pass from the sdist: none skipped for a data file
    # the sdist lacks, none missing.
    collected, counts = _summary(collected_out), _summary(ran_out)
    assert collected.keys() == {"tests collected"} and collected["tests collected"] > 0, collected
    assert counts.keys() <= {"passed", "warning", "warnings"}, counts
    assert counts["passed"] == collected["tests collected"], (counts, collected)


def _summary(out: str) -> dict:
    """pytest -q's last line as counts: {"passed": 183, "skipped": 2, ...}."""
    last = out.strip().splitlines()[-1]
    return {what: int(n) for n, what in re.findall(r"(\d+) ([a-z][a-z ]*?)(?:,| in )", last)}


def test_the_wheel_installs_into_a_fresh_virtualenv(builds: Builds, tmp_path: Path) -> None:
    venv = builds.venv.result(timeout=900)
    py = venv / "bin" / "python"
    help_text = run(str(venv / "bin" / "webds"), "--help")
    assert "bench" in help_text and "verify" in help_text
    script = (
        "import webds\n"
        "with webds.TarWriter('a.tar') as w:\n"
        "    for i in range(3): w.write({'__key__': f'{i:03d}', 'txt': f'sample {i}'})\n"
        "print([s['txt'] for s in webds.WebDataset('a.tar', shardshuffle=False).decode()])\n"
    )
    out = run(str(py), "-c", script, cwd=tmp_path)
    assert out.strip() == "['sample 0', 'sample 1', 'sample 2']"
    out = run(str(venv / "bin" / "webds"), "ls", "a.tar", cwd=tmp_path)
    assert out.splitlines()[0].startswith("000")
