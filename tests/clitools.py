"""Helpers for the ``webds`` command-line tests: run the command as a real subprocess, and read
the tars it writes with independent tools (GNU ``tar``, Python's ``tarfile``).

A plain module the tests import (``from clitools import run_webds, tar_names``), like servers.py.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

#: The checkout under test; put first on PYTHONPATH so subprocesses import this ``webds``.
ROOT = Path(__file__).resolve().parents[1]

#: This Python and ``python -m webds.cli`` as shell words, for :func:`run_shell` and ``pipe:``.
PY = shlex.quote(sys.executable)
WEBDS = f"{PY} -m webds.cli"


def cli_env() -> Dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def webds_command(*args: str) -> List[str]:
    """The argv of ``python -m webds.cli ARGS`` (for ``subprocess.Popen`` pipelines)."""
    return [sys.executable, "-m", "webds.cli", *args]


def run_webds(*args: str, cwd: Path, **kw: Any) -> subprocess.CompletedProcess:
    """``python -m webds.cli ARGS`` as a real subprocess; ``kw`` go to ``subprocess.run``.

    By default stdout and stderr are captured, stdin is empty (``input=`` or ``stdin=`` to give
    one), the environment is :func:`cli_env` and the run times out after 120 s. stdout comes back
    as bytes (str with ``text=True``); stderr, the command's messages, always as str.
    """
    if "input" not in kw:
        kw.setdefault("stdin", subprocess.DEVNULL)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("env", cli_env())
    kw.setdefault("timeout", 120)
    proc = subprocess.run(webds_command(*args), cwd=cwd, **kw)
    if isinstance(proc.stderr, bytes):
        proc.stderr = proc.stderr.decode(errors="backslashreplace")
    return proc


def run_shell(command: str, cwd: Path, **kw: Any) -> subprocess.CompletedProcess:
    """``bash -o pipefail -c COMMAND`` with :func:`cli_env`; stdout and stderr captured as
    text; times out after 120 s."""
    kw.setdefault("env", cli_env())
    kw.setdefault("timeout", 120)
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], cwd=cwd, capture_output=True, text=True, **kw
    )


def tar_names(path: Path) -> List[str]:
    """The member names GNU tar lists, in archive order."""
    out = subprocess.run(["tar", "tf", str(path)], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def tar_contents(path: Path, dest: Path) -> Dict[str, bytes]:
    """Every regular file GNU tar extracts from ``path`` into ``dest``, by archive name."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "xf", str(path), "-C", str(dest)], check=True)
    return {
        p.relative_to(dest).as_posix(): p.read_bytes()
        for p in sorted(dest.rglob("*"))
        if p.is_file()
    }


def tar_members(path: Path) -> List[Tuple[str, bytes]]:
    """(name, data) of every regular file in the tar, in archive order (repeats kept), read with
    Python's ``tarfile``."""
    with tarfile.open(path) as tf:
        files = [m for m in tf.getmembers() if m.isfile()]
        return [(m.name, tf.extractfile(m).read()) for m in files]  # type: ignore[union-attr]
