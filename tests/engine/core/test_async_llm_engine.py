"""AsyncLLMEngine: streams, early exits, aborts and shutdown, on the tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nanoserve.engine import AbortCause, AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams, TokensPrompt
from nanoserve.engine.errors import DuplicateRequestError, EngineDeadError, InvalidRequestError, RequestNotFoundError

PROMPT = TokensPrompt([101, 202, 303, 404, 505])
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _config(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=4
    )


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(_config(tiny_model_dir))
    await engine.start()
    yield engine
    await engine.shutdown(grace_s=0.0)


async def _wait_all_free(engine: AsyncLLMEngine) -> None:
    for _ in range(200):
        status = engine.pool_status()
        if status.num_free == status.num_blocks and status.num_running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks not freed: {engine.pool_status()}")


async def test_stream_deltas_concatenate_to_the_final_output(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = [o async for o in engine.generate(PROMPT, params, "a")]
    final = outputs[-1]
    assert final.finished
    assert final.finish_reason == "length"
    assert len(final.token_ids) == 10
    assert not any(o.finished for o in outputs[:-1])
    assert [t for o in outputs for t in o.delta_token_ids] == final.token_ids
    assert "".join(o.delta_text for o in outputs) == final.text


async def test_stream_matches_llm_engine_greedy(engine: AsyncLLMEngine, tiny_model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    streamed = [o async for o in engine.generate(PROMPT, params, "a")][-1].token_ids
    sync = LLMEngine(engine.config)
    sync.add_request("a", PROMPT, params)
    final = None
    while sync.has_unfinished_requests():
        final = next((o for o in sync.step() if o.finished), final)
    assert final is not None
    assert streamed == final.token_ids


async def test_consumer_leaving_early_aborts_and_frees_blocks(engine: AsyncLLMEngine) -> None:
    stream = engine.generate(PROMPT, LONG, "a")
    async for _ in stream:
        break
    await stream.aclose()
    await _wait_all_free(engine)
    # the id is free again
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    assert [o async for o in engine.generate(PROMPT, params, "a")][-1].finished


async def test_cancelled_consumer_aborts_and_frees_blocks(engine: AsyncLLMEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(PROMPT, LONG, "a"):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_all_free(engine)


async def test_abort_ends_the_stream_with_finish_reason_abort(engine: AsyncLLMEngine) -> None:
    outputs = []
    async for output in engine.generate(PROMPT, LONG, "a"):
        outputs.append(output)
        if len(outputs) == 2:
            await engine.abort("a")
    assert outputs[-1].finish_reason == "abort"
    assert outputs[-1].finished
    assert len(outputs[-1].token_ids) < 400
    await _wait_all_free(engine)


async def test_abort_of_unknown_request_raises(engine: AsyncLLMEngine) -> None:
    with pytest.raises(RequestNotFoundError):
        await engine.abort("nobody")


async def test_invalid_request_raises_before_the_first_item(engine: AsyncLLMEngine) -> None:
    with pytest.raises(InvalidRequestError) as info:
        async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=10**6), "a"):
            pytest.fail("no item expected")
    assert info.value.field == "max_tokens"


async def test_duplicate_live_id_raises(engine: AsyncLLMEngine) -> None:
    first = engine.generate(PROMPT, LONG, "a")
    await first.__anext__()
    with pytest.raises(DuplicateRequestError):
        await engine.generate(PROMPT, LONG, "a").__anext__()
    await first.aclose()


async def test_concurrent_streams_each_get_their_own_tokens(engine: AsyncLLMEngine) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 6)]

    async def run(i: int) -> list[int]:
        return [o async for o in engine.generate(TokensPrompt([7 + i, 8, 9]), params[i], f"r{i}")][-1].token_ids

    results = await asyncio.gather(*(run(i) for i in range(3)))
    assert [len(r) for r in results] == [3, 9, 6]


async def test_shutdown_aborts_what_outlives_the_grace_period(engine: AsyncLLMEngine) -> None:
    outputs = []

    async def consume() -> None:
        async for output in engine.generate(
            PROMPT, SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True), "a"
        ):
            outputs.append(output)

    task = asyncio.create_task(consume())
    while not outputs:
        await asyncio.sleep(0.01)
    await engine.shutdown(grace_s=0.05)
    await task
    assert outputs[-1].finish_reason == "abort"
    assert not engine.is_running
    assert not engine.errored
    assert engine.pool_status().num_free == engine.pool_status().num_blocks
    with pytest.raises(EngineDeadError):
        await engine.generate(PROMPT, LONG, "b").__anext__()


async def test_shutdown_lets_short_requests_finish(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    stream = engine.generate(PROMPT, params, "a")
    first = await stream.__anext__()
    shutdown = asyncio.create_task(engine.shutdown(grace_s=30.0))
    rest = [o async for o in stream]
    await shutdown
    assert (rest or [first])[-1].finish_reason == "length"


async def test_failed_engine_loop_fails_streams_and_refuses_new_requests(tiny_model_dir: Path) -> None:
    def broken_step() -> list:
        raise RuntimeError("device lost")

    core = LLMEngine(_config(tiny_model_dir))
    core.step = broken_step  # type: ignore[method-assign]
    engine = AsyncLLMEngine(core.config, core)
    await engine.start()
    stream = engine.add_request("a", PROMPT, LONG)
    with pytest.raises(EngineDeadError) as info:
        async for _ in stream:
            pass
    assert "device lost" in str(info.value)
    final = await stream.finished  # the request still ends once, with its cause
    assert (final.finish_reason, final.abort_cause) == ("abort", AbortCause.ENGINE_ERROR)
    assert engine.errored
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        await engine.generate(PROMPT, LONG, "b").__anext__()
    await engine.shutdown(grace_s=0.0)
