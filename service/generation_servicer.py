"""``nanoserve.v1.Generation``: thin methods over ``AsyncLLMEngine``.

Each method validates and converts the request (``validation``, ``convert``),
makes one engine call, and converts back. Errors are raised as domain errors;
``interceptors.ErrorInterceptor`` turns them into status codes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog

from nanoserve.engine import AsyncLLMEngine
from nanoserve.engine.errors import RequestNotFoundError
from nanoserve.service import convert
from nanoserve.service.metrics import ServerMetrics
from nanoserve.service.validation import validate_generate_request, validate_input
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

log = structlog.get_logger("nanoserve.service")


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Streams completions. A stream that ends early for any reason (client
    cancel, disconnect, deadline, server shutdown) aborts its request in the
    engine, which frees its KV blocks at once."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        validate_generate_request(request, self._engine.tokenizer.vocab_size)
        request_id = request.request_id or uuid.uuid4().hex
        outputs = self._engine.generate(convert.to_prompt(request), convert.to_sampling_params(request.sampling), request_id)
        done = False
        # grpc may leave this generator suspended when the call is cancelled;
        # the callback aborts the request at once instead of at garbage collection
        context.add_done_callback(lambda _: done or self._abort_soon(request_id))
        try:
            async for output in outputs:
                if output.finished:
                    done = True
                    self._record(convert.finished_request(output))
                yield convert.to_response(output)
        except BaseException:
            done = True  # refused (raised before the first output) or cancelled: the engine has it
            raise
        finally:
            await outputs.aclose()

    def _abort_soon(self, request_id: str) -> None:
        asyncio.get_running_loop().create_task(self._abort_quietly(request_id))

    async def _abort_quietly(self, request_id: str) -> None:
        """Aborts ``request_id`` if the engine still streams it."""
        try:
            await self._engine.abort(request_id)
        except RequestNotFoundError:
            return
        log.info("request_cancelled", request_id=request_id)

    def _record(self, request: convert.FinishedRequest) -> None:
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
        )

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._engine.abort(request.request_id)
        return pb.AbortResponse()

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        tokenizer = self._engine.tokenizer
        validate_input(request, tokenizer.vocab_size)
        if request.WhichOneof("input") == "text":
            token_ids = tokenizer.encode(request.text)
        else:
            token_ids = tokenizer.apply_chat_template(convert.to_messages(request.chat))
        return pb.TokenizeResponse(token_ids=token_ids)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return convert.to_model_info(self._engine)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
