"""The allocator's logged events -> the KV cache events of ``smg.grpc.common`` (``KvEventBatch``).

A gateway's cache-aware router keeps, per replica, an index of the prefix
blocks that replica holds; ``VllmEngine/SubscribeKvEvents`` feeds it three
shapes: ``stored`` (blocks entered the prefix cache: content hash, token ids,
parent hash), ``removed`` (hashes evicted) and ``cleared`` (nothing is cached
any more). This module maps our durable log onto them, one small converter per
event kind (``KV_EVENT_CONVERTERS``):

- REGISTER -> ``stored``: the blocks a forward pass wrote, with their token ids
  (logged since REGISTER records carry them), one event per chain of blocks;
- EVICT -> ``removed``: cached-free blocks that lost their keys;
- CACHE_RESET, POOL_INIT, POOL_CLOSE -> ``cleared``: a reset (refused while any
  block is held, so afterwards nothing is cached), a fresh pool, a closed one.

Our block keys are hex sha256; the contract's block hash is an int64, so a key
maps to its first 8 bytes read as a signed big-endian integer (``block_hash``),
the same way for a block and for the parent another block names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from smg_grpc_proto.generated import common_pb2 as cpb

from nanoserve.allocator import EventKind
from nanoserve.allocator.log import Event
from nanoserve.service.errors import KvEventsUnavailableError

KvEventConverter = Callable[[Event], list[cpb.KvCacheEvent]]


def block_hash(key: str) -> int:
    """The contract's int64 block hash of a hex block key: its first 8 bytes, signed big-endian.

    ValueError when ``key`` has fewer than 16 hex digits.
    """
    if len(key) < 16:
        raise ValueError(f"block key {key!r} has fewer than 16 hex digits")
    return int.from_bytes(bytes.fromhex(key[:16]), "big", signed=True)


def _stored(event: Event) -> list[cpb.KvCacheEvent]:
    """One ``stored`` event per run of blocks each of which follows the one before it.

    KvBlocksStored names one parent for its blocks, the rest chained in order;
    the allocator registers a sequence's blocks in order, so a REGISTER is one run.
    Raises KvEventsUnavailableError for a record written before REGISTER logged token ids.
    """
    if len(event.token_ids) != len(event.keys):
        raise KvEventsUnavailableError(
            f"the REGISTER at seq {event.seq} was logged without its blocks' token ids (written by an older nanoserve)"
        )
    kv_events: list[cpb.KvCacheEvent] = []
    previous: str | None = None
    for key, parent, token_ids in zip(event.keys, event.parent_keys, event.token_ids, strict=True):
        block = cpb.KvBlock(block_hash=block_hash(key), token_ids=token_ids, block_size=len(token_ids))
        if kv_events and parent is not None and parent == previous:
            kv_events[-1].stored.blocks.append(block)
        else:
            stored = cpb.KvBlocksStored(blocks=[block])
            if parent is not None:
                stored.parent_block_hash = block_hash(parent)
            kv_events.append(cpb.KvCacheEvent(event_id=event.seq, stored=stored))
        previous = key
    return kv_events


def _removed(event: Event) -> list[cpb.KvCacheEvent]:
    removed = cpb.KvBlocksRemoved(block_hashes=[block_hash(key) for key in event.keys])
    return [cpb.KvCacheEvent(event_id=event.seq, removed=removed)]


def _cleared(event: Event) -> list[cpb.KvCacheEvent]:
    return [cpb.KvCacheEvent(event_id=event.seq, cleared=cpb.KvCacheCleared())]


# allocator event kind -> its KV cache events; a kind not here (a reference taken or
# dropped, a block held by one request) changes nothing a prefix index holds
KV_EVENT_CONVERTERS: dict[str, KvEventConverter] = {
    EventKind.POOL_INIT.value: _cleared,
    EventKind.REGISTER.value: _stored,
    EventKind.EVICT.value: _removed,
    EventKind.CACHE_RESET.value: _cleared,
    EventKind.POOL_CLOSE.value: _cleared,
}


def to_kv_events(events: Iterable[Event]) -> list[cpb.KvCacheEvent]:
    """The KV cache events of logged allocator events, in log order; ``event_id`` is the event's seq."""
    return [
        kv_event
        for event in events
        if event.kind in KV_EVENT_CONVERTERS
        for kv_event in KV_EVENT_CONVERTERS[event.kind](event)
    ]


def to_kv_event_batch(sequence_number: int, events: Sequence[Event]) -> cpb.KvEventBatch | None:
    """One KvEventBatch of one logged batch of events; None when none of them is a KV event.

    sequence_number: the batch's number on its stream. The gateway applies
    batches in order and takes a number more than one past the last as a gap
    (it resubscribes), so batches are numbered 1, 2, 3, ... (the log's seq,
    which counts every event, cannot serve). timestamp: the wall time of the
    batch's last event, seconds since the epoch.
    """
    kv_events = to_kv_events(events)
    if not kv_events:
        return None
    return cpb.KvEventBatch(
        sequence_number=sequence_number, timestamp=events[-1].wall_time_ns / 1e9, events=kv_events, dp_rank=0
    )
