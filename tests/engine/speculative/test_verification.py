"""The verify rule: accepted prefix, one row per verified position, and the target distribution kept."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.sampling.sampler import Sampler, output_position
from nanoserve.engine.speculative import accepted_tokens, draft_rows


@dataclass
class Row:
    """A ``SamplingRow`` with nothing but what the sampler reads."""

    sampling_params: SamplingParams
    seed: int = 7
    num_prior_output_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    min_tokens_banned_ids: list[int] = field(default_factory=list)


def test_drafts_are_accepted_up_to_the_first_mismatch_then_its_target() -> None:
    assert accepted_tokens([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert accepted_tokens([4, 5, 6], [8, 5, 6, 1]) == [8]


def test_all_drafts_accepted_add_the_bonus_token() -> None:
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]
    assert accepted_tokens([], [3]) == [3]


def test_targets_must_cover_every_draft_and_the_bonus() -> None:
    with pytest.raises(ValueError, match="need 3 targets for 2 drafts, got 2"):
        accepted_tokens([4, 5], [4, 5])


def test_row_i_sees_the_first_i_drafts_as_generated() -> None:
    row = Row(SamplingParams(temperature=1.0), num_prior_output_tokens=2, prompt_token_ids=[1, 2, 8, 9])
    row.output_token_ids = [30, 31]
    rows = draft_rows(row, [40, 41])
    assert [r.output_token_ids for r in rows] == [[30, 31], [30, 31, 40], [30, 31, 40, 41]]
    assert [output_position(r) for r in rows] == [4, 5, 6]  # the positions plain decoding would sample at
    assert {(r.seed, r.num_prior_output_tokens) for r in rows} == {(7, 2)}


def test_min_tokens_counts_the_drafts_before_a_row() -> None:
    eos = 2
    row = Row(SamplingParams(temperature=0.0, min_tokens=2), min_tokens_banned_ids=[eos], output_token_ids=[5])
    logits = torch.full((3, 8), -5.0)
    logits[:, eos] = 5.0  # EOS is every row's argmax
    tokens = Sampler()(logits, draft_rows(row, [6, 7])).token_ids
    assert tokens[0] != eos  # one output token so far: EOS is still banned
    assert tokens[1:] == [eos, eos]  # the draft makes two


# The target distribution: p over 5 tokens, then temperature 0.7 and top_k 4 as the sampler applies them.
P = [0.4, 0.25, 0.2, 0.1, 0.05]
TEMPERATURE = 0.7
NUM_DRAWS = 20_000
DRAFT = 1
CHI2_CRITICAL_DF3 = 16.266  # chi-square quantile 0.999 with 3 degrees of freedom (4 tokens kept by top_k)
CHI2_CRITICAL_DF2 = 13.816  # with 2 (the 3 tokens left once the draft is removed)


def _target() -> list[float]:
    scaled = [p ** (1 / TEMPERATURE) for p in P[:4]] + [0.0]  # top_k=4 drops the least likely token
    return [s / sum(scaled) for s in scaled]


def _chi2(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    """One draft (k = 1) proposed at NUM_DRAWS positions of a seeded request: the draft is accepted with
    probability p(draft), a rejection emits a token from p with the draft removed and renormalised, and
    the emitted token follows p (chi-square, fixed seed: the counts are the same on every run)."""
    params = SamplingParams(temperature=TEMPERATURE, top_k=4)
    logits = torch.tensor([math.log(p) for p in P]).repeat(2 * NUM_DRAWS, 1)  # [2 * NUM_DRAWS, 5]
    rows = [r for i in range(NUM_DRAWS) for r in draft_rows(Row(params, seed=2023, num_prior_output_tokens=i), [DRAFT])]
    targets = Sampler()(logits, rows).token_ids
    emitted = [accepted_tokens([DRAFT], targets[2 * i : 2 * i + 2]) for i in range(NUM_DRAWS)]
    target = _target()
    num_accepted = sum(len(tokens) == 2 for tokens in emitted)
    # binomial(NUM_DRAWS, p(draft)): within 4 standard deviations
    sigma = math.sqrt(NUM_DRAWS * target[DRAFT] * (1 - target[DRAFT]))
    assert abs(num_accepted - NUM_DRAWS * target[DRAFT]) < 4 * sigma
    first = [tokens[0] for tokens in emitted]
    assert _chi2([first.count(t) for t in range(5)], target) < CHI2_CRITICAL_DF3
    assert first.count(4) == 0  # top_k removed it
    rejected = [tokens[0] for tokens in emitted if len(tokens) == 1]
    residual = [0.0 if t == DRAFT else q / (1 - target[DRAFT]) for t, q in enumerate(target)]
    assert DRAFT not in rejected
    assert _chi2([rejected.count(t) for t in range(5)], residual) < CHI2_CRITICAL_DF2
    again = Sampler()(logits, rows).token_ids
    assert again == targets  # the seed decides every draw
