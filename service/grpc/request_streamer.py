"""The one path from a streaming gRPC call to an engine request, shared by every generation contract.

``nanoserve.v1.GenerationService/Generate`` and ``vllm.grpc.engine.VllmEngine/Generate``
differ only in their messages; each converts its request, then iterates
``RequestStreamer.outputs``, which starts the engine request, ties it to the
call's life and records it once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from nanoserve.engine import AbortCause, AsyncLLMEngine, RequestOutput, RequestStream, SamplingParams
from nanoserve.engine.text.prompts import Prompt
from nanoserve.service.grpc import convert
from nanoserve.service.grpc.metrics import ServerMetrics

log = structlog.get_logger("nanoserve.service")

# A client's deadline fires on the client's clock: its cancellation reaches the server a moment
# before the server's own copy of the deadline runs out. A cancellation this close to the deadline
# is the deadline.
DEADLINE_SLACK_S = 0.25


class RequestStreamer:
    """Streams engine requests to gRPC calls.

    A call that ends early for any reason (client cancel, disconnect, deadline,
    a gateway dropping its upstream stream) aborts its request in the engine,
    which frees its KV blocks at once; every request the engine accepted is
    recorded once (one ``request_finished`` line, one count in the metrics)
    from its final output, with the cause the engine carried and the contract
    (``api``) it came through.
    """

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    async def outputs(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        context: grpc.aio.ServicerContext[Any, Any],
        api: str,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them; the last one is finished.

        Refusals (invalid, duplicate id, full queue, engine down) are raised
        before the first output, as domain errors. Leaving the iteration early,
        or the call ending, aborts the request with cause ``deadline`` (within
        DEADLINE_SLACK_S of the call's deadline) or ``cancelled``.
        """
        deadline_s = _deadline(context)
        stream = self._engine.add_request(request_id, prompt, params, deadline_s)
        stream.finished.add_done_callback(lambda finished: self._record(finished, api))
        # grpc may leave the servicer's generator suspended when the call is cancelled;
        # the callback aborts the request at once instead of at garbage collection
        # types-grpcio declares the callback as a class (_DoneCallback), not a Protocol: no function matches it
        context.add_done_callback(lambda _: stream.abort(_client_cause(deadline_s)))  # type: ignore[arg-type]
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort(_client_cause(deadline_s))  # a no-op once the request has ended

    def record_recovered(self, streams: list[RequestStream]) -> None:
        """Records each request recovery re-admitted when it ends, as ``api`` ``recovered``: nobody streams
        it (a client follows it with Resume), yet it is logged and counted once like any other."""
        for stream in streams:
            stream.finished.add_done_callback(lambda finished: self._record(finished, "recovered"))

    def _record(self, finished: asyncio.Future[RequestOutput], api: str) -> None:
        """Counts and logs one request from its final output; the engine resolves it exactly once.

        A request refused before it ran (invalid, duplicate id, queue full,
        engine down) is not a finished request: its caller got the error status.
        """
        if finished.exception() is not None:
            return
        request = convert.finished_request(finished.result())
        self._metrics.observe_finished(request)
        log.info(
            "request_finished",
            request_id=request.request_id,
            api=api,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_completion_tokens,
            ttft_s=_round(request.ttft_s),
            duration_s=_round(request.total_s),
            finish_reason=request.finish_reason,
            num_preemptions=request.num_preemptions,
            **({"cause": request.abort_cause} if request.abort_cause is not None else {}),
        )


def _deadline(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    """The call's deadline on this process's monotonic clock; None without one."""
    remaining_s = context.time_remaining()
    return None if remaining_s is None else time.monotonic() + remaining_s


def _client_cause(deadline_s: float | None) -> AbortCause:
    """Why the client side ended a stream: its deadline (within DEADLINE_SLACK_S of it), or a cancel."""
    if deadline_s is not None and time.monotonic() >= deadline_s - DEADLINE_SLACK_S:
        return AbortCause.DEADLINE
    return AbortCause.CANCELLED


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
