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
from nanoserve.service.grpc.errors import KvEventsUnavailableError

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


# A batch's number on the KvEventBatch stream: the epoch in the high bits, the
# batch's rank among its epoch's KV batches (1, 2, 3, ...) in the low ones, so a
# number names one batch of one epoch across restarts and numbers only grow.
EPOCH_SHIFT = 32
MAX_BATCH_IN_EPOCH = (1 << EPOCH_SHIFT) - 1


def batch_number(epoch: int, batch_in_epoch: int) -> int:
    """The stream's sequence number of an epoch's ``batch_in_epoch``-th KV batch (1-based).

    ValueError when ``epoch`` < 1 or ``batch_in_epoch`` is outside 1..2**32-1.
    """
    if epoch < 1:
        raise ValueError(f"epoch must be >= 1, got {epoch}")
    if not 1 <= batch_in_epoch <= MAX_BATCH_IN_EPOCH:
        raise ValueError(f"batch_in_epoch must be in 1..{MAX_BATCH_IN_EPOCH}, got {batch_in_epoch}")
    return (epoch << EPOCH_SHIFT) | batch_in_epoch


def split_batch_number(number: int) -> tuple[int, int]:
    """(epoch, batch in epoch) of a stream sequence number; (0, n) for a number sent before
    numbers carried the epoch (or 0, "from the start")."""
    return number >> EPOCH_SHIFT, number & MAX_BATCH_IN_EPOCH


def first_batch_to_send(epoch: int, cursor: int) -> int:
    """The rank in ``epoch`` of the first KV batch a subscription starting at ``cursor`` gets.

    0 and any cursor of an earlier epoch (the replica restarted since the
    subscriber last heard from it, or the cursor predates epoch-tagged numbers)
    start at batch 1: POOL_INIT's ``cleared``, so the subscriber's index of this
    replica resyncs at once. A cursor of this epoch starts at its own batch.
    ValueError for a cursor of a later epoch (not one this replica sent).
    """
    cursor_epoch, batch_in_epoch = split_batch_number(cursor)
    if cursor_epoch > epoch:
        raise ValueError(f"names epoch {cursor_epoch}, but this replica's epoch is {epoch}")
    if cursor_epoch < epoch:
        return 1
    return max(batch_in_epoch, 1)
