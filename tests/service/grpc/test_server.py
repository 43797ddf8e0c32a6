"""The gRPC service end to end: a real server on 127.0.0.1, the real SmolLM2."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import structlog
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ..conftest import MAX_NUM_SEQS, MAX_NUM_WAITING, NUM_KV_BLOCKS, Served, engine_config, wait_pool_free

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]

CHAT = [pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="What is the capital of France?")]
# SmolLM2-135M-Instruct, float32, greedy, 24 tokens
EXPECTED_CHAT_TEXT = "The capital of France is Paris."


def _generation(served: Served) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(served.channel)


def _allocation(served: Served) -> allocation_pb2_grpc.AllocationServiceStub:
    return allocation_pb2_grpc.AllocationServiceStub(served.channel)


def _long_request(request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt="Count from one to one thousand: one, two,",
        sampling=pb.SamplingParameters(max_tokens=400, temperature=0.0, ignore_eos=True),
    )


async def _read_rest(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    """The remaining messages of a call already read with ``read()``."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def _collect(
    stub: generation_pb2_grpc.GenerationServiceStub, request: pb.GenerateRequest
) -> list[pb.GenerateResponse]:
    return [response async for response in stub.Generate(request)]


async def test_chat_request_streams_the_greedy_text(served: Served) -> None:
    request = pb.GenerateRequest(
        request_id="chat-1",
        chat=pb.ChatMessages(messages=CHAT),
        sampling=pb.SamplingParameters(max_tokens=24, temperature=0.0),
    )
    responses = await _collect(_generation(served), request)
    assert "".join(r.text for r in responses) == EXPECTED_CHAT_TEXT
    assert all(r.request_id == "chat-1" for r in responses)
    assert [r.HasField("finish") for r in responses] == [False] * (len(responses) - 1) + [True]
    finish = responses[-1].finish
    assert finish.reason == pb.FINISH_REASON_STOP
    assert not finish.HasField("stop_reason")  # EOS: neither a stop string nor a stop token id
    num_tokens = sum(len(r.token_ids) for r in responses)
    assert finish.usage.completion_tokens == num_tokens
    timings = finish.timings
    queue_s, ttft_s, total_s = (d.ToNanoseconds() / 1e9 for d in (timings.queue_time, timings.ttft, timings.total_time))
    assert all(timings.HasField(name) for name in ("queue_time", "ttft", "total_time"))
    assert 0 <= queue_s <= ttft_s <= total_s
    info = await _generation(served).GetModelInfo(pb.GetModelInfoRequest())
    assert responses[-1].token_ids[-1] in info.eos_token_ids  # the model's EOS ended it


async def test_server_assigns_a_request_id_when_empty(served: Served) -> None:
    request = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParameters(max_tokens=2, temperature=0.0))
    responses = await _collect(_generation(served), request)
    assert len(responses[0].request_id) == 32
    assert {r.request_id for r in responses} == {responses[0].request_id}


async def test_sixteen_concurrent_streams_complete_and_audit_is_clean(served: Served) -> None:
    stub = _generation(served)
    requests = [
        pb.GenerateRequest(
            request_id=f"c{i}",
            prompt=f"Write a short note number {i} about the sea.",
            sampling=pb.SamplingParameters(max_tokens=8 + i, temperature=0.0, ignore_eos=True),
        )
        for i in range(16)
    ]
    results = await asyncio.gather(*(_collect(stub, r) for r in requests))
    for i, responses in enumerate(results):
        assert responses[-1].finish.reason == pb.FINISH_REASON_LENGTH
        assert responses[-1].finish.usage.completion_tokens == 8 + i
    await wait_pool_free(served)
    report = await _allocation(served).Audit(apb.AuditRequest())
    assert list(report.violations) == []


async def test_audit_of_the_servers_own_epoch_reports_it_live(served: Served) -> None:
    report = await _allocation(served).Audit(apb.AuditRequest())
    assert not report.closed
    head = report.summary.splitlines()[0]
    assert head.endswith(", open (live: this server's epoch)"), head
    assert list(report.held_blocks) == []


async def test_cancel_mid_stream_frees_the_blocks(served: Served) -> None:
    call = _generation(served).Generate(_long_request("cancel-me"))
    received = 0
    async for _ in call:
        received += 1
        if received == 3:
            break
    call.cancel()
    status = await wait_pool_free(served, timeout_s=2.0)
    assert status.num_free == NUM_KV_BLOCKS
    stored = await _stored_events(served)
    assert _return_reasons(stored, "cancel-me") == {"aborted"}


