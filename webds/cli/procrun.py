"""The engine of ``webds proc`` (:mod:`webds.cli.proc`): a shell command run on each sample in
a temporary folder holding its fields as files, several samples at once, results in input order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, Optional, Set, Tuple

from ..base.redact import redact
from ..errors import WebdsError

__all__ = ["SampleCommand", "SampleCommandError", "ShardCommand", "Running", "run_samples"]

Sample = Dict[str, Any]

#: Lines of the command's stderr shown for a failed sample.
STDERR_LINES = 5


class SampleCommandError(WebdsError):
    """The command failed on one sample (exit status, timeout, or no output files)."""

    def __init__(
        self,
        message: str,
        *,
        url: Optional[str] = None,
        key: Optional[str] = None,
        stderr: str = "",
    ) -> None:
        super().__init__(message, url=url, key=key)
        self.stderr = stderr

    def report(self) -> str:
        """Several lines for stderr: what failed, then the end of the command's stderr."""
        where = f"sample {self.key!r}" + (f" in shard {self.url!r}" if self.url else "")
        lines = [f"webds proc: {where}: {self.message}"]
        lines += [f"  | {line}" for line in self.stderr.splitlines()]
        return redact("\n".join(lines))

    def __str__(self) -> str:
        # One line (for a shard's error in map_shards): the stderr lines joined by " | ".
        text = super().__str__()
        if self.stderr:
            text += "; the command's stderr ended with: " + " | ".join(self.stderr.splitlines())
        return text

    def __reduce__(self) -> Any:
        return (_rebuild_failure, (self.message, self.url, self.key, self.stderr))


def _rebuild_failure(message: str, url: Any, key: Any, stderr: str) -> SampleCommandError:
    return SampleCommandError(message, url=url, key=key, stderr=stderr)


