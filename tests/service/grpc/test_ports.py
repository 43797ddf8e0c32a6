"""The server's ports are its own: no second server shares them (gRPC's SO_REUSEPORT is off)."""

from __future__ import annotations

import socket

import grpc
import pytest

from nanoserve.service.grpc.metrics import ServerMetrics
from nanoserve.service.grpc.ports import GRPC_OPTIONS, PortUnavailableError


async def test_a_grpc_server_with_the_servers_options_cannot_share_a_port() -> None:
    first = grpc.aio.server()  # gRPC's defaults: SO_REUSEPORT on, as every server before this fix
    port = first.add_insecure_port("127.0.0.1:0")
    shared = grpc.aio.server()
    try:
        assert shared.add_insecure_port(f"127.0.0.1:{port}") == port  # the kind of the bug: both would listen
        ours = grpc.aio.server(options=GRPC_OPTIONS)
        with pytest.raises(RuntimeError, match="Failed to bind"):
            ours.add_insecure_port(f"127.0.0.1:{port}")
    finally:
        await first.stop(0)
        await shared.stop(0)


def test_the_metrics_port_taken_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(PortUnavailableError) as caught:
            ServerMetrics().serve_http("127.0.0.1", port)
    assert str(caught.value).startswith(f"--metrics-port {port}: 127.0.0.1:{port} cannot be bound (")
    assert str(caught.value).endswith("stop it or choose another --metrics-port")


@pytest.mark.parametrize("port", [0, 51931])
def test_a_host_that_does_not_resolve_is_refused_before_the_model_loads(port: int) -> None:
    """`serve --host 999.1.1.1` loaded the model, opened an epoch, then ended in a traceback."""
    from nanoserve.service.grpc.ports import check_port_free

    with pytest.raises(PortUnavailableError) as caught:
        check_port_free("--port", "999.1.1.1", port)
    message = str(caught.value)
    assert message.startswith(f"--port {port}: 999.1.1.1:{port} cannot be bound (")
    assert message.endswith("); choose another --port or --host")
