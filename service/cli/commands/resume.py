"""``nanoserve resume REQUEST_ID``: stream a request's completion again, from the journal, by its id.

    nanoserve resume REQUEST_ID [--after-token N] [--json] [--server HOST:PORT] [--token T]

The server journals every token of a request: ``Resume`` streams them after
``--after-token`` (0: the whole completion), then follows the request live
until it ends: a finished request's completion again, a running one's from a
second terminal (Ctrl-C here leaves it running). A client that went away
cancelled its call, and the server aborted that request (cause ``cancelled``):
resume prints what it generated until then.
The output is ``generate``'s: the text on stdout, the finish line on stderr.
Requests of several samples (``--n``/``--best-of``) cannot be resumed (the
journal keeps no tokens of parallel samples). Exit status: 0 done, 1 an error
(NOT_FOUND: no such request in the live journal; FAILED_PRECONDITION: the
server keeps no journal) or a request that ended aborted, 2 a flag mistake,
130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nanoserve.service.cli.arguments import INT64_MAX, add_connection_flags, integer, number
from nanoserve.service.cli.commands.generate import (
    EXIT_ABORTED,
    CancelOnInterrupt,
    StreamPrinter,
    error_lines,
    interrupted_exit,
)

EXIT_ERROR = 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "resume",
        help="stream a request's completion again by its id (a finished one, or a running one to its end)",
        description="Stream the completion of a running or finished request again, from the server's request "
        "journal, and follow it live until it ends, as `generate` printed it. A request whose client went away "
        "was aborted (cancelled): what it generated until then is printed. Exit 0 done, 1 error or aborted, "
        "130 Ctrl-C (the request runs on).",
    )
    parser.add_argument(
        "request_id",
        metavar="REQUEST_ID",
        help="the request's id (generate --request-id, or the id "
        "the server assigned: `nanoserve log requests` lists them)",
    )
    parser.add_argument(
        "--after-token",
        type=integer(0, INT64_MAX),
        default=0,
        metavar="N",
        help="start after the first N output tokens (the ones already printed) [default: 0, the whole completion]",
    )
    add_connection_flags(parser)
    parser.add_argument(
        "--timeout",
        type=number(0.0, low_open=True),
        default=None,
        metavar="SECONDS",
        help="deadline of the call (the request itself runs on)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per streamed message instead of the text"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from nanoserve.service.cli.client import auth_metadata, open_channel
    from nanoserve.v1 import generation_pb2 as pb
    from nanoserve.v1 import generation_pb2_grpc

    request = pb.ResumeRequest(request_id=args.request_id, after_token_index=args.after_token)
    printer = StreamPrinter(args.json)
    with open_channel(args.server, tls=args.tls, ca_cert=args.ca_cert) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        call = stub.Resume(request, timeout=args.timeout, metadata=auth_metadata(args.token))
        interrupt = CancelOnInterrupt(call)
        try:
            with interrupt:
                for response in call:
                    printer.print(response)
        except grpc.RpcError as exc:
            if interrupt.interrupted:
                return interrupted_exit(printer)
            printer.end_line()
            print(error_lines(exc, args), file=sys.stderr)
            return EXIT_ERROR
    if interrupt.interrupted:
        return interrupted_exit(printer)
    finish = printer.finish
    if finish is not None and args.after_token > finish.usage.completion_tokens:
        print(
            f"note: --after-token {args.after_token} is past the request's {finish.usage.completion_tokens} output "
            "tokens: no text after it",
            file=sys.stderr,
        )
    return EXIT_ABORTED if printer.aborted else 0
