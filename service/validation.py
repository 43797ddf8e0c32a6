"""Checks on a ``GenerateRequest`` before it reaches the engine.

Each check raises ``InvalidRequestError(field, message)`` with the protobuf
field path (``sampling.top_p``) and the limit, so the client sees
INVALID_ARGUMENT that says what to fix. Checks that need the token count of a
text prompt (longer than ``max_model_len``) are the engine's, which tokenizes.
"""

from __future__ import annotations

import math

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.service.convert import CHAT_ROLES
from nanoserve.v1 import generation_pb2 as pb

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_REQUEST_ID_CHARS = 128


def validate_generate_request(request: pb.GenerateRequest, vocab_size: int) -> None:
    """Raises InvalidRequestError for the first bad field of ``request``."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            "request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request.request_id)}"
        )
    validate_input(request, vocab_size)
    validate_sampling(request.sampling, vocab_size)


def validate_input(request: pb.GenerateRequest | pb.TokenizeRequest, vocab_size: int) -> None:
    """Exactly one non-empty input; chat roles known; token ids inside the vocabulary."""
    kind = request.WhichOneof("input")
    if kind is None:
        names = [field.name for field in request.DESCRIPTOR.oneofs_by_name["input"].fields]
        raise InvalidRequestError("input", f"give exactly one of {', '.join(names[:-1])} or {names[-1]}; none was set")
    if kind in ("prompt", "text") and not getattr(request, kind):
        raise InvalidRequestError(kind, "must not be empty")
    if kind == "prompt_token_ids":
        assert isinstance(request, pb.GenerateRequest), "only GenerateRequest has prompt_token_ids"
        _check_token_ids("prompt_token_ids", list(request.prompt_token_ids.ids), vocab_size)
    if kind == "chat":
        _check_chat(request.chat)


def _check_token_ids(field: str, ids: list[int], vocab_size: int) -> None:
    if not ids:
        raise InvalidRequestError(field, "must not be empty")
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"{field}[{index}]", f"token id {token_id} outside the vocabulary [0, {vocab_size})"
            )


def _check_chat(chat: pb.ChatMessages) -> None:
    if not chat.messages:
        raise InvalidRequestError("chat.messages", "must hold at least one message")
    for index, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            known = ", ".join(pb.ChatRole.Name(role) for role in CHAT_ROLES)
            if message.role == pb.CHAT_ROLE_UNSPECIFIED:
                given = "CHAT_ROLE_UNSPECIFIED (unset)"
            else:  # a value from a newer contract, or a number sent as is
                given = f"{message.role} (not a role this server knows)"
            raise InvalidRequestError(f"chat.messages[{index}].role", f"must be one of {known}, got {given}")


def validate_sampling(params: pb.SamplingParameters, vocab_size: int) -> None:
    """Ranges of the sampling parameters, as the engine defines them."""
    if params.HasField("max_tokens") and params.max_tokens < 1:
        raise InvalidRequestError("sampling.max_tokens", f"must be >= 1, got {params.max_tokens}")
    if params.min_tokens < 0:
        raise InvalidRequestError("sampling.min_tokens", f"must be >= 0, got {params.min_tokens}")
    if params.HasField("max_tokens") and params.min_tokens > params.max_tokens:
        raise InvalidRequestError(
            "sampling.min_tokens", f"must be <= max_tokens ({params.max_tokens}), got {params.min_tokens}"
        )
    if params.HasField("temperature") and not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise InvalidRequestError("sampling.temperature", f"must be >= 0 (0 = greedy), got {params.temperature}")
    if params.HasField("top_p") and not 0 < params.top_p <= 1:
        raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {params.top_p}")
    if params.HasField("top_k") and params.top_k < 0:
        raise InvalidRequestError("sampling.top_k", f"must be >= 0 (0 = off), got {params.top_k}")
    if params.HasField("min_p") and not 0 <= params.min_p <= 1:
        raise InvalidRequestError("sampling.min_p", f"must be in [0, 1], got {params.min_p}")
    if params.HasField("repetition_penalty") and not params.repetition_penalty > 0:
        raise InvalidRequestError(
            "sampling.repetition_penalty", f"must be > 0 (1 = off), got {params.repetition_penalty}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if params.HasField(name) and not -2 <= getattr(params, name) <= 2:
            raise InvalidRequestError(f"sampling.{name}", f"must be in [-2, 2], got {getattr(params, name)}")
    if params.HasField("logprobs") and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError("sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}], got {params.logprobs}")
    _check_stop(params, vocab_size)


def _check_stop(params: pb.SamplingParameters, vocab_size: int) -> None:
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
    for index, stop in enumerate(params.stop):
        if not stop:
            raise InvalidRequestError(f"sampling.stop[{index}]", "stop strings must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"sampling.stop[{index}]", f"at most {MAX_STOP_STRING_CHARS} characters, got {len(stop)}"
            )
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            "sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}"
        )
    for index, token_id in enumerate(params.stop_token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"sampling.stop_token_ids[{index}]", f"token id {token_id} outside the vocabulary [0, {vocab_size})"
            )
