"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, as a user runs it.

The notebooks are committed without outputs; this test executes each one with nbclient in a
real IPython kernel of its own (working directory: notebooks/, as when a user opens it from a
checkout) and fails on the first cell that raises. The only help the kernel gets is the startup
file of this project's torchvision workaround (tests/torchvision_cpu.py: the CUDA build of
torchvision needs two op schemas declared on CPU-only torch), loaded through a temporary
IPYTHONDIR so that the notebooks themselves stay free of it; it runs when a notebook first
imports torchvision, so that the notebooks which never do start without it.

Each notebook runs in a thread of the test process (nbclient talking to the notebook's kernel),
two notebooks at a time, in the order of their tests: the next one starts as soon as one ends,
and each test waits for its own notebook. A notebook alone leaves much of a 2-core machine idle
(one process importing torch, a training loop in one thread, waits on a server or the disk);
two at a time keep both cores busy. They share nothing: each has a new kernel that nothing ran
in before (killed once its notebook has run), its own temporary folder, servers on ports of their
own; what they print about speed is not checked. Each test still judges its own notebook only.
"""

from __future__ import annotations

import json
import os
import sys
import threading
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


#: The startup file: on the first ``import torchvision`` (by a cell or by a library a cell
#: uses), import it through tests/torchvision_cpu.py's workaround instead, once. It leaves no
#: name behind in the notebook's namespace.
STARTUP = f"""\
def _torchvision_workaround_on_first_import():
    import importlib.abc
    import importlib.machinery
    import sys

    class Workaround(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name != "torchvision":
                return None
            return importlib.machinery.ModuleSpec(name, self)

        def create_module(self, spec):
            sys.meta_path.remove(self)  # the import below, and every later one, is the usual one
            sys.path.insert(0, {str(ROOT / "tests")!r})
            try:
                from torchvision_cpu import import_torchvision

                module = import_torchvision()  # ImportError without torchvision, as usual
            finally:
                sys.path.pop(0)
            self.spec = module.__spec__
            return module

        def exec_module(self, module):
            module.__spec__ = self.spec  # the import machinery set ours: give the real one back

    sys.meta_path.insert(0, Workaround())


_torchvision_workaround_on_first_import()
del _torchvision_workaround_on_first_import
"""


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """The kernels' environment: an IPYTHONDIR whose startup file declares the torchvision ops
    (see the module doc)."""
    ipython_dir = tmp_path_factory.mktemp("ipython")
    startup = ipython_dir / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-torchvision-cpu.py").write_text(STARTUP)
    env = {
        "IPYTHONDIR": str(ipython_dir),
        # The kernel must import this checkout's webds, also when it is not installed.
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "MPLBACKEND": "agg",
        "TQDM_DISABLE": "1",
    }
    return env


#: Notebooks running at once: two keep both cores of a 2-core machine busy (see the module doc).
AT_ONCE = 2


class Run:
    """One notebook executed in a new kernel, in a thread of its own; ``on_end()`` is called
    (in that thread) when the run has ended, however it ended."""

    def __init__(self, path: Path, env: dict, on_end=None) -> None:
        self.path, self.env, self.on_end = path, env, on_end
        self.nb = nbformat.read(str(path), as_version=4)
        self.km = None
        self.failure = None  # the CellExecutionError, or any other exception of the run
        self.elapsed = None
        self.thread = threading.Thread(target=self._run, name=f"notebook {path.stem}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            started = time.monotonic()
            # The kernel is this interpreter (ipykernel in the same environment), not whatever
            # "python3" kernel a user registered elsewhere.
            self.km = _this_python_kernel_manager()(kernel_name="python3")
            self.km.start_kernel(cwd=str(self.path.parent), env={**os.environ, **self.env})
            client = nbclient.NotebookClient(
                self.nb, km=self.km, timeout=CELL_TIMEOUT, kernel_name="python3"
            )
            try:
                client.execute()
            finally:
                # The notebook has run (its last cells clean up): no need to wait for a polite
                # exit.
                if client.kc is not None:
                    client.kc.stop_channels()
                self.km.shutdown_kernel(now=True)
            self.elapsed = time.monotonic() - started
        except BaseException as exn:  # judged by the notebook's test, in the main thread
            self.failure = exn
        finally:
            if self.on_end is not None:
                self.on_end()

    def result(self):
        """The executed notebook, once the run has ended; raises what the run raised."""
        self.thread.join()
        if self.failure is not None:
            raise self.failure
        return self.nb

    def kill(self) -> None:
        """End the run now if it is still going (its kernel dies; its thread ends with that)."""
        if self.thread.is_alive() and self.km is not None:
            try:
                self.km.shutdown_kernel(now=True)
            except Exception:
                pass
        self.thread.join(timeout=30)


class Runs:
    """The runs of the notebooks this session tests, in the order of their tests, ``AT_ONCE`` at
    a time: the next one starts as soon as one ends. A test waits for its own notebook only."""

    def __init__(self, env: dict, order: list) -> None:
        self.env = env
        self.waiting = list(order)
        self.runs: dict = {}
        self.running = 0
        self.closed = False
        self.lock = threading.Lock()
        with self.lock:
            self._fill()

    def _start(self, path: Path) -> None:  # with the lock held
        if path in self.waiting:
            self.waiting.remove(path)
        self.running += 1
        self.runs[path] = Run(path, self.env, on_end=self._ended)

    def _fill(self) -> None:  # with the lock held
        while not self.closed and self.waiting and self.running < AT_ONCE:
            self._start(self.waiting[0])

    def _ended(self) -> None:
        with self.lock:
            self.running -= 1
            self._fill()

    def take(self, path: Path) -> Run:
        """``path``'s run, started now if it was not (maybe still running); its test ends it."""
        with self.lock:
            if path not in self.runs:
                self._start(path)
            return self.runs.pop(path)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.waiting.clear()
            left = list(self.runs.values())
            self.runs.clear()
        for run in left:
            run.kill()


@pytest.fixture(scope="module")
def runs(kernel_env, request):
    """Runs of the notebooks this session tests, in the order it tests them."""
    order = [
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_notebook_runs_top_to_bottom"
    ]
    pool = Runs(kernel_env, order)
    yield pool
    pool.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, runs):
    run = runs.take(path)
    try:
        nb = run.result()
    except nbclient.exceptions.CellExecutionError as exn:
        pytest.fail(f"{path.name}: a cell failed:\n{exn}", pytrace=False)
    finally:
        run.kill()  # when this test is interrupted (its timeout) before the run has ended
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
    print(f"{path.name}: {run.elapsed:.1f} s")


def _this_python_kernel_manager():
    from jupyter_client.manager import KernelManager

    class ThisPython(KernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            return [sys.executable, "-m", "ipykernel_launcher", "-f", self.connection_file]

    return ThisPython
