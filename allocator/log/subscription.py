"""Who hears of each commit: the writer's ``Subscribers``, and ``EventStream`` for an asyncio consumer.

``Subscribers`` holds the callbacks the writer thread calls after each commit, with the
committed events decoded once for all of them.

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
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import structlog

from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log.record_codec import decode_event
from nanoserve.allocator.log.store import Row
from nanoserve.allocator.log.stored_event import Event

if TYPE_CHECKING:
    from nanoserve.allocator.log.event_log import EventLog

_CLOSE = EventKind.POOL_CLOSE.value

log = structlog.get_logger(__name__)

# called on the writer thread with the events of one commit, in seq order
Subscriber = Callable[[Sequence[Event]], None]


class Subscribers:
    """The callbacks to call after each commit, safe to add to and remove from on any thread.

    ``publish`` runs on the writer thread: a callback that raises is dropped (logged once)
    so that one broken consumer never stops the log.
    """

    def __init__(self) -> None:
        self._callbacks: list[Subscriber] = []
        self._lock = threading.Lock()

    def add(self, callback: Subscriber) -> Callable[[], None]:
        """Adds ``callback``; returns the function that removes it (safe to call twice)."""
        with self._lock:
            self._callbacks.append(callback)
        return lambda: self._remove(callback)

    def _remove(self, callback: Subscriber) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def publish(self, rows: Sequence[Row]) -> None:
        """Decodes the committed ``rows`` (``store.ROW_COLUMNS`` order) once, if anyone listens, and
        hands the events to every callback."""
        with self._lock:
            callbacks = list(self._callbacks)
        if not callbacks:
            return
        events = [
            decode_event(pool_id, epoch, seq, record, hash_) for pool_id, epoch, seq, _, _, record, hash_, _ in rows
        ]
        for callback in callbacks:
            try:
                callback(events)
            except Exception as exc:
                log.warning("event_log_subscriber_failed", error=repr(exc))
                self._remove(callback)


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
