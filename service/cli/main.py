"""The ``nanoserve`` command line: one sub-command module per verb.

Each module in ``nanoserve.service.cli.commands`` exposes
``register(subparsers) -> None``, which adds its parser and sets
``func(args) -> int`` (the exit status). Modules import heavy dependencies
(torch, grpc) inside ``func`` so that ``nanoserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from collections.abc import Sequence

# sub-command module names under nanoserve.service.cli.commands, in --help order
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell shows for a command whose reader went away

COMMANDS: tuple[str, ...] = ("serve", "generate", "resume", "health", "log", "db", "gateway")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoserve",
        description="LLM inference server: gRPC streaming over a paged KV cache with an event-sourced block allocator.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"nanoserve.service.cli.commands.{name}").register(subparsers)
    return parser


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), for bug reports."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nanoserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's C core logs at INFO by default, and a failed TLS handshake is two lines of it on a client's
    # stderr before the status the command explains; GRPC_VERBOSITY=INFO brings them back. Read at import.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    # Before anything imports torch: its OpenMP pool reads the wait policy once, at start.
    from nanoserve.engine.model.threads import prefer_bounded_spin

    prefer_bounded_spin()
    # The parser's imports, and serve's after them (torch, grpc, SQLAlchemy: ~200k objects that live
    # until exit), run with the collector off: a collection during them walks them all, again and
    # again. serve turns it back on once they are frozen (nanoserve.service.grpc.server.serve); the other
    # commands, here.
    gc.disable()
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        gc.enable()
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # here, not at exit, where a closed pipe could only be reported as ignored
        return status
    except KeyboardInterrupt:  # Ctrl-C outside a command's own handling: quiet, as shells expect
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `nanoserve log show | head`: the reader has what it wanted
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _silence_stdout() -> None:
    """Points stdout at /dev/null, so that the interpreter's last flush of the dead pipe raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
