"""Domain errors map to status codes in one interceptor; the token check leaves health open.

A real grpc.aio server on 127.0.0.1 with a servicer that raises the error the
request names, so the mapping is checked end to end through the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from nanoserve.allocator.log import LogDamagedError, LogUnavailableError
from nanoserve.engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EventLogNotDurableError,
    InvalidRequestError,
    QueueFullError,
    RequestNotFoundError,
)
from nanoserve.service.grpc.errors import EventLogDisabledError
from nanoserve.service.grpc.interceptors import AuthInterceptor, ErrorInterceptor
from nanoserve.service.tenants import TenantTable
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

# request_id -> the error the test servicer raises
ERRORS = {
    "invalid": InvalidRequestError("sampling.top_p", "must be in (0, 1], got 2.0"),
    "duplicate": DuplicateRequestError("request id 'r1' is already live"),
    "full": QueueFullError("waiting queue holds 4 requests (max_num_waiting=4)"),
    "dead": EngineDeadError("engine loop stopped"),
    "missing": RequestNotFoundError("no live request 'r9'"),
    "nolog": EventLogDisabledError("the server keeps no event log"),
    "notdurable": EventLogNotDurableError("event log not durable: commits have failed for 2.0 s"),
    "storedown": LogUnavailableError("event log store postgresql+psycopg://u@db/x is unavailable: OperationalError"),
    "damaged": LogDamagedError("seq 42: the record is not valid UTF-8 text"),
    "bug": ZeroDivisionError("division by zero"),
}


class RaisingServicer(generation_pb2_grpc.GenerationServiceServicer):
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(request_id=request.request_id, text="first")
        raise ERRORS[request.request_id]

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if request.request_id in ERRORS:
            raise ERRORS[request.request_id]
        return pb.AbortResponse()


async def _start(
    interceptors: list[grpc.aio.ServerInterceptor], options: tuple[tuple[str, int], ...] = ()
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=interceptors, options=options)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(RaisingServicer(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port


@pytest.fixture
async def stub() -> AsyncIterator[generation_pb2_grpc.GenerationServiceStub]:
    server, port = await _start([ErrorInterceptor()])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)
    await server.stop(0)


@pytest.mark.parametrize(
    ("request_id", "code", "details"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1], got 2.0"),
        ("duplicate", grpc.StatusCode.ALREADY_EXISTS, "request id 'r1' is already live"),
        ("full", grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue holds 4 requests (max_num_waiting=4)"),
        ("dead", grpc.StatusCode.UNAVAILABLE, "engine loop stopped"),
        ("missing", grpc.StatusCode.NOT_FOUND, "no live request 'r9'"),
        ("nolog", grpc.StatusCode.FAILED_PRECONDITION, "the server keeps no event log"),
        ("notdurable", grpc.StatusCode.UNAVAILABLE, "event log not durable: commits have failed for 2.0 s"),
        (
            "storedown",
            grpc.StatusCode.UNAVAILABLE,
            "event log store postgresql+psycopg://u@db/x is unavailable: OperationalError",
        ),
        ("damaged", grpc.StatusCode.DATA_LOSS, "seq 42: the record is not valid UTF-8 text"),
        ("bug", grpc.StatusCode.INTERNAL, "internal error (ZeroDivisionError); see the server log"),
    ],
)
async def test_unary_error_maps_to_status(
    stub: generation_pb2_grpc.GenerationServiceStub, request_id: str, code: grpc.StatusCode, details: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Abort(pb.AbortRequest(request_id=request_id))
    assert (info.value.code(), info.value.details()) == (code, details)


async def test_stream_error_after_first_message_maps_to_status(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in stub.Generate(pb.GenerateRequest(request_id="full", prompt="x")):
            received.append(response.text)
    assert received == ["first"]
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _retry_infos(error: grpc.aio.AioRpcError) -> list[error_details_pb2.RetryInfo]:
    """The google.rpc.RetryInfo details of the status in the error's trailers."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    infos = []
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            infos.append(info)
    return infos


async def test_queue_full_carries_retry_info(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Abort(pb.AbortRequest(request_id="full"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _retry_infos(info.value) == [error_details_pb2.RetryInfo(retry_delay=Duration(seconds=1))]


async def test_queue_full_mid_stream_carries_retry_info(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(pb.GenerateRequest(request_id="full", prompt="x")):
            pass
    assert _retry_infos(info.value) == [error_details_pb2.RetryInfo(retry_delay=Duration(seconds=1))]


@pytest.mark.parametrize("request_id", ["invalid", "duplicate", "dead", "missing", "nolog", "bug"])
async def test_other_errors_carry_no_status_details(
    stub: generation_pb2_grpc.GenerationServiceStub, request_id: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Abort(pb.AbortRequest(request_id=request_id))
    assert rpc_status.from_call(info.value) is None  # type: ignore[arg-type]


def _cli_error_line(port: int, request_id: str) -> str:
    """``nanoserve generate``'s error line for the status a blocking call to Abort gets."""
    from nanoserve.service.cli.commands.generate import error_line

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            generation_pb2_grpc.GenerationServiceStub(channel).Abort(pb.AbortRequest(request_id=request_id))
        except grpc.RpcError as exc:
            return error_line(exc)
    raise AssertionError("Abort succeeded")


async def test_cli_error_line_gives_the_retry_delay_of_a_full_queue() -> None:
    server, port = await _start([ErrorInterceptor()])
    try:
        full = await asyncio.to_thread(_cli_error_line, port, "full")
        missing = await asyncio.to_thread(_cli_error_line, port, "missing")
    finally:
        await server.stop(0)
    assert full == "error: RESOURCE_EXHAUSTED: waiting queue holds 4 requests (max_num_waiting=4) (retry after 1 s)"
    assert missing == "error: NOT_FOUND: no live request 'r9'"


async def test_over_size_message_is_resource_exhausted_without_retry_info() -> None:
    """gRPC's own RESOURCE_EXHAUSTED (a message over the receive limit): retrying cannot help, and
    the missing RetryInfo is how a client tells it from a full queue."""
    server, port = await _start([ErrorInterceptor()], options=(("grpc.max_receive_message_length", 1024),))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Abort(pb.AbortRequest(request_id="x" * 2000))
    finally:
        await server.stop(0)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _retry_infos(info.value) == []


async def test_token_check() -> None:
    server, port = await _start([AuthInterceptor(TenantTable.single_token("s3cret")), ErrorInterceptor()])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.Abort(pb.AbortRequest(request_id="ok"))
            assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await stub.Abort(pb.AbortRequest(request_id="ok"), metadata=(("authorization", "Bearer nope"),))
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as stream:
                async for _ in stub.Generate(pb.GenerateRequest(request_id="full", prompt="x")):
                    pass
            assert stream.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (
                await stub.Abort(pb.AbortRequest(request_id="ok"), metadata=(("authorization", "Bearer s3cret"),))
                == pb.AbortResponse()
            )
            health_stub = health_pb2_grpc.HealthStub(channel)
            response = await health_stub.Check(health_pb2.HealthCheckRequest(service=""))
            assert response.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
