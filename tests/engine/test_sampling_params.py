"""SamplingParams validates itself: every bad value names its field and range."""

from __future__ import annotations

import pytest

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"top_k": 0}, "top_k", ">= 1 (unset: no top-k)"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
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


def test_temperature_zero_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy
