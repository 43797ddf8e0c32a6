"""Speculative decoding on the real SmolLM2-135M-Instruct (float32): a copying answer, the same tokens."""

from __future__ import annotations

import dataclasses

import pytest

from nanoserve.engine import ChatPrompt, LLMEngine, SamplingParams
from nanoserve.engine.config import SpeculativeConfig

pytestmark = pytest.mark.real_model

# the model answers "The list is: apple, banana, ..., nectarine." (33 tokens), copied from the prompt
PROMPT = ChatPrompt(
    [
        {
            "role": "user",
            "content": "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
            "kiwi, lemon, mango, nectarine.",
        }
    ]
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def _generate(engine: LLMEngine) -> list[int]:
    engine.add_request("copy", PROMPT, GREEDY)
    final = None
    while engine.has_unfinished_requests():
        final = next((output for output in engine.step() if output.finished), final)
    assert final is not None
    return final.outputs[0].token_ids


def test_greedy_copying_answer_is_unchanged_by_speculation(real_runner) -> None:
    expected = _generate(LLMEngine(real_runner.config, runner=real_runner))
    config = dataclasses.replace(real_runner.config, speculative=SpeculativeConfig(speculative="ngram"))
    engine = LLMEngine(config, runner=real_runner)
    assert _generate(engine) == expected
    status = engine.pool_status()
    assert status.num_accepted_draft_tokens > len(expected) // 2  # the copy is mostly accepted drafts
