"""``nanoserve.v1.GenerationService``: thin methods over ``AsyncLLMEngine``.

Each method converts the request (``convert``), makes one engine call, and
converts back. Errors are raised as domain errors; ``interceptors.ErrorInterceptor``
turns them into status codes. The engine owns every request and every ending;
the servicer streams and records what it hands back.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc

from nanoserve.engine import AsyncLLMEngine
from nanoserve.service import convert
from nanoserve.service.request_streamer import RequestStreamer
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

GenerateContext = grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse]
API = "nanoserve.v1"


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Streams completions through ``RequestStreamer``: a stream that ends early for any
    reason (client cancel, disconnect, deadline) aborts its request in the engine, which
    frees its KV blocks at once; every request the engine accepted is recorded once."""

    def __init__(self, engine: AsyncLLMEngine, streamer: RequestStreamer) -> None:
        self._engine = engine
        self._streamer = streamer

    async def Generate(
        self, request: pb.GenerateRequest, context: GenerateContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        prompt = convert.to_prompt(request)
        params = convert.to_sampling_params(request.sampling, request.cache_salt)
        request_id = request.request_id or uuid.uuid4().hex
        async for output in self._streamer.outputs(request_id, prompt, params, context, API):
            yield convert.to_response(output)

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext[pb.ResumeRequest, pb.ResumeResponse]
    ) -> AsyncIterator[pb.ResumeResponse]:
        async for output in self._engine.resume(request.request_id, request.after_token_index):
            yield convert.to_resume_response(output)

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