async def test_n_samples_stream_with_their_index_and_each_ends_with_its_finish(served: Served) -> None:
    single = await _collect(
        _generation(served),
        pb.GenerateRequest(prompt="Count to five:", sampling=pb.SamplingParameters(temperature=0, max_tokens=6)),
    )
    request = pb.GenerateRequest(
        prompt="Count to five:", sampling=pb.SamplingParameters(temperature=0, max_tokens=6, n=2)
    )
    responses = await _collect(_generation(served), request)
    expected = [t for r in single for t in r.token_ids]
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        assert [t for r in mine for t in r.token_ids] == expected
        assert [r.HasField("finish") for r in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish.usage.completion_tokens == 6
    ranked = await _collect(
        _generation(served),
        pb.GenerateRequest(
            prompt="Count to five:", sampling=pb.SamplingParameters(temperature=0, max_tokens=6, n=1, best_of=3)
        ),
    )
    assert [(r.index, list(r.token_ids), r.HasField("finish")) for r in ranked] == [(0, expected, True)]


async def test_a_logit_bias_forbidding_the_greedy_first_token_changes_it(served: Served) -> None:
    sampling = pb.SamplingParameters(temperature=0, max_tokens=3)
    [first, *_] = [
        t
        for r in await _collect(_generation(served), pb.GenerateRequest(prompt="Count to five:", sampling=sampling))
        for t in r.token_ids
    ]
    sampling.logit_bias[first] = -100.0
    biased = [
        t
        for r in await _collect(_generation(served), pb.GenerateRequest(prompt="Count to five:", sampling=sampling))
        for t in r.token_ids
    ]
    assert biased[0] != first


async def test_prompt_logprobs_come_once_on_the_first_message(served: Served) -> None:
    prompt = pb.TokenIds(ids=[1, 504, 2821, 282, 4649, 314])
    sampling = pb.SamplingParameters(temperature=0, max_tokens=4, prompt_logprobs=1)
    responses = await _collect(_generation(served), pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling))
    assert [len(r.prompt_logprobs) for r in responses] == [5] + [0] * (len(responses) - 1)
    assert [e.token_id for e in responses[0].prompt_logprobs] == list(prompt.ids[1:])
    assert all(len(e.top) == 1 and e.logprob <= 0 for e in responses[0].prompt_logprobs)


async def test_cancel_mid_stream_of_n_samples_frees_every_block(served: Served) -> None:
    request = _long_request("cancel-samples")
    request.sampling.n = 4
    call = _generation(served).Generate(request)
    received = 0
    async for _ in call:
        received += 1
        if received == 8:
            break
    call.cancel()
    status = await wait_pool_free(served, timeout_s=2.0)
    assert status.num_free == NUM_KV_BLOCKS


async def test_deadline_exceeded_aborts_the_request(served: Served) -> None:
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in _generation(served).Generate(_long_request("deadline"), timeout=0.5):
            received.append(response)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received
    assert not received[-1].HasField("finish")
    await wait_pool_free(served, timeout_s=2.0)
    stored = await _stored_events(served)
    assert _return_reasons(stored, "deadline") == {"aborted"}


async def test_abort_ends_the_stream_with_finish_reason_abort(served: Served) -> None:
    stub = _generation(served)
    call = stub.Generate(_long_request("abort-me"))
    first = await call.read()
    assert first.request_id == "abort-me"
    await stub.Abort(pb.AbortRequest(request_id="abort-me"))
    rest = await _read_rest(call)
    assert rest[-1].finish.reason == pb.FINISH_REASON_ABORT
    await wait_pool_free(served)


async def test_abort_of_unknown_request_is_not_found(served: Served) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _generation(served).Abort(pb.AbortRequest(request_id="nobody"))
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.NOT_FOUND,
        "request_id: no live request 'nobody'",
    )


async def test_duplicate_live_request_id_is_already_exists(served: Served) -> None:
    stub = _generation(served)
    call = stub.Generate(_long_request("twin"))
    await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub, _long_request("twin"))
    call.cancel()
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "twin" in info.value.details()
    await wait_pool_free(served)


@pytest.mark.parametrize(
    ("request_", "details"),
    [
        (pb.GenerateRequest(), "input: give exactly one of prompt, prompt_token_ids or chat; none was set"),
        (
            pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(content="hi")])),
            "chat.messages[0].role: must be one of CHAT_ROLE_SYSTEM, CHAT_ROLE_USER, CHAT_ROLE_ASSISTANT, "
            "got CHAT_ROLE_UNSPECIFIED (unset)",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(max_tokens=0)),
            "sampling.max_tokens: must be >= 1, got 0",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(temperature=-1.0)),
            "sampling.temperature: must be finite and >= 0 (0, or below 1e-05: greedy), got -1.0",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(top_p=0.0)),
            "sampling.top_p: must be in (0, 1], got 0.0",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(top_p=1.5)),
            "sampling.top_p: must be in (0, 1], got 1.5",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(stop=["a"] * 17)),
            "sampling.stop: at most 16 stop strings, got 17",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(stop=[""])),
            "sampling.stop[0]: must be a non-empty string, got ''",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(n=0)),
            "sampling.n: must be an integer >= 1, got 0",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(n=17)),
            "sampling.n: must be in [1, 16] (--max-parallel-samples), got 17",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(n=3, best_of=2)),
            "sampling.best_of: must be an integer >= n (3) or unset, got 2",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(logit_bias={5: 200.0})),
            "sampling.logit_bias[5]: must be in [-100, 100], got 200.0",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(logit_bias={49152: 1.0})),
            "sampling.logit_bias[49152]: token id 49152 outside the vocabulary [0, 49152)",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(prompt_logprobs=21)),
            "sampling.prompt_logprobs: must be in [0, 20], got 21",
        ),
        (
            pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParameters(truncate_prompt_tokens=-2)),
            "sampling.truncate_prompt_tokens: must be -1 (the model's limit) or an integer >= 1, got -2",
        ),
    ],
    ids=[
        "empty-input",
        "unset-role",
        "max-tokens",
        "temperature",
        "top-p-zero",
        "top-p-above-one",
        "too-many-stops",
        "empty-stop",
        "n-zero",
        "n-above-limit",
        "best-of-below-n",
        "logit-bias-range",
        "logit-bias-vocab",
        "prompt-logprobs-above-20",
        "truncate-below-minus-one",
    ],
)
async def test_bad_request_is_invalid_argument(served: Served, request_: pb.GenerateRequest, details: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(_generation(served), request_)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)


