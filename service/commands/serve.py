"""``nanoserve serve``: load the model and serve it over gRPC until SIGTERM/SIGINT.

Every setting is a flag and a ``NANOSERVE_*`` environment variable (see
``nanoserve.service.config.SETTINGS``); the flag wins.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nanoserve.service.config import add_arguments

EXIT_POOL_TAKEN = 3  # another live server holds --pool-id in the event log


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
            "Exit 0 after a clean shutdown, 2 on a bad setting, 3 when another live server writes "
            "--pool-id in the event log."
        ),
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
        return 2
    configure_logging(server_config.log_format, server_config.log_level)
    from nanoserve.allocator.log import SecondWriterError
    from nanoserve.service.server import serve

    try:
        return asyncio.run(serve(server_config, engine_config))
    except SecondWriterError as exc:  # another live server writes this pool: refuse to start, say why
        print(f"nanoserve serve: error: {exc}", file=sys.stderr)
        return EXIT_POOL_TAKEN
