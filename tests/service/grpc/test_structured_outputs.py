"""Structured outputs through both contracts on the tiny random model: whatever the model's logits,
the output matches its constraint, and every bad constraint is INVALID_ARGUMENT naming the field,
with nothing queued."""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from ..conftest import Served, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT_IDS = [1, 2, 3, 4, 5]


async def _ours(served: Served, **sampling: Any) -> tuple[str, pb.Finish]:
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT_IDS),
        sampling=pb.SamplingParameters(**{"temperature": 0.0, "max_tokens": 64, **sampling}),
    )
    responses = [r async for r in generation_pb2_grpc.GenerationServiceStub(served.channel).Generate(request)]
    return "".join(r.text for r in responses), responses[-1].finish


async def test_regex_output_matches_on_our_contract(tiny_served: Served) -> None:
    text, finish = await _ours(tiny_served, regex="[0-9]{3}-[0-9]{4}")
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", text), text
    assert finish.reason == pb.FINISH_REASON_STOP


async def test_choice_and_json_object_on_our_contract(tiny_served: Served) -> None:
    text, finish = await _ours(tiny_served, choice=pb.ChoiceConstraint(choices=["alpha", "beta", "gamma"]))
    assert (text in {"alpha", "beta", "gamma"}, finish.reason) == (True, pb.FINISH_REASON_STOP)
    number = {"type": "integer", "minimum": 0, "maximum": 999}  # bounded: an unbounded one may outrun max_tokens
    schema = {"type": "object", "properties": {"n": number}, "required": ["n"], "additionalProperties": False}
    text, finish = await _ours(tiny_served, json_schema=json.dumps(schema), temperature=0.7, top_k=5, seed=11)
    assert finish.reason == pb.FINISH_REASON_STOP, text
    assert list(json.loads(text)) == ["n"]
    assert isinstance(json.loads(text)["n"], int)


async def test_regex_through_the_vllm_contract(tiny_served: Served) -> None:
    request = vpb.GenerateRequest(
        tokenized=vpb.TokenizedInput(input_ids=PROMPT_IDS),
        sampling_params=vpb.SamplingParams(
            temperature=0.0, max_tokens=64, regex="(yes|no)!", grammar_from_first_token=True
        ),
        stream=False,
    )
    [response] = [r async for r in vllm_engine_pb2_grpc.VllmEngineStub(tiny_served.channel).Generate(request)]
    text = tiny_served.engine.tokenizer.decode(list(response.complete.output_ids))
    assert (text in {"yes!", "no!"}, response.complete.finish_reason) == (True, "stop")


BAD: list[tuple[dict[str, Any], str]] = [
    ({"json_schema": "{oops"}, "sampling.json_schema: is not valid JSON: Expecting property name"),
    ({"json_schema": '{"type": "object", "if": {}}'}, 'sampling.json_schema: Unimplemented keys: ["if"]'),
    ({"regex": "[0-9"}, 'sampling.regex: invalid regex "[0-9": unclosed character class at offset 0'),
    ({"choice": pb.ChoiceConstraint()}, "sampling.choice.choices: is an empty list (give at least one choice)"),
    ({"json_object": False}, "sampling.json_object: must be true when set (unset it for no constraint)"),
    ({"grammar": "start: nowhere"}, 'sampling.grammar: at 1(8): unknown name: "nowhere"'),
]


@pytest.mark.parametrize(("sampling", "message"), BAD, ids=[next(iter(f)) for f, _ in BAD])
async def test_a_bad_constraint_is_invalid_argument_and_nothing_is_queued(
    tiny_served: Served, sampling: dict[str, Any], message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _ours(tiny_served, **sampling)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message), info.value.details()
    await wait_pool_free(tiny_served)


async def test_a_schema_past_the_compile_limit_is_invalid_argument(tiny_served: Served) -> None:
    from tests.engine.structured.test_grammar_compiler import nested_one_of

    grammars = tiny_served.engine._core.grammars
    grammars.compile_timeout_s, limit_s = 0.01, grammars.compile_timeout_s
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _ours(tiny_served, json_schema=json.dumps(nested_one_of(3, 8)))  # ~0.17 s to compile alone
    finally:
        grammars.compile_timeout_s = limit_s
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "sampling.json_schema: did not compile within 0.01 s "
        "(--structured-output-compile-timeout-s); simplify the grammar"
    )
    await wait_pool_free(tiny_served)


async def test_metrics_count_constrained_requests_and_time_compiles_and_masks(tiny_served: Served) -> None:
    import asyncio

    registry = tiny_served.server.metrics.registry  # type: ignore[attr-defined]

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return registry.get_sample_value(name, labels or {}) or 0.0

    await asyncio.sleep(1.2)  # two monitor ticks: the earlier tests' timings are observed by now
    before = value("nanoserve_structured_output_requests_total", {"kind": "regex"})
    masks_before = value("nanoserve_structured_output_mask_seconds_count")
    text, finish = await _ours(tiny_served, regex="[a-c]{4}", max_tokens=8)
    assert len(text) == 4
    num_steps = finish.usage.completion_tokens  # one mask per constrained step; a token may hold several letters
    for _ in range(100):  # the monitor refreshes every 0.5 s
        if value("nanoserve_structured_output_mask_seconds_count") - masks_before == num_steps:
            break
        await asyncio.sleep(0.05)
    assert value("nanoserve_structured_output_requests_total", {"kind": "regex"}) == before + 1
    assert value("nanoserve_structured_output_mask_seconds_count") - masks_before == num_steps
    assert value("nanoserve_structured_output_compile_seconds_count") >= 1


async def test_a_compiling_grammar_holds_up_no_other_request(tiny_served: Served, monkeypatch) -> None:
    import asyncio
    import threading

    grammars = tiny_served.engine._core.grammars
    compile_matcher, released = grammars.matcher, threading.Event()

    def slow_matcher(constraint):  # a compile that lasts until the other request has finished
        assert released.wait(20), "the unconstrained request did not finish while a grammar compiled"
        return compile_matcher(constraint)

    monkeypatch.setattr(grammars, "matcher", slow_matcher)
    constrained = asyncio.ensure_future(_ours(tiny_served, regex="[0-9]{2}"))
    await asyncio.sleep(0.2)  # the constrained request is waiting for its grammar
    text, finish = await _ours(tiny_served, max_tokens=4)
    assert (finish.reason, finish.usage.completion_tokens) == (pb.FINISH_REASON_LENGTH, 4)
    released.set()
    text, finish = await constrained
    assert re.fullmatch("[0-9]{2}", text)
