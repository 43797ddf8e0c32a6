"""``nanoserve serve``: load the model and serve it over gRPC until SIGTERM/SIGINT.

Every setting is a flag and a ``NANOSERVE_*`` environment variable (see
``nanoserve.service.settings.SETTINGS``); the flag wins.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nanoserve.service.settings import add_arguments

# exit statuses of `nanoserve serve` (README "When the event log is in trouble")
EXIT_OK = 0  # served, shut down, every event of the epoch written and the epoch closed
EXIT_ERROR = 1  # an unexpected error (its traceback is in the log)
EXIT_BAD_CONFIG = 2  # a flag or NANOSERVE_* variable out of range, no model at --model, or a port that cannot be bound
EXIT_LOG_UNUSABLE = 3  # the event log's store could not be used at start (checked before the model loads)
EXIT_LOG_INCOMPLETE = 4  # shut down with events the log could not write: they are named, the epoch stays open

EXIT_STATUSES = f"""exit status:
  {EXIT_OK}  served and shut down; every event written, the epoch closed
  {EXIT_ERROR}  an unexpected error (its traceback is in the log)
  {EXIT_BAD_CONFIG}  a flag or NANOSERVE_* variable is out of range, --model names no model file or folder,
     --device is not on this machine, or --port / --metrics-port cannot be bound (another server
     listens there): one line on stderr; checked before the model loads
  {EXIT_LOG_UNUSABLE}  the event log is unusable at start (store down, read-only or full, no schema, another
     writer, another live server on the same --pool-id): one line on stderr names the store and the
     cause; checked before the model loads (the --pool-id lock when the epoch opens, after it)
  {EXIT_LOG_INCOMPLETE}  shut down with events the log could not write within --event-log-close-timeout-s after
     --grace-s (store away or full, log file deleted): stderr says how many and from which seq;
     the epoch stays open (nanoserve log epochs shows it as crashed)
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over gRPC (default: SmolLM2-135M-Instruct on port 50051)",
        description=(
            "Load the model, open a new epoch of the KV block event log and serve the "
            "nanoserve.v1 GenerationService and AllocationService, and vLLM's engine service "
            "(vllm.grpc.engine.VllmEngine, for a gateway such as smg), with health and reflection. "
            "SIGTERM or SIGINT shuts down gracefully: new calls are refused, streams in "
            "flight get --grace-s seconds to finish, the rest are aborted, the log is "
            "flushed and closed. Each flag also reads the NANOSERVE_* variable named in its help. "
            "The exit statuses are listed below."
        ),
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from nanoserve.service.config import build_configs
    from nanoserve.service.logs import configure_logging

    try:
        server_config, engine_config = build_configs(args)
    except ValueError as exc:
        print(f"nanoserve serve: error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    configure_logging(server_config.log_format, server_config.log_level)
    from nanoserve.allocator.log import SecondWriterError
    from nanoserve.service.grpc.server import serve

    try:
        return asyncio.run(serve(server_config, engine_config))
    except SecondWriterError as exc:  # another live server writes this pool: refuse to start, say why
        print(f"nanoserve serve: error: {exc}", file=sys.stderr)
        return EXIT_LOG_UNUSABLE
