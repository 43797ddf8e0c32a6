"""Delta outputs (issue 31): a request's non-final outputs hold only their step's tokens, so making
a step's output costs O(the step), not a copy of the whole completion so far; the final output
carries the whole, and whoever must end a request without the engine rebuilds it from the deltas."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nanoserve.engine import AbortCause, AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams, TokensPrompt
from nanoserve.engine.core.outputs import RequestOutput, TokenLogprob
from nanoserve.engine.core.request import Request
from nanoserve.engine.errors import EngineDeadError
from nanoserve.engine.text.tokenizer import Tokenizer

PROMPT = TokensPrompt([101, 202, 303, 404, 505])
NUM_TOKENS = 4000
NUM_TOP_LOGPROBS = 20


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_model_dir)


def _generate(tokenizer: Tokenizer) -> list[RequestOutput]:
    """Every output of a 4,000-token request with 20 top logprobs, its final one last."""
    params = SamplingParams(max_tokens=NUM_TOKENS, logprobs=NUM_TOP_LOGPROBS, ignore_eos=True)
    request = Request("r", [1], params, max_tokens=NUM_TOKENS, eos_token_ids=[2], decoder=tokenizer)
    outputs = []
    for i in range(NUM_TOKENS):
        top = {300 + (i + k) % 500: -0.5 - k for k in range(NUM_TOP_LOGPROBS)}
        request.append_token(300 + i % 500, TokenLogprob(300 + i % 500, -0.5, top))
        output = request.make_output(final=request.finish_reason is not None)
        if output is not None:
            outputs.append(output)
    return outputs


def test_a_non_final_output_of_a_4000_token_request_holds_only_its_delta(tokenizer: Tokenizer) -> None:
    outputs = _generate(tokenizer)
    *deltas, final = outputs
    last = deltas[-1]
    assert last.is_delta
    assert last.outputs[0].token_ids == last.delta_token_ids
    assert len(last.outputs[0].logprobs or []) == len(last.delta_token_ids)
    assert last.num_released_tokens == last.delta_start + len(last.delta_token_ids)
    # every token is in exactly one output's completion until the final one: 4,000 in all, not ~8 million
    assert sum(len(o.outputs[0].token_ids) for o in deltas) == final.delta_start_index
    assert sum(len(o.outputs[0].logprobs or []) for o in deltas) == final.delta_start_index
    assert final.delta_start_index + len(final.delta_token_ids) == NUM_TOKENS
    assert [o.delta_start for o in deltas] == [o.num_released_tokens - len(o.delta_token_ids) for o in deltas]
    # the final output is whole: the deltas concatenate to it
    assert final.finished
    assert not final.is_delta
    assert len(final.token_ids) == NUM_TOKENS
    assert len(final.outputs[0].logprobs or []) == NUM_TOKENS
    assert [t for o in outputs for t in o.delta_token_ids] == final.token_ids
    assert "".join(o.delta_text for o in outputs) == final.text


def test_llm_engine_step_hands_out_deltas_then_the_whole(tiny_model_dir: Path) -> None:
    engine = LLMEngine(_config(tiny_model_dir))
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outputs[:-1]] == [1] * 11  # one token a step, alone
    assert [o.delta_start for o in outputs[:-1]] == list(range(11))
    assert len(outputs[-1].token_ids) == 12
    assert [t for o in outputs[:-1] for t in o.token_ids] == outputs[-1].token_ids[:11]


async def test_an_engine_failure_ends_a_stream_with_what_its_deltas_delivered(tiny_model_dir: Path) -> None:
    core = LLMEngine(_config(tiny_model_dir))
    step = core.step
    num_steps = 0

    def failing_step() -> list[RequestOutput]:
        nonlocal num_steps
        num_steps += 1
        if num_steps > 6:
            raise RuntimeError("device lost")
        return step()

    core.step = failing_step  # type: ignore[method-assign]
    engine = AsyncLLMEngine(core.config, core)
    await engine.start()
    stream = engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    delivered: list[RequestOutput] = []
    with pytest.raises(EngineDeadError):
        async for output in stream:
            delivered.append(output)
    final = await asyncio.wait_for(stream.finished, timeout=60)
    await engine.shutdown(grace_s=0.0)
    assert (final.finish_reason, final.abort_cause) == ("abort", AbortCause.ENGINE_ERROR)
    assert delivered  # the first steps' tokens arrived before the failure
    assert final.token_ids == [t for o in delivered for t in o.delta_token_ids]
    assert final.text == "".join(o.delta_text for o in delivered)


def _config(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=4
    )
