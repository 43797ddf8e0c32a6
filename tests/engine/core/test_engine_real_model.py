"""The engine on the real SmolLM2-135M-Instruct (float32): scheduling changes no token."""

from __future__ import annotations

import pytest

from nanoserve.engine import ChatPrompt, LLMEngine, SamplingParams, TokensPrompt

pytestmark = pytest.mark.real_model

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def engine(real_runner) -> LLMEngine:
    return LLMEngine(real_runner.config, runner=real_runner)


def _run(engine: LLMEngine, prompts: list, params: SamplingParams) -> list:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[f"q{i}"] for i in range(len(prompts))]


def test_greedy_chat_answer_stops_at_eos(engine: LLMEngine) -> None:
    (out,) = _run(
        engine,
        [ChatPrompt([{"role": "user", "content": QUESTIONS[0]}])],
        SamplingParams(temperature=0.0, max_tokens=12),
    )
    assert out.text == "The capital of France is Paris."
    # EOS is the model's own ending, not a stop token the client asked for: no stop_reason
    assert (out.finish_reason, out.stop_reason, out.token_ids[-1]) == ("stop", None, 2)


def test_batched_engine_matches_the_runner_greedy_oracle(engine: LLMEngine, real_runner, greedy) -> None:
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected, _ = greedy(real_runner, prompts, 8)
    outputs = _run(
        engine, [TokensPrompt(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert [o.token_ids for o in outputs] == expected
    assert engine.pool_status().num_free == engine.pool_status().num_blocks
