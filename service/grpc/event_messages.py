"""``EventMessages``: each event WatchEvents streams, converted and serialized once for all its watchers.

The watchers of one log are sent the same events: a live event is one ``Event`` object handed
to every subscription, and a stored page read for a crowd catching up at once is one list of
``Event`` objects shared by them (``LogReads.run_shared``). Converting an event to its message
and serializing it costs the event loop tens of microseconds, so 100 watchers catching up paid
it 100 times per event. Here the serialized ``WatchEventsResponse`` is kept for the last
``max_events`` events converted, keyed by the event object, and each watcher is handed the same
bytes (``interceptors._passing_bytes`` sends them as they are). A watcher that asked for several
events a message (``max_events_per_message``) gets them joined from the same kept bytes (``batch``).
"""

from __future__ import annotations

import collections

from nanoserve.allocator.log import Event
from nanoserve.service.grpc import allocation_convert
from nanoserve.v1 import allocation_pb2 as apb

# protobuf wire format (protobuf.dev/programming-guides/encoding): a length-delimited field's tag is
# field_number << 3 | 2; WatchEventsResponse.event is field 1, WatchEventsResponse.events field 2
EVENT_TAG = bytes([1 << 3 | 2])
EVENTS_TAG = bytes([2 << 3 | 2])

MAX_EVENTS = 16_384  # serialized events kept: 16 catch-up pages, about 10 MB with their events


class EventMessages:
    """Invariant: an entry holds its ``Event`` itself as well as its bytes, so the event's id cannot
    be reused by another object while the entry lives; at most ``max_events`` entries, the least
    recently sent dropped first. Events are immutable (frozen): the bytes never go stale."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.max_events = max_events
        # id(event) -> (the event, its serialized WatchEventsResponse), least recently sent first
        self._messages: collections.OrderedDict[int, tuple[Event, bytes]] = collections.OrderedDict()

    def message(self, event: Event) -> bytes:
        """``WatchEventsResponse(event=allocation_convert.to_event(event))``, serialized; the same
        ``bytes`` object for every watcher sent this event object while it is kept."""
        key = id(event)
        entry = self._messages.get(key)
        if entry is not None:
            self._messages.move_to_end(key)
            return entry[1]
        serialized = apb.WatchEventsResponse(event=allocation_convert.to_event(event)).SerializeToString()
        self._messages[key] = (event, serialized)
        if len(self._messages) > self.max_events:
            self._messages.popitem(last=False)
        return serialized

    def batch(self, events: list[Event]) -> bytes:
        """``WatchEventsResponse(events=[...])`` of ``events``, serialized. A message with only
        ``event`` set is its tag, the event's length and the event's bytes; the same with the tag of
        ``events`` is one element of the repeated field, so the batch is those joined."""
        parts = []
        for event in events:
            single = self.message(event)
            assert single[:1] == EVENT_TAG  # the message holds the one field, first
            parts.append(EVENTS_TAG)
            parts.append(single[1:])
        return b"".join(parts)
