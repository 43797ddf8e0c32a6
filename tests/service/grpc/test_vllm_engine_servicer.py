"""vllm.grpc.engine.VllmEngine on a real server (the tiny random model): the same engine path as nanoserve.v1.

What the gateway relies on: token ids in, the same token ids out as our own API
for the same prompt (streamed as deltas, or all at once), aborts that free the
blocks, loads read from their owners, the tokenizer rebuilt from GetTokenizer,
and every refusal with its status and the field's path in this contract.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ..conftest import Served, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="What is a KV cache?")]


def _vllm(served: Served) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(served.channel)


def _ours(served: Served) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(served.channel)


async def _chat_ids(served: Served) -> list[int]:
    """The chat's prompt token ids, as a gateway would send them (rendered with the model's template)."""
    response = await _ours(served).Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=CHAT)))
    return list(response.token_ids)


async def _our_token_ids(served: Served, prompt_ids: list[int], **sampling: Any) -> tuple[list[int], pb.Finish]:
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt_ids), sampling=pb.SamplingParameters(temperature=0.0, **sampling)
    )
    responses = [r async for r in _ours(served).Generate(request)]
    return [t for r in responses for t in r.token_ids], responses[-1].finish


def _generate_request(prompt_ids: list[int], stream: bool = True, request_id: str = "", **sampling: Any):
    return vpb.GenerateRequest(
        request_id=request_id,
        tokenized=vpb.TokenizedInput(input_ids=prompt_ids),
        sampling_params=vpb.SamplingParams(temperature=0.0, **sampling),
        stream=stream,
    )


async def _collect(served: Served, request: vpb.GenerateRequest) -> list[vpb.GenerateResponse]:
    return [r async for r in _vllm(served).Generate(request)]


async def _read_rest(call: Any) -> list[vpb.GenerateResponse]:
    """The remaining messages of a call already read with ``read()``."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def _long_request(request_id: str) -> vpb.GenerateRequest:
    return _generate_request([1, 2, 3, 4], request_id=request_id, max_tokens=900, ignore_eos=True)


# ---- Generate ----------------------------------------------------------------------------


async def test_streamed_generate_sends_our_apis_token_ids_as_deltas_then_complete(tiny_served: Served) -> None:
    prompt_ids = await _chat_ids(tiny_served)
    expected, _ = await _our_token_ids(tiny_served, prompt_ids, max_tokens=24)
    responses = await _collect(tiny_served, _generate_request(prompt_ids, max_tokens=24))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds == ["chunk"] * (len(responses) - 1) + ["complete"]
    chunks = [r.chunk for r in responses[:-1]]
    assert [t for c in chunks for t in c.token_ids] == expected
    assert [c.completion_tokens for c in chunks] == [len(c.token_ids) for c in chunks]  # deltas
    assert {c.prompt_tokens for c in chunks} == {len(prompt_ids)}
    complete = responses[-1].complete
    assert (list(complete.output_ids), complete.finish_reason) == (expected, "length")
    # the same prompt through nanoserve.v1 just before left its whole blocks (4 tokens) cached, all but the last token's
    cached = (len(prompt_ids) - 1) // 4 * 4
    assert (complete.prompt_tokens, complete.completion_tokens, complete.cached_tokens) == (len(prompt_ids), 24, cached)


async def test_unstreamed_generate_sends_one_complete_with_every_token_id(tiny_served: Served) -> None:
    prompt_ids = await _chat_ids(tiny_served)
    expected, _ = await _our_token_ids(tiny_served, prompt_ids, max_tokens=16)
    [response] = await _collect(tiny_served, _generate_request(prompt_ids, stream=False, max_tokens=16))
    assert list(response.complete.output_ids) == expected
    assert response.complete.completion_tokens == 16


async def test_n_samples_stream_chunks_and_a_complete_each_with_their_index(tiny_served: Served) -> None:
    prompt_ids = await _chat_ids(tiny_served)
    expected, _ = await _our_token_ids(tiny_served, prompt_ids, max_tokens=8)
    responses = await _collect(tiny_served, _generate_request(prompt_ids, max_tokens=8, n=2))
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1]
    for index in (0, 1):  # greedy: each sample is the single greedy answer
        assert [t for c in chunks if c.index == index for t in c.token_ids] == expected
        [complete] = [c for c in completes if c.index == index]
        assert (list(complete.output_ids), complete.finish_reason, complete.completion_tokens) == (
            expected,
            "length",
            8,
        )
    [unstreamed] = [await _collect(tiny_served, _generate_request(prompt_ids, stream=False, max_tokens=8, n=2))]
    assert [(r.complete.index, list(r.complete.output_ids)) for r in unstreamed] == [(0, expected), (1, expected)]