async def test_prompt_longer_than_max_model_len_is_invalid_argument_naming_the_prompt(served: Served) -> None:
    """Issue 8, fault 4: the prompt alone is over the limit, so the message names the prompt."""
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[42] * 1100), sampling=pb.SamplingParameters(max_tokens=1)
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(_generation(served), request)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_token_ids.ids: prompt has 1100 tokens; at most 1023 leave room for one generated token "
        "(max_model_len 1024, KV pool 4096 tokens)",
    )


async def test_max_tokens_past_max_model_len_names_the_protobuf_field(served: Served) -> None:
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[42] * 1000), sampling=pb.SamplingParameters(max_tokens=100)
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(_generation(served), request)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling.max_tokens: prompt (1000 tokens) + max_tokens (100) = 1100 exceeds max_model_len (1024)",
    )


async def test_queue_full_is_resource_exhausted(served: Served) -> None:
    stub = _generation(served)
    calls = [stub.Generate(_long_request(f"run{i}")) for i in range(MAX_NUM_SEQS)]
    for call in calls:
        await call.read()  # running
    waiting = [stub.Generate(_long_request(f"wait{i}")) for i in range(MAX_NUM_WAITING)]
    waiting_tasks = [asyncio.ensure_future(call.read()) for call in waiting]
    allocation = _allocation(served)
    while (await allocation.GetPoolStatus(apb.GetPoolStatusRequest())).num_waiting < MAX_NUM_WAITING:
        await asyncio.sleep(0.02)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub, _long_request("one-too-many"))
    for call in calls + waiting:
        call.cancel()
    for task in waiting_tasks:
        task.cancel()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"max_num_waiting {MAX_NUM_WAITING}" in info.value.details()
    status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
    assert status is not None
    retry = error_details_pb2.RetryInfo()
    assert [detail.Unpack(retry) for detail in status.details] == [True]
    assert retry.retry_delay == Duration(seconds=1)
    await wait_pool_free(served)


async def test_a_message_over_the_size_limit_is_refused_by_grpc_and_the_limit_follows_max_model_len(
    served: Served,
) -> None:
    """Issue 8, fault 5: the limit is derived from max_model_len; over it, gRPC's own RESOURCE_EXHAUSTED."""
    server = served.server
    info = served.engine.model_info
    assert server.max_request_bytes == info.max_prompt_bytes + 64 * 1024  # type: ignore[attr-defined]
    assert info.max_prompt_bytes == 1023 * served.engine.tokenizer.max_token_bytes
    big = pb.GenerateRequest(prompt="x" * (server.max_request_bytes + 1))  # type: ignore[attr-defined]
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{server.port}",
        options=[("grpc.max_send_message_length", 16 << 20)],  # type: ignore[attr-defined]
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info_:
            await _collect(generation_pb2_grpc.GenerationServiceStub(channel), big)
    assert info_.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_num_waiting" not in (info_.value.details() or "")


async def test_a_prompt_too_long_by_its_length_alone_is_invalid_argument_not_tokenized(served: Served) -> None:
    text = "x" * 100_000  # under the message limit, over what 1023 tokens can hold
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(_generation(served), pb.GenerateRequest(prompt=text))
    bound = -(-len(text) // served.engine.tokenizer.max_token_bytes)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"prompt: 100000 bytes of text are at least {bound} tokens; a prompt may have at most 1023 tokens "
        "(max_model_len 1024, KV pool 4096 tokens, one token left to generate)",
    )


