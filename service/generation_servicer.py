"""``nanoserve.v1.GenerationService``: thin methods over ``AsyncLLMEngine``.

Each method converts the request (``convert``), makes one engine call, and
converts back. Errors are raised as domain errors; ``interceptors.ErrorInterceptor``
turns them into status codes. The engine owns every request and every ending;
the servicer streams and records what it hands back.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog

from nanoserve.engine import AbortCause, AsyncLLMEngine, RequestOutput
from nanoserve.service import convert
from nanoserve.service.metrics import ServerMetrics
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

log = structlog.get_logger("nanoserve.service")

GenerateContext = grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse]

# A client's deadline fires on the client's clock: its cancellation reaches the server a moment
# before the server's own copy of the deadline runs out. A cancellation this close to the deadline
# is the deadline.
DEADLINE_SLACK_S = 0.25


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Streams completions. A stream that ends early for any reason (client
    cancel, disconnect, deadline) aborts its request in the engine, which frees
    its KV blocks at once; every request the engine accepted is recorded once
    (one ``request_finished`` line, one count in the metrics) from its final
    output, with the cause the engine carried."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    async def Generate(
        self, request: pb.GenerateRequest, context: GenerateContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        prompt = convert.to_prompt(request)
        params = convert.to_sampling_params(request.sampling)
        deadline_s = _deadline(context)
        stream = self._engine.add_request(request.request_id or uuid.uuid4().hex, prompt, params)
        stream.finished.add_done_callback(self._record)
        # grpc may leave this generator suspended when the call is cancelled;
        # the callback aborts the request at once instead of at garbage collection
        # types-grpcio declares the callback as a class (_DoneCallback), not a Protocol: no function matches it
        context.add_done_callback(lambda _: stream.abort(_client_cause(deadline_s)))  # type: ignore[arg-type]
        try:
            async for output in stream:
                yield convert.to_response(output)
        finally:
            stream.abort(_client_cause(deadline_s))  # a no-op once the request has ended

    def _record(self, finished: asyncio.Future[RequestOutput]) -> None:
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
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_completion_tokens,
            ttft_s=_round(request.ttft_s),
            duration_s=_round(request.total_s),
            finish_reason=request.finish_reason,
            num_preemptions=request.num_preemptions,
            **({"cause": request.abort_cause} if request.abort_cause is not None else {}),
        )

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[pb.AbortRequest, pb.AbortResponse]
    ) -> pb.AbortResponse:
        await self._engine.abort(request.request_id)
        return pb.AbortResponse()

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext[pb.TokenizeRequest, pb.TokenizeResponse]
    ) -> pb.TokenizeResponse:
        token_ids = await self._engine.tokenize(convert.to_tokenize_input(request))
        return pb.TokenizeResponse(token_ids=token_ids)

    async def GetModelInfo(
        self,
        request: pb.GetModelInfoRequest,
        context: grpc.aio.ServicerContext[pb.GetModelInfoRequest, pb.GetModelInfoResponse],
    ) -> pb.GetModelInfoResponse:
        return convert.to_model_info(self._engine.model_info)


def _deadline(context: GenerateContext) -> float | None:
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