class SampleCommand:
    """``run(sample) -> sample``: the shell command applied to one raw sample (bytes fields).

    A plain picklable value (command and timeout), so it can go to worker processes; the
    subprocesses of one run are tracked by the :class:`~webds.cli.procrun.Running` passed to
    ``run``.
    """

    def __init__(self, command: str, timeout: Optional[float] = None) -> None:
        self.command = command
        self.timeout = timeout

    def run(self, sample: Sample, running: Optional["Running"] = None) -> Sample:
        key = sample["__key__"]
        url = sample.get("__url__")
        if "\0" in key:
            # Only a damaged or hostile header (a pax path record) gives a name with a NUL.
            raise SampleCommandError(
                "the sample's key holds a NUL byte, so it can't be given to the command as "
                "$KEY: a damaged or hostile member name in the shard; re-create the shard, or "
                "pass --keep-going to leave such samples out",
                url=url,
                key=key,
            )
        with tempfile.TemporaryDirectory(prefix="webds-proc-") as folder:
            for field, value in sample.items():
                if field.startswith("_"):
                    continue
                if "/" in field or "\0" in field:
                    raise SampleCommandError(
                        f"field name {field!r} can't be a file name", url=url, key=key
                    )
                if isinstance(value, str):
                    value = value.encode("utf-8")
                with open(os.path.join(folder, f"sample.{field}"), "wb") as stream:
                    stream.write(value)
            status, stderr, timed_out = self._execute(folder, key, running or Running())
            if timed_out:
                raise SampleCommandError(
                    f"command timed out after {self.timeout:g} s (killed)",
                    url=url,
                    key=key,
                    stderr=stderr,
                )
            if status != 0:
                what = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
                raise SampleCommandError(f"command failed: {what}", url=url, key=key, stderr=stderr)
            result: Sample = {"__key__": key}
            if url is not None:
                result["__url__"] = url
            with os.scandir(folder) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    name = entry.name
                    if name.startswith("sample.") and len(name) > 7:
                        if entry.is_file(follow_symlinks=False):
                            with open(entry.path, "rb") as stream:
                                result[name[7:]] = stream.read()
        if not any(not field.startswith("_") for field in result):
            raise SampleCommandError(
                "command left no sample.* file in its folder", url=url, key=key, stderr=stderr
            )
        return result

    def _execute(self, folder: str, key: str, running: "Running") -> Tuple[int, str, bool]:
        env = dict(os.environ, KEY=key)
        with running.lock:
            if running.stopped:
                raise SampleCommandError("not run: the command stopped early", key=key)
            # Own process group: a timeout or an early stop ends the command and its children.
            try:
                proc = subprocess.Popen(
                    ["sh", "-c", self.command],
                    cwd=folder,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except (OSError, ValueError) as exn:  # e.g. a key too long for the environment
                raise SampleCommandError(
                    f"cannot start the command: {type(exn).__name__}: {exn}", key=key
                ) from None
            running.procs.add(proc)
        timed_out = False
        try:
            try:
                _, err = proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                _, err = proc.communicate()
        finally:
            with running.lock:
                running.procs.discard(proc)
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
        tail = err.decode("utf-8", "replace").rstrip("\n").splitlines()[-STDERR_LINES:]
        return proc.returncode, "\n".join(tail), timed_out


class Running:
    """The subprocesses of one run; ``stop()`` kills them and starts no more."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: Set[subprocess.Popen] = set()
        self.stopped = False

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            procs = list(self.procs)
        for proc in procs:
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_samples(
    samples: Iterable[Sample],
    command: SampleCommand,
    parallel: int = 1,
    on_failure: Optional[Callable[[SampleCommandError], None]] = None,
) -> Iterator[Sample]:
    """Run ``command`` on each sample, ``parallel`` at once, yielding results in input order.

    A failure is passed to ``on_failure`` (and the sample left out), or raised when it is None;
    stopping early (a failure, an error, the consumer closing the generator) ends the commands
    still running.
    """
    with contextlib.closing(_ordered(samples, command, parallel)) as outcomes:
        for _, future in outcomes:
            try:
                yield future.result()
            except SampleCommandError as exn:
                if on_failure is None:
                    raise
                on_failure(exn)


def _ordered(
    samples: Iterable[Sample], command: SampleCommand, parallel: int
) -> Iterator[Tuple[Sample, "Future[Sample]"]]:
    if parallel <= 1:
        for sample in samples:
            future: Future[Sample] = Future()
            try:
                future.set_result(command.run(sample))
            except SampleCommandError as exn:
                future.set_exception(exn)
            yield sample, future
        return
    pool = ThreadPoolExecutor(parallel, thread_name_prefix="webds-proc")
    running = Running()
    pending: Deque[Tuple[Sample, Future[Sample]]] = deque()
    try:
        for sample in samples:
            pending.append((sample, pool.submit(command.run, sample, running)))
            # At most `parallel` commands run; the oldest is waited on first to keep the order.
            if len(pending) >= parallel:
                yield pending[0][0], pending[0][1]
                pending.popleft()
        while pending:
            yield pending[0][0], pending[0][1]
            pending.popleft()
    finally:
        for _, fut in pending:
            fut.cancel()
        if pending:
            running.stop()  # stopped early: end the commands still running
        pool.shutdown(wait=True)


class ShardCommand:
    """A shard-level function for :func:`~webds.parallel.map_shards`: the command on each
    sample of a shard.

    With ``keep_going`` a failed sample is reported on this process's stderr and left out (the
    shard's ``samples_in - samples_out`` counts them); otherwise it fails the shard.
    """

    def __init__(
        self, command: str, timeout: Optional[float], parallel: int, keep_going: bool
    ) -> None:
        self.command = SampleCommand(command, timeout)
        self.parallel = parallel
        self.keep_going = keep_going

    def __call__(self, samples: Iterator[Sample]) -> Iterator[Sample]:
        on_failure = _print_failure if self.keep_going else None
        return run_samples(samples, self.command, self.parallel, on_failure)


def _print_failure(exn: SampleCommandError) -> None:
    from tqdm.auto import tqdm

    tqdm.write(exn.report(), file=sys.stderr)  # above a progress bar, if one is showing
    sys.stderr.flush()
