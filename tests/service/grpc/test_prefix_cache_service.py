"""Prefix caching over gRPC: cached_tokens in usage, cache_salt, pool status, ResetPrefixCache, WatchEvents."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ..conftest import Served, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [1000 + i for i in range(21)]  # 5 full blocks of 4 and one token


def _request(salt: str = "", max_tokens: int = 4, tokens: list[int] = PROMPT) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=tokens),
        sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0),
        cache_salt=salt,
    )


async def _finish(served: Served, request: pb.GenerateRequest) -> pb.Finish:
    stub = generation_pb2_grpc.GenerationServiceStub(served.channel)
    responses = [response async for response in stub.Generate(request)]
    return responses[-1].finish


async def test_the_second_identical_prompt_reports_its_cached_tokens(tiny_served: Served) -> None:
    first = await _finish(tiny_served, _request("usage"))
    second = await _finish(tiny_served, _request("usage"))
    other_salt = await _finish(tiny_served, _request("usage-other"))
    assert (first.usage.cached_tokens, second.usage.cached_tokens, other_salt.usage.cached_tokens) == (0, 20, 0)
    assert second.usage.prompt_tokens == 21
    status = await wait_pool_free(tiny_served)
    assert status.enable_prefix_caching
    assert status.prefix_cache_hits >= 20
    assert status.prefix_cache_queries >= 63
    assert status.num_cached == status.num_cached_free > 0
    assert status.num_shared == 0


async def test_a_salt_longer_than_256_characters_is_invalid_argument(tiny_served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _finish(tiny_served, _request("x" * 257))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "cache_salt: at most 256 characters, got 257"  # the salt is not echoed


async def test_reset_is_refused_while_blocks_are_held_then_empties_the_cache(tiny_served: Served) -> None:
    allocation = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    stub = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
    await _finish(tiny_served, _request("reset"))
    running = stub.Generate(_request("reset-busy", max_tokens=400, tokens=[7] * 9))
    await running.read()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await allocation.ResetPrefixCache(apb.ResetPrefixCacheRequest())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "blocks are held by 1 running requests" in info.value.details()
    running.cancel()
    status = await wait_pool_free(tiny_served)
    assert status.num_cached_free > 0
    reply = await allocation.ResetPrefixCache(apb.ResetPrefixCacheRequest())
    assert reply.num_blocks_reset == status.num_cached_free
    after = await wait_pool_free(tiny_served)
    assert (after.num_cached, after.num_cached_free) == (0, 0)
    assert (await _finish(tiny_served, _request("reset"))).usage.cached_tokens == 0


async def test_watch_events_carries_shares_with_their_keys_and_counts(tiny_served: Served) -> None:
    await _finish(tiny_served, _request("watch"))
    await _finish(tiny_served, _request("watch"))
    status = await wait_pool_free(tiny_served)
    allocation = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    events: list[apb.AllocationEvent] = []
    call = allocation.WatchEvents(apb.WatchEventsRequest(from_seq=1))
    async for response in call:
        events.append(response.event)
        if response.event.seq >= status.durable_seq:
            break
    call.cancel()
    await asyncio.sleep(0)
    shares = [event for event in events if event.kind == apb.EVENT_KIND_SHARE]
    registers = [event for event in events if event.kind == apb.EVENT_KIND_REGISTER]
    assert shares
    assert registers
    share = shares[-1]
    assert len(share.keys) == len(share.block_ids) == len(share.ref_counts) == 5
    assert all(len(key) == 64 for key in share.keys)
    assert list(share.ref_counts) == [1] * 5
    first_register = next(event for event in registers if share.keys[0] in event.keys)
    assert first_register.parent_keys[list(first_register.keys).index(share.keys[0])] == ""
    assert {apb.EVENT_KIND_RELEASE} <= {event.kind for event in events}
