"""The sampler's numpy greedy path: the same tokens as torch's argmax after ``finite_logits``,
ties to the first index, taken only when nothing but the argmax is asked for."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from nanoserve.engine.sampling import sampler as sampler_module
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.sampling.sampler import Sampler, argmax_rows, finite_logits, only_argmax

GREEDY = SamplingParams(temperature=0.0)
INF = float("inf")
NAN = float("nan")


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)
    min_tokens_banned_ids: list[int] = field(default_factory=lambda: [2])
    seed: int = 0
    num_prior_output_tokens: int = 0


def _general_path(logits: torch.Tensor) -> list[int]:
    """The greedy tokens as the sampler's general path takes them."""
    return torch.argmax(finite_logits(logits), dim=-1).tolist()


def test_argmax_rows_equals_torch_argmax_on_model_sized_rows() -> None:
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)) * 4
    assert argmax_rows(logits) == torch.argmax(logits, dim=-1).tolist()


def test_argmax_rows_breaks_ties_to_the_first_index_as_torch() -> None:
    logits = torch.zeros(4, 49152)
    logits[0, [7, 3, 40000]] = 2.0
    logits[1, [49151, 100]] = -1.0  # the max is 0.0 everywhere else: first index 0
    logits[1, 0] = -0.0  # -0.0 == 0.0: still a tie, still index 0
    logits[2, [20000, 20001]] = 5.0
    logits[3] = 1.5  # a constant row
    assert argmax_rows(logits) == torch.argmax(logits, dim=-1).tolist() == [3, 0, 20000, 0]


def test_argmax_rows_reads_a_strided_view() -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))[:, :999]
    assert not logits.is_contiguous()
    assert argmax_rows(logits) == torch.argmax(logits, dim=-1).tolist()


def test_argmax_rows_keeps_rows_with_minus_inf_but_a_finite_max() -> None:
    logits = torch.tensor([[-INF, 1.0, -INF, 1.0], [-INF, -INF, -3.0, -INF]])
    assert argmax_rows(logits) == _general_path(logits) == [1, 2]


@pytest.mark.parametrize(
    "row",
    [
        [1.0, NAN, 3.0, 0.0],  # a NaN: the general path makes it -inf
        [1.0, INF, INF, 0.0],  # +inf: the general path makes it the largest float
        [NAN, INF, 1.0, 0.0],
        [-INF, -INF, -INF, -INF],  # no finite logit: the general path takes token 0
        [NAN, NAN, NAN, NAN],
    ],
)
def test_argmax_rows_declines_a_row_whose_max_is_not_finite(row: list[float]) -> None:
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0], row])
    assert argmax_rows(logits) is None


def test_argmax_rows_declines_other_dtypes() -> None:
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(2))
    assert argmax_rows(logits.bfloat16()) is None
    assert argmax_rows(logits.double()) is None


def test_sampler_greedy_tokens_equal_the_general_path_on_edge_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.tensor(
        [
            [0.5, 2.0, 2.0, -1.0],
            [1.0, NAN, 3.0, 0.0],
            [1.0, INF, INF, 0.0],
            [-INF, -INF, -INF, -INF],
            [-INF, 0.0, -0.0, -INF],
        ]
    )
    rows = [Row(GREEDY) for _ in range(5)]
    fast = Sampler()(logits, rows)
    monkeypatch.setattr(sampler_module, "only_argmax", lambda rows: False)
    general = Sampler()(logits, rows)
    assert fast == general
    assert fast.token_ids == [1, 2, 1, 0, 1]
    assert fast.logprobs == [None] * 5


def test_only_argmax_for_plain_greedy_rows() -> None:
    assert only_argmax([Row(GREEDY), Row(SamplingParams(temperature=1e-7))])
    # min_tokens already reached: the EOS is no longer masked
    assert only_argmax([Row(SamplingParams(temperature=0.0, min_tokens=2), output_token_ids=[5, 6])])


@pytest.mark.parametrize(
    "row",
    [
        Row(SamplingParams(temperature=0.7)),
        Row(SamplingParams(temperature=0.0, logprobs=0)),
        Row(SamplingParams(temperature=0.0, repetition_penalty=1.2)),
        Row(SamplingParams(temperature=0.0, presence_penalty=0.5)),
        Row(SamplingParams(temperature=0.0, frequency_penalty=-0.5)),
        Row(SamplingParams(temperature=0.0, min_tokens=2), output_token_ids=[5]),
    ],
)
def test_only_argmax_refuses_a_batch_with_any_other_request(row: Row) -> None:
    assert not only_argmax([Row(GREEDY), row])


def test_sampler_takes_the_general_path_when_a_row_asks_for_more(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(logits: torch.Tensor) -> list[int] | None:
        raise AssertionError("argmax_rows called for a batch that asks for more than the argmax")

    monkeypatch.setattr(sampler_module, "argmax_rows", refuse)
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]] * 2)
    min_tokens = Row(SamplingParams(temperature=0.0, min_tokens=1), min_tokens_banned_ids=[2])
    out = Sampler()(logits, [Row(SamplingParams(temperature=0.0, logprobs=1)), min_tokens])
    assert out.token_ids == [2, 3]  # the second row's EOS (2) is banned below min_tokens
    assert out.logprobs[0] is not None
    assert out.logprobs[1] is None
