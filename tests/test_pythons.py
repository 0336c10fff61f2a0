"""The Python versions setup.cfg claims besides the one the suite runs on: on each, in a fresh
virtualenv without torch, the torch-free part of webds (the tar reader and writer, encoders,
URLs and listing, the index command) passes its tests.

torch builds for those Pythons are multi-GB downloads, so the torch-dependent parts run on the
suite's own Python only (README, "Supported versions"). An interpreter that is missing is
skipped, unless ``WEBDS_REQUIRE_PYTHONS=1`` (CI), where it fails the run.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ["3.9", "3.10", "3.12", "3.13"]
#: Test modules that import nothing of torch, directly or through webds.
TORCH_FREE = [
    "tests/test_tario.py",
    "tests/test_encode.py",
    "tests/test_urls.py",
    "tests/test_cli_index.py",
]
DEPENDENCIES = ["numpy", "pillow", "braceexpand", "fsspec", "tqdm"]
TEST_TOOLS = ["pytest", "pytest-timeout"]

pytestmark = pytest.mark.slow


def interpreter(version: str) -> Optional[str]:
    """A working ``python{version}``: on PATH, or in pyenv's versions."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
    for path in filter(None, candidates):
        probe = subprocess.run(
            [path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return path
    return None


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    # nice: the checks run beside the rest of the suite and must not slow it down.
    return subprocess.run(
        ["nice", "-n", "15", *args], capture_output=True, text=True, timeout=600, **kw
    )


def check(version: str, python: str, folder: Path) -> str:
    """Set up a virtualenv for ``python`` and run the torch-free tests there; "" if they
    passed, else what went wrong."""
    venv = folder / "venv"
    made = run(python, "-m", "venv", str(venv))
    if made.returncode != 0:
        return f"venv: {made.stderr}"
    py = str(venv / "bin" / "python")
    # No constraints.txt: its pins are those of the suite's Python; pip picks what fits here.
    installed = run(py, "-m", "pip", "install", "-q", *DEPENDENCIES, *TEST_TOOLS)
    if installed.returncode != 0:
        return f"pip install: {installed.stderr[-3000:]}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    no_torch = run(py, "-c", "import webds, sys; assert 'torch' not in sys.modules", cwd=ROOT,
                   env=env)  # fmt: skip
    if no_torch.returncode != 0:
        return f"import webds imported torch: {no_torch.stderr}"
    out = run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TORCH_FREE, cwd=ROOT,
              env=env)  # fmt: skip
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or " passed" not in last or "skipped" in last:
        return out.stdout[-3000:] + out.stderr[-2000:]
    return ""


_started: Dict[str, Future] = {}


def start_checks(root: Path, items: Optional[List[Any]] = None) -> Dict[str, Future]:
    """Start the checks (once per session), two at a time, in folders under ``root``: those of
    the selected test ``items`` of this module, or every version's.

    tests/conftest.py calls this as the session starts when these tests are selected: the
    checks are subprocesses (venv, pip, pytest), run at low priority, so they take the core
    that pytest, running on one, leaves idle for most of the suite, instead of holding the
    suite up for two minutes when their turn comes."""
    if not _started:
        pool = ThreadPoolExecutor(max_workers=2)
        wanted = VERSIONS if items is None else [i.callspec.params["version"] for i in items]
        for version in wanted:
            python = interpreter(version)
            if python is not None and version != f"{sys.version_info[0]}.{sys.version_info[1]}":
                folder = root / f"python{version}"
                folder.mkdir(parents=True, exist_ok=True)
                _started[version] = pool.submit(check, version, python, folder)
        pool.shutdown(wait=False)  # the checks run on; results() waits for each
    return _started


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Dict[str, Future]:
    """Every version's check: started with the session, or now."""
    return start_checks(tmp_path_factory.mktemp("pythons"))


@pytest.mark.parametrize("version", VERSIONS)
def test_the_torch_free_part_on_python(version: str, results: Dict[str, Future]) -> None:
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        pytest.skip("the whole suite runs on this Python")
    if version not in results:
        message = f"python{version} is not installed (pyenv install {version})"
        if os.environ.get("WEBDS_REQUIRE_PYTHONS", "") not in ("", "0"):
            pytest.fail(message)
        pytest.skip(message)
    problem = results[version].result(timeout=1200)
    assert problem == "", problem
