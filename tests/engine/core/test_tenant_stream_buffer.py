"""The tenant bound on unread stream bytes (issue 31): all the streams of one request-id scope
(``tenant/id``) hold at most ``max_tenant_stream_buffer_bytes`` unread; past it the tenant's stream
holding the most is cut off, whichever stream's output tipped it over, and other tenants are untouched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nanoserve.engine import AbortCause, AsyncLLMEngine, EngineConfig, SamplingParams, TokensPrompt
from nanoserve.engine.config import StreamConfig
from nanoserve.engine.core.outputs import CompletionOutput, RequestOutput
from nanoserve.engine.core.request_stream import RequestStream, StreamRegistry, output_size_bytes
from nanoserve.engine.errors import StreamBufferFullError

TEXT = "x" * 100


def _delta(request_id: str, start: int) -> RequestOutput:
    completion = CompletionOutput(0, TEXT, [start])
    return RequestOutput(
        request_id, [1], [completion], False, TEXT, [start], is_delta=True, delta_start=start, serial=start
    )


SIZE = output_size_bytes(_delta("acme/a", 0))  # every output here is this size


def _streams(tenant_bound: int, *request_ids: str) -> tuple[StreamRegistry, list[RequestStream]]:
    limits = StreamConfig(max_tenant_stream_buffer_bytes=tenant_bound)
    registry = StreamRegistry()
    streams = [RequestStream(request_id, 0.0, limits) for request_id in request_ids]
    for stream in streams:
        registry.add(stream)
    return registry, streams


async def _error(stream: RequestStream) -> str:
    with pytest.raises(StreamBufferFullError) as error:
        [output async for output in stream]
    return str(error.value)


async def test_the_tenants_laggard_is_cut_off_not_the_stream_that_tipped_it_over() -> None:
    registry, (a, b, blue) = _streams(5 * SIZE, "acme/a", "acme/b", "blue/a")
    for start in range(4):
        a._deliver(_delta("acme/a", start))  # nobody reads a
    for start in range(5):
        blue._deliver(_delta("blue/a", start))  # another tenant's bytes count for it alone: at its bound
    assert registry.scope_buffers.num_queued_bytes("acme") == 4 * SIZE
    b._deliver(_delta("acme/b", 0))  # 5 outputs: at the bound
    assert (a.overflowed, b.overflowed) == (False, False)
    b._deliver(_delta("acme/b", 1))  # 6: past it; a holds the most
    assert (a.overflowed, b.overflowed, blue.overflowed) == (True, False, False)
    assert a.abort_cause is AbortCause.SLOW_CONSUMER
    assert (b.num_queued, blue.num_queued) == (2, 5)
    assert registry.scope_buffers.num_queued_bytes("acme") == 2 * SIZE
    assert registry.scope_buffers.num_queued_bytes("blue") == 5 * SIZE
    assert await _error(a) == (
        f"request 'acme/a': the client read its stream too slowly: {4 * SIZE} bytes (the most of any stream "
        f"of tenant 'acme', whose streams held more than --max-tenant-stream-buffer-bytes={5 * SIZE} bytes "
        "in all) waited unread; the request was aborted"
    )


async def test_what_a_reader_takes_or_leaves_behind_is_released_from_its_tenant() -> None:
    registry, (a, b) = _streams(6 * SIZE, "acme/a", "acme/b")
    for start in range(3):
        a._deliver(_delta("acme/a", start))
        b._deliver(_delta("acme/b", start))
    reader = aiter(a)
    merged = await anext(reader)  # the three outputs waiting, as one
    assert merged.delta_token_ids == [0, 1, 2]
    assert registry.scope_buffers.num_queued_bytes("acme") == 3 * SIZE
    await reader.aclose()  # a's reader leaves: nothing more is queued for it
    a._deliver(_delta("acme/a", 3))
    assert registry.scope_buffers.num_queued_bytes("acme") == 3 * SIZE
    reader = aiter(b)
    await anext(reader)
    await reader.aclose()
    assert registry.scope_buffers.num_queued_bytes("acme") == 0
    for stream in (a, b):
        stream.finished.set_result(merged)  # both end: the tenant's account goes
    await asyncio.sleep(0)  # (done callbacks run on the loop's next turn)
    assert len(registry.scope_buffers) == 0


async def test_an_engine_cuts_off_a_tenants_unread_stream_at_the_tenant_bound(tiny_model_dir: Path) -> None:
    config = EngineConfig.from_kwargs(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=256,
        block_size=4,
        max_tenant_stream_buffer_bytes=20_000,
    )
    engine = AsyncLLMEngine(config)
    await engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, logprobs=5)
        stream = engine.add_request("acme/unread", TokensPrompt([101, 202, 303]), params)
        final = await stream.finished
        message = await _error(stream)
    finally:
        await engine.shutdown(grace_s=0.0)
    assert (final.finish_reason, final.abort_cause) == ("abort", AbortCause.SLOW_CONSUMER)
    assert len(final.token_ids) < 400
    assert "--max-tenant-stream-buffer-bytes=20000 bytes" in message
    assert "tenant 'acme'" in message
