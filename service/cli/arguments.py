"""argparse types of bounded numbers: a flag outside its range is refused by argparse (exit 2, the usage
line, ``argument --max-tokens: must be >= 1, got 0``) before the command connects anywhere.

The bounds are the engine's (``nanoserve.engine.sampling.limits``) and the contract's wire types
(int32, int64): a number protobuf cannot carry would otherwise end in a traceback.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

INT32_MAX = 2**31 - 1  # the contract's int32 fields (max_tokens, n, logprobs, ...)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # its int64 (seed)
MAX_SALT_CHARS = 256  # GenerateRequest.cache_salt, as the server checks it
GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:")  # gRPC name syntax targets, taken as given


def integer(low: int, high: int = INT32_MAX, also: int | None = None) -> Callable[[str], int]:
    """An int in [low, high] (or the one value ``also``, e.g. -1 for "as many as fit")."""
    allowed = f">= {low}" if high == INT32_MAX else f"in [{low}, {high}]"
    if also is not None:
        allowed = f"{also} or {allowed}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {text!r}") from None
        if value > high and high == INT32_MAX:
            raise argparse.ArgumentTypeError(f"must be at most {INT32_MAX} (the API's int32), got {value}")
        if not (low <= value <= high or value == also):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def number(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """A finite float in [low, high] (``low_open``: (low, high])."""
    if high == math.inf:
        allowed = f"> {low:g}" if low_open else f">= {low:g}"
    else:
        allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {allowed}, got {text!r}") from None
        above_low = value > low if low_open else value >= low
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {allowed}, got {text}")
        if not (above_low and value <= high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def salt(text: str) -> str:
    """A cache salt: 1..256 characters (an empty one would silently mean "no salt")."""
    if not 1 <= len(text) <= MAX_SALT_CHARS:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_SALT_CHARS} characters, got {len(text)}")
    return text


def server_address(text: str) -> str:
    """A gRPC target: ``HOST:PORT`` (``[IPv6]:PORT``), or a gRPC URI (``dns:``, ``unix:``, ``ipv4:``, ``ipv6:``).

    A URL with another scheme (``http://...``) or a host without a port is refused: gRPC would dial a
    misformatted name, or port 443, and fail with a message about neither."""
    if text.startswith(GRPC_SCHEMES):
        return text
    if "://" in text:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT (no scheme; e.g. localhost:50051), got {text!r}")
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or host.endswith(":"):
        raise argparse.ArgumentTypeError(
            f"must be HOST:PORT with a port in 1..65535 (e.g. localhost:50051), got {text!r}"
        )
    return text


def add_connection_flags(parser: argparse.ArgumentParser, token: bool = True) -> None:
    """--server, --token (unless ``token`` is False), --tls and --ca-cert: how a client command reaches the
    server; the defaults come from NANOSERVE_SERVER and NANOSERVE_AUTH_TOKEN."""
    parser.add_argument(
        "--server",
        type=server_address,
        default=os.environ.get("NANOSERVE_SERVER", "localhost:50051"),
        help="server address host:port [env NANOSERVE_SERVER; default: localhost:50051]",
    )
    if token:
        parser.add_argument(
            "--token",
            default=os.environ.get("NANOSERVE_AUTH_TOKEN"),
            help="bearer token, when the server requires one [env NANOSERVE_AUTH_TOKEN]",
        )
    parser.add_argument(
        "--tls", action="store_true", help="connect with TLS (system root certificates unless --ca-cert)"
    )
    parser.add_argument(
        "--ca-cert", default=None, help="PEM file of the CA that signed the server's certificate (implies --tls)"
    )
