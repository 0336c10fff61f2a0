"""Library progress bars honour tqdm's environment switch as well as the caller's flag."""

import os
import subprocess
import sys
from pathlib import Path

from webds.progress import progress_bar

ROOT = Path(__file__).resolve().parents[1]


def test_tqdm_disable_env_turns_bars_off():
    # tqdm reads TQDM_* when it is imported: a fresh process, as a notebook kernel or CI job is.
    code = (
        "from webds.progress import progress_bar\n"
        "bar = progress_bar(10, 'packing', ' samples', enabled=True)\n"
        "print(bar.disable)\n"
    )
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_enabled_false_turns_bars_off():
    bar = progress_bar(10, "packing", " samples", enabled=False)
    assert bar.disable
    bar.close()
