"""``vllm.grpc.engine.VllmEngine``: vLLM's engine contract over the same ``AsyncLLMEngine``.

What lets the Shepherd Model Gateway (``smg``) put its OpenAI API and router in
front of nanoserve replicas: it tokenizes and applies the chat template itself,
sends token ids, and detokenizes and applies stop strings to the token ids we
stream back. Each method converts (``vllm_convert``), makes one engine call and
converts back; ``Generate`` takes the same path as ``nanoserve.v1``'s
(``RequestStreamer``: aborted when the gateway drops the call, recorded once).
Errors are domain errors, mapped to status codes by ``ErrorInterceptor``; an
``InvalidRequestError`` names the field by its path in this contract.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.allocator.log import Event
from nanoserve.engine import AsyncLLMEngine
from nanoserve.engine.errors import InvalidRequestError, PrefixCacheResetRefusedError, RequestNotFoundError
from nanoserve.service.grpc import kv_events, vllm_convert
from nanoserve.service.grpc.errors import EventLogDisabledError, UnimplementedError
from nanoserve.service.grpc.event_follower import follow_events
from nanoserve.service.grpc.interceptors import CALLER
from nanoserve.service.grpc.request_streamer import RequestStreamer
from nanoserve.service.tenants import scoped_id

API = "vllm.grpc.engine"
SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# how often FlushCache retries while blocks are held, seconds
FLUSH_RETRY_S = 0.05

Context = grpc.aio.ServicerContext[Any, Any]


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """vLLM's engine RPCs; what nanoserve does not do is UNIMPLEMENTED with a message saying so.

    started_s: when the server started, ``time.monotonic()`` seconds (GetServerInfo's uptime).
    """

    def __init__(
        self, engine: AsyncLLMEngine, streamer: RequestStreamer, started_s: float, share_prefix_cache: bool = False
    ) -> None:
        self._engine = engine
        self._share_prefix_cache = share_prefix_cache  # tenants share prefix-cache blocks (off: salted by tenant)
        self._streamer = streamer
        self._started_s = started_s
        self._max_num_seqs = engine.config.scheduler.max_num_seqs
        self._tokenizer_zip: asyncio.Task[bytes] | None = None  # built on first use; the tokenizer never changes

    async def Generate(self, request: vpb.GenerateRequest, context: Context) -> AsyncIterator[vpb.GenerateResponse]:
        """Streamed: a chunk per step that released token ids, then ``complete``; otherwise
        ``complete`` alone, with every token id (and logprob)."""
        caller = CALLER.get()  # this contract has no salt: the connection's tenant is the salt
        prompt = vllm_convert.to_prompt(request)
        params = vllm_convert.to_sampling_params(request.sampling_params)
        salt = caller.cache_salt("", self._share_prefix_cache)
        if salt:
            params = dataclasses.replace(params, cache_salt=salt)
        request_id = scoped_id(caller, request.request_id or uuid.uuid4().hex)  # uuid4: random, unguessable
        input_logprobs_sent = False  # the prompt's logprobs go out once, on the first chunk
        async for output in self._streamer.outputs(request_id, prompt, params, context, API):
            for message in vllm_convert.to_messages(output, request.stream):
                if message.WhichOneof("response") == "chunk":
                    if input_logprobs_sent:
                        message.chunk.ClearField("input_logprobs")
                    input_logprobs_sent = input_logprobs_sent or message.chunk.HasField("input_logprobs")
                yield message

    async def Abort(self, request: vpb.AbortRequest, context: Context) -> vpb.AbortResponse:
        """Aborts each live request named; an id no live request has is skipped, as in vLLM (the
        gateway aborts a call it drops, which may have ended in the meantime)."""
        caller = CALLER.get()  # another tenant's id is skipped as an unknown one
        verdicts = await asyncio.gather(
            *(self._engine.abort(scoped_id(caller, request_id)) for request_id in request.request_ids),
            return_exceptions=True,
        )
        for verdict in verdicts:
            if isinstance(verdict, BaseException) and not isinstance(verdict, RequestNotFoundError):
                raise verdict
        return vpb.AbortResponse()

    async def HealthCheck(self, request: vpb.HealthCheckRequest, context: Context) -> vpb.HealthCheckResponse:
        if self._engine.errored:
            return vpb.HealthCheckResponse(healthy=False, message="the engine loop failed; see the server log")
        if not self._engine.is_running:
            return vpb.HealthCheckResponse(healthy=False, message="the engine is not running")
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest, context: Context) -> vpb.GetModelInfoResponse:
        return vllm_convert.to_model_info(self._engine.model_info)

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest, context: Context) -> vpb.GetServerInfoResponse:
        return vllm_convert.to_server_info(
            self._engine.model_info,
            self._engine.pool_status(),
            uptime_s=time.monotonic() - self._started_s,
            max_num_seqs=self._max_num_seqs,
        )

    async def GetLoads(self, request: vpb.GetLoadsRequest, context: Context) -> vpb.GetLoadsResponse:
        """The queues and KV usage as of the engine's last step, read from the engine when asked."""
        return vllm_convert.to_loads(request, self._engine.pool_status(), self._max_num_seqs, _nanoserve_version())

    async def GetTokenizer(
        self, request: cpb.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[cpb.GetTokenizerChunk]:
        """The loaded tokenizer's files (``AsyncLLMEngine.tokenizer_files``, the GGUF's chat template
        included) as one zip in chunks, its SHA-256 on the last: the gateway needs no model files."""
        building = self._tokenizer_zip
        # built once and kept (the tokenizer never changes); built again after a failure
        if building is None or (building.done() and (building.cancelled() or building.exception() is not None)):
            self._tokenizer_zip = building = asyncio.ensure_future(self._build_tokenizer_zip())
        for chunk in vllm_convert.to_tokenizer_chunks(await asyncio.shield(building)):
            yield chunk

    async def _build_tokenizer_zip(self) -> bytes:
        files = await self._engine.tokenizer_files()
        return await asyncio.to_thread(vllm_convert.tokenizer_zip, files)

    async def FlushCache(self, request: cpb.FlushCacheRequest, context: Context) -> cpb.FlushCacheResponse:
        """Resets the prefix cache (``ResetPrefixCache``), retrying for up to ``timeout_s`` seconds while
        blocks are held; success False, with the reason, when they still are (or caching is off)."""
        if not (request.timeout_s >= 0 and math.isfinite(request.timeout_s)):
            raise InvalidRequestError("timeout_s", f"must be a finite number of seconds >= 0, got {request.timeout_s}")
        deadline = time.monotonic() + request.timeout_s
        while True:
            try:
                num_blocks = await self._engine.reset_prefix_cache()
            except PrefixCacheResetRefusedError as exc:
                if time.monotonic() >= deadline or not self._engine.config.cache.enable_prefix_caching:
                    return cpb.FlushCacheResponse(success=False, message=str(exc))
                await asyncio.sleep(FLUSH_RETRY_S)
                continue
            return cpb.FlushCacheResponse(success=True, message=f"prefix cache reset: {num_blocks} cached blocks freed")

    async def SubscribeKvEvents(
        self, request: cpb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[cpb.KvEventBatch]:
        """The prefix cache's stored / removed / cleared events, from the durable event log only.

        Each logged batch (a scheduler step's events, a reset, an epoch's
        boundary) that holds a KV event is one KvEventBatch, numbered
        ``epoch << 32 | n`` for the epoch's n-th such batch (``kv_events.batch_number``):
        a number names one batch across restarts and numbers only grow.
        start_sequence_number: the first batch to send. 0, or a number of an
        earlier epoch (the replica restarted since; a number sent before numbers
        carried the epoch counts as epoch 0): from this epoch's start, POOL_INIT's
        ``cleared`` first, which resyncs the subscriber's index at once. A number
        of a later epoch, or past this epoch's next batch, is INVALID_ARGUMENT.
        The stream ends after POOL_CLOSE; no load records are sent (GetLoads answers them).
        """
        event_log = self._engine.event_log
        if event_log is None:
            raise EventLogDisabledError("SubscribeKvEvents: the server keeps no event log (--event-log-url none)")
        epoch = event_log.epoch
        try:
            start = kv_events.first_batch_to_send(epoch, request.start_sequence_number)
        except ValueError as exc:
            raise InvalidRequestError(
                "start_sequence_number",
                f"must be at most {kv_events.batch_number(epoch, kv_events.MAX_BATCH_IN_EPOCH)} (epoch {epoch}'s "
                f"last number), got {request.start_sequence_number}: it {exc}",
            ) from exc
        num_batches = 0  # KV batches of the epoch so far
        pending: list[Event] = []  # the events of the logged batch being read
        pacer, tenant = self._engine.read_pacer, CALLER.get().tenant
        async for event in follow_events(event_log, 1, stored=self._engine.stored_events, pacer=pacer, scope=tenant):
            if event is None:  # caught up with the store: what is there to resume from is known
                if start > num_batches + 1:
                    raise InvalidRequestError(
                        "start_sequence_number",
                        f"must be at most {kv_events.batch_number(epoch, num_batches + 1)} (the next batch of "
                        f"epoch {epoch}), got {request.start_sequence_number}: not a number this replica sent",
                    )
                continue
            pending.append(event)
            if event.seq != event.batch_seq:  # batch_seq is the seq of its batch's last event
                continue
            batch = kv_events.to_kv_event_batch(kv_events.batch_number(epoch, num_batches + 1), pending)
            pending = []
            if batch is not None:
                num_batches += 1
                if num_batches >= start:
                    yield batch

    async def Embed(self, request: vpb.EmbedRequest, context: Context) -> vpb.EmbedResponse:
        raise UnimplementedError("Embed: nanoserve serves generation only; it computes no embeddings")

    async def StartProfile(self, request: cpb.StartProfileRequest, context: Context) -> cpb.ProfileResponse:
        raise UnimplementedError("StartProfile: nanoserve has no profiler to start; use py-spy or torch.profiler")

    async def StopProfile(self, request: cpb.StopProfileRequest, context: Context) -> cpb.ProfileResponse:
        raise UnimplementedError("StopProfile: nanoserve has no profiler to stop")


def _nanoserve_version() -> str:
    try:
        return version("nanoserve")
    except PackageNotFoundError:  # run from a source tree without installing
        return ""
