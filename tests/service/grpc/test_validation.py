"""Each bad GenerateRequest field gets a message starting with its protobuf path and naming the limit.

The checks are the engine's (``SamplingParams``, ``InputProcessor``); the service
only checks the message's shape (the oneof, the ChatRole enum) and turns engine
field names into protobuf paths. This runs the same path as the server:
convert, process, ``message_for``.
"""

from __future__ import annotations

import pytest

from nanoserve.engine.core.status import ModelInfo
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.model.weights import resolve_model_path
from nanoserve.engine.text.input_processor import InputProcessor
from nanoserve.engine.text.tokenizer import Tokenizer
from nanoserve.service.grpc import convert
from nanoserve.service.grpc.interceptors import message_for
from nanoserve.v1 import generation_pb2 as pb

VOCAB_SIZE = 49152


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    tokenizer = Tokenizer.from_path(resolve_model_path(None))
    info = ModelInfo("m", "float32", "cpu", 1024, 16, 256, VOCAB_SIZE, True, (2,), 1023 * tokenizer.max_token_bytes)
    return InputProcessor(tokenizer, info)


def _request(**sampling: object) -> pb.GenerateRequest:
    request = pb.GenerateRequest(prompt="hello")
    for name, value in sampling.items():
        if isinstance(value, list):
            getattr(request.sampling, name).extend(value)
        else:
            setattr(request.sampling, name, value)
    return request


def _client_message(processor: InputProcessor, request: pb.GenerateRequest) -> str:
    with pytest.raises(InvalidRequestError) as info:
        processor.process(
            request.request_id or "r", convert.to_prompt(request), convert.to_sampling_params(request.sampling)
        )
    return message_for(info.value)


def test_valid_request_passes(processor: InputProcessor) -> None:
    request = _request(max_tokens=8, temperature=0.0, top_p=1.0, stop=["\n"])
    processor.process("r", convert.to_prompt(request), convert.to_sampling_params(request.sampling))


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(), "input: give exactly one of prompt, prompt_token_ids or chat; none was set"),
        (pb.GenerateRequest(prompt=""), "prompt: is empty (0 tokens)"),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), "prompt_token_ids.ids: is empty (0 tokens)"),
        (
            pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, VOCAB_SIZE])),
            f"prompt_token_ids.ids[1]: token id {VOCAB_SIZE} outside the vocabulary [0, {VOCAB_SIZE})",
        ),
        (pb.GenerateRequest(chat=pb.ChatMessages()), "chat.messages: must hold at least one message"),
        (
            pb.GenerateRequest(
                chat=pb.ChatMessages(
                    messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="hi"), pb.ChatMessage(content="x")]
                )
            ),
            "chat.messages[1].role: must be one of CHAT_ROLE_SYSTEM, CHAT_ROLE_USER, CHAT_ROLE_ASSISTANT, "
            "got CHAT_ROLE_UNSPECIFIED (unset)",
        ),
        (
            pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role=7, content="x")])),  # type: ignore[arg-type]
            "chat.messages[0].role: must be one of CHAT_ROLE_SYSTEM, CHAT_ROLE_USER, CHAT_ROLE_ASSISTANT, "
            "got 7 (not a role this server knows)",
        ),
        (
            _request(temperature=-0.5),
            "sampling.temperature: must be finite and >= 0 (0, or below 1e-05: greedy), got -0.5",
        ),
        (_request(top_k=-1), "sampling.top_k: must be 0 (off) or an integer >= 1, got -1"),
        (_request(max_tokens=0), "sampling.max_tokens: must be >= 1, got 0"),
        (_request(max_tokens=4, min_tokens=5), "sampling.min_tokens: must be <= max_tokens (4), got 5"),
        (_request(top_p=0.0), "sampling.top_p: must be in (0, 1], got 0.0"),
        (_request(top_p=1.5), "sampling.top_p: must be in (0, 1], got 1.5"),
        (_request(min_p=2.0), "sampling.min_p: must be in [0, 1], got 2.0"),
        (_request(presence_penalty=3.0), "sampling.presence_penalty: must be in [-2, 2], got 3.0"),
        (_request(logprobs=21), "sampling.logprobs: must be in [0, 20], got 21"),
        (
            _request(stop_token_ids=[5, VOCAB_SIZE + 1]),
            f"sampling.stop_token_ids[1]: token id {VOCAB_SIZE + 1} outside the vocabulary [0, {VOCAB_SIZE})",
        ),
        (pb.GenerateRequest(request_id="x" * 129, prompt="hi"), "request_id: at most 128 characters, got 129"),
        (_request(stop=[f"s{i}" for i in range(17)]), "sampling.stop: at most 16 stop strings, got 17"),
        (_request(stop=["ok", ""]), "sampling.stop[1]: must be a non-empty string, got ''"),
        (_request(stop=["x" * 257]), "sampling.stop[0]: at most 256 characters, got 257"),
        (_request(stop_token_ids=list(range(65))), "sampling.stop_token_ids: at most 64 ids, got 65"),
        (
            _request(stop_token_ids=[-3]),
            "sampling.stop_token_ids[0]: token id -3 outside the vocabulary (ids are >= 0)",
        ),
    ],
)
def test_bad_field_message_starts_with_its_protobuf_path(
    processor: InputProcessor, request_: pb.GenerateRequest, message: str
) -> None:
    assert _client_message(processor, request_) == message


def test_tokenize_without_input_names_the_tokenize_fields() -> None:
    with pytest.raises(InvalidRequestError) as info:
        convert.to_tokenize_input(pb.TokenizeRequest())
    assert str(info.value) == "input: give exactly one of text or chat; none was set"
