"""Start the gloo ranks of test_ddp.py (and the example runs of test_train_imagenet.py) by
forking one process that has imported torch and webds.

A rank started as ``python JOB.py`` spent about 5 s of CPU importing torch, torch.distributed,
webds and (when it made its DistributedDataParallel model) torch._dynamo, and 1-2 s more tearing
the interpreter down at exit; test_ddp.py starts some 40 ranks. This script makes those imports
once, then, for each job the test asks for, forks one child per rank: each child is a rank as
before (its own process and gloo process group, its own DataLoader workers, forked or spawned;
SIGKILL still kills it), only its imports are done. A job module's ``main()`` reads
``sys.argv`` as when the module runs as a script (each can still be run so, by hand).

Protocol, one JSON object a line: the test writes ``{"job": "ddp_job", "argvs": [[...], ...],
"logs": [...]}`` (one argv and one log file per rank; a rank's stdout and stderr go to its
log, or its stderr to its file in ``"errs"`` when the request has them); this process
answers ``{"status": [...]}``, each rank's exit status as ``subprocess.Popen.returncode`` gives
it (``-9``: killed by SIGKILL). The test reads the answer with a timeout and kills this
process's whole session (the ranks and their workers) on a hang.
Only the standard library is imported at the top: a spawned DataLoader worker runs this file as
``__mp_main__`` and imports no more than its dataset needs.

``python rank_forker.py MODULE[:FUNCTION] ...`` imports those modules instead of test_ddp.py's
(and calls each FUNCTION once imported): test_train_imagenet.py forks its example runs so,
``run_example`` (whose ``main()`` runs the example) with torchvision imported, and
``torch.distributed.run`` (torchrun's launcher; the ranks it starts are its own new
interpreters, as under any torchrun).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import importlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import traceback
from typing import Dict, List, Optional, Sequence

JOBS = ("ddp_job", "elastic_job", "resume_job")


class Forker:
    """The test's end: this script in a process of its own (a new session), started when first
    asked and again after a hang killed it."""

    def __init__(
        self, env: Dict[str, str], preload: Sequence[str] = (), cwd: Optional[str] = None
    ) -> None:
        self.env = env
        self.preload = list(preload)  # MODULE[:FUNCTION] (none: test_ddp.py's imports)
        self.cwd = cwd
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        """Start this script now (it makes its imports while the test goes on), unless it
        runs."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, *self.preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self.env,
                cwd=self.cwd,
                text=True,
                start_new_session=True,
            )

    def run(
        self,
        job: str,
        argvs: List[list],
        logs: List[str],
        timeout: float,
        errs: Optional[List[str]] = None,
    ) -> Optional[list]:
        """Every rank's exit status, or None if they had not all ended after ``timeout``
        seconds (the ranks, their workers and this script are then killed). ``errs``: a file
        per rank for its stderr (else it goes to its log with its stdout)."""
        self.start()
        assert self.proc is not None
        assert self.proc.stdin is not None and self.proc.stdout is not None
        request = {"job": job, "argvs": [list(map(str, a)) for a in argvs], "logs": logs}
        if errs is not None:
            request["errs"] = errs
        request["timeout"] = max(timeout - 30, timeout / 2)  # each rank's, to dump its threads
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.kill()
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rank_forker.py exited with status {self.proc.wait()}")
        return json.loads(line)["status"]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal this script's session: it, the ranks and their DataLoader workers (a worker
        whose rank died while it started never notices: it would outlive the test)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:  # it has just ended
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                if sig == signal.SIGKILL:
                    raise
                self.kill()

    def close(self) -> None:
        """End it all: between jobs nothing runs but what a failed job left behind. SIGTERM
        lets each resource tracker (which ignores it) still clean up after its workers."""
        self.kill(signal.SIGTERM)


def rank(job: str, argv: list, log: str, timeout: float, err: Optional[str] = None) -> int:
    """In the forked child: run ``job``'s ``main()`` with ``argv``, as a script; its exit code.
    A rank still running after ``timeout`` seconds writes where every thread is to its log (or
    ``err``) and exits (status 1), before the test's own timeout: the test then fails with
    that."""
    for target, path in ((1, log), (2, err or log)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    faulthandler.dump_traceback_later(timeout, exit=True)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # Its own entropy, as a process started anew has (forked, every rank would draw the same).
    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    module = sys.modules[job]
    sys.argv = [module.__file__, *argv]
    code = 0
    try:
        module.main()
    except SystemExit as exn:
        code = exn.code if isinstance(exn.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    return code


def leave(code: int) -> None:
    """End the forked child as a script ends (threads joined, atexit handlers run:
    multiprocessing's, weakref finalizers, torch's; garbage collected; output flushed), short of
    tearing the interpreter down: that touches every object the factory imported, copying each
    page shared with it (2.5 s of CPU per rank), and checks nothing."""
    threading._shutdown()  # type: ignore[attr-defined]  (what the interpreter calls first)
    atexit._run_exitfuncs()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(preload: Sequence[str]) -> None:
    # The imports every rank makes, done once: the jobs (torch, torch.distributed, gloo_rank),
    # what DistributedDataParallel imports when first made (torch._dynamo: 2 s of CPU), the
    # webds modules that webds's lazy attributes and a WebLoader's pass import, numpy.random.
    # Or those asked for (MODULE:FUNCTION: called once imported).
    names = list(preload) or [*JOBS, "torch._dynamo", "numpy.random"]
    names += [f"webds.{n}" for n in ("loader", "fluent", "pipeline", "shards", "tar", "stages")]
    names.append("webds.io")
    for name in names:
        module, _, function = name.partition(":")
        imported = importlib.import_module(module)
        if function:
            getattr(imported, function)()
    gc.freeze()  # the ranks' collections leave these objects (and the pages they share) alone
    answers = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        pids = []
        for argv, log in zip(request["argvs"], request["logs"]):
            pid = os.fork()
            if pid == 0:  # the rank: it never returns to this loop
                code = 1
                try:
                    err = request["errs"][len(pids)] if "errs" in request else None
                    code = rank(request["job"], argv, log, request["timeout"], err)
                finally:
                    leave(code)
            pids.append(pid)
        status = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        answers.write(json.dumps({"status": status}) + "\n")
        answers.flush()


def end_as_forked_workers_end() -> None:
    """In a spawned DataLoader worker (it runs this file as ``__mp_main__``): once its process
    has run (its finalizers too), end it as :func:`leave` ends a rank, as a forked worker ends
    (``os._exit`` after the same ``_bootstrap``), not by tearing the interpreter down: that
    spent some 0.5 s of CPU per worker on torch's modules (12 workers a run in test_ddp.py's
    spawn case, one after another with the ranks waiting on each to end)."""
    if os.environ.get("RANK_FORKER_TEARDOWN") == "1":  # to compare: tear down as before
        return
    from multiprocessing import process

    bootstrap = process.BaseProcess._bootstrap

    def _bootstrap(self, parent_sentinel=None):  # type: ignore[no-untyped-def]
        leave(bootstrap(self, parent_sentinel))

    process.BaseProcess._bootstrap = _bootstrap  # type: ignore[method-assign]


if __name__ == "__mp_main__":
    end_as_forked_workers_end()

if __name__ == "__main__":
    serve(sys.argv[1:])