async def test_prompt_logprobs_ride_the_first_chunk_or_the_complete(tiny_served: Served) -> None:
    prompt_ids = [5, 17, 300, 42, 9]
    streamed = await _collect(tiny_served, _generate_request(prompt_ids, max_tokens=4, prompt_logprobs=1))
    chunks = [r.chunk for r in streamed if r.WhichOneof("response") == "chunk"]
    assert [c.HasField("input_logprobs") for c in chunks] == [True] + [False] * (len(chunks) - 1)
    first = chunks[0].input_logprobs
    assert list(first.token_ids) == prompt_ids
    assert [e.HasField("value") for e in first.token_logprobs] == [False] + [True] * 4
    [unstreamed] = await _collect(
        tiny_served, _generate_request(prompt_ids, stream=False, max_tokens=4, prompt_logprobs=1)
    )
    assert list(unstreamed.complete.input_logprobs.token_logprobs) == list(first.token_logprobs)


async def test_a_text_prompt_is_tokenized_by_the_engine(tiny_served: Served) -> None:
    expected = tiny_served.engine.tokenizer.encode("Hello world")
    request = vpb.GenerateRequest(text="Hello world", sampling_params=vpb.SamplingParams(max_tokens=4), stream=False)
    [response] = await _collect(tiny_served, request)
    assert response.complete.prompt_tokens == len(expected)


async def test_a_stop_string_ends_generation_and_every_token_is_sent(tiny_served: Served) -> None:
    """The gateway detokenizes and trims the stop string itself: it needs the tokens that spell it."""
    prompt_ids = await _chat_ids(tiny_served)
    tokenizer = tiny_served.engine.tokenizer
    unstopped, _ = await _our_token_ids(tiny_served, prompt_ids, max_tokens=40)
    text = tokenizer.decode(unstopped)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    ours, finish = await _our_token_ids(tiny_served, prompt_ids, max_tokens=40, stop=[stop])
    assert finish.stop_string == stop
    [response] = await _collect(tiny_served, _generate_request(prompt_ids, stream=False, max_tokens=40, stop=[stop]))
    complete = response.complete
    assert (complete.finish_reason, complete.matched_stop_str) == ("stop", stop)
    assert list(complete.output_ids) == ours
    assert stop in tokenizer.decode(ours)


async def test_logprobs_stream_with_the_tokens_they_score(tiny_served: Served) -> None:
    prompt_ids = await _chat_ids(tiny_served)
    ours = [
        lp
        async for r in _ours(tiny_served).Generate(
            pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=prompt_ids),
                sampling=pb.SamplingParameters(temperature=0.0, max_tokens=6, logprobs=2),
            )
        )
        for lp in r.logprobs
    ]
    responses = await _collect(tiny_served, _generate_request(prompt_ids, max_tokens=6, logprobs=2))
    streamed = [r.chunk.output_logprobs for r in responses[:-1]]
    assert [t for lp in streamed for t in lp.token_ids] == [lp.token_id for lp in ours]
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx([lp.logprob for lp in ours])
    tops = [top for lp in streamed for top in lp.top_logprobs]
    assert [list(top.token_ids) for top in tops] == [[t.token_id for t in lp.top] for lp in ours]


async def test_abort_ends_the_named_streams_with_abort_and_skips_unknown_ids(tiny_served: Served) -> None:
    stub = _vllm(tiny_served)
    with structlog.testing.capture_logs() as logs:
        call = stub.Generate(_long_request("v-abort"))
        await call.read()
        await stub.Abort(vpb.AbortRequest(request_ids=["v-abort", "no-such-request"]))
        rest = await _read_rest(call)
        await wait_pool_free(tiny_served)
    assert rest[-1].complete.finish_reason == "abort"
    [line] = [e for e in logs if e["event"] == "request_finished" and e["request_id"] == "v-abort"]
    assert (line["api"], line["finish_reason"], line["cause"]) == ("vllm.grpc.engine", "abort", "abort_rpc")
    await stub.Abort(vpb.AbortRequest(request_ids=["no-such-request"]))  # an ended request: nothing to do


async def test_a_dropped_call_aborts_its_request_and_frees_its_blocks(tiny_served: Served) -> None:
    with structlog.testing.capture_logs() as logs:
        call = _vllm(tiny_served).Generate(_long_request("v-drop"))
        await call.read()
        call.cancel()
        status = await wait_pool_free(tiny_served)
        await asyncio.sleep(0.2)  # room for a second, wrong, record
    assert status.num_free == status.num_blocks
    [line] = [e for e in logs if e["event"] == "request_finished" and e["request_id"] == "v-drop"]
    assert (line["finish_reason"], line["cause"]) == ("abort", "cancelled")


# ---- management ------------------------------------------------------------------------------


async def test_health_check_is_healthy_while_the_engine_runs(tiny_served: Served) -> None:
    assert await _vllm(tiny_served).HealthCheck(vpb.HealthCheckRequest()) == vpb.HealthCheckResponse(
        healthy=True, message="serving"
    )


