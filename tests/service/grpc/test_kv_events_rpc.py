"""VllmEngine/SubscribeKvEvents on a real server (tiny model, block size 4): the prefix cache's
stored / cleared events from the durable log, batch numbers epoch << 32 | 1, 2, 3, ... .

A module of its own, so its server's log starts with these tests' requests.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.allocator import extend_block_keys
from nanoserve.service.grpc.kv_events import batch_number, block_hash

from ..conftest import Served, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK_SIZE = 4  # tiny_served's
READ_TIMEOUT_S = 10.0


def _vllm(served: Served) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


async def _generate(served: Served, prompt: list[int]) -> None:
    request = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=2),
    )
    [r async for r in _vllm(served).Generate(request)]
    await wait_pool_free(served)


async def _read(call: Any, num_batches: int) -> list[cpb.KvEventBatch]:
    return [await asyncio.wait_for(call.read(), READ_TIMEOUT_S) for _ in range(num_batches)]


def _stored(blocks: list[tuple[str, tuple[int, ...]]], parent: str | None) -> cpb.KvBlocksStored:
    stored = cpb.KvBlocksStored(
        blocks=[
            cpb.KvBlock(block_hash=block_hash(key), token_ids=tokens, block_size=BLOCK_SIZE) for key, tokens in blocks
        ]
    )
    if parent is not None:
        stored.parent_block_hash = block_hash(parent)
    return stored


async def test_a_prompts_blocks_are_stored_chained_with_their_token_ids_and_a_flush_clears_them(
    tiny_served: Served,
) -> None:
    prompt = list(range(400, 412))  # 3 full blocks
    longer = [*prompt, 412, 413, 414, 415]  # the same 3, and a 4th after them
    keys = extend_block_keys([], longer, BLOCK_SIZE)
    call = _vllm(tiny_served).SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
    [opened] = await _read(call, 1)
    await _generate(tiny_served, prompt)
    [first] = await _read(call, 1)
    await _generate(tiny_served, longer)  # its head is a cache hit: only the 4th block is stored
    [second] = await _read(call, 1)
    flushed = await _vllm(tiny_served).FlushCache(cpb.FlushCacheRequest(timeout_s=5))
    assert flushed.success, flushed.message
    [cleared] = await _read(call, 1)
    call.cancel()

    # a fresh log: epoch 1
    assert [b.sequence_number for b in (opened, first, second, cleared)] == [(1 << 32) + n for n in (1, 2, 3, 4)]
    assert list(opened.events) == [cpb.KvCacheEvent(event_id=1, cleared=cpb.KvCacheCleared())]  # POOL_INIT
    [stored_first] = first.events
    assert stored_first.stored == _stored([(k.key, k.token_ids) for k in keys[:3]], parent=None)
    assert [list(b.token_ids) for b in stored_first.stored.blocks] == [prompt[0:4], prompt[4:8], prompt[8:12]]
    [stored_second] = second.events
    assert stored_second.stored == _stored([(keys[3].key, (412, 413, 414, 415))], parent=keys[2].key)
    assert stored_second.event_id > stored_first.event_id
    assert [event.WhichOneof("data") for event in cleared.events] == ["cleared"]
    assert first.dp_rank == 0
    assert first.timestamp > 0


async def test_a_subscription_from_a_batch_number_starts_with_that_batch(tiny_served: Served) -> None:
    await _generate(tiny_served, list(range(500, 508)))  # the epoch has at least two KV batches
    from_start = _vllm(tiny_served).SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=0))
    batches = await _read(from_start, 2)
    from_start.cancel()
    resumed = _vllm(tiny_served).SubscribeKvEvents(
        cpb.SubscribeKvEventsRequest(start_sequence_number=batch_number(1, 2))
    )
    [again] = await _read(resumed, 1)
    resumed.cancel()
    assert again == batches[1]
    assert again.sequence_number == batch_number(1, 2)
