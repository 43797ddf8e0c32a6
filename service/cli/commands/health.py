"""``nanoserve health``: ask a server's grpc.health.v1 service whether it serves.

Exit 0 when SERVING, 1 when the server answers anything else, 2 when it cannot
be reached, 3 when it does not know the ``--service`` asked about. The
container healthcheck uses it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nanoserve.service.cli.arguments import add_connection_flags

EXIT_SERVING, EXIT_NOT_SERVING, EXIT_UNREACHABLE, EXIT_UNKNOWN_SERVICE = 0, 1, 2, 3
# the services a nanoserve server reports health for ('' is the whole server)
KNOWN_SERVICES = ("", "nanoserve.v1.GenerationService", "nanoserve.v1.AllocationService", "vllm.grpc.engine.VllmEngine")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "health",
        help="check a server's health (exit 0 SERVING, 1 not serving, 2 unreachable, 3 unknown --service)",
        description="Query grpc.health.v1 on a running server and print the status.",
    )
    add_connection_flags(parser, token=False)
    parser.add_argument(
        "--service",
        default="",
        help=(
            "service to check: '' (the whole server, default), nanoserve.v1.GenerationService, "
            "nanoserve.v1.AllocationService or vllm.grpc.engine.VllmEngine"
        ),
    )
    parser.add_argument(
        "--wait", type=float, default=0.0, metavar="SECONDS", help="poll up to this long for SERVING before answering"
    )
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="deadline of one check")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from nanoserve.service.cli.client import health_status, open_channel, status_hint, wait_ready

    with open_channel(args.server, tls=args.tls, ca_cert=args.ca_cert) as channel:
        if args.wait > 0:
            wait_ready(channel, args.wait, args.service)
        try:
            status = health_status(channel, args.service, timeout_s=args.timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # grpc.health.v1's answer for a service it does not track
                known = ", ".join(repr(name) for name in KNOWN_SERVICES)
                print(f"{args.server}: unknown service {args.service!r}; known: {known}", file=sys.stderr)
                return EXIT_UNKNOWN_SERVICE
            print(f"{args.server}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            hint = status_hint(exc.code(), exc.details() or "", args.server)
            if hint is not None:
                print(f"hint: {hint}", file=sys.stderr)
            return EXIT_UNREACHABLE
    print(status)
    return EXIT_SERVING if status == "SERVING" else EXIT_NOT_SERVING
