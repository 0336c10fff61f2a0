"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, as a user runs it.

The notebooks are committed without outputs; this test executes each one with nbclient in a
real IPython kernel (working directory: notebooks/, as when a user opens it from a checkout)
and fails on the first cell that raises. The only help the kernel gets is the startup file of
this project's torchvision workaround (tests/torchvision_cpu.py: the CUDA build of torchvision
needs two op schemas declared on CPU-only torch), loaded through a temporary IPYTHONDIR so that
the notebooks themselves stay free of it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: Seconds one cell may run: the slowest cells train a small network for an epoch or two.
CELL_TIMEOUT = 300

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 7, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs(path: Path):
    """Outputs would go stale (and bloat diffs): a notebook is committed as source only."""
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert not cell.get("outputs"), f"{path.name}: cell {i} has outputs"
            assert cell.get("execution_count") is None, f"{path.name}: cell {i} was executed"
    kernel = nb["metadata"].get("kernelspec", {})
    assert kernel.get("name") == "python3", f"{path.name}: kernel {kernel}"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """An IPYTHONDIR whose startup file declares the torchvision ops (see the module doc)."""
    ipython_dir = tmp_path_factory.mktemp("ipython")
    startup = ipython_dir / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-torchvision-cpu.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from torchvision_cpu import import_torchvision\n"
        "try:\n"
        "    import_torchvision()\n"
        "except ImportError:\n"
        "    pass  # no torchvision: notebooks that need it say so\n"
        "finally:\n"
        "    sys.path.pop(0)\n"
    )
    env = {
        "IPYTHONDIR": str(ipython_dir),
        # The kernel must import this checkout's webds, also when it is not installed.
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "MPLBACKEND": "agg",
        "TQDM_DISABLE": "1",
    }
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, kernel_env, monkeypatch):
    for key, value in kernel_env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(str(path), as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    # The kernel is this interpreter (ipykernel in the same environment), not whatever
    # "python3" kernel a user registered elsewhere.
    client.kernel_manager_class = _this_python_kernel_manager()
    started = time.monotonic()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exn:
        pytest.fail(f"{path.name}: a cell failed:\n{exn}", pytrace=False)
    elapsed = time.monotonic() - started
    # execute() raises only for errors it is not told to allow (a cell tagged
    # "raises-exception" gets through): judge the executed notebook itself.
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    assert code, f"{path.name}: no code cells"
    unrun = [i for i, c in code if c.get("execution_count") is None]
    assert not unrun, f"{path.name}: cells {unrun} did not run"
    errors = [
        (i, out.get("ename"), out.get("evalue"))
        for i, c in code
        for out in c.outputs
        if out.output_type == "error"
    ]
    assert not errors, f"{path.name}: cells raised {errors}"
    assert any(c.outputs for _, c in code), f"{path.name}: no cell showed anything"
    print(f"{path.name}: {elapsed:.1f} s")


def _this_python_kernel_manager():
    from jupyter_client.manager import KernelManager

    class ThisPython(KernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            return [sys.executable, "-m", "ipykernel_launcher", "-f", self.connection_file]

    return ThisPython
