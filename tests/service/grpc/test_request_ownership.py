"""One owner per request, under load: ids reused at once after a cancel, a deadline or an Abort call.

Issue 8's stress test, on a real server in front of the tiny random model: every
call gets its own complete output or its own clear status, the pool ends all
free, the audit is clean, and each stream has exactly one ``request_finished``
line with the cause its client saw.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import structlog

from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ..conftest import Served, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

NUM_ROUNDS = 200
NUM_WORKERS = 4
NUM_BACKGROUND_STREAMS = 3
MODES = ("cancel", "deadline", "abort")
EXPECTED_CAUSE = {"cancel": "cancelled", "deadline": "deadline", "abort": "abort_rpc"}
DEADLINE_S = 0.2  # long enough for the server to start the call, far shorter than its 400 tokens


def _request(request_id: str, max_tokens: int, prompt: str = "Once upon a time") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _end_first_call(stub: generation_pb2_grpc.GenerationServiceStub, request_id: str, mode: str) -> bool:
    """Starts a long request and ends it the way ``mode`` says, checking what its client sees.

    True when the client saw a message of it, so the server surely ran it; a
    deadline may also pass before the server ever started the call, and then
    the server has no stream to record.
    """
    if mode == "deadline":
        call = stub.Generate(_request(request_id, 400), timeout=DEADLINE_S)
        num_messages = 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                num_messages += 1
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return num_messages > 0
    call = stub.Generate(_request(request_id, 400))
    first = await call.read()
    assert first.request_id == request_id
    if mode == "cancel":
        call.cancel()
        return True
    await stub.Abort(pb.AbortRequest(request_id=request_id))
    last = first
    while (response := await call.read()) is not grpc.aio.EOF:
        last = response
    assert last.finish.reason == pb.FINISH_REASON_ABORT
    return True


async def _collect(
    stub: generation_pb2_grpc.GenerationServiceStub, request: pb.GenerateRequest
) -> tuple[list[pb.GenerateResponse], grpc.StatusCode | None]:
    """The call's messages, and its status code when it failed."""
    responses: list[pb.GenerateResponse] = []
    try:
        async for response in stub.Generate(request):
            responses.append(response)
    except grpc.aio.AioRpcError as error:
        return responses, error.code()
    return responses, None


async def _worker(stub: generation_pb2_grpc.GenerationServiceStub, worker: int, rounds: int, seen: dict) -> None:
    rng = random.Random(worker)
    for round_ in range(rounds):
        request_id = f"w{worker}-r{round_}"
        mode = rng.choice(MODES)
        ran = await _end_first_call(stub, request_id, mode)
        # the same id again, at once: its own 10 tokens, or ALREADY_EXISTS while the old one is still live
        responses, code = await _collect(stub, _request(request_id, 10))
        if code is not None:
            assert code == grpc.StatusCode.ALREADY_EXISTS
            seen[request_id] = (mode, "refused", ran)
            continue
        assert all(response.request_id == request_id for response in responses)
        assert sum(len(response.token_ids) for response in responses) == 10
        finish = responses[-1].finish
        assert (finish.reason, finish.usage.completion_tokens) == (pb.FINISH_REASON_LENGTH, 10)
        seen[request_id] = (mode, "served", ran)


async def _background(stub: generation_pb2_grpc.GenerationServiceStub, index: int, stop: asyncio.Event) -> int:
    served = 0
    while not stop.is_set():
        responses = [r async for r in stub.Generate(_request(f"bg{index}-{served}", 40, "The weather today"))]
        assert responses[-1].finish.reason == pb.FINISH_REASON_LENGTH
        served += 1
    return served


async def test_reused_ids_after_cancel_deadline_and_abort_each_get_their_own_stream(tiny_served: Served) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
    seen: dict[str, tuple[str, str, bool]] = {}
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        background = [asyncio.create_task(_background(stub, i, stop)) for i in range(NUM_BACKGROUND_STREAMS)]
        await asyncio.gather(*(_worker(stub, w, NUM_ROUNDS // NUM_WORKERS, seen) for w in range(NUM_WORKERS)))
        stop.set()
        num_background = sum(await asyncio.gather(*background))
        await wait_pool_free(tiny_served)
        await asyncio.sleep(0.2)  # room for a late, wrong, second record
    assert len(seen) == NUM_ROUNDS
    num_refused = sum(outcome == "refused" for _, outcome, _ in seen.values())
    assert num_refused <= NUM_ROUNDS // 10, f"{num_refused} re-sends refused as ALREADY_EXISTS"
    lines: dict[str, list[dict]] = {}
    for entry in logs:
        if entry["event"] == "request_finished":
            lines.setdefault(entry["request_id"], []).append(entry)
    num_unseen = 0
    for request_id, (mode, outcome, ran) in seen.items():
        causes = sorted((r["finish_reason"], r.get("cause")) for r in lines.get(request_id, []))
        second = [("length", None)] if outcome == "served" else []
        first = [("abort", EXPECTED_CAUSE[mode])]
        if not ran and causes == second:  # the deadline passed before the server started the first call
            num_unseen += 1
            continue
        assert causes == sorted(first + second), f"{request_id} ({mode}, {outcome}): {causes}"
    assert num_unseen <= NUM_ROUNDS // 20, f"{num_unseen} first calls never reached the server"
    assert sum(len(v) for k, v in lines.items() if k.startswith("bg")) == num_background
    report = await allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel).Audit(apb.AuditRequest())
    assert report.clean, report.summary
