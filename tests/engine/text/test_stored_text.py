"""Request ids and cache salts are refused on arrival when the log could not store them as text."""

from __future__ import annotations

import pytest

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.stored_text import check_stored_text


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ("a\x00b", "control character U+0000 at index 1"),
        ("line\nbreak", "control character U+000A at index 4"),
        ("del\x7f", "control character U+007F at index 3"),
        ("c1\x85", "control character U+0085 at index 2"),
        ("half\ud800", "surrogate (not valid UTF-8) U+D800 at index 4"),
    ],
)
def test_control_characters_and_surrogates_are_refused_by_index(value: str, detail: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_stored_text("request_id", value, 128)
    assert str(info.value) == f"request_id: must hold no control characters or surrogates: {detail}"
    assert info.value.field == "request_id"


@pytest.mark.parametrize("value", ["req-1", "with space", "überschrift-ß", "日本語", "x" * 128, "zero\u200bwidth"])
def test_printable_text_up_to_the_limit_passes(value: str) -> None:
    assert check_stored_text("request_id", value, 128) == value


def test_length_and_type_are_named() -> None:
    with pytest.raises(InvalidRequestError, match=r"^request_id: at most 128 characters, got 129$"):
        check_stored_text("request_id", "x" * 129, 128)
    with pytest.raises(InvalidRequestError, match=r"^request_id: must be a non-empty string, got ''$"):
        check_stored_text("request_id", "", 128)
    with pytest.raises(InvalidRequestError, match=r"^request_id: must be a non-empty string, got 7$"):
        check_stored_text("request_id", 7, 128)


def test_a_salt_with_a_nul_is_refused_by_sampling_params() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(cache_salt="tenant\x00a")
    assert (
        str(info.value)
        == "cache_salt: must hold no control characters or surrogates: control character U+0000 at index 6"
    )
    with pytest.raises(InvalidRequestError, match=r"^cache_salt: at most 256 characters, got 257$"):
        SamplingParams(cache_salt="s" * 257)
