"""One owner per request: the engine thread decides every admission and every ending.

Each request handed to AsyncLLMEngine ends with exactly one final output,
delivered to the stream that owns it (by serial, never by id alone) and
carrying its cause when it was aborted. On the tiny random model.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nanoserve.engine import AbortCause, AsyncLLMEngine, EngineConfig, RequestOutput, SamplingParams, TokensPrompt
from nanoserve.engine.errors import DuplicateRequestError, QueueFullError, RequestNotFoundError

PROMPT = TokensPrompt([101, 202, 303, 404, 505])
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
TEN = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[AsyncLLMEngine]:
    config = EngineConfig.from_kwargs(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=4,
        max_num_waiting=2,
    )
    engine = AsyncLLMEngine(config)
    await engine.start()
    yield engine
    await engine.shutdown(grace_s=0.0)


async def _all_free(engine: AsyncLLMEngine) -> None:
    for _ in range(500):
        status = engine.pool_status()
        if status.num_free == status.num_blocks and status.num_running == 0 and status.num_waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks not freed: {engine.pool_status()}")


async def _outputs(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in stream]


async def test_an_id_reused_right_after_a_cancel_gets_its_own_tokens(engine: AsyncLLMEngine) -> None:
    """Issue 8, fault 1: cancel after one message, re-send the same id at once, 50 times."""
    for _ in range(50):
        old = engine.add_request("X", PROMPT, LONG)
        await old.__aiter__().__anext__()
        old.abort(AbortCause.CANCELLED)
        new = engine.add_request("X", PROMPT, TEN)
        outputs = await _outputs(new)
        assert outputs[-1].finish_reason == "length"
        assert len(outputs[-1].token_ids) == 10
        assert outputs[-1].abort_cause is None
        assert sum(len(o.delta_token_ids) for o in outputs) == 10
        old_final = await old.finished
        assert (old_final.finish_reason, old_final.abort_cause) == ("abort", AbortCause.CANCELLED)
        assert old_final.serial != outputs[-1].serial
    await _all_free(engine)


async def test_every_ending_gives_one_final_output_with_its_cause(engine: AsyncLLMEngine) -> None:
    finished = engine.add_request("done", PROMPT, TEN)
    await _outputs(finished)
    rpc = engine.add_request("rpc", PROMPT, LONG)
    await rpc.__aiter__().__anext__()
    await engine.abort("rpc")
    cancelled = engine.add_request("cancelled", PROMPT, LONG)
    await cancelled.__aiter__().__anext__()
    cancelled.abort(AbortCause.CANCELLED)
    deadline = engine.add_request("deadline", PROMPT, LONG)
    await deadline.__aiter__().__anext__()
    deadline.abort(AbortCause.DEADLINE)
    deadline.abort(AbortCause.CANCELLED)  # only the first cause counts
    finals = [await s.finished for s in (finished, rpc, cancelled, deadline)]
    assert [(f.request_id, f.finish_reason, f.abort_cause) for f in finals] == [
        ("done", "length", None),
        ("rpc", "abort", AbortCause.ABORT_RPC),
        ("cancelled", "abort", AbortCause.CANCELLED),
        ("deadline", "abort", AbortCause.DEADLINE),
    ]
    await _all_free(engine)


async def test_the_abort_rpc_ends_only_the_live_request_of_that_id(engine: AsyncLLMEngine) -> None:
    first = engine.add_request("same", PROMPT, TEN)
    await _outputs(first)
    with pytest.raises(RequestNotFoundError, match="request_id: no live request 'same'"):
        await engine.abort("same")  # the finished one is not live
    second = engine.add_request("same", PROMPT, LONG)
    await second.__aiter__().__anext__()
    await engine.abort("same")
    final = await second.finished
    assert final.abort_cause is AbortCause.ABORT_RPC
    assert (await first.finished).abort_cause is None


async def test_a_request_aborted_while_tokenizing_never_reaches_the_engine(engine: AsyncLLMEngine) -> None:
    release = threading.Event()
    processor = engine._core.input_processor
    real_tokenize = processor.tokenize

    def slow_tokenize(*args, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(5)
        return real_tokenize(*args, **kwargs)

    processor.tokenize = slow_tokenize  # type: ignore[method-assign]
    try:
        stream = engine.add_request("early", "Once upon a time", TEN)
        stream.abort(AbortCause.DEADLINE)
        release.set()
        outputs = await _outputs(stream)  # the one final output, then the stream stops
        final = await stream.finished
    finally:
        processor.tokenize = real_tokenize  # type: ignore[method-assign]
    assert outputs == [final]
    assert (final.finish_reason, final.abort_cause, final.token_ids) == ("abort", AbortCause.DEADLINE, [])
    assert final.prompt_token_ids == engine.tokenizer.encode("Once upon a time")  # counted by the engine, once
    assert engine.pool_status().num_running == 0


async def test_tokenization_runs_off_the_event_loop(engine: AsyncLLMEngine) -> None:
    seen: list[str] = []
    processor = engine._core.input_processor
    real_tokenize = processor.tokenize

    def recording_tokenize(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(threading.current_thread().name)
        return real_tokenize(*args, **kwargs)

    processor.tokenize = recording_tokenize  # type: ignore[method-assign]
    try:
        await _outputs(engine.add_request("t", "Hello there", TEN))
        await engine.tokenize("Hello there")
    finally:
        processor.tokenize = real_tokenize  # type: ignore[method-assign]
    assert len(seen) == 2
    assert all(name.startswith("nanoserve-tokenize") for name in seen)


async def test_duplicate_live_id_is_refused_by_the_engine_and_the_first_stream_goes_on(
    engine: AsyncLLMEngine,
) -> None:
    first = engine.add_request("dup", PROMPT, TEN)
    second = engine.add_request("dup", PROMPT, TEN)
    with pytest.raises(DuplicateRequestError):
        await _outputs(second)
    with pytest.raises(DuplicateRequestError):
        await second.finished
    outputs = await _outputs(first)
    assert len(outputs[-1].token_ids) == 10


async def test_queue_full_is_decided_by_the_engine(engine: AsyncLLMEngine) -> None:
    running = []
    for i in range(4):  # one at a time: the queue limit counts requests not yet scheduled
        running.append(engine.add_request(f"run{i}", PROMPT, LONG))
        await running[-1].__aiter__().__anext__()
    waiting = [engine.add_request(f"wait{i}", PROMPT, LONG) for i in range(2)]
    refused = engine.add_request("one-too-many", PROMPT, LONG)
    with pytest.raises(
        QueueFullError, match=r"4 requests are running and 2 waiting \(max_num_seqs 4 \+ max_num_waiting 2\)"
    ):
        await _outputs(refused)
    for stream in running + waiting:
        stream.abort(AbortCause.CANCELLED)
    await _all_free(engine)


async def test_shutdown_ends_what_outlives_the_grace_with_cause_shutdown(tiny_model_dir: Path) -> None:
    engine = AsyncLLMEngine(
        EngineConfig.from_kwargs(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=64)
    )
    await engine.start()
    stream = engine.add_request("long", PROMPT, LONG)
    await stream.__aiter__().__anext__()
    await engine.shutdown(grace_s=0.05)
    final = await stream.finished
    assert (final.finish_reason, final.abort_cause) == ("abort", AbortCause.SHUTDOWN)