async def test_grpc_health_and_reflection_know_the_vllm_engine_service(tiny_served: Served) -> None:
    health = await health_pb2_grpc.HealthStub(tiny_served.channel).Check(
        health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine")
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(tiny_served.channel)
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="vllm.grpc.engine.VllmEngine")
    [response] = [r async for r in stub.ServerReflectionInfo(iter([request]))]
    assert response.HasField("file_descriptor_response")


async def test_model_info_describes_the_loaded_model(tiny_served: Served) -> None:
    info = tiny_served.engine.model_info
    response = await _vllm(tiny_served).GetModelInfo(vpb.GetModelInfoRequest())
    assert (response.served_model_name, response.model_path) == (info.model_name, info.model_name)
    assert response.tokenizer_path == f"nanoserve://{info.model_name}"
    assert (response.max_context_length, response.max_req_input_len, response.vocab_size) == (1024, 1023, 49152)
    assert list(response.eos_token_ids) == [0, 2]  # generation_config.json's [2, 0] and the tokenizer's EOS, sorted
    assert response.bos_token_id == 1
    assert response.is_generation


async def test_loads_and_server_info_read_the_engine_while_a_request_runs(tiny_served: Served) -> None:
    stub = _vllm(tiny_served)
    call = stub.Generate(_long_request("v-load"))
    await call.read()
    load = (await stub.GetLoads(vpb.GetLoadsRequest())).loads[0]
    server = await stub.GetServerInfo(vpb.GetServerInfoRequest())
    status = await allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel).GetPoolStatus(
        apb.GetPoolStatusRequest()
    )
    call.cancel()
    assert (load.num_running_reqs, load.num_waiting_reqs, load.max_running_requests) == (1, 0, 8)
    assert load.max_total_num_tokens == 512 * 4
    assert 0 < load.token_usage < 1
    assert server.active_requests == 1
    assert (server.block_size, server.max_num_seqs, server.server_type) == (4, 8, "nanoserve")
    await wait_pool_free(tiny_served)
    idle = (await stub.GetLoads(vpb.GetLoadsRequest())).loads[0]
    assert (idle.num_running_reqs, idle.num_used_tokens, idle.token_usage) == (0, 0, 0.0)
    assert status.num_running == 1


async def test_get_tokenizer_streams_files_that_rebuild_the_same_tokenizer(tiny_served: Served, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    chunks = [c async for c in _vllm(tiny_served).GetTokenizer(cpb.GetTokenizerRequest())]
    bundle = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks] == [""] * (len(chunks) - 1) + [hashlib.sha256(bundle).hexdigest()]
    with zipfile.ZipFile(io.BytesIO(bundle)) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": [0, 2], "bos_token_id": 1}
    rebuilt = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "Paged attention: blocks of 16 tokens, ünïcödé and 漢字."
    assert rebuilt.encode(text, add_special_tokens=False) == tiny_served.engine.tokenizer.encode(text)
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    rendered = rebuilt.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(rendered) == await _chat_ids(tiny_served)
    again = b"".join([c.data async for c in _vllm(tiny_served).GetTokenizer(cpb.GetTokenizerRequest())])
    assert again == bundle


# ---- refusals, table-driven ----------------------------------------------------------------------

Call = Callable[[vllm_engine_pb2_grpc.VllmEngineStub], Any]


async def _unary(call: Any) -> None:
    await call


async def _stream(call: Any) -> None:
    async for _ in call:
        pass


def _generate(**fields: Any) -> Call:
    return lambda stub: _stream(stub.Generate(vpb.GenerateRequest(**fields)))


def _tokens(ids: list[int], **sampling: Any) -> dict[str, Any]:
    return {"tokenized": vpb.TokenizedInput(input_ids=ids), "sampling_params": vpb.SamplingParams(**sampling)}


