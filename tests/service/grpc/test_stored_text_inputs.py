"""A request id or cache salt the log could not store is INVALID_ARGUMENT on both contracts, on both
stores, and the server stays SERVING: no batch the store would refuse is ever queued."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from ..conftest import Served, engine_config, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

NUL_ID_DETAILS = "request_id: must hold no control characters or surrogates: control character U+0000 at index 3"


@pytest_asyncio.fixture(
    scope="module", loop_scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def store_served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> AsyncIterator[Served]:
    if request.param == "sqlite":
        log_url = f"sqlite:///{Path(tmp_path_factory.mktemp('nul-log')) / 'events.db'}"
    else:
        log_url = request.getfixturevalue("pg_url")
    config = engine_config(log_url, model=str(tiny_model_dir), num_kv_blocks=128, block_size=4, max_num_seqs=4)
    async with serving(config, log_url, grace_s=1.0, metrics_port=0) as served:
        yield served


async def _serving(served: Served) -> bool:
    health = health_pb2_grpc.HealthStub(served.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def _ours(served: Served, request_id: str, cache_salt: str = "") -> int:
    stub = generation_pb2_grpc.GenerationServiceStub(served.channel)
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParameters(temperature=0.0, max_tokens=2, ignore_eos=True),
        cache_salt=cache_salt,
    )
    return sum([len(r.token_ids) async for r in stub.Generate(request)])


async def _vllm(served: Served, request_id: str) -> int:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
    request = vpb.GenerateRequest(
        request_id=request_id,
        tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        stream=False,
    )
    responses = [r async for r in stub.Generate(request)]
    return len(responses[-1].complete.output_ids)


async def test_a_nul_request_id_is_invalid_argument_on_our_contract(store_served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _ours(store_served, "bad\x00id")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == NUL_ID_DETAILS
    assert await _serving(store_served)
    assert await _ours(store_served, "good-after-nul") == 2


async def test_a_nul_request_id_is_invalid_argument_on_the_vllm_contract(store_served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _vllm(store_served, "bad\x00id")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == NUL_ID_DETAILS
    assert await _serving(store_served)
    assert await _vllm(store_served, "vllm-good-after-nul") == 2


async def test_a_salt_with_a_control_character_is_invalid_argument(store_served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _ours(store_served, "salted", cache_salt="tenant\x1b")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "cache_salt: must hold no control characters or surrogates: control character U+001B at index 6"
    )
    assert await _serving(store_served)
