"""Bounded streams (issue 31): a stream queues deltas, O(its tokens), and cuts off a reader that
falls behind its bound, aborting the request (cause slow_consumer) and freeing its blocks."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from pathlib import Path

import pytest

from nanoserve.engine import AbortCause, AsyncLLMEngine, EngineConfig, SamplingParams, TokensPrompt
from nanoserve.engine.config import StreamConfig
from nanoserve.engine.core.outputs import CompletionOutput, RequestOutput, TokenLogprob
from nanoserve.engine.core.request import Request
from nanoserve.engine.core.request_stream import RequestStream, merge_outputs
from nanoserve.engine.errors import StreamBufferFullError
from nanoserve.engine.text.tokenizer import Tokenizer

PROMPT = TokensPrompt([101, 202, 303, 404, 505])
NUM_TOP_LOGPROBS = 20


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_model_dir)


def _request(tokenizer: Tokenizer, num_tokens: int) -> tuple[Request, list[TokenLogprob]]:
    params = SamplingParams(max_tokens=num_tokens, logprobs=NUM_TOP_LOGPROBS, ignore_eos=True)
    request = Request("r", [1], params, max_tokens=num_tokens, eos_token_ids=[2], decoder=tokenizer)
    logprobs = [
        TokenLogprob(300 + i % 500, -0.5, {300 + (i + k) % 500: -0.5 - k for k in range(NUM_TOP_LOGPROBS)})
        for i in range(num_tokens)
    ]
    return request, logprobs


async def _bytes_queued_per_token(tokenizer: Tokenizer, num_tokens: int) -> tuple[float, float]:
    """(bytes traced per token for what an unread stream holds, the stream's own estimate per token).

    The request is dropped before measuring, as the engine drops a finished one: what the
    queue then holds alone (the steps' text, ids, logprobs and the outputs) is measured."""
    unbounded = StreamConfig(max_stream_buffer_messages=1 << 30, max_stream_buffer_bytes=1 << 50)
    stream = RequestStream("r", 0.0, unbounded)
    gc.collect()
    tracemalloc.start()
    try:
        request, logprobs = _request(tokenizer, num_tokens)
        for index in range(num_tokens):
            request.append_token(logprobs[index].token_id, logprobs[index])
            output = request.make_output(final=False)  # the engine's output of the step (a delta)
            if output is not None:
                stream._deliver(output)
            del output
        stream._last_output = None
        del request, logprobs
        gc.collect()
        holding, _ = tracemalloc.get_traced_memory()
        estimate = stream.num_queued_bytes
        while not stream._outputs.empty():
            stream._outputs.get_nowait()
        gc.collect()
        drained, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return (holding - drained) / num_tokens, estimate / num_tokens


async def test_an_unread_stream_holds_bytes_linear_in_its_tokens(tokenizer: Tokenizer) -> None:
    per_token_1k, estimate_1k = await _bytes_queued_per_token(tokenizer, 1024)
    per_token_8k, estimate_8k = await _bytes_queued_per_token(tokenizer, 8192)
    # whole outputs would cost ~8x more per token at 8k than at 1k (O(tokens²) in all)
    assert 0.8 < per_token_8k / per_token_1k < 1.25, (per_token_1k, per_token_8k)
    # each queued output holds one token's delta: its ids, text, 20 top logprobs, the output itself
    assert per_token_8k < 4000, per_token_8k
    # the byte bound counts what is really held, within a factor of two
    for measured, estimate in ((per_token_1k, estimate_1k), (per_token_8k, estimate_8k)):
        assert 0.5 < estimate / measured < 2.0, (measured, estimate)


async def test_a_queued_output_is_the_delta_and_the_final_output_is_whole(tokenizer: Tokenizer) -> None:
    request, logprobs = _request(tokenizer, 3)
    stream = RequestStream("r", 0.0)
    reader = aiter(stream)
    received: list[RequestOutput] = []
    for index in range(3):  # a reader that takes each output before the next step's
        request.append_token(logprobs[index].token_id, logprobs[index])
        output = request.make_output(final=request.finish_reason is not None)
        assert output is not None
        stream._deliver(output)
        received.append(await anext(reader))
    assert [o.is_delta for o in received] == [True, True, False]
    assert [o.token_ids for o in received[:2]] == [[300], [301]]
    assert [o.outputs[0].logprobs for o in received[:2]] == [[logprobs[0]], [logprobs[1]]]
    assert received[-1].token_ids == [300, 301, 302]
    assert received[-1].outputs[0].logprobs == logprobs
    assert [t for o in received for t in o.delta_token_ids] == received[-1].token_ids
    assert "".join(o.delta_text for o in received) == received[-1].text
    assert stream.num_queued == stream.num_queued_bytes == 0


async def test_a_reader_behind_takes_what_waits_as_one_merged_output(tokenizer: Tokenizer) -> None:
    request, logprobs = _request(tokenizer, 5)
    stream = RequestStream("r", 0.0)
    outputs = []
    for index in range(5):
        request.append_token(logprobs[index].token_id, logprobs[index])
        output = request.make_output(final=request.finish_reason is not None)
        assert output is not None
        outputs.append(output)
    reader = aiter(stream)
    for output in outputs[:3]:  # three steps while the reader is away
        stream._deliver(output)
    assert stream.num_queued == 3
    merged = await anext(reader)
    assert stream.num_queued == stream.num_queued_bytes == 0
    assert (merged.is_delta, merged.finished) == (True, False)
    assert merged.delta_token_ids == merged.token_ids == [300, 301, 302]
    assert (merged.delta_start, merged.num_released_tokens) == (0, 3)
    assert merged.delta_logprobs == merged.outputs[0].logprobs == logprobs[:3]
    assert merged.delta_text == "".join(o.delta_text for o in outputs[:3])
    assert merged.metrics is outputs[2].metrics
    for output in outputs[3:]:  # the last delta and the final output, read together
        stream._deliver(output)
    final = await anext(reader)
    assert (final.is_delta, final.finished) == (False, True)
    assert final.delta_token_ids == [303, 304]
    assert final.token_ids == [300, 301, 302, 303, 304]  # the final output stays whole
    assert final.outputs[0].logprobs == logprobs
    assert merged.delta_text + final.delta_text == final.text
    with pytest.raises(StopAsyncIteration):
        await anext(reader)


def _config(tiny_model_dir: Path, **stream: int) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=4, **stream
    )


async def _cut_off(tiny_model_dir: Path, params: SamplingParams, **bound: int) -> tuple[RequestOutput, str]:
    """Runs one request nobody reads until it ends; returns its final output and the reader's error."""
    engine = AsyncLLMEngine(_config(tiny_model_dir, **bound))
    await engine.start()
    try:
        stream = engine.add_request("unread", PROMPT, params)
        final = await asyncio.wait_for(stream.finished, 60.0)
        with pytest.raises(StreamBufferFullError) as error:
            [output async for output in stream]
        for _ in range(200):
            status = engine.pool_status()
            if status.num_free == status.num_blocks and status.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert (status.num_free, status.num_running) == (status.num_blocks, 0)
        return final, str(error.value)
    finally:
        await engine.shutdown(grace_s=0.0)


async def test_an_unread_stream_is_cut_off_at_the_message_bound(tiny_model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    final, message = await _cut_off(tiny_model_dir, params, max_stream_buffer_messages=16)
    assert (final.finish_reason, final.abort_cause) == ("abort", AbortCause.SLOW_CONSUMER)
    # 17 steps made an output each (the 17th passed the bound); the abort lands before the engine's next step
    assert 17 <= len(final.token_ids) < 400
    assert "--max-stream-buffer-messages=16" in message
    assert "'unread'" in message


async def test_an_unread_stream_is_cut_off_at_the_byte_bound(tiny_model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, logprobs=5)
    final, message = await _cut_off(tiny_model_dir, params, max_stream_buffer_bytes=20_000)
    assert (final.finish_reason, final.abort_cause) == ("abort", AbortCause.SLOW_CONSUMER)
    assert len(final.token_ids) < 400
    assert "--max-stream-buffer-bytes=20000 bytes" in message


async def test_a_reader_that_keeps_up_is_never_cut_off(tiny_model_dir: Path) -> None:
    # 200 outputs against a bound of 64: an unread stream would pass it, a reader never does.
    engine = AsyncLLMEngine(_config(tiny_model_dir, max_stream_buffer_messages=64))
    await engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        outputs = [output async for output in engine.generate(PROMPT, params, "reader")]
        assert outputs[-1].finish_reason == "length"
        assert len(outputs[-1].token_ids) == 200
    finally:
        await engine.shutdown(grace_s=0.0)


def _delta(index: int, token_id: int) -> RequestOutput:
    completion = CompletionOutput(index=index, text=f"<{token_id}>", token_ids=[token_id])
    return RequestOutput(
        "r", [1], [completion], finished=False, delta_text=f"<{token_id}>", delta_token_ids=[token_id], is_delta=True
    )


def test_only_runs_of_one_samples_deltas_are_merged() -> None:
    outputs = [_delta(0, 10), _delta(0, 11), _delta(1, 20), _delta(0, 12), _delta(1, 21), _delta(1, 22)]
    merged = merge_outputs(outputs)
    assert [(o.outputs[0].index, o.delta_token_ids, o.token_ids, o.delta_text) for o in merged] == [
        (0, [10, 11], [10, 11], "<10><11>"),
        (1, [20], [20], "<20>"),
        (0, [12], [12], "<12>"),
        (1, [21, 22], [21, 22], "<21><22>"),
    ]
    assert merge_outputs(outputs[:1]) == outputs[:1]