REFUSALS: list[tuple[str, Call, grpc.StatusCode, str]] = [
    ("Generate: no input", _generate(), grpc.StatusCode.INVALID_ARGUMENT, "input: give tokenized or text"),
    (
        "Generate: n above --max-parallel-samples",
        _generate(**_tokens([1, 2], n=17)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling_params.n: must be in [1, 16] (--max-parallel-samples), got 17",
    ),
    (
        "Generate: a regex that does not compile",
        _generate(**_tokens([1, 2], regex="[0-9")),
        grpc.StatusCode.INVALID_ARGUMENT,
        'sampling_params.regex: invalid regex "[0-9": unclosed character class at offset 0',
    ),
    (
        "Generate: empty prompt",
        _generate(**_tokens([])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokenized.input_ids: is empty (0 tokens)",
    ),
    (
        "Generate: token id outside the vocabulary",
        _generate(**_tokens([1, 49152])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokenized.input_ids[1]: token id 49152 outside the vocabulary [0, 49152)",
    ),
    (
        "Generate: prompt longer than max_req_input_len",
        _generate(**_tokens([1] * 1024)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokenized.input_ids: prompt has 1024 tokens; at most 1023",
    ),
    (
        "Generate: max_tokens past max_model_len",
        _generate(**_tokens([1, 2], max_tokens=2000)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling_params.max_tokens: prompt (2 tokens) + max_tokens (2000)",
    ),
    (
        "Generate: a stop token id outside the vocabulary",
        _generate(**_tokens([1, 2], stop_token_ids=[60000])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling_params.stop_token_ids[0]: token id 60000 outside the vocabulary",
    ),
    (
        "Generate: media",
        _generate(**_tokens([1, 2]), media_refs=vpb.MediaRefs(items=[vpb.MediaRef(url="data:,x")])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "media_refs: not supported: the model takes text only",
    ),
    (
        "GetLoads: another rank",
        lambda stub: _unary(stub.GetLoads(vpb.GetLoadsRequest(dp_rank=2))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "dp_rank: must be 0 or unset",
    ),
    (
        "FlushCache: a negative timeout",
        lambda stub: _unary(stub.FlushCache(cpb.FlushCacheRequest(timeout_s=-1))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "timeout_s: must be a finite number of seconds >= 0, got -1",
    ),
    (
        "SubscribeKvEvents: a start in an epoch still to come",
        lambda stub: _stream(stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=10**12))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "start_sequence_number: must be at most ",
    ),
    (
        "SubscribeKvEvents: a start past this epoch's next batch",
        lambda stub: _stream(
            stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=(1 << 32) + 10**6))
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "start_sequence_number: must be at most ",
    ),
    (
        "Embed",
        lambda stub: _unary(stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[1])))),
        grpc.StatusCode.UNIMPLEMENTED,
        "Embed: nanoserve serves generation only",
    ),
    (
        "StartProfile",
        lambda stub: _unary(stub.StartProfile(cpb.StartProfileRequest())),
        grpc.StatusCode.UNIMPLEMENTED,
        "StartProfile: nanoserve has no profiler to start",
    ),
    (
        "StopProfile",
        lambda stub: _unary(stub.StopProfile(cpb.StopProfileRequest())),
        grpc.StatusCode.UNIMPLEMENTED,
        "StopProfile: nanoserve has no profiler to stop",
    ),
]


@pytest.mark.parametrize(("call", "code", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
async def test_each_rpcs_refusals_carry_their_status_and_name_the_field(
    tiny_served: Served, call: Call, code: grpc.StatusCode, message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(_vllm(tiny_served))
    assert info.value.code() == code
    assert info.value.details().startswith(message), info.value.details()


async def test_a_live_request_id_again_is_already_exists(tiny_served: Served) -> None:
    stub = _vllm(tiny_served)
    call = stub.Generate(_long_request("v-twice"))
    await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _stream(stub.Generate(_long_request("v-twice")))
    call.cancel()
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    await wait_pool_free(tiny_served)


async def test_the_pool_audits_clean_after_every_vllm_call(tiny_served: Served) -> None:
    await wait_pool_free(tiny_served)
    report = await allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel).Audit(apb.AuditRequest())
    assert report.clean, report.summary


async def test_flush_cache_waits_for_the_busy_pool_then_empties_the_cache(tiny_served: Served) -> None:
    stub = _vllm(tiny_served)
    await _stream(stub.Generate(vpb.GenerateRequest(**_tokens(list(range(100, 121)), max_tokens=2))))
    busy = stub.Generate(_long_request("v-flush-busy"))
    await busy.read()
    refused = await stub.FlushCache(cpb.FlushCacheRequest(timeout_s=0))
    assert not refused.success
    assert "blocks are held by 1 running requests" in refused.message
    flushing = asyncio.ensure_future(stub.FlushCache(cpb.FlushCacheRequest(timeout_s=30)))
    await asyncio.sleep(0.2)
    assert not flushing.done()  # it waits for the running request
    await stub.Abort(vpb.AbortRequest(request_ids=["v-flush-busy"]))
    reply = await flushing
    assert reply.success, reply.message
    assert reply.message.startswith("prefix cache reset: ")
    status = await wait_pool_free(tiny_served)
    assert (status.num_cached, status.num_cached_free) == (0, 0)


async def test_the_complete_message_reports_the_cached_prompt_tokens(tiny_served: Served) -> None:
    stub = _vllm(tiny_served)
    prompt = list(range(300, 321))  # 5 whole blocks of 4 and one token
    cached = []
    for _ in range(2):
        responses = [r async for r in stub.Generate(vpb.GenerateRequest(**_tokens(prompt, max_tokens=2)))]
        cached.append(responses[-1].complete.cached_tokens)
    assert cached == [0, 20]
