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
from pathlib import Path
from typing import Optional

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
    return subprocess.run(list(args), capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_torch_free_part_on_python(version: str, tmp_path: Path) -> None:
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        pytest.skip("the whole suite runs on this Python")
    python = interpreter(version)
    if python is None:
        message = f"python{version} is not installed (pyenv install {version})"
        if os.environ.get("WEBDS_REQUIRE_PYTHONS", "") not in ("", "0"):
            pytest.fail(message)
        pytest.skip(message)
    venv = tmp_path / "venv"
    made = run(python, "-m", "venv", str(venv))
    assert made.returncode == 0, made.stderr
    py = str(venv / "bin" / "python")
    # No constraints.txt: its pins are those of the suite's Python; pip picks what fits here.
    installed = run(py, "-m", "pip", "install", "-q", *DEPENDENCIES, *TEST_TOOLS)
    assert installed.returncode == 0, installed.stderr[-3000:]
    no_torch = run(py, "-c", "import webds, sys; assert 'torch' not in sys.modules", cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    assert no_torch.returncode == 0, no_torch.stderr
    out = run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TORCH_FREE, cwd=ROOT,
              env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1], tail
