"""Speculative decoding on the real SmolLM2-135M-Instruct (float32): a copying answer, the same tokens; a
verify pass the decode path computes gives plain decoding's logprobs bit for bit."""

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


STORY = ChatPrompt([{"role": "user", "content": "Write a short story about a robot learning to paint."}])


def _logprobs(engine: LLMEngine, prompt: ChatPrompt) -> tuple[list[int], list[float]]:
    engine.add_request("story", prompt, SamplingParams(temperature=0.0, max_tokens=48, logprobs=1))
    final = None
    while engine.has_unfinished_requests():
        final = next((output for output in engine.step() if output.finished), final)
    assert final is not None
    completion = final.outputs[0]
    assert completion.logprobs is not None
    return completion.token_ids, [entry.logprob for entry in completion.logprobs]


@pytest.mark.parametrize(
    ("k", "batch_invariant"),
    [(3, "off"), (4, "off"), (5, "off"), (6, "off"), (7, "off"), (4, "on"), (9, "on")],
    ids=[
        "k3-decode-body",
        "k4-decode-body",
        "k5-decode-body",
        "k6-decode-body",
        "k7-decode-body",
        "k4-batch-invariant",
        "k9-batch-invariant",
    ],
)
def test_a_verify_pass_on_the_decode_path_gives_plain_decodings_logprobs_bit_for_bit(
    k: int, batch_invariant: str
) -> None:
    """A verify pass's rows attend as decodes at their own positions (``SeqSlice.as_decodes``), so where
    the matmuls of k + 1 rows take the decode path's arithmetic too (at most 8 rows on the GGUF kernel,
    or any number under ``--batch-invariant on``: beyond 8 rows its int16 panels) each verified
    position's logits are plain decoding's.
    1-gram drafts: a story that repeats little still drafts, and about half its tokens come from them."""
    from ..conftest import make_real_runner

    runner = make_real_runner(batch_invariant=batch_invariant)
    expected = _logprobs(LLMEngine(runner.config, runner=runner), STORY)
    speculative = SpeculativeConfig(speculative="ngram", num_speculative_tokens=k, speculative_ngram_min=1)
    engine = LLMEngine(dataclasses.replace(runner.config, speculative=speculative), runner=runner)
    assert _logprobs(engine, STORY) == expected
    assert engine.pool_status().num_accepted_draft_tokens > 0
