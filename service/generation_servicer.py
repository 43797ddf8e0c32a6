"""``nanoserve.v1.Generation``: thin methods over ``AsyncLLMEngine``.

Each method validates and converts the request (``validation``, ``convert``),
makes one engine call, and converts back. Errors are raised as domain errors;
``interceptors.ErrorInterceptor`` turns them into status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog

from nanoserve.engine import AsyncLLMEngine, RequestOutput
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
        self._rpc_aborts: set[str] = set()  # request ids aborted by the Abort RPC, until their stream ends

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        validate_generate_request(request, self._engine.tokenizer.vocab_size)
        request_id = request.request_id or uuid.uuid4().hex
        outputs = self._engine.generate(
            convert.to_prompt(request), convert.to_sampling_params(request.sampling), request_id
        )
        stream = _Stream(request_id, time.monotonic())
        # grpc may leave this generator suspended when the call is cancelled;
        # the callback aborts the request at once instead of at garbage collection
        context.add_done_callback(lambda _: self._end_early(stream, request, context))
        try:
            async for output in outputs:
                stream.last_output = output
                if output.finished:
                    cause = None
                    if output.outputs[0].finish_reason == "abort":
                        cause = "abort_rpc" if request_id in self._rpc_aborts else "shutdown"
                    self._record(stream, convert.finished_request(output), cause)
                yield convert.to_response(output)
        except (asyncio.CancelledError, GeneratorExit):
            self._end_early(stream, request, context)
            raise
        except BaseException:
            stream.recorded = True  # refused before the first output, or the engine failed: not a finished request
            raise
        finally:
            self._rpc_aborts.discard(request_id)
            await outputs.aclose()

    def _end_early(self, stream: _Stream, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Records a stream the client ended (cancel, disconnect, deadline) and
        aborts its request if the engine still runs it. Runs at most once per
        stream, from the done callback or from the generator, whichever is first."""
        if stream.recorded:
            return
        remaining_s = context.time_remaining()
        cause = "deadline" if remaining_s is not None and remaining_s <= 0 else "cancelled"
        self._record(stream, self._abandoned(stream, request), cause)
        asyncio.get_running_loop().create_task(self._abort_quietly(stream.request_id))

    def _abandoned(self, stream: _Stream, request: pb.GenerateRequest) -> convert.FinishedRequest:
        """The counts and timings of a request whose stream ended before its finished output."""
        now_s = time.monotonic()
        output = stream.last_output
        if output is None:  # cancelled before its first token
            return convert.FinishedRequest(
                request_id=stream.request_id,
                finish_reason="abort",
                num_prompt_tokens=self._num_prompt_tokens(request),
                num_completion_tokens=0,
                queue_s=None,
                ttft_s=None,
                total_s=now_s - stream.arrival_s,
                num_preemptions=0,
            )
        seen = convert.finished_request(output)
        arrival_s = output.metrics.arrival_time if output.metrics is not None else stream.arrival_s
        return dataclasses.replace(seen, finish_reason="abort", total_s=now_s - arrival_s)

    def _num_prompt_tokens(self, request: pb.GenerateRequest) -> int:
        kind = request.WhichOneof("input")
        if kind == "prompt_token_ids":
            return len(request.prompt_token_ids)
        if kind == "prompt":
            return len(self._engine.tokenizer.encode(request.prompt))
        return len(self._engine.tokenizer.apply_chat_template(convert.to_messages(request.chat)))

    async def _abort_quietly(self, request_id: str) -> None:
        """Aborts ``request_id`` if the engine still streams it (the stream's
        close may have aborted it already)."""
        with contextlib.suppress(RequestNotFoundError):
            await self._engine.abort(request_id)

    def _record(self, stream: _Stream, request: convert.FinishedRequest, cause: str | None) -> None:
        """Counts and logs one finished request; every stream is recorded exactly once."""
        assert not stream.recorded, f"request {request.request_id!r} recorded twice"
        stream.recorded = True
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
            **({"cause": cause} if cause is not None else {}),
        )

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            await self._engine.abort(request.request_id)
        except RequestNotFoundError:
            raise RequestNotFoundError(f"request_id: no live request {request.request_id!r}") from None
        self._rpc_aborts.add(request.request_id)
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


@dataclasses.dataclass
class _Stream:
    """One Generate call's bookkeeping: what it has seen and whether it is recorded."""

    request_id: str
    arrival_s: float  # time.monotonic() when the call arrived
    last_output: RequestOutput | None = None
    recorded: bool = False


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
