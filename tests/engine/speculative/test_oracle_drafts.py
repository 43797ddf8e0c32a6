"""Drafts that are right for exactly j tokens, then wrong: every accept count 0..k, exact counts, same tokens."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest

from nanoserve.engine.core.llm import LLM
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.prompts import TokensPrompt

PROMPT = TokensPrompt([5, 17, 300, 42, 9, 77, 1000, 23, 8, 61])
K = 4
RIGHT_PREFIXES = (0, 3, 1, 4, 2, 5)  # per call: how many leading drafts are right (>= K: all of them)


class OracleProposer:
    """Knows the answer: proposes its next j tokens (j cycling through RIGHT_PREFIXES), then a wrong one.

    Records how many drafts each call proposed and how many of them are right.
    """

    def __init__(self, prompt: list[int], answer: list[int]) -> None:
        self.prompt = prompt
        self.answer = answer
        self.cycle = itertools.cycle(RIGHT_PREFIXES)
        self.proposed: list[tuple[int, int]] = []  # (drafts, right drafts) per call

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        position = len(token_ids) - len(self.prompt)  # the output index of the next token
        assert list(token_ids[len(self.prompt) :]) == self.answer[:position], "the request left the answer"
        num_right = min(next(self.cycle), num_tokens)
        drafts = self.answer[position : position + num_right]
        if num_right < num_tokens:
            drafts.append(self.answer[position + num_right] + 1)  # wrong: never the answer's token
        self.proposed.append((len(drafts), num_right))
        return drafts


@pytest.mark.parametrize(
    ("params", "num_kv_blocks"),
    [
        (SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), 64),
        (SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=30, ignore_eos=True), 64),
        (SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), 11),  # 10 + 30 tokens: 11 blocks of 4
    ],
    ids=["greedy", "seeded", "pool-just-fits"],
)
def test_exactly_the_right_drafts_are_accepted_and_the_tokens_do_not_change(
    tiny_model_dir: Path, params: SamplingParams, num_kv_blocks: int
) -> None:
    settings: dict[str, object] = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_threads": 1}
    plain = LLM(model=str(tiny_model_dir), num_kv_blocks=64, **settings)
    [expected] = plain.generate(PROMPT, params)
    plain.shutdown()
    answer = expected.outputs[0].token_ids
    llm = LLM(
        model=str(tiny_model_dir),
        num_kv_blocks=num_kv_blocks,
        speculative="ngram",
        num_speculative_tokens=K,
        **settings,
    )
    oracle = OracleProposer(list(PROMPT.prompt_token_ids), answer)
    llm.engine.scheduler.proposer = oracle
    [got] = llm.generate(PROMPT, params)
    status = llm.engine.pool_status()
    llm.shutdown()
    assert got.outputs[0].token_ids == answer
    assert status.num_draft_tokens == sum(num for num, _ in oracle.proposed)
    assert status.num_accepted_draft_tokens == sum(right for _, right in oracle.proposed)
    assert {right for _, right in oracle.proposed} >= {0, 1, 2, 3, 4}  # every accept count, all-accepted included
    assert llm.engine.allocator.num_free == num_kv_blocks
