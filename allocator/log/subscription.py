"""``EventStream``: an event log's newly committed events for an asyncio consumer.

The log's writer thread calls subscribers after each commit; this wraps such a
subscriber so that a coroutine can ``async for event in stream`` without
polling: the writer thread hands each group of events to the consumer's loop
with ``loop.call_soon_threadsafe``. The stream ends after the POOL_CLOSE
event, or when ``close()`` is called.

A consumer that falls more than ``max_queued_events`` behind is cut off with
``EventStreamLagged`` (rather than letting memory grow without bound or
slowing the writer); it can resume from the stored log with
``read_events(url, pool_id, epoch, from_seq=error.next_seq)``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log.stored_event import Event

if TYPE_CHECKING:
    from nanoserve.allocator.log.event_log import EventLog

_CLOSE = EventKind.POOL_CLOSE.value


class EventStreamLagged(RuntimeError):
    """The consumer fell too far behind; ``next_seq`` is the first event it did not get."""

    def __init__(self, next_seq: int, max_queued_events: int) -> None:
        super().__init__(
            f"event stream consumer fell more than {max_queued_events} events behind; "
            f"resume with read_events(..., from_seq={next_seq})"
        )
        self.next_seq = next_seq


class EventStream:
    """Committed events of one log, in seq order, as an async iterator.

    Create it on the consumer's event loop (or pass ``loop``). Events committed
    before it was created are not included.
    """

    def __init__(
        self, log: EventLog, loop: asyncio.AbstractEventLoop | None = None, max_queued_events: int = 100_000
    ) -> None:
        if max_queued_events < 1:
            raise ValueError(f"max_queued_events must be >= 1, got {max_queued_events}")
        self._loop = loop or asyncio.get_running_loop()
        self._max_queued_events = max_queued_events
        self._buffer: deque[Event] = deque()  # owned by the loop thread
        self._wakeup = asyncio.Event()
        self._ended = False
        self._error: EventStreamLagged | None = None
        self._unsubscribe = log.subscribe(self._on_commit)

    def _on_commit(self, events: Sequence[Event]) -> None:
        # writer thread: hand off and return at once
        self._loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, events: Sequence[Event]) -> None:
        if self._ended or self._error is not None:
            return
        if len(self._buffer) + len(events) > self._max_queued_events:
            next_seq = self._buffer[0].seq if self._buffer else events[0].seq
            self._error = EventStreamLagged(next_seq, self._max_queued_events)
            self._buffer.clear()
            self._unsubscribe()
        else:
            self._buffer.extend(events)
        self._wakeup.set()

    def close(self) -> None:
        """Stop receiving; a waiting ``__anext__`` ends the iteration."""
        self._ended = True
        self._unsubscribe()
        self._loop.call_soon_threadsafe(self._wakeup.set)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()
        event = self._buffer.popleft()
        if event.kind == _CLOSE:
            self._ended = True
            self._unsubscribe()
        return event
