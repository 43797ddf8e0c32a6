"""The sampler, checked on logits: each setting changes the distribution as defined."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from nanoserve.engine.sampler import Sampler, apply_penalties, mask_min_tokens, sampling_probs
from nanoserve.engine.sampling_params import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    min_tokens_banned_ids: list[int] = field(default_factory=list)


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()  # [1, vocab_size]


def _probs(params: SamplingParams, probs: list[float] = PROBS) -> list[float]:
    return sampling_probs(_logits(probs), [params])[0].tolist()


def test_temperature_divides_logits() -> None:
    logits = _logits(PROBS)
    expected = torch.softmax(logits / 0.5, dim=-1)[0].tolist()
    assert _probs(SamplingParams(temperature=0.5)) == pytest.approx(expected)
    # T < 1 sharpens: the top token gains mass.
    assert expected[0] > PROBS[0]


def test_top_k_keeps_k_most_likely_renormalized() -> None:
    assert _probs(SamplingParams(top_k=2)) == pytest.approx([0.625, 0.375, 0.0, 0.0])


def test_top_p_keeps_smallest_nucleus_reaching_p() -> None:
    assert _probs(SamplingParams(top_p=0.75)) == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert _probs(SamplingParams(top_p=0.85)) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_top_p_always_keeps_the_most_likely_token() -> None:
    assert _probs(SamplingParams(top_p=0.1)) == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    # threshold 0.5 * 0.5 = 0.25: keeps 0.5 and 0.3
    assert _probs(SamplingParams(min_p=0.5)) == pytest.approx([0.625, 0.375, 0.0, 0.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    row = Row(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0], output_token_ids=[1])
    assert apply_penalties(logits, [row])[0].tolist() == [1.0, -4.0, 2.0, -2.0]


def test_presence_and_frequency_penalties_subtract_per_generated_token() -> None:
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = Row(params, prompt_token_ids=[3, 3], output_token_ids=[1, 1, 1, 2])
    # token 1: 0.5 + 3 * 0.25; token 2: 0.5 + 0.25; prompt-only token 3: untouched
    assert apply_penalties(logits, [row])[0].tolist() == [0.0, -1.25, -0.75, 0.0]


def test_penalties_apply_per_row() -> None:
    logits = torch.ones(2, 3)
    rows = [Row(SamplingParams(repetition_penalty=2.0), [0]), Row(SamplingParams(), [0])]
    assert apply_penalties(logits, rows).tolist() == [[0.5, 1.0, 1.0], [1.0, 1.0, 1.0]]


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, 4)
    params = SamplingParams(min_tokens=2)
    rows = [
        Row(params, output_token_ids=[1], min_tokens_banned_ids=[3]),
        Row(params, output_token_ids=[1, 1], min_tokens_banned_ids=[3]),
    ]
    masked = mask_min_tokens(logits, rows)
    assert masked[0].tolist() == [0.0, 0.0, 0.0, -math.inf]
    assert masked[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_greedy_takes_argmax() -> None:
    logits = torch.tensor([[0.1, 0.2, 3.0, 0.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler()(logits, [Row(SamplingParams(temperature=0.0))] * 2)
    assert out.token_ids == [2, 0]


def test_sampling_never_draws_outside_top_k() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    sampler = Sampler(torch.Generator().manual_seed(1))
    drawn = {sampler(logits, [Row(SamplingParams(top_k=3))]).token_ids[0] for _ in range(200)}
    assert drawn <= allowed
    assert len(drawn) == 3


def test_sampling_frequencies_follow_probabilities() -> None:
    sampler = Sampler(torch.Generator().manual_seed(2))
    logits = _logits(PROBS).repeat(4000, 1)
    tokens = sampler(logits, [Row(SamplingParams())] * 4000).token_ids
    freqs = [tokens.count(t) / 4000 for t in range(4)]
    assert freqs == pytest.approx(PROBS, abs=0.03)


def test_seeded_row_draws_same_tokens_whatever_shares_the_batch() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=7)

    def draws(rows_logits: torch.Tensor, index: int) -> list[int]:
        generator = torch.Generator().manual_seed(7)
        rows = [Row(SamplingParams(temperature=0.8)) for _ in range(rows_logits.shape[0])]
        rows[index] = Row(params, generator=generator)
        sampler = Sampler()
        return [sampler(rows_logits, rows).token_ids[index] for _ in range(30)]

    alone = draws(logits[2:3], 0)
    in_batch = draws(logits, 2)
    assert alone == in_batch
    assert len(set(alone)) > 1  # it did sample, not argmax


def test_logprobs_give_chosen_and_top_n_of_raw_distribution() -> None:
    logits = _logits(PROBS)
    out = Sampler()(logits, [Row(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5), [1])])
    lp = out.logprobs[0]
    assert lp is not None
    assert lp.token_id == 0
    assert lp.logprob == pytest.approx(math.log(0.5))
    assert list(lp.top_logprobs) == [0, 1]
    assert list(lp.top_logprobs.values()) == pytest.approx([math.log(0.5), math.log(0.3)])


def test_rows_without_logprobs_get_none() -> None:
    out = Sampler()(
        _logits(PROBS).repeat(2, 1),
        [Row(SamplingParams(temperature=0, logprobs=0)), Row(SamplingParams(temperature=0))],
    )
    assert out.logprobs[1] is None
    assert out.logprobs[0] is not None
    assert out.logprobs[0].top_logprobs == {}
