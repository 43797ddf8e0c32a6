"""What a client left out or left empty, on a real server (the tiny random model), in both contracts.

An unset ``max_tokens`` is the default clamped to the room the prompt leaves
(vLLM's meaning), never an error naming a field the client did not send; a
``max_tokens`` given that does not fit keeps its error; a prompt that leaves no
room is named as the prompt. An empty text is INVALID_ARGUMENT naming ``text``
in Tokenize as in Generate.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from ..conftest import Served

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_MODEL_LEN = 1024  # the tiny model's


def _ours(served: Served) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(served.channel)


def _vllm(served: Served) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


async def _our_tokens(served: Served, num_prompt_tokens: int, **sampling: Any) -> tuple[int, str]:
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[5] * num_prompt_tokens),
        sampling=pb.SamplingParameters(temperature=0.0, ignore_eos=True, **sampling),
    )
    responses = [r async for r in _ours(served).Generate(request)]
    return sum(len(r.token_ids) for r in responses), pb.FinishReason.Name(responses[-1].finish.reason)


async def _vllm_tokens(served: Served, num_prompt_tokens: int, **sampling: Any) -> tuple[int, str]:
    request = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=[5] * num_prompt_tokens),
        sampling_params=vpb.SamplingParams(temperature=0.0, ignore_eos=True, **sampling),
        stream=False,
    )
    responses = [r async for r in _vllm(served).Generate(request)]
    complete = responses[-1].complete
    return len(complete.output_ids), complete.finish_reason


async def test_the_tiny_server_has_the_context_these_numbers_assume(tiny_served: Served) -> None:
    info = await _ours(tiny_served).GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_model_len == MAX_MODEL_LEN


async def test_unset_max_tokens_is_16_where_the_prompt_leaves_room(tiny_served: Served) -> None:
    assert await _our_tokens(tiny_served, 10) == (16, "FINISH_REASON_LENGTH")


async def test_unset_max_tokens_is_clamped_to_the_room_the_prompt_leaves(tiny_served: Served) -> None:
    assert await _our_tokens(tiny_served, MAX_MODEL_LEN - 3) == (3, "FINISH_REASON_LENGTH")
    assert await _our_tokens(tiny_served, MAX_MODEL_LEN - 1) == (1, "FINISH_REASON_LENGTH")


async def test_vllm_unset_max_tokens_is_the_room_the_prompt_leaves(tiny_served: Served) -> None:
    assert await _vllm_tokens(tiny_served, MAX_MODEL_LEN - 3) == (3, "length")


async def test_a_given_max_tokens_that_does_not_fit_is_still_refused(tiny_served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _our_tokens(tiny_served, MAX_MODEL_LEN - 1, max_tokens=16)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "sampling.max_tokens: prompt (1023 tokens) + max_tokens (16) = 1039 exceeds max_model_len (1024)"
    )


@pytest.mark.parametrize("contract", ["nanoserve.v1", "vllm"])
async def test_a_prompt_that_fills_the_context_is_named_as_the_prompt(tiny_served: Served, contract: str) -> None:
    generate = _our_tokens if contract == "nanoserve.v1" else _vllm_tokens
    path = "prompt_token_ids.ids" if contract == "nanoserve.v1" else "tokenized.input_ids"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(tiny_served, MAX_MODEL_LEN)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{path}: prompt has 1024 tokens; at most 1023 leave room"), (
        info.value.details()
    )


async def test_tokenize_an_empty_text_is_invalid_argument_naming_text(tiny_served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _ours(tiny_served).Tokenize(pb.TokenizeRequest(text=""))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "text: is empty (0 tokens)"


async def test_vllm_generate_an_empty_text_is_invalid_argument_naming_text(tiny_served: Served) -> None:
    request = vpb.GenerateRequest(text="", sampling_params=vpb.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in _vllm(tiny_served).Generate(request)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "text: is empty (0 tokens)"
