"""The sampler, checked on logits: each setting changes the distribution as defined,
the draw follows it, and a row's token is a function of its own logits, settings,
seed and output position."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.sampling.sampler import (
    CDF_CHUNK_SIZE,
    Sampler,
    apply_penalties,
    inverse_cdf,
    mask_min_tokens,
    sampling_probs,
)

PROBS = [0.5, 0.3, 0.15, 0.05]


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)
    min_tokens_banned_ids: list[int] = field(default_factory=list)
    seed: int = 0
    num_prior_output_tokens: int = 0


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
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)).repeat(200, 1)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    rows = [Row(SamplingParams(top_k=3), seed=seed) for seed in range(200)]
    drawn = set(Sampler()(logits, rows).token_ids)
    assert drawn == allowed


def test_presence_penalty_counts_a_resumed_requests_prior_output_tokens() -> None:
    logits = torch.zeros(2, 4)
    params = SamplingParams(presence_penalty=1.0)
    resumed = Row(params, prompt_token_ids=[3, 1, 2], num_prior_output_tokens=2)  # 1, 2 were generated
    fresh = Row(params, prompt_token_ids=[3], output_token_ids=[1, 2])
    assert apply_penalties(logits, [resumed, fresh]).tolist() == [[0.0, -1.0, -1.0, 0.0]] * 2


# ---- numeric edges: no NaN or inf ever reaches the draw ------------------


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 5e-324, 9.99e-6])
def test_temperature_below_the_floor_is_greedy_exactly(temperature: float) -> None:
    # Issue 8: temperature 1e-39 made logits / T overflow to inf and drew token 0 every time.
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(5)) * 3
    tiny = [Row(SamplingParams(temperature=temperature, logprobs=1), seed=s) for s in range(4)]
    greedy = [Row(SamplingParams(temperature=0.0, logprobs=1)) for _ in range(4)]
    out, expected = Sampler()(logits, tiny), Sampler()(logits, greedy)
    assert out.token_ids == expected.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == expected.logprobs


def test_temperature_just_above_the_floor_samples_without_overflow() -> None:
    logits = torch.tensor([[1e30, 1e30 - 1e24, -1e30, 0.0]])  # / 1e-5 would overflow float32
    probs = sampling_probs(logits, [SamplingParams(temperature=1e-5)])
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_tiny_repetition_penalty_clamps_instead_of_overflowing() -> None:
    # 5.0 / 1e-38 overflows float32: clamped to the largest float, so seen positive logits tie at the top.
    logits = torch.tensor([[5.0, 4.0, -1.0, 3.0]])
    row = Row(SamplingParams(repetition_penalty=1e-38), prompt_token_ids=[0, 1, 2])
    penalized = apply_penalties(logits, [row])
    big = torch.finfo(torch.float32).max
    assert penalized[0].tolist() == [big, big, torch.tensor(-1e-38).item(), 3.0]
    probs = sampling_probs(penalized, [row.sampling_params])
    assert probs[0].tolist() == [0.5, 0.5, 0.0, 0.0]
    rows = [Row(row.sampling_params, prompt_token_ids=[0, 1, 2], seed=s) for s in range(50)]
    assert set(Sampler()(logits.repeat(50, 1), rows).token_ids) == {0, 1}


def test_nan_logit_is_never_drawn_and_inf_logit_always_is() -> None:
    logits = torch.tensor([[float("nan"), 1.0, float("inf"), 0.5], [float("nan"), 1.0, 2.0, 0.5]])
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1)):
        rows = [Row(params, seed=s, output_token_ids=[3]) for s in range(40)]
        tokens = Sampler()(logits.repeat(20, 1), rows).token_ids
        assert tokens[0::2] == [2] * 20
        assert 0 not in tokens[1::2]


def test_row_without_any_finite_logit_draws_uniformly_and_greedy_takes_token_0() -> None:
    logits = torch.full((64, 8), float("-inf"))
    logits[:32] = float("nan")
    sampled = Sampler()(logits, [Row(SamplingParams(logprobs=0), seed=s) for s in range(64)])
    assert len(set(sampled.token_ids)) == 8
    assert [lp.logprob for lp in sampled.logprobs if lp is not None] == pytest.approx([-math.log(8)] * 64)
    assert Sampler()(logits[:2], [Row(SamplingParams(temperature=0.0))] * 2).token_ids == [0, 0]


# ---- the draw: inverse transform sampling on one uniform per row ----------


def test_inverse_cdf_takes_the_token_whose_interval_holds_u() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])  # exact in binary: the boundaries are exact
    cases = {0.0: 0, 0.4999: 0, 0.5: 1, 0.7499: 1, 0.75: 2, 0.875: 3, 1.0 - 2.0**-53: 3}
    for u, token in cases.items():
        assert inverse_cdf(probs, torch.tensor([u], dtype=torch.float64)).tolist() == [token], u


def test_inverse_cdf_never_returns_a_token_without_mass() -> None:
    vocab_size = 3 * CDF_CHUNK_SIZE + 7  # a short last chunk
    probs = torch.zeros(4, vocab_size)
    probs[0, [5, CDF_CHUNK_SIZE - 1]] = 0.5  # zeros before, between and after, inside one chunk
    probs[1, [0, vocab_size - 1]] = torch.tensor([1e-30, 1.0])  # the short last chunk
    probs[2, CDF_CHUNK_SIZE] = 1.0  # a whole empty chunk before it
    probs[3, [2 * CDF_CHUNK_SIZE - 1, 2 * CDF_CHUNK_SIZE]] = 0.5  # either side of a chunk boundary
    allowed = [
        {5, CDF_CHUNK_SIZE - 1},
        {0, vocab_size - 1},
        {CDF_CHUNK_SIZE},
        {2 * CDF_CHUNK_SIZE - 1, 2 * CDF_CHUNK_SIZE},
    ]
    for u in (0.0, 1e-31, 0.25, 0.5, 0.75, 1.0 - 2.0**-53):
        tokens = inverse_cdf(probs, torch.full((4,), u, dtype=torch.float64)).tolist()
        assert all(t in ok for t, ok in zip(tokens, allowed, strict=True)), (u, tokens)


def test_two_level_inverse_cdf_equals_one_float64_cumsum() -> None:
    generator = torch.Generator().manual_seed(11)
    vocab_size = 49152 + 100
    probs = torch.softmax(torch.randn(64, vocab_size, generator=generator) * 4, dim=-1)
    u = torch.rand(64, generator=generator, dtype=torch.float64)
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    assert inverse_cdf(probs, u).tolist() == expected.tolist()


def test_draw_frequencies_follow_probabilities_chi_square() -> None:
    # Deterministic: fixed seeds and positions. 3 degrees of freedom: P(chi2 > 16.27) = 0.001.
    probs = [0.5, 0.3, 0.15, 0.05]
    num_draws = 8000
    logits = _logits(probs).repeat(num_draws, 1)
    across_seeds = [Row(SamplingParams(), seed=seed) for seed in range(num_draws)]
    across_positions = [Row(SamplingParams(), seed=-12345, num_prior_output_tokens=n) for n in range(num_draws)]
    for rows in (across_seeds, across_positions):
        tokens = Sampler()(logits, rows).token_ids
        chi2 = sum((tokens.count(t) - num_draws * p) ** 2 / (num_draws * p) for t, p in enumerate(probs))
        assert chi2 < 16.27, chi2


def test_truncated_distribution_frequencies_follow_chi_square() -> None:
    # top_k 3 at temperature 0.5: renormalized [0.5, 0.3, 0.15]^2; 2 degrees of freedom, P(chi2 > 13.82) = 0.001
    probs = torch.tensor(PROBS[:3]) ** 2
    expected = (probs / probs.sum()).tolist()
    num_draws = 6000
    rows = [Row(SamplingParams(temperature=0.5, top_k=3), seed=7, num_prior_output_tokens=n) for n in range(num_draws)]
    tokens = Sampler()(_logits(PROBS).repeat(num_draws, 1), rows).token_ids
    assert 3 not in tokens
    chi2 = sum((tokens.count(t) - num_draws * p) ** 2 / (num_draws * p) for t, p in enumerate(expected))
    assert chi2 < 13.82, chi2


# ---- a row's token: a function of its logits, settings, seed and position -


def _varied_rows() -> list[Row]:
    return [
        Row(SamplingParams(temperature=1.0), seed=1, output_token_ids=[4, 5]),
        Row(SamplingParams(temperature=0.0)),
        Row(SamplingParams(temperature=0.7, top_p=0.9), seed=-1),
        Row(SamplingParams(temperature=1.3, top_k=20, min_p=0.01), seed=2**63 - 1, num_prior_output_tokens=9),
        Row(SamplingParams(temperature=1.0, repetition_penalty=1.3), seed=2**32 - 1, prompt_token_ids=[1, 2, 3]),
        Row(SamplingParams(temperature=1.0, presence_penalty=0.5), seed=1, output_token_ids=[4, 5, 6]),
    ]


def test_seeded_row_token_is_the_same_in_any_batch_and_row_order() -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)) * 3
    rows = _varied_rows()
    together = Sampler()(logits, rows).token_ids
    alone = [Sampler()(logits[i : i + 1], [row]).token_ids[0] for i, row in enumerate(rows)]
    order = [4, 0, 5, 2, 1, 3]
    shuffled = Sampler()(logits[order], [rows[i] for i in order]).token_ids
    doubled = Sampler()(torch.cat([logits, logits]), rows + rows).token_ids
    assert together == alone
    assert shuffled == [together[i] for i in order]
    assert doubled == together + together
    assert Sampler()(logits, rows).token_ids == together  # no state carried between calls


def test_same_seed_draws_differently_at_each_position() -> None:
    logits = torch.zeros(64, 1000)  # uniform
    rows = [Row(SamplingParams(), seed=42, num_prior_output_tokens=n) for n in range(64)]
    assert len(set(Sampler()(logits, rows).token_ids)) > 55  # 64 uniform draws of 1000: few repeats


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