async def test_health_is_serving_overall_and_per_service(served: Served) -> None:
    stub = health_pb2_grpc.HealthStub(served.channel)
    for service in (
        "",
        "nanoserve.v1.GenerationService",
        "nanoserve.v1.AllocationService",
        "vllm.grpc.engine.VllmEngine",
    ):
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_reflection_lists_the_services(served: Served) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    responses = [
        r async for r in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    ]
    names = sorted(s.name for s in responses[0].list_services_response.service)
    assert names == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "nanoserve.v1.AllocationService",
        "nanoserve.v1.GenerationService",
        "vllm.grpc.engine.VllmEngine",
    ]


async def test_model_info_describes_smollm2(served: Served) -> None:
    from nanoserve.engine.model import kernels

    info = await _generation(served).GetModelInfo(pb.GetModelInfoRequest())
    assert (info.max_model_len, info.block_size, info.num_blocks, info.vocab_size) == (1024, 16, NUM_KV_BLOCKS, 49152)
    assert info.dtype == "float32"
    # auto: float16 for a float32 model on nanoserve's GGUF kernels (llama.cpp's cache type), else the model's
    assert info.kv_cache_dtype == ("float16" if kernels.load() else "float32")
    assert info.has_chat_template
    assert list(info.eos_token_ids) == sorted(served.engine.tokenizer.eos_token_ids)
    assert list(info.eos_token_ids) == [2]  # SmolLM2's <|im_end|>


async def test_tokenize_text_matches_the_engine_tokenizer(served: Served) -> None:
    response = await _generation(served).Tokenize(pb.TokenizeRequest(text="Hello world"))
    assert list(response.token_ids) == served.engine.tokenizer.encode("Hello world")


async def test_watch_events_from_zero_sees_every_event_without_gap(served: Served) -> None:
    allocation = _allocation(served)
    watch = allocation.WatchEvents(apb.WatchEventsRequest(from_seq=0))
    seen: list[apb.AllocationEvent] = []

    async def read_until(last_seq: int) -> None:
        async for response in watch:
            seen.append(response.event)
            if response.event.seq >= last_seq:
                return

    stub = _generation(served)
    requests = [
        pb.GenerateRequest(
            prompt=f"Tell me about the number {i}.",
            sampling=pb.SamplingParameters(max_tokens=40, temperature=0.0, ignore_eos=True),
        )
        for i in range(6)
    ]
    reader = asyncio.ensure_future(read_until(10**9))
    await asyncio.gather(*(_collect(stub, r) for r in requests))
    status = await wait_pool_free(served)
    deadline = asyncio.get_running_loop().time() + 10
    while (not seen or seen[-1].seq < status.last_seq) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    reader.cancel()
    watch.cancel()
    assert [e.seq for e in seen][: status.last_seq] == list(range(1, status.last_seq + 1))
    assert seen[0].kind == apb.EVENT_KIND_POOL_INIT
    stored = {e.seq: e for e in await _stored_events(served)}
    for event in seen[: status.last_seq]:  # every event crosses with its kind, reason and times
        assert apb.EventKind.Name(event.kind) == f"EVENT_KIND_{stored[event.seq].kind.upper()}"
        reason = stored[event.seq].reason
        assert apb.FreeReason.Name(event.free_reason) == (
            f"FREE_REASON_{reason.upper()}" if reason else "FREE_REASON_UNSPECIFIED"
        )
        assert event.wall_time.ToNanoseconds() == stored[event.seq].wall_time_ns
        assert event.monotonic_time.ToNanoseconds() == stored[event.seq].monotonic_ns
    # this test's six requests ran to max_tokens: their blocks went back as finished
    assert apb.FREE_REASON_FINISHED in {e.free_reason for e in seen if e.kind == apb.EVENT_KIND_FREE_ALL}


async def test_event_log_lag_gauge_falls_to_zero_once_the_log_is_durable(served: Served) -> None:
    """Issue 8, fault 6: the gauge reads the log's progress from the log, not from a copy taken after a step."""
    from nanoserve.service.grpc.server import MONITOR_INTERVAL_S

    await _collect(_generation(served), pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParameters(max_tokens=3)))
    await wait_pool_free(served)  # idle, and every event durable
    await asyncio.sleep(3 * MONITOR_INTERVAL_S)
    assert _metric(served, "nanoserve_event_log_lag_events") == 0.0


