"""The ``webds`` command: ``webds COMMAND ...``; ``webds COMMAND --help`` explains each one.

Each family of subcommands lives in its own module here with a ``register(subparsers)`` function
that adds its parsers with :func:`add_command`, each with a ``run(args) -> int`` that returns the
exit status. Errors: a :class:`~webds.errors.WebdsError` (or an ``OSError``) prints one line,
``webds CMD: error: MESSAGE``, on stderr and exits with 2 for bad arguments
(:class:`~webds.errors.ArgumentError`) or 1 for data problems; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any, Callable, List, Optional, Sequence

from ..base.redact import redact
from ..errors import ArgumentError, WebdsError

__all__ = ["main", "build_parser", "add_command", "COMMAND_MODULES"]

#: The modules that register subcommands, in the order ``webds --help`` lists them.
COMMAND_MODULES: List[str] = [
    "create",
    "reshard",
    "sort",
    "inspect",
    "stats",
    "proc",
    "index",
    "convert",
    "clips",
    "bench",
]


def build_parser() -> argparse.ArgumentParser:
    """The ``webds`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="webds",
        description="Create, inspect and check WebDataset tar shards.",
        epilog="Run 'webds COMMAND --help' for the options and an example of each command.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the full traceback when a command fails"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    # Added after each command's own options, so --help lists them last.
    for command in dict.fromkeys(subparsers.choices.values()):  # an alias shares its parser
        add_common(command)
    return parser


def add_command(
    subparsers: Any,
    name: str,
    *,
    help: str,
    description: str,
    epilog: str,
    run: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """Add the subcommand ``name``, run by ``run(args)``; ``epilog`` (its example) and
    ``description`` are printed as written. :func:`build_parser` adds the common options to it
    once the command's own are in."""
    parser = subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(run=run)
    return parser


def add_common(parser: argparse.ArgumentParser) -> None:
    """Options every subcommand takes (also accepted after the command name)."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,  # keep a --debug given before the command name
        help="show the full traceback when the command fails",
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``webds`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(format="%(message)s", level=logging.WARNING, stream=sys.stderr)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"webds {args.command}: interrupted", file=sys.stderr)
        return 130
    except (WebdsError, OSError) as exn:
        if _broken_pipe(exn) and not args.debug:
            # The reader went away (`webds ls big.tar | head`): stop quietly, as cat and ls
            # do. stdout goes to devnull so the interpreter's final flush does not complain.
            _silence_stdout()
            return 141
        if args.debug:
            raise
        print(f"webds {args.command}: error: {_one_line(exn)}", file=sys.stderr)
        return 2 if isinstance(exn, ArgumentError) else 1


def _broken_pipe(exn: Optional[BaseException]) -> bool:
    """Whether ``exn`` comes from writing to a pipe whose reader is gone (maybe wrapped)."""
    while exn is not None:
        if isinstance(exn, BrokenPipeError):
            return True
        exn = exn.__cause__ or exn.__context__
    return False


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real file (tests capture it): nothing will flush to a pipe


def _one_line(exn: BaseException) -> str:
    text = str(exn) if isinstance(exn, WebdsError) else f"{type(exn).__name__}: {exn}"
    return " ".join(redact(text).split())
