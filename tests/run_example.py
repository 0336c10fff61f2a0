"""Run an example script that imports torchvision, on this machine's CPU-only torch.

``python tests/run_example.py examples/train_imagenet.py ARGS...`` (or the same after
``torchrun ...``) makes torchvision importable through :mod:`torchvision_cpu` (this folder is on
``sys.path`` because it holds this script), then runs the example as ``__main__`` with ``ARGS``.
A user's machine has a working torchvision and runs the example directly.
"""

from __future__ import annotations

import faulthandler
import runpy
import sys

from torchvision_cpu import import_torchvision


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: run_example.py SCRIPT [ARGS...]")
    import_torchvision()
    # A rank that hangs (waiting on a collective, a worker) prints where every thread is and
    # exits, before the test's 300 s timeout: the test then fails with that, not a bare timeout.
    faulthandler.dump_traceback_later(240, exit=True)
    sys.argv = sys.argv[1:]  # the example sees itself as argv[0], as when run directly
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
