"""A small blocking client for the CLI and scripts: channel, readiness, health.

The CLI talks to the server the way any client would: through the generated
stubs, with the bearer token in the ``authorization`` metadata.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_SERVER = "localhost:50051"


# gRPC backs off between reconnects up to 120 s by default: a CLI waiting for a restarting server
# (`--wait-ready`) would see it SERVING up to two minutes late, or not within its wait. Retry each second.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def open_channel(server: str, tls: bool = False, ca_cert: str | None = None) -> grpc.Channel:
    """A channel to ``host:port``; TLS with the system roots or ``ca_cert`` (PEM) when asked."""
    if tls or ca_cert:
        roots = Path(ca_cert).read_bytes() if ca_cert else None
        return grpc.secure_channel(server, grpc.ssl_channel_credentials(root_certificates=roots), CHANNEL_OPTIONS)
    return grpc.insecure_channel(server, CHANNEL_OPTIONS)


def status_hint(code: grpc.StatusCode, details: str, server: str, token_given: bool = False) -> str | None:
    """What a CLI user can do about a call that ended with ``code``: one line, or None when the
    status and its details say it already (the server's own INVALID_ARGUMENT names the field).

    UNAVAILABLE with a refused connection means nothing listens at ``server``; other UNAVAILABLEs
    (reset, TLS handshake, name lookup) cannot tell a crash from a wrong address, and say both.
    """
    if code == grpc.StatusCode.UNAVAILABLE:
        if "shutting down" in details:  # the server answered: its message says what to do
            return None
        if "WRONG_VERSION_NUMBER" in details:  # a TLS client, a plaintext server
            return f"the server at {server} does not speak TLS: drop --tls (and --ca-cert)"
        if "handshake" in details.lower() or "certificate" in details.lower():
            return (
                f"the TLS handshake with {server} failed: --ca-cert must name the CA that signed the server's "
                "certificate (and the certificate must name the address in --server)"
            )
        if "Connection refused" in details:
            return (
                f"nothing listens at {server}: `nanoserve serve` is not running there "
                "(--server or NANOSERVE_SERVER names the address)"
            )
        return (
            f"the server at {server} went away or cannot be reached: is `nanoserve serve` running there "
            "(--server or NANOSERVE_SERVER names the address; --tls for a TLS server)?"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if token_given:
            return "the server does not accept the token given (--token or NANOSERVE_AUTH_TOKEN)"
        return "the server requires a token: pass --token TOKEN or set NANOSERVE_AUTH_TOKEN"
    return None


def unready_hint(channel: grpc.Channel, server: str) -> str | None:
    """Why ``server`` is not SERVING now, as ``status_hint`` says it (one health check), or its status."""
    try:
        status = health_status(channel, timeout_s=2.0)
    except grpc.RpcError as exc:
        return status_hint(exc.code(), exc.details() or "", server)
    return f"the server at {server} answers {status}"


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def health_status(channel: grpc.Channel, service: str = "", timeout_s: float = 5.0) -> str:
    """The health status name of ``service`` ("" = the whole server): SERVING, NOT_SERVING, ...

    Raises grpc.RpcError when the server cannot be reached or does not know the service.
    """
    stub = health_pb2_grpc.HealthStub(channel)
    response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)  # grpc_health is untyped
    return name


def wait_ready(channel: grpc.Channel, timeout_s: float, service: str = "") -> bool:
    """Polls health until ``service`` is SERVING or ``timeout_s`` seconds pass; True when ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining_s = deadline - time.monotonic()
        try:
            if health_status(channel, service, timeout_s=max(0.1, min(remaining_s, 2.0))) == "SERVING":
                return True
        except grpc.RpcError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
