"""The allocator's logged events -> the KV cache events of ``smg.grpc.common`` (``KvEventBatch``).

A gateway's cache-aware router keeps, per replica, an index of the prefix
blocks that replica holds; ``VllmEngine/SubscribeKvEvents`` feeds it three
shapes: ``stored`` (blocks entered the prefix cache: content hash, token ids,
parent hash), ``removed`` (hashes evicted) and ``cleared`` (nothing is cached
any more). This module maps our durable log onto them, one small converter per
event kind (``KV_EVENT_CONVERTERS``).

What maps today is an epoch's boundaries: POOL_INIT (a fresh pool caches
nothing) and POOL_CLOSE (the pool and its cache are gone) are ``cleared``.
Prefix caching logs the kinds that matter (REGISTER: a block cached with its
key and parent key; EVICT: a cached block's key dropped; CACHE_RESET), but a
``stored`` event also needs each block's token ids, which REGISTER records do
not carry yet: once they do, each kind is one more entry in the table and
``SubscribeKvEvents`` streams ``to_kv_event_batch`` of each logged batch.
Until then the RPC is UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from smg_grpc_proto.generated import common_pb2 as cpb

from nanoserve.allocator import EventKind
from nanoserve.allocator.log import Event

KvEventConverter = Callable[[Event], cpb.KvCacheEvent]


def _cleared(event: Event) -> cpb.KvCacheEvent:
    return cpb.KvCacheEvent(event_id=event.seq, cleared=cpb.KvCacheCleared())


# allocator event kind -> its KV cache event; a kind not here (a block held by one request) has none
KV_EVENT_CONVERTERS: dict[str, KvEventConverter] = {
    EventKind.POOL_INIT.value: _cleared,
    EventKind.POOL_CLOSE.value: _cleared,
}


def to_kv_events(events: Iterable[Event]) -> list[cpb.KvCacheEvent]:
    """The KV cache events of logged allocator events, in log order; ``event_id`` is the event's seq."""
    return [KV_EVENT_CONVERTERS[event.kind](event) for event in events if event.kind in KV_EVENT_CONVERTERS]


def to_kv_event_batch(sequence_number: int, events: Sequence[Event]) -> cpb.KvEventBatch | None:
    """One KvEventBatch of one logged batch of events; None when none of them is a KV event.

    sequence_number: the batch's number on its stream. The gateway applies
    batches in order and takes a number more than one past the last as a gap
    (it resubscribes), so a stream numbers the batches it sends 1, 2, 3, ...
    (the log's seq, which counts every event, cannot serve). timestamp: the wall
    time of the batch's last event, seconds since the epoch.
    """
    kv_events = to_kv_events(events)
    if not kv_events:
        return None
    return cpb.KvEventBatch(
        sequence_number=sequence_number, timestamp=events[-1].wall_time_ns / 1e9, events=kv_events, dp_rank=0
    )
