"""``nanoserve.v1.AllocationService``: the KV pool's status, its live event stream, its audit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from nanoserve.allocator import EventKind
from nanoserve.allocator.log import Event, EventLog, EventStream, EventStreamLagged, audit, read_events
from nanoserve.engine import AsyncLLMEngine
from nanoserve.service import convert
from nanoserve.service.errors import EventLogDisabledError
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc

NUM_EVENTS_PER_PAGE = 1000  # stored events read per query while catching up


class AllocationServicer(allocation_pb2_grpc.AllocationServiceServicer):
    """max_queued_events: live events one WatchEvents stream may buffer before the log
    cuts it off (it then catches up from the store)."""

    def __init__(self, engine: AsyncLLMEngine, max_queued_events: int = 100_000) -> None:
        self._engine = engine
        self._max_queued_events = max_queued_events

    async def GetPoolStatus(
        self,
        request: apb.GetPoolStatusRequest,
        context: grpc.aio.ServicerContext[apb.GetPoolStatusRequest, apb.GetPoolStatusResponse],
    ) -> apb.GetPoolStatusResponse:
        return convert.to_pool_status(self._engine.pool_status())

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
    ) -> AsyncIterator[apb.WatchEventsResponse]:
        """Stored events from ``from_seq``, then live ones, without gap or duplicate.

        The live subscription opens *before* the stored events are read, so an
        event committed meanwhile is in one or both; duplicates are dropped by
        seq. A subscriber that falls too far behind is cut off by the log
        (EventStreamLagged) and catches up from the store again. The stream
        ends after POOL_CLOSE.
        """
        event_log = self._event_log()
        next_seq = convert.to_from_seq(request)
        while True:
            live = EventStream(event_log, max_queued_events=self._max_queued_events)
            try:
                async for event in self._stored_events(event_log, next_seq):
                    yield apb.WatchEventsResponse(event=convert.to_event(event))
                    next_seq = event.seq + 1
                    if event.kind == EventKind.POOL_CLOSE.value:
                        return
                async for event in live:
                    if event.seq < next_seq:
                        continue
                    assert event.seq == next_seq, f"live events jumped from {next_seq} to {event.seq}"
                    yield apb.WatchEventsResponse(event=convert.to_event(event))
                    next_seq = event.seq + 1
                return  # POOL_CLOSE ended the live stream
            except EventStreamLagged:
                continue
            finally:
                live.close()

    async def _stored_events(self, event_log: EventLog, from_seq: int) -> AsyncIterator[Event]:
        """Committed events of the current epoch from ``from_seq``, a page per query."""
        while True:
            page = await asyncio.to_thread(
                read_events,
                event_log.url,
                event_log.pool_id,
                event_log.epoch,
                from_seq,
                from_seq + NUM_EVENTS_PER_PAGE - 1,
            )
            for event in page:
                yield event
            if len(page) < NUM_EVENTS_PER_PAGE:
                return
            from_seq = page[-1].seq + 1

    async def Audit(
        self, request: apb.AuditRequest, context: grpc.aio.ServicerContext[apb.AuditRequest, apb.AuditResponse]
    ) -> apb.AuditResponse:
        event_log = self._event_log()
        epoch = convert.to_audit_epoch(request, default=event_log.epoch)
        report = await asyncio.to_thread(audit, event_log.url, pool_id=event_log.pool_id, epoch=epoch)
        # the server knows its own epoch is open because it is running, not crashed
        return convert.to_audit_response(report, live=report.epoch == event_log.epoch)

    def _event_log(self) -> EventLog:
        event_log = self._engine.event_log
        if event_log is None:
            raise EventLogDisabledError("the server keeps no event log (--event-log-url none)")
        return event_log