async def test_metrics_count_finished_requests(served: Served) -> None:
    request = pb.GenerateRequest(
        prompt="Hi", sampling=pb.SamplingParameters(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    before = _metric(served, 'nanoserve_requests_total{finish_reason="length"}')
    await _collect(_generation(served), request)
    assert _metric(served, 'nanoserve_requests_total{finish_reason="length"}') == before + 1


async def test_metrics_and_pool_status_count_forked_and_copied_blocks(served: Served) -> None:
    from nanoserve.service.grpc.server import MONITOR_INTERVAL_S

    before = await _allocation(served).GetPoolStatus(apb.GetPoolStatusRequest())
    prompt = pb.TokenIds(ids=list(range(100, 119)))  # 19 tokens: one full block of 16 and a partial one
    sampling = pb.SamplingParameters(max_tokens=2, temperature=0.0, ignore_eos=True, n=3)
    await _collect(_generation(served), pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling))
    status = await _allocation(served).GetPoolStatus(apb.GetPoolStatusRequest())
    assert status.num_forked_blocks - before.num_forked_blocks == 3 * 2
    assert status.num_copied_blocks - before.num_copied_blocks == 3
    await asyncio.sleep(3 * MONITOR_INTERVAL_S)
    assert _metric(served, "nanoserve_kv_blocks_forked_total") == status.num_forked_blocks
    assert _metric(served, "nanoserve_kv_blocks_copied_total") == status.num_copied_blocks


async def test_metrics_measure_the_wait_for_the_journal(served: Served) -> None:
    request = pb.GenerateRequest(
        prompt="Hi", sampling=pb.SamplingParameters(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    before = _metric(served, "nanoserve_journal_durability_wait_seconds_count")
    await _collect(_generation(served), request)
    # one step per token, each waited for its journal batch (a step may bring outputs of other requests too)
    assert _metric(served, "nanoserve_journal_durability_wait_seconds_count") >= before + 4
    assert _metric(served, "nanoserve_journal_durability_wait_seconds_sum") > 0


def _metric(served: Served, name: str) -> float:
    port = served.server.metrics_port  # type: ignore[attr-defined]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def test_token_check_refuses_calls_without_the_token(served: Served) -> None:
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer

    guarded = NanoServer(
        served.engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=None, auth_token="s3cret"), owns_engine=False
    )
    await guarded.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{guarded.port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info_ok = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer s3cret"),))
            assert info_ok.block_size == 16
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await guarded.stop(0)


def _return_reasons(stored: list, owner: str) -> set[str | None]:
    """The reasons of the events that gave ``owner``'s blocks back: FREE / FREE_ALL for blocks
    no other request can reuse, RELEASE for full blocks the prefix cache keeps (a request
    stopped when its last block was just filled holds only those)."""
    return {e.reason for e in stored if e.owner == owner and e.kind in ("free", "free_all", "release")}


async def _stored_events(served: Served) -> list:
    from nanoserve.allocator.log import read_events

    event_log = served.engine.event_log
    return await asyncio.to_thread(read_events, served.log_url, event_log.pool_id, event_log.epoch)


async def test_tls_serves_a_client_that_trusts_the_certificate(served: Served, tmp_path: Path) -> None:
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=None, tls_cert=str(cert), tls_key=str(key))
    secured = NanoServer(served.engine, config, owns_engine=False)
    await secured.start()
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{secured.port}", credentials) as channel:
            info = await generation_pb2_grpc.GenerationServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest())
            assert info.block_size == 16
        async with grpc.aio.insecure_channel(f"127.0.0.1:{secured.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generation_pb2_grpc.GenerationServiceStub(plain).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await secured.stop(0)


async def _cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "nanoserve.service.cli.main",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    return process.returncode or 0, stdout.decode(), stderr.decode()


async def test_generate_cli_streams_the_chat_completion(served: Served) -> None:
    server = f"127.0.0.1:{served.server.port}"  # type: ignore[attr-defined]
    code, stdout, stderr = await _cli(
        "generate",
        "--server",
        server,
        "--chat",
        "What is the capital of France?",
        "--max-tokens",
        "24",
        "--temperature",
        "0",
    )
    assert code == 0, stderr
    assert stdout == EXPECTED_CHAT_TEXT + "\n"
    assert stderr.startswith("[stop; ")


async def test_generate_cli_prints_each_of_n_samples_whole_under_its_index(served: Served) -> None:
    server = f"127.0.0.1:{served.server.port}"  # type: ignore[attr-defined]
    question = ("--chat", "What is the capital of France?", "--max-tokens", "24", "--temperature", "0")
    code, stdout, stderr = await _cli("generate", "--server", server, *question, "--n", "2")
    assert code == 0, stderr
    assert stdout == f"--- sample 0 ---\n{EXPECTED_CHAT_TEXT}\n--- sample 1 ---\n{EXPECTED_CHAT_TEXT}\n"
    assert [line.split(":")[0] for line in stderr.splitlines()] == ["sample 0", "sample 1"]


async def test_generate_cli_json_prints_one_object_per_message(served: Served) -> None:
    server = f"127.0.0.1:{served.server.port}"  # type: ignore[attr-defined]
    code, stdout, stderr = await _cli(
        "generate",
        "--server",
        server,
        "--json",
        "--request-id",
        "json-1",
        "Hello",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
        "--ignore-eos",
    )
    assert code == 0, stderr
    messages = [json.loads(line) for line in stdout.splitlines()]
    assert {m["request_id"] for m in messages} == {"json-1"}
    assert sum(len(m.get("token_ids", [])) for m in messages) == 3
    assert messages[-1]["finish"]["reason"] == "FINISH_REASON_LENGTH"
    assert messages[-1]["finish"]["timings"]["total_time"].endswith("s")  # a Duration: "0.123456789s"


async def test_generate_cli_error_before_any_text_starts_with_error(served: Served) -> None:
    server = f"127.0.0.1:{served.server.port}"  # type: ignore[attr-defined]
    # a limit only the server knows (max_model_len): --max-tokens 0 is refused by the CLI itself now (exit 2)
    code, stdout, stderr = await _cli("generate", "--server", server, "Hi", "--max-tokens", "1000000")
    assert (code, stdout) == (1, "")
    assert stderr.startswith("error: INVALID_ARGUMENT: sampling.max_tokens: ")


async def test_generate_cli_ctrl_c_exits_130_quietly_and_the_server_aborts(served: Served) -> None:
    server = f"127.0.0.1:{served.server.port}"  # type: ignore[attr-defined]
    with structlog.testing.capture_logs() as logs:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nanoserve.service.cli.main",
            "generate",
            "--server",
            server,
            "--request-id",
            "ctrl-c",
            "--max-tokens",
            "400",
            "--ignore-eos",
            "--temperature",
            "0",
            "Count from one to one thousand: one, two,",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        assert process.stderr is not None
        first = await asyncio.wait_for(process.stdout.read(1), timeout=60)
        process.send_signal(signal.SIGINT)
        rest, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
        await _settle(served)
    assert process.returncode == 130, (stderr.decode(), len(first + rest))
    assert stderr.decode() == ""
    assert first
    assert (first + rest).endswith(b"\n")
    assert not (first + rest).endswith(b"\n\n")
    [line] = _finished_lines(logs, "ctrl-c")
    assert (line["finish_reason"], line["cause"]) == ("abort", "cancelled")


async def test_health_cli_exit_codes(served: Served) -> None:
    server = f"127.0.0.1:{served.server.port}"  # type: ignore[attr-defined]
    assert await _cli("health", "--server", server) == (0, "SERVING\n", "")
    code, _, _ = await _cli("health", "--server", "127.0.0.1:1", "--timeout", "1")
    assert code == 2


async def test_health_cli_unknown_service_exits_3_naming_the_known_ones(served: Served) -> None:
    server = f"127.0.0.1:{served.server.port}"  # type: ignore[attr-defined]
    assert await _cli("health", "--server", server, "--service", "bogus") == (
        3,
        "",
        f"{server}: unknown service 'bogus'; known: '', 'nanoserve.v1.GenerationService', "
        "'nanoserve.v1.AllocationService', 'vllm.grpc.engine.VllmEngine'\n",
    )


async def test_watch_events_with_max_events_per_message_sends_the_same_events_in_fewer_messages(
    served: Served,
) -> None:
    stub = _generation(served)
    requests = [
        pb.GenerateRequest(
            prompt=f"Name the colour {i}.",
            sampling=pb.SamplingParameters(max_tokens=40, temperature=0.0, ignore_eos=True),
        )
        for i in range(3)
    ]
    await asyncio.gather(*(_collect(stub, r) for r in requests))
    status = await wait_pool_free(served)  # every event stored: the catch-up reads them all
    allocation = _allocation(served)

    async def watch(max_per_message: int, until_seq: int) -> list[apb.WatchEventsResponse]:
        request = apb.WatchEventsRequest(from_seq=1, max_events_per_message=max_per_message)
        call = allocation.WatchEvents(request)
        messages: list[apb.WatchEventsResponse] = []
        async for response in call:
            messages.append(response)
            if (response.events[-1] if response.events else response.event).seq >= until_seq:
                break
        call.cancel()
        return messages

    singles = await watch(1, status.last_seq)
    batches = await watch(8, status.last_seq)
    assert [len(m.events) for m in batches] == [8] * (status.last_seq // 8) + (
        [status.last_seq % 8] if status.last_seq % 8 else []
    )
    assert not any(m.HasField("event") for m in batches)
    assert [e for m in batches for e in m.events] == [m.event for m in singles]
    assert [e.seq for m in batches for e in m.events] == list(range(1, status.last_seq + 1))

    # caught up, each live event goes out as it comes: one a message
    call = allocation.WatchEvents(apb.WatchEventsRequest(from_seq=status.last_seq + 1, max_events_per_message=64))
    live: list[apb.WatchEventsResponse] = []

    async def read_live(until_seq: int) -> None:
        async for response in call:
            live.append(response)
            if response.events[-1].seq >= until_seq:
                return

    reader = asyncio.ensure_future(read_live(10**9))
    await asyncio.sleep(0.2)  # subscribed
    await _collect(stub, requests[0])
    after = await wait_pool_free(served)
    deadline = asyncio.get_running_loop().time() + 10
    while (not live or live[-1].events[-1].seq < after.last_seq) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    reader.cancel()
    call.cancel()
    assert [e.seq for m in live for e in m.events] == list(range(status.last_seq + 1, after.last_seq + 1))
    assert {len(m.events) for m in live} == {1}


@pytest.mark.parametrize("max_per_message", [-1, 1025])
async def test_watch_events_refuses_max_events_per_message_outside_its_range(
    served: Served, max_per_message: int
) -> None:
    call = _allocation(served).WatchEvents(apb.WatchEventsRequest(from_seq=1, max_events_per_message=max_per_message))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == f"max_events_per_message: must be in [0, 1024], got {max_per_message}"


async def test_watch_events_catches_up_from_the_log_after_falling_behind(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanoserve.allocator.log import EventStream
    from nanoserve.service.grpc import event_follower
    from nanoserve.service.grpc.allocation_servicer import AllocationServicer

    subscriptions = []

    class CountedEventStream(EventStream):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            subscriptions.append(self)

    monkeypatch.setattr(event_follower, "EventStream", CountedEventStream)
    # a subscriber allowed to buffer 2 live events falls behind at once
    servicer = AllocationServicer(served.engine, max_queued_events=2)
    start = await wait_pool_free(served)
    events = servicer.WatchEvents(apb.WatchEventsRequest(from_seq=start.last_seq + 1), context=None)
    first = asyncio.ensure_future(events.__anext__())  # subscribes, then waits for the first new event
    await asyncio.sleep(0.2)
    requests = [
        pb.GenerateRequest(
            prompt=f"Say {i}.", sampling=pb.SamplingParameters(max_tokens=20, temperature=0.0, ignore_eos=True)
        )
        for i in range(4)
    ]
    await asyncio.gather(*(_collect(_generation(served), r) for r in requests))
    end = await wait_pool_free(served)
    seqs = [apb.WatchEventsResponse.FromString(await first).event.seq]  # the servicer yields them serialized
    while seqs[-1] < end.last_seq:
        seqs.append(
            apb.WatchEventsResponse.FromString(await asyncio.wait_for(events.__anext__(), timeout=10)).event.seq
        )
    await events.aclose()
    assert seqs == list(range(start.last_seq + 1, end.last_seq + 1))
    assert len(subscriptions) >= 2  # cut off at least once, resubscribed, caught up from the store


def _finished_lines(logs: list[dict], request_id: str) -> list[dict]:
    return [e for e in logs if e["event"] == "request_finished" and e["request_id"] == request_id]


async def _settle(served: Served) -> None:
    await wait_pool_free(served)
    await asyncio.sleep(0.2)  # room for a second, wrong, record to show up


async def test_cancelled_stream_is_counted_and_logged_once_as_abort(served: Served) -> None:
    before = _metric(served, 'nanoserve_requests_total{finish_reason="abort"}')
    with structlog.testing.capture_logs() as logs:
        call = _generation(served).Generate(_long_request("cancel-count"))
        await call.read()
        call.cancel()
        await _settle(served)
    assert _metric(served, 'nanoserve_requests_total{finish_reason="abort"}') == before + 1
    [line] = _finished_lines(logs, "cancel-count")
    assert (line["finish_reason"], line["cause"]) == ("abort", "cancelled")
    assert line["completion_tokens"] >= 1


async def test_deadline_exceeded_stream_is_counted_and_logged_once_as_abort(served: Served) -> None:
    before = _metric(served, 'nanoserve_requests_total{finish_reason="abort"}')
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in _generation(served).Generate(_long_request("deadline-count"), timeout=0.5):
                pass
        await _settle(served)
    assert _metric(served, 'nanoserve_requests_total{finish_reason="abort"}') == before + 1
    [line] = _finished_lines(logs, "deadline-count")
    assert (line["finish_reason"], line["cause"]) == ("abort", "deadline")


async def test_abort_rpc_stream_is_counted_and_logged_once_as_abort(served: Served) -> None:
    stub = _generation(served)
    before = _metric(served, 'nanoserve_requests_total{finish_reason="abort"}')
    with structlog.testing.capture_logs() as logs:
        call = stub.Generate(_long_request("abort-count"))
        await call.read()
        await stub.Abort(pb.AbortRequest(request_id="abort-count"))
        await _read_rest(call)
        await _settle(served)
    assert _metric(served, 'nanoserve_requests_total{finish_reason="abort"}') == before + 1
    [line] = _finished_lines(logs, "abort-count")
    assert (line["finish_reason"], line["cause"]) == ("abort", "abort_rpc")


async def _cancel_while_waiting(served: Served, waiting_request: pb.GenerateRequest) -> dict:
    """The request_finished line of ``waiting_request``, cancelled while every running slot is busy."""
    stub = _generation(served)
    running = [stub.Generate(_long_request(f"busy-{i}")) for i in range(MAX_NUM_SEQS)]
    for call in running:
        await call.read()
    with structlog.testing.capture_logs() as logs:
        waiting = stub.Generate(waiting_request)
        while (await _allocation(served).GetPoolStatus(apb.GetPoolStatusRequest())).num_waiting == 0:
            await asyncio.sleep(0.01)
        waiting.cancel()
        for call in running:
            call.cancel()
        await _settle(served)
    [line] = _finished_lines(logs, waiting_request.request_id)
    return line


async def test_stream_cancelled_while_waiting_is_logged_with_its_prompt_tokens(served: Served) -> None:
    waiting_request = _long_request("cancel-waiting")
    line = await _cancel_while_waiting(served, waiting_request)
    assert line["prompt_tokens"] == len(served.engine.tokenizer.encode(waiting_request.prompt))
    assert (line["completion_tokens"], line["ttft_s"], line["cause"]) == (0, None, "cancelled")


async def test_token_ids_stream_cancelled_while_waiting_is_counted_and_logged_with_its_prompt_tokens(
    served: Served,
) -> None:
    # found by mypy: the prompt token count of an abandoned stream took len() of the TokenIds message
    waiting_request = pb.GenerateRequest(
        request_id="cancel-waiting-ids",
        prompt_token_ids=pb.TokenIds(ids=[504, 3458, 2030, 1029, 282, 1029, 13, 1029, 28, 827, 28]),
        sampling=pb.SamplingParameters(max_tokens=400, temperature=0.0, ignore_eos=True),
    )
    before = _metric(served, 'nanoserve_requests_total{finish_reason="abort"}')
    line = await _cancel_while_waiting(served, waiting_request)
    # the waiting stream and the MAX_NUM_SEQS busy ones, each counted once
    assert _metric(served, 'nanoserve_requests_total{finish_reason="abort"}') == before + 1 + MAX_NUM_SEQS
    assert line["prompt_tokens"] == 11
    assert (line["completion_tokens"], line["ttft_s"], line["cause"]) == (0, None, "cancelled")


async def test_a_seeded_sample_is_the_same_from_the_prefix_cache(tmp_path: Path) -> None:
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer, start_engine

    # issue 32's reproduction, with --batch-invariant on (off by default): a 52-token prompt, seed 7,
    # temperature 1, salt s1; the repeat's first three blocks come from the prefix cache and its tail
    # is prefilled alone, yet tokens and logprobs are equal
    prompt = [(i * 7919 + 13) % 3000 + 100 for i in range(52)]
    sampling = pb.SamplingParameters(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, logprobs=0)

    async def sample(request_id: str) -> tuple[list[int], list[float], int]:
        request = pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling, cache_salt="s1"
        )
        responses = await _collect(_generation(invariant), request)
        token_ids = [t for r in responses for t in r.token_ids]
        logprobs = [lp.logprob for r in responses for lp in r.logprobs]
        return token_ids, logprobs, responses[-1].finish.usage.cached_tokens

    log_url = f"sqlite:///{tmp_path / 'events.db'}"
    engine = await start_engine(engine_config(log_url, batch_invariant="on"))
    server = NanoServer(engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=None, grace_s=0.5))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            invariant = Served(server, channel, log_url)
            uncached, cached = await sample("seed7-uncached"), await sample("seed7-cached")
    finally:
        await server.stop(0.5)
    assert (uncached[2], cached[2]) == (0, 48)
    assert cached[:2] == uncached[:2]
    assert len(uncached[0]) == 24


async def test_resume_cli_streams_a_finished_requests_text_again_by_its_id(served: Served) -> None:
    """A user whose `generate` went away had no command to get the completion back: `nanoserve resume ID`."""
    server = f"127.0.0.1:{served.server.port}"  # type: ignore[attr-defined]
    question = ("--chat", "What is the capital of France?", "--max-tokens", "24", "--temperature", "0")
    code, stdout, stderr = await _cli("generate", "--server", server, "--request-id", "resume-cli-1", *question)
    assert (code, stdout) == (0, EXPECTED_CHAT_TEXT + "\n"), stderr
    code, resumed, resumed_err = await _cli("resume", "--server", server, "resume-cli-1")
    assert (code, resumed) == (0, EXPECTED_CHAT_TEXT + "\n"), resumed_err
    assert resumed_err.splitlines()[-1].startswith("[stop; ")
    code, lines, _ = await _cli("resume", "--server", server, "resume-cli-1", "--after-token", "3", "--json")
    messages = [json.loads(line) for line in lines.splitlines()]
    code_all, all_lines, _ = await _cli("resume", "--server", server, "resume-cli-1", "--json")
    every = [t for m in (json.loads(line) for line in all_lines.splitlines()) for t in m.get("token_ids", [])]
    assert code == code_all == 0
    assert [t for m in messages for t in m.get("token_ids", [])] == every[3:]
    code, past, past_err = await _cli("resume", "--server", server, "resume-cli-1", "--after-token", "5000")
    assert (code, past) == (0, ""), past_err
    finish, note = past_err.splitlines()
    assert finish.startswith("[stop; ")
    assert note == f"note: --after-token 5000 is past the request's {len(every)} output tokens: no text after it"
    code, stdout, stderr = await _cli("resume", "--server", server, "no-such-request")
    assert (code, stdout) == (1, "")
    assert stderr.startswith("error: NOT_FOUND: ")
