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


def test_auto_speculates_on_the_gguf_kernels_bit_for_bit_and_not_on_the_dequantized_model(real_runner) -> None:
    """``--speculative auto`` (the server's default): ngram where every linear runs nanoserve's GGUF kernel
    (a verify pass of up to 8 rows is plain decoding's arithmetic), off on the dequantized float32 model,
    whose matmul reduction order follows the row count, and off above k = 7."""
    from nanoserve.engine.speculative.proposer import resolve

    from ..conftest import make_real_runner

    auto = SpeculativeConfig(speculative="auto")
    assert real_runner.on_gguf_kernels is False
    assert resolve(auto, real_runner.on_gguf_kernels) == (
        "off",
        "auto: the model does not run on nanoserve's GGUF kernels",
    )
    dequantized = LLMEngine(dataclasses.replace(real_runner.config, speculative=auto), runner=real_runner)
    assert dequantized.scheduler.proposer is None

    runner = make_real_runner()  # the default: the GGUF file's blocks on nanoserve's kernel
    assert runner.on_gguf_kernels is True
    assert resolve(SpeculativeConfig(speculative="auto", num_speculative_tokens=8), True)[0] == "off"
    expected = _logprobs(LLMEngine(runner.config, runner=runner), STORY)
    engine = LLMEngine(dataclasses.replace(runner.config, speculative=auto), runner=runner)
    assert engine.scheduler.proposer is not None
    assert _logprobs(engine, STORY) == expected
