"""``nanoserve.v1.AllocationService``: the KV pool's status, its live event stream, its audit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from nanoserve.allocator.log import Event, EventLog, audit
from nanoserve.allocator.log.segment import archived_through
from nanoserve.engine import AsyncLLMEngine
from nanoserve.service.grpc import allocation_convert
from nanoserve.service.grpc.errors import EventLogDisabledError, SeqOutOfRangeError
from nanoserve.service.grpc.event_follower import follow_events
from nanoserve.service.grpc.event_messages import EventMessages
from nanoserve.service.grpc.interceptors import CALLER
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc


class AllocationServicer(allocation_pb2_grpc.AllocationServiceServicer):
    """max_queued_events: live events one WatchEvents stream may buffer before the log
    cuts it off (it then catches up from the store)."""

    def __init__(self, engine: AsyncLLMEngine, max_queued_events: int = 100_000) -> None:
        self._engine = engine
        self._max_queued_events = max_queued_events
        self._event_messages = EventMessages()

    async def GetPoolStatus(
        self,
        request: apb.GetPoolStatusRequest,
        context: grpc.aio.ServicerContext[apb.GetPoolStatusRequest, apb.GetPoolStatusResponse],
    ) -> apb.GetPoolStatusResponse:
        return allocation_convert.to_pool_status(self._engine.pool_status())

    async def ResetPrefixCache(
        self,
        request: apb.ResetPrefixCacheRequest,
        context: grpc.aio.ServicerContext[apb.ResetPrefixCacheRequest, apb.ResetPrefixCacheResponse],
    ) -> apb.ResetPrefixCacheResponse:
        return apb.ResetPrefixCacheResponse(num_blocks_reset=await self._engine.reset_prefix_cache())

    async def WatchEvents(
        self,
        request: apb.WatchEventsRequest,
        context: grpc.aio.ServicerContext[apb.WatchEventsRequest, apb.WatchEventsResponse],
    ) -> AsyncIterator[bytes]:
        """Stored events from ``from_seq``, then live ones, without gap or duplicate
        (``follow_events``), each a serialized ``WatchEventsResponse`` shared by the watchers sent the
        same event (``EventMessages``), or up to ``max_events_per_message`` of them a message while it
        catches up (``EventMessages.batch``); the stream ends after POOL_CLOSE. SeqOutOfRangeError when
        ``from_seq`` is past ``last_seq + 1``, the seq of the epoch's next event, or in the epoch's
        archived part (``segment.archived_through``: 1 and 0 start at the checkpoint after it)."""
        event_log = self._event_log()
        next_seq = allocation_convert.to_from_seq(request)
        max_per_message = allocation_convert.to_max_events_per_message(request)
        last_seq = event_log.last_seq
        if next_seq > last_seq + 1:
            raise SeqOutOfRangeError(
                f"from_seq: {next_seq} is past the epoch's next event (last seq {last_seq});"
                f" ask for at most {last_seq + 1}"
            )
        # 1 (and 0) start at the checkpoint after the archived part: only a later seq asks the store
        archived = (
            0
            if next_seq <= 1
            else await asyncio.to_thread(archived_through, event_log.url, event_log.pool_id, event_log.epoch)
        )
        if 1 < next_seq <= archived:
            raise SeqOutOfRangeError(
                f"from_seq: {next_seq} is archived (seqs 1..{archived} of epoch {event_log.epoch} moved to segment "
                f"files in --event-log-archive-dir, read by `nanoserve log show --url sqlite:///FILE`); ask for 1 "
                f"(from the checkpoint at {archived + 1}) or at least {archived + 1}"
            )
        stored, pacer, tenant = self._engine.stored_events, self._engine.read_pacer, CALLER.get().tenant
        events = follow_events(event_log, next_seq, self._max_queued_events, stored, pacer, tenant)
        if max_per_message == 1:
            async for event in events:
                if event is not None:  # None: caught up with the store
                    yield self._event_messages.message(event)
            return
        pending: list[Event] = []  # stored events not sent yet
        caught_up = False  # live events go out one a message, as they come
        try:
            async for event in events:
                if event is None:
                    caught_up = True
                else:
                    pending.append(event)
                if pending and (caught_up or len(pending) == max_per_message):
                    yield self._event_messages.batch(pending)
                    pending = []
        except Exception:
            if pending:  # the stored events before the error still go out
                yield self._event_messages.batch(pending)
            raise
        if pending:  # the epoch ended (POOL_CLOSE) before the catch-up did
            yield self._event_messages.batch(pending)

    async def Audit(
        self, request: apb.AuditRequest, context: grpc.aio.ServicerContext[apb.AuditRequest, apb.AuditResponse]
    ) -> apb.AuditResponse:
        event_log = self._event_log()
        epoch = allocation_convert.to_audit_epoch(request, default=event_log.epoch)
        report = await asyncio.to_thread(audit, event_log.url, pool_id=event_log.pool_id, epoch=epoch)
        # the server knows its own epoch is open because it is running, and an older open one crashed
        return allocation_convert.to_audit_response(report, live_epoch=event_log.epoch)

    def _event_log(self) -> EventLog:
        event_log = self._engine.event_log
        if event_log is None:
            raise EventLogDisabledError("the server keeps no event log (--event-log-url none)")
        return event_log
