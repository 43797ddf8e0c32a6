"""The grammar mask: bits unpack in token order, and the sampler never draws a masked token."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.sampling.sampler import Sampler
from nanoserve.engine.structured.token_mask import TokenMask, TokenMasker, apply_token_mask, mask_bias, unpack_bitmask


@dataclass
class Allowed:
    rows: list[int]
    allowed: torch.Tensor


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)
    min_tokens_banned_ids: list[int] = field(default_factory=list)
    seed: int = 0
    num_prior_output_tokens: int = 0


def test_bit_j_of_word_i_is_token_32i_plus_j() -> None:
    bitmask = np.array([[1 | (1 << 31), 1 << 2]], dtype=np.uint32).view(np.int32)  # tokens 0, 31 and 34
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed.shape == (1, 40)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 31, 34]


def test_the_bias_is_zero_where_allowed_and_minus_inf_elsewhere() -> None:
    mask = TokenMask.from_allowed([0, 2], torch.tensor([[True, False, True], [False, False, True]]))
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    inf = float("inf")
    assert apply_token_mask(logits, mask).tolist() == [[1.0, -inf, 3.0], [4.0, 5.0, 6.0], [-inf, -inf, 9.0]]
    assert logits[0, 1] == 2.0  # the input is kept (logprobs read it)
    masked = apply_token_mask(logits, mask, in_place=True)  # no logprobs asked: the runner's logits are changed
    assert masked is logits
    assert logits.tolist() == [[1.0, -inf, 3.0], [4.0, 5.0, 6.0], [-inf, -inf, 9.0]]


def test_the_maskers_reused_bias_buffer_gives_the_same_bias() -> None:
    masker = TokenMasker(40)
    for allowed in ([[True] * 3 + [False] * 37, [False] * 39 + [True]], [[False, True] * 20]):
        bitmask = TokenMask.from_allowed(list(range(len(allowed))), torch.tensor(allowed)).bitmask
        assert torch.equal(masker.bias(bitmask), mask_bias(bitmask, 40))


def test_a_row_whose_allowed_tokens_have_no_mass_is_uniform_over_them() -> None:
    logits = torch.tensor([[0.0, float("-inf"), float("-inf"), 1.0], [0.0, 1.0, 2.0, 3.0]])
    mask = Allowed([0], torch.tensor([[False, True, True, False]]))
    masked = apply_token_mask(logits, TokenMask.from_allowed(mask.rows, mask.allowed))
    assert masked.tolist() == [[float("-inf"), 0.0, 0.0, float("-inf")], [0.0, 1.0, 2.0, 3.0]]


VOCAB_SIZE = 37  # more than one 32-bit word


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(
        st.lists(st.floats(-30, 30) | st.just(float("-inf")), min_size=VOCAB_SIZE, max_size=VOCAB_SIZE),
        min_size=1,
        max_size=4,
    ),
    allowed_bits=st.lists(st.integers(1, 2**VOCAB_SIZE - 1), min_size=4, max_size=4),  # at least one allowed
    temperature=st.sampled_from([0.0, 1e-6, 0.3, 1.0, 2.5]),
    top_k=st.none() | st.integers(1, VOCAB_SIZE),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.01]),
    min_p=st.sampled_from([0.0, 0.1, 0.9]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    min_tokens=st.integers(0, 2),
    seed=st.integers(0, 2**32),
)
def test_sampler_never_returns_a_masked_token(
    logits, allowed_bits, temperature, top_k, top_p, min_p, repetition_penalty, min_tokens, seed
) -> None:
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        min_tokens=min_tokens,
        logprobs=1 if seed % 2 else None,
    )
    rows = [Row(params, seed=seed + i, min_tokens_banned_ids=[0, 1]) for i in range(len(logits))]
    allowed = torch.tensor([[bool(bits >> t & 1) for t in range(VOCAB_SIZE)] for bits in allowed_bits[: len(logits)]])
    token_mask = TokenMask.from_allowed(list(range(len(logits))), allowed)
    assert torch.equal(token_mask.allowed(VOCAB_SIZE), allowed)
    token_ids = Sampler()(torch.tensor(logits), rows, token_mask).token_ids
    for row, token_id in enumerate(token_ids):
        assert allowed[row, token_id], f"row {row} drew masked token {token_id}"
