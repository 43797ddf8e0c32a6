"""Tenants kept apart (issue 31): identities from the tokens file, requests scoped by tenant on both
contracts, operator RPCs for admins only, prefix-cache isolation per tenant.

A second gRPC server with a tokens file sits in front of the tiny model's engine: tenants ``acme``
and ``blue`` are clients, ``ops`` is an admin.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.service.config import ServerConfig
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ..conftest import Served

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKENS = """\
# token   tenant  role
token acme-key acme client
token blue-key blue client   # a second client
token ops-key  ops  admin
"""
ACME = (("authorization", "Bearer acme-key"),)
BLUE = (("authorization", "Bearer blue-key"),)
OPS = (("authorization", "Bearer ops-key"),)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def guarded(tiny_served: Served, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    yield await _start_guarded(tiny_served, tmp_path_factory.mktemp("tenants") / "tokens", share=False)


async def _start_guarded(tiny_served: Served, tokens_file: Path, share: bool) -> Any:
    from nanoserve.service.grpc.server import NanoServer

    tokens_file.write_text(TOKENS)
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=None,
        auth_tokens_file=str(tokens_file),
        share_prefix_cache_across_tenants=share,
    )
    server = NanoServer(tiny_served.engine, config, owns_engine=False)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return Served(server, channel, tiny_served.log_url)


@pytest_asyncio.fixture(scope="module", loop_scope="module", autouse=True)
async def _stop_guarded(guarded: Served) -> AsyncIterator[None]:
    yield
    await guarded.channel.close()
    await guarded.server.stop(0)  # type: ignore[attr-defined]


def _ours(served: Served) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(served.channel)


def _vllm(served: Served) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


def _request(request_id: str, prompt: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _generate(served: Served, request: pb.GenerateRequest, metadata: Any) -> list[pb.GenerateResponse]:
    return [r async for r in _ours(served).Generate(request, metadata=metadata)]


def _text(responses: list[Any]) -> str:
    return "".join(r.text for r in responses)


async def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = await call if not hasattr(call, "__aiter__") else [r async for r in call]
        del result
    return info.value.code(), info.value.details() or ""


# ---- operator surfaces ----------------------------------------------------------------------


async def test_a_client_cannot_call_the_operator_rpcs(guarded: Served) -> None:
    pool = allocation_pb2_grpc.AllocationServiceStub(guarded.channel)
    vllm = _vllm(guarded)
    calls = {
        "WatchEvents": pool.WatchEvents(apb.WatchEventsRequest(from_seq=1), metadata=BLUE),
        "Audit": pool.Audit(apb.AuditRequest(), metadata=BLUE),
        "GetPoolStatus": pool.GetPoolStatus(apb.GetPoolStatusRequest(), metadata=BLUE),
        "ResetPrefixCache": pool.ResetPrefixCache(apb.ResetPrefixCacheRequest(), metadata=BLUE),
        "SubscribeKvEvents": vllm.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=BLUE),
        "FlushCache": vllm.FlushCache(cpb.FlushCacheRequest(), metadata=BLUE),
    }
    for name, call in calls.items():
        code, details = await _code(call)
        assert code == grpc.StatusCode.PERMISSION_DENIED, name
        assert details.endswith(f"/{name} needs role 'admin'; tenant 'blue' has role 'client'"), details
    status = await pool.GetPoolStatus(apb.GetPoolStatusRequest(), metadata=OPS)
    assert status.num_blocks == 512
    info = await _ours(guarded).GetModelInfo(pb.GetModelInfoRequest(), metadata=BLUE)
    assert info.block_size == 4


async def test_an_unknown_token_is_unauthenticated(guarded: Served) -> None:
    code, _ = await _code(_ours(guarded).GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "x"),)))
    assert code == grpc.StatusCode.UNAUTHENTICATED


# ---- requests belong to their tenant: nanoserve.v1 ------------------------------------------


async def test_another_tenant_cannot_resume_or_overwrite_a_finished_request(guarded: Served) -> None:
    acme = await _generate(guarded, _request("order-1001", "My bank PIN is", 12), ACME)
    assert {r.request_id for r in acme} == {"order-1001"}
    code, details = await _code(_ours(guarded).Resume(pb.ResumeRequest(request_id="order-1001"), metadata=BLUE))
    assert code == grpc.StatusCode.NOT_FOUND, details
    blue = await _generate(guarded, _request("order-1001", "Once upon a time", 5), BLUE)
    assert blue[-1].finish.usage.completion_tokens == 5
    resumed = [r async for r in _ours(guarded).Resume(pb.ResumeRequest(request_id="order-1001"), metadata=ACME)]
    assert _text(resumed) == _text(acme)
    assert resumed[-1].finish.usage.completion_tokens == 12
    assert {r.request_id for r in resumed} == {"order-1001"}


async def test_another_tenant_cannot_abort_a_running_request(guarded: Served) -> None:
    call = _ours(guarded).Generate(_request("long-1", "Once upon a time", 300), metadata=ACME)
    first = await call.read()
    assert first.request_id == "long-1"
    code, _ = await _code(_ours(guarded).Abort(pb.AbortRequest(request_id="long-1"), metadata=BLUE))
    assert code == grpc.StatusCode.NOT_FOUND
    # the same id is free for blue while acme's runs: no ALREADY_EXISTS
    blue = await _generate(guarded, _request("long-1", "Hello", 3), BLUE)
    assert blue[-1].finish.reason == pb.FINISH_REASON_LENGTH
    rest = []
    while (response := await call.read()) is not grpc.aio.EOF:
        rest.append(response)
    assert rest[-1].finish.reason == pb.FINISH_REASON_LENGTH
    assert rest[-1].finish.usage.completion_tokens == 300


async def test_pool_status_and_metrics_count_each_tenants_requests_and_blocks(guarded: Served) -> None:
    metrics = guarded.server.metrics  # type: ignore[attr-defined]

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, labels) or 0.0

    calls = [
        _ours(guarded).Generate(_request(f"usage-{i}", "Once upon a time", 900), metadata=metadata)
        for i, metadata in enumerate((ACME, ACME, BLUE))
    ]
    try:
        for call in calls:
            await call.read()  # each is running
        pool = allocation_pb2_grpc.AllocationServiceStub(guarded.channel)
        status = await pool.GetPoolStatus(apb.GetPoolStatusRequest(), metadata=OPS)
        assert [(t.tenant, t.num_running, t.num_waiting) for t in status.tenants] == [("acme", 2, 0), ("blue", 1, 0)]
        assert all(1 <= t.num_blocks_held <= 2 * 1024 // 16 for t in status.tenants), status.tenants
        metrics.observe_tenants(guarded.server.engine.pool_status().scopes)  # type: ignore[attr-defined]
        assert sample("nanoserve_tenant_requests_running", tenant="acme") == 2
        assert sample("nanoserve_tenant_requests_running", tenant="blue") == 1
        assert sample("nanoserve_tenant_kv_blocks_held", tenant="acme") >= 2
    finally:
        for call in calls:
            call.cancel()
    engine = guarded.server.engine  # type: ignore[attr-defined]
    for _ in range(500):
        if engine.pool_status().num_running == 0:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # the cancelled requests' final outputs are counted
    tokens_before = sample("nanoserve_tenant_generation_tokens_total", tenant="blue")
    finished_before = sample("nanoserve_tenant_requests_total", tenant="blue", finish_reason="length")
    acme_tokens = sample("nanoserve_tenant_generation_tokens_total", tenant="acme")
    await _generate(guarded, _request("usage-short", "Hello", 3), BLUE)
    assert sample("nanoserve_tenant_generation_tokens_total", tenant="blue") == tokens_before + 3
    assert sample("nanoserve_tenant_requests_total", tenant="blue", finish_reason="length") == finished_before + 1
    assert sample("nanoserve_tenant_generation_tokens_total", tenant="acme") == acme_tokens  # not another's
    guarded.server.metrics.observe_tenants(guarded.server.engine.pool_status().scopes)  # type: ignore[attr-defined]
    assert sample("nanoserve_tenant_requests_running", tenant="acme") == 0  # a tenant gone quiet reads 0


async def test_a_server_assigned_id_is_random_hex(guarded: Served) -> None:
    responses = await _generate(guarded, _request("", "Hi", 2), ACME)
    request_id = responses[0].request_id
    assert len(request_id) == 32
    assert int(request_id, 16) >= 0


# ---- requests belong to their tenant: vLLM's contract ---------------------------------------


def _vllm_request(request_id: str, prompt_ids: list[int], max_tokens: int) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=request_id,
        tokenized=vpb.TokenizedInput(input_ids=prompt_ids),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )


async def test_vllm_another_tenant_cannot_abort_or_take_a_running_id(guarded: Served) -> None:
    call = _vllm(guarded).Generate(_vllm_request("gw-7", [1, 2, 3, 4], 300), metadata=ACME)
    assert (await call.read()).HasField("chunk")
    await _vllm(guarded).Abort(vpb.AbortRequest(request_ids=["gw-7"]), metadata=BLUE)  # skipped: not blue's
    blue = [r async for r in _vllm(guarded).Generate(_vllm_request("gw-7", [5, 6, 7], 3), metadata=BLUE)]
    assert blue[-1].complete.completion_tokens == 3
    rest = []
    while (response := await call.read()) is not grpc.aio.EOF:
        rest.append(response)
    assert rest[-1].complete.finish_reason == "length"
    assert rest[-1].complete.completion_tokens == 300


# ---- prefix cache isolation -----------------------------------------------------------------

PROMPT_IDS = list(range(40, 80))  # 10 full blocks of 4


async def _vllm_cached(served: Served, prompt_ids: list[int], metadata: Any) -> int:
    responses = [r async for r in _vllm(served).Generate(_vllm_request("", prompt_ids, 1), metadata=metadata)]
    return responses[-1].complete.cached_tokens


async def _ours_cached(served: Served, prompt: str, metadata: Any) -> int:
    responses = await _generate(served, _request("", prompt, 1), metadata)
    return responses[-1].finish.usage.cached_tokens


async def test_tenants_share_no_prefix_cache_by_default(guarded: Served) -> None:
    prompt = "The quarterly numbers for the secret project are as follows: " * 3
    assert await _ours_cached(guarded, prompt, ACME) == 0
    assert await _ours_cached(guarded, prompt, BLUE) == 0
    assert await _ours_cached(guarded, prompt, ACME) > 0  # acme's own blocks are there
    assert await _vllm_cached(guarded, PROMPT_IDS, ACME) == 0
    assert await _vllm_cached(guarded, PROMPT_IDS, BLUE) == 0
    assert await _vllm_cached(guarded, PROMPT_IDS, ACME) == 36  # all but the last, partial-or-final block


async def test_sharing_flag_lets_tenants_hit_each_others_blocks(
    tiny_served: Served, tmp_path_factory: pytest.TempPathFactory
) -> None:
    shared = await _start_guarded(tiny_served, tmp_path_factory.mktemp("shared") / "tokens", share=True)
    try:
        ids = list(range(100, 140))
        assert await _vllm_cached(shared, ids, ACME) == 0
        assert await _vllm_cached(shared, ids, BLUE) == 36
    finally:
        await shared.channel.close()
        await shared.server.stop(0)  # type: ignore[attr-defined]


# ---- reload -----------------------------------------------------------------------------------


async def test_reload_adds_a_token_and_a_bad_file_keeps_the_old_table(guarded: Served) -> None:
    tokens_file = Path(guarded.server.config.auth_tokens_file)  # type: ignore[attr-defined]
    green = (("authorization", "Bearer green-key"),)
    code, _ = await _code(_ours(guarded).GetModelInfo(pb.GetModelInfoRequest(), metadata=green))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    tokens_file.write_text(TOKENS + "token green-key green client\n")
    assert guarded.server.reload_tenants() is True  # type: ignore[attr-defined]
    assert (await _ours(guarded).GetModelInfo(pb.GetModelInfoRequest(), metadata=green)).block_size == 4
    tokens_file.write_text("token green-key green\n")
    assert guarded.server.reload_tenants() is False  # type: ignore[attr-defined]
    assert (await _ours(guarded).GetModelInfo(pb.GetModelInfoRequest(), metadata=green)).block_size == 4
