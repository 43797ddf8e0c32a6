"""Each bad GenerateRequest field raises InvalidRequestError naming the field and the limit."""

from __future__ import annotations

import pytest

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.service.validation import validate_generate_request, validate_input
from nanoserve.v1 import generation_pb2 as pb

VOCAB_SIZE = 100


def _request(**sampling: object) -> pb.GenerateRequest:
    request = pb.GenerateRequest(prompt="hello")
    for name, value in sampling.items():
        if isinstance(value, list):
            getattr(request.sampling, name).extend(value)
        else:
            setattr(request.sampling, name, value)
    return request


def _error(request: pb.GenerateRequest) -> str:
    with pytest.raises(InvalidRequestError) as info:
        validate_generate_request(request, VOCAB_SIZE)
    return str(info.value)


def test_valid_request_passes() -> None:
    validate_generate_request(_request(max_tokens=8, temperature=0.0, top_p=1.0, stop=["\n"]), VOCAB_SIZE)


def test_missing_input() -> None:
    assert _error(pb.GenerateRequest()) == "input: give exactly one of prompt, prompt_token_ids or chat; none was set"


def test_empty_prompt() -> None:
    assert _error(pb.GenerateRequest(prompt="")) == "prompt: must not be empty"


def test_empty_prompt_token_ids() -> None:
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[]))
    assert _error(request) == "prompt_token_ids: must not be empty"


def test_prompt_token_id_outside_vocabulary() -> None:
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 100]))
    assert _error(request) == "prompt_token_ids[1]: token id 100 outside the vocabulary [0, 100)"


def test_empty_chat() -> None:
    request = pb.GenerateRequest(chat=pb.ChatMessages())
    assert _error(request) == "chat.messages: must hold at least one message"


def test_unset_chat_role() -> None:
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="hi"), pb.ChatMessage(content="x")]
        )
    )
    assert _error(request) == (
        "chat.messages[1].role: must be one of CHAT_ROLE_SYSTEM, CHAT_ROLE_USER, CHAT_ROLE_ASSISTANT, "
        "got CHAT_ROLE_UNSPECIFIED (unset)"
    )


def test_chat_role_number_unknown_to_this_server() -> None:
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role=7, content="x")]))  # type: ignore[arg-type]
    assert _error(request) == (
        "chat.messages[0].role: must be one of CHAT_ROLE_SYSTEM, CHAT_ROLE_USER, CHAT_ROLE_ASSISTANT, "
        "got 7 (not a role this server knows)"
    )


def test_tokenize_without_input_names_the_tokenize_fields() -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_input(pb.TokenizeRequest(), VOCAB_SIZE)
    assert str(info.value) == "input: give exactly one of text or chat; none was set"


def test_max_tokens_below_one() -> None:
    assert _error(_request(max_tokens=0)) == "sampling.max_tokens: must be >= 1, got 0"


def test_min_tokens_above_max_tokens() -> None:
    assert _error(_request(max_tokens=4, min_tokens=5)) == "sampling.min_tokens: must be <= max_tokens (4), got 5"


def test_negative_temperature() -> None:
    assert _error(_request(temperature=-0.5)) == "sampling.temperature: must be >= 0 (0 = greedy), got -0.5"


def test_top_p_zero() -> None:
    assert _error(_request(top_p=0.0)) == "sampling.top_p: must be in (0, 1], got 0.0"


def test_top_p_above_one() -> None:
    assert _error(_request(top_p=1.5)) == "sampling.top_p: must be in (0, 1], got 1.5"


def test_negative_top_k() -> None:
    assert _error(_request(top_k=-1)) == "sampling.top_k: must be >= 0 (0 = off), got -1"


def test_min_p_above_one() -> None:
    assert _error(_request(min_p=2.0)) == "sampling.min_p: must be in [0, 1], got 2.0"


def test_presence_penalty_out_of_range() -> None:
    assert _error(_request(presence_penalty=3.0)) == "sampling.presence_penalty: must be in [-2, 2], got 3.0"


def test_too_many_logprobs() -> None:
    assert _error(_request(logprobs=21)) == "sampling.logprobs: must be in [0, 20], got 21"


def test_too_many_stop_strings() -> None:
    assert _error(_request(stop=[f"s{i}" for i in range(17)])) == "sampling.stop: at most 16 stop strings, got 17"


def test_empty_stop_string() -> None:
    assert _error(_request(stop=["ok", ""])) == "sampling.stop[1]: stop strings must not be empty"


def test_stop_token_id_outside_vocabulary() -> None:
    assert (
        _error(_request(stop_token_ids=[-3]))
        == "sampling.stop_token_ids[0]: token id -3 outside the vocabulary [0, 100)"
    )


def test_request_id_too_long() -> None:
    request = _request()
    request.request_id = "x" * 129
    assert _error(request) == "request_id: at most 128 characters, got 129"
