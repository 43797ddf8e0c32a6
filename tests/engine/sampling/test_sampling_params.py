"""SamplingParams validates itself: every bad value names its field and range."""

from __future__ import annotations

import pytest

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling.params import MAX_LOGPROBS, MIN_SAMPLING_TEMPERATURE, SamplingParams

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": NAN}, "temperature", "finite and >= 0"),
        ({"temperature": INF}, "temperature", "finite and >= 0"),
        ({"top_k": 0}, "top_k", ">= 1 (unset: no top-k)"),
        ({"top_k": 2.5}, "top_k", "integer >= 1"),
        ({"top_p": NAN}, "top_p", "(0, 1]"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": NAN}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": INF}, "repetition_penalty", "finite and > 0"),
        ({"repetition_penalty": NAN}, "repetition_penalty", "finite and > 0"),
        ({"presence_penalty": -INF}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": NAN}, "frequency_penalty", "[-2, 2]"),
        ({"seed": 2**63}, "seed", "[-2**63, 2**63 - 1]"),
        ({"seed": -(2**63) - 1}, "seed", "[-2**63, 2**63 - 1]"),
        ({"seed": 1.5}, "seed", "[-2**63, 2**63 - 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "[-2, 2]"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "<= max_tokens (4)"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs", f"[0, {MAX_LOGPROBS}]"),
        ({"stop": ["ok", ""]}, "stop[1]", "non-empty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]", ">= 0"),
    ],
)
def test_bad_value_names_field_and_limit(kwargs: dict, field: str, limit: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert limit in str(info.value)


def test_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]


def test_message_is_field_must_be_range_got_value() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(top_p=NAN)
    assert str(info.value) == "top_p: must be in (0, 1], got nan"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(temperature=-INF)
    assert str(info.value) == "temperature: must be finite and >= 0 (0, or below 1e-05: greedy), got -inf"


def test_temperature_zero_or_below_the_floor_is_greedy() -> None:
    assert MIN_SAMPLING_TEMPERATURE == 1e-5
    for temperature in (0.0, -0.0, 1e-45, 1e-39, 9.999e-6):
        assert SamplingParams(temperature=temperature).greedy, temperature
    for temperature in (1e-5, 0.5, 1e30):
        assert not SamplingParams(temperature=temperature).greedy, temperature


def test_extreme_int64_seeds_are_accepted() -> None:
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
