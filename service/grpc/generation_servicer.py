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
from nanoserve.engine.errors import RequestEndedAtRecoveryError
from nanoserve.service.grpc import convert
from nanoserve.service.grpc.interceptors import CALLER
from nanoserve.service.grpc.request_streamer import RequestStreamer
from nanoserve.service.grpc.resume_messages import ResumeMessages
from nanoserve.service.tenants import scoped_id
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

GenerateContext = grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse]
API = "nanoserve.v1"


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Streams completions through ``RequestStreamer``: a stream that ends early for any
    reason (client cancel, disconnect, deadline) aborts its request in the engine, which
    frees its KV blocks at once; every request the engine accepted is recorded once."""

    def __init__(self, engine: AsyncLLMEngine, streamer: RequestStreamer, share_prefix_cache: bool = False) -> None:
        self._engine = engine
        self._streamer = streamer
        self._share_prefix_cache = share_prefix_cache  # tenants share prefix-cache blocks (off: salted by tenant)
        self._resume_messages = ResumeMessages()

    async def Generate(
        self, request: pb.GenerateRequest, context: GenerateContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        caller = CALLER.get()
        prompt = convert.to_prompt(request)
        salt = caller.cache_salt(request.cache_salt, self._share_prefix_cache)
        params = convert.to_sampling_params(request.sampling, salt)
        request_id = request.request_id or uuid.uuid4().hex  # uuid4: random, unguessable
        prompt_logprobs_sent = False  # the engine repeats them on the final output; the stream sends them once
        async for output in self._streamer.outputs(scoped_id(caller, request_id), prompt, params, context, API):
            for response in convert.to_responses(output):
                response.request_id = request_id
                if prompt_logprobs_sent:
                    del response.prompt_logprobs[:]
                prompt_logprobs_sent = prompt_logprobs_sent or bool(response.prompt_logprobs)
                yield response

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext[pb.ResumeRequest, pb.ResumeResponse]
    ) -> AsyncIterator[bytes]:  # serialized ResumeResponses, shared by the callers resuming one output
        # another tenant's id is this tenant's unknown id: NOT_FOUND, as any unknown id
        engine_id = scoped_id(CALLER.get(), request.request_id)
        async for output in self._engine.resume(engine_id, request.after_token_index):
            yield self._resume_messages.message(output, request.request_id)
            if output.finished and output.abort_detail is not None and output.abort_cause is not None:
                # the Finish names the cause only; the status says why (a limit this server's pool breaks)
                raise RequestEndedAtRecoveryError(
                    f"request {request.request_id} ended at the restart after a crash, abort cause "
                    f"{output.abort_cause.value}: {output.abort_detail}"
                )

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[pb.AbortRequest, pb.AbortResponse]
    ) -> pb.AbortResponse:
        await self._engine.abort(scoped_id(CALLER.get(), request.request_id))
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
