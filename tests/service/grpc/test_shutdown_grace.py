"""During the shutdown grace the server still listens (issue 29, item 7e).

A client that connects while a stream in flight is given its grace meets an open
port: health answers NOT_SERVING and a new Generate gets UNAVAILABLE saying the
server is shutting down, not a refused connection. Once the grace is over the
listener closes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from ..conftest import engine_config

pytestmark = pytest.mark.asyncio

GRACE_S = 3.0
MAX_MODEL_LEN = 32_768
MAX_TOKENS = MAX_MODEL_LEN - 3


def _long(request_id: str) -> pb.GenerateRequest:
    # far more tokens than the tiny model makes in the grace on any machine (a fast one made
    # 1,000 in 2.9 s): the stream outlives the grace and is aborted
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=pb.TokenIds(ids=[101, 202, 303]),
        sampling=pb.SamplingParameters(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )


async def test_a_client_connecting_during_the_grace_gets_not_serving_and_unavailable(
    tmp_path: Path, make_tiny_model_dir
) -> None:
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer, start_engine

    model_dir = make_tiny_model_dir(max_position_embeddings=MAX_MODEL_LEN)
    config = engine_config(
        f"sqlite:///{tmp_path / 'events.db'}",
        model=str(model_dir),
        block_size=16,
        num_kv_blocks=MAX_MODEL_LEN // 16,
        max_model_len=MAX_MODEL_LEN,
    )
    engine = await start_engine(config)
    server = NanoServer(engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=None, grace_s=GRACE_S))
    await server.start()
    address = f"127.0.0.1:{server.port}"
    async with grpc.aio.insecure_channel(address) as channel:
        in_flight = generation_pb2_grpc.GenerationServiceStub(channel).Generate(_long("in-flight"))
        await in_flight.read()  # running
        stopping = asyncio.ensure_future(server.stop())
        await asyncio.sleep(0.3)
        assert not stopping.done()
        async with grpc.aio.insecure_channel(address) as late:  # a new connection, during the grace
            health = await health_pb2_grpc.HealthStub(late).Check(health_pb2.HealthCheckRequest(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generation_pb2_grpc.GenerationServiceStub(late).Generate(_long("late"), timeout=5).read()
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.UNAVAILABLE,
            "the server is shutting down: new calls are refused; retry on another server",
        )
        last = await in_flight.read()
        while last.finish.reason == pb.FINISH_REASON_UNSPECIFIED:
            last = await in_flight.read()
        assert last.finish.reason == pb.FINISH_REASON_ABORT  # the grace ran out
        await stopping
    async with grpc.aio.insecure_channel(address) as after:
        with pytest.raises(grpc.aio.AioRpcError) as closed:
            await health_pb2_grpc.HealthStub(after).Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert closed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert closed.value.details() != info.value.details()  # the port is closed now
