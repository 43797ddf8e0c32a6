"""The cause logged for an aborted stream is what its client saw (issue 9, fault 10).

Many streams through a real server (the tiny model: fast steps, a busy event loop) end by a short
deadline or by a client cancel, several at once. A client's deadline fires on its own clock, so its
cancellation reaches the server a moment before the server's copy of the deadline: such a stream
must still be logged ``deadline``, and only a stream the client cancelled ``cancelled``.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import structlog

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from ..conftest import Served, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

NUM_STREAMS = 112
NUM_AT_ONCE = 16
CAUSE_BY_STATUS = {grpc.StatusCode.DEADLINE_EXCEEDED: "deadline", grpc.StatusCode.CANCELLED: "cancelled"}


async def _stream(stub: generation_pb2_grpc.GenerationServiceStub, request_id: str, rng: random.Random) -> tuple:
    """Runs one stream to its end; returns (what the client saw, whether it got a message)."""
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt="Once upon a time",
        sampling=pb.SamplingParameters(max_tokens=600, temperature=0.0, ignore_eos=True),
    )
    cancel_after_s = rng.uniform(0.05, 0.5) if rng.random() < 0.25 else None
    call = stub.Generate(request, timeout=60.0 if cancel_after_s is not None else rng.uniform(0.05, 0.6))
    num_messages = 0

    async def read() -> grpc.StatusCode:
        nonlocal num_messages
        try:
            async for _ in call:
                num_messages += 1
        except grpc.aio.AioRpcError as error:
            return error.code()
        except asyncio.CancelledError:
            return grpc.StatusCode.CANCELLED
        return grpc.StatusCode.OK

    reading = asyncio.ensure_future(read())
    if cancel_after_s is not None:
        await asyncio.sleep(cancel_after_s)
        call.cancel()
    code = await reading
    return code, num_messages > 0


async def test_every_logged_cause_is_what_the_client_saw(tiny_served: Served) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
    rng = random.Random(9)
    seen: dict[str, tuple] = {}
    with structlog.testing.capture_logs() as logs:
        for first in range(0, NUM_STREAMS, NUM_AT_ONCE):
            ids = [f"cause-{i}" for i in range(first, first + NUM_AT_ONCE)]
            results = await asyncio.gather(*(_stream(stub, request_id, rng) for request_id in ids))
            seen.update(zip(ids, results, strict=True))
        await wait_pool_free(tiny_served)
        await asyncio.sleep(0.2)
    logged = {entry["request_id"]: entry for entry in logs if entry["event"] == "request_finished"}
    num_deadlines = sum(code == grpc.StatusCode.DEADLINE_EXCEEDED for code, _ in seen.values())
    assert num_deadlines >= NUM_STREAMS // 2
    mismatches = []
    num_unseen = 0
    for request_id, (code, got_message) in seen.items():
        entry = logged.get(request_id)
        if entry is None:  # ended by the client before the server started the call: nothing to record
            assert code in CAUSE_BY_STATUS, (request_id, code)
            assert not got_message, request_id
            num_unseen += 1
            continue
        expected = CAUSE_BY_STATUS.get(code)
        if (entry["finish_reason"], entry.get("cause")) != ("abort" if expected else "length", expected):
            mismatches.append((request_id, code.name, entry["finish_reason"], entry.get("cause")))
    assert mismatches == []
    assert num_unseen <= NUM_STREAMS // 4, f"{num_unseen} calls never reached the server"
