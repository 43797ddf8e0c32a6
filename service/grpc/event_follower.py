"""``follow_events``: an event log's committed events from a seq on, stored ones first, then live ones.

What both streaming readers of the log share (``AllocationService/WatchEvents``
and ``VllmEngine/SubscribeKvEvents``): only durable events, in seq order,
without gap or duplicate, from the store while catching up and from the log's
commit subscription after that.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from nanoserve.allocator import EventKind
from nanoserve.allocator.log import Event, EventLog, EventStream, EventStreamLagged
from nanoserve.engine.core.log_reads import ReadPacer
from nanoserve.engine.core.stored_events import StoredEvents

NUM_EVENTS_PER_PACE = 64  # stored events sent per turn at the read pacer


async def follow_events(
    event_log: EventLog,
    from_seq: int,
    max_queued_events: int = 100_000,
    stored: StoredEvents | None = None,
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
    (``LogUnavailableError``, ``LogDamagedError``). stored: the pages of stored events the server's
    catch-ups share, read on its reader threads (None: pages of this call's own, each read on a
    thread of asyncio's own). pacer: the stored events go out at its pace, and the reads take their
    turns, under ``scope`` (the caller's tenant).
    """
    stored = stored if stored is not None else StoredEvents()
    next_seq = from_seq
    while True:
        live = EventStream(event_log, max_queued_events=max_queued_events)
        try:
            async for event in _stored_events(event_log, next_seq, stored, scope):
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


async def _stored_events(event_log: EventLog, from_seq: int, stored: StoredEvents, scope: str) -> AsyncIterator[Event]:
    """Committed events of the current epoch from ``from_seq``, a page at a time (``StoredEvents.page``, in
    ``scope``'s turn at the reader threads): a crowd catching up reads and decodes each page about
    once, and each later caller only the events committed since."""
    while True:
        page = await stored.page(event_log, from_seq, scope)
        for event in page:
            yield event
        if len(page) < stored.num_events_per_page:
            return
        from_seq = page[-1].seq + 1
