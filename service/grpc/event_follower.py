"""``follow_events``: an event log's committed events from a seq on, stored ones first, then live ones.

What both streaming readers of the log share (``AllocationService/WatchEvents``
and ``VllmEngine/SubscribeKvEvents``): only durable events, in seq order,
without gap or duplicate, from the store while catching up and from the log's
commit subscription after that.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from nanoserve.allocator import EventKind
from nanoserve.allocator.log import Event, EventLog, EventStream, EventStreamLagged, read_events
from nanoserve.engine.core.log_reads import LogReads, ReadPacer

NUM_EVENTS_PER_PAGE = 1000  # stored events read per query while catching up
NUM_EVENTS_PER_PACE = 64  # stored events sent per turn at the read pacer


async def follow_events(
    event_log: EventLog,
    from_seq: int,
    max_queued_events: int = 100_000,
    reads: LogReads | None = None,
    pacer: ReadPacer | None = None,
    scope: str = "",
) -> AsyncIterator[Event | None]:
    """The current epoch's committed events from ``from_seq`` (1 is its first), then None
    when the stored ones are all sent, then live ones; ends after POOL_CLOSE.

    The live subscription opens *before* the stored events are read, so an
    event committed meanwhile is in one or both; duplicates are dropped by
    seq. A follower that falls more than ``max_queued_events`` behind is cut
    off by the log (``EventStreamLagged``) and catches up from the store again
    (and yields None again). Raises the log reader's errors
    (``LogUnavailableError``, ``LogDamagedError``). reads: the reader threads the stored
    pages are read and decoded on, one page per turn (None: a thread of asyncio's own).
    pacer: the stored events go out at its pace, and the reads take their turns, under ``scope``
    (the caller's tenant).
    """
    next_seq = from_seq
    while True:
        live = EventStream(event_log, max_queued_events=max_queued_events)
        try:
            async for event in _stored_events(event_log, next_seq, reads, scope):
                if pacer is not None and (event.seq - from_seq) % NUM_EVENTS_PER_PACE == 0:
                    await pacer.take(scope, NUM_EVENTS_PER_PACE)
                yield event
                next_seq = event.seq + 1
                if event.kind == EventKind.POOL_CLOSE.value:
                    return
            yield None  # caught up: the stored events are all sent
            async for event in live:
                if event.seq < next_seq:
                    continue
                assert event.seq == next_seq, f"live events jumped from {next_seq} to {event.seq}"
                yield event
                next_seq = event.seq + 1
            return  # POOL_CLOSE ended the live stream
        except EventStreamLagged:
            continue
        finally:
            live.close()


async def _stored_events(
    event_log: EventLog, from_seq: int, reads: LogReads | None, scope: str
) -> AsyncIterator[Event]:
    """Committed events of the current epoch from ``from_seq``, a page per query (a turn on ``reads``,
    in ``scope``'s turn). The callers of one scope asking for the same page before its query starts
    share the query and the page's ``Event`` objects (``LogReads.run_shared``): a crowd catching up
    at once reads and decodes each page about once, not once per caller."""
    while True:
        query = (event_log.url, event_log.pool_id, event_log.epoch, from_seq, from_seq + NUM_EVENTS_PER_PAGE - 1)
        page: list[Event] = await (
            reads.run_shared(query, read_events, *query, scope=scope)
            if reads is not None
            else asyncio.to_thread(read_events, *query)
        )
        for event in page:
            yield event
        if len(page) < NUM_EVENTS_PER_PAGE:
            return
        from_seq = page[-1].seq + 1
