"""Logged allocator events -> smg.grpc.common KV cache events: one converter per kind, stream-numbered batches."""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import common_pb2 as cpb

from nanoserve.allocator import EventKind
from nanoserve.allocator.log import Event
from nanoserve.service.kv_events import KV_EVENT_CONVERTERS, to_kv_event_batch, to_kv_events


def _event(seq: int, kind: EventKind, block_ids: tuple[int, ...] = (), owner: str | None = None, **extra: Any) -> Event:
    settings: dict[str, Any] = {
        "pool_id": "replica-0",
        "epoch": 1,
        "seq": seq,
        "batch_seq": seq,
        "kind": kind.value,
        "block_ids": block_ids,
        "owner": owner,
        "step": None,
        "reason": None,
        "wall_time_ns": 1_700_000_000_500_000_000 + seq,
        "monotonic_ns": seq,
        "data": None,
        "hash": b"\x00" * 32,
    }
    settings.update(extra)
    return Event(**settings)


EPOCH = [
    _event(1, EventKind.POOL_INIT, data={"num_blocks": 8, "block_size": 16}),
    _event(2, EventKind.ALLOCATE_FOR, (7, 6), owner="r1"),
    _event(3, EventKind.FREE_ALL, (7, 6), owner="r1", reason="finished"),
    _event(4, EventKind.POOL_CLOSE, data={}),
]


def test_an_epochs_boundaries_clear_the_cache_and_blocks_held_by_one_request_are_not_cached() -> None:
    assert to_kv_events(EPOCH) == [
        cpb.KvCacheEvent(event_id=1, cleared=cpb.KvCacheCleared()),
        cpb.KvCacheEvent(event_id=4, cleared=cpb.KvCacheCleared()),
    ]


def test_every_kind_is_either_converted_or_known_to_have_no_kv_event() -> None:
    """A new kind (prefix caching's) must be decided on: converted, or added here as having none."""
    without_kv_event = {
        EventKind.ALLOCATE,
        EventKind.ALLOCATE_FOR,
        EventKind.FREE,
        EventKind.FREE_ALL,
        EventKind.SNAPSHOT,
        EventKind.SHARE,  # references change no block's KV: a router's index sees stores and removals only
        EventKind.RELEASE,
    }
    # stored / removed / cleared once REGISTER records carry token ids (SubscribeKvEvents is UNIMPLEMENTED until then)
    awaiting_token_ids = {EventKind.REGISTER, EventKind.EVICT, EventKind.CACHE_RESET}
    decided = set(KV_EVENT_CONVERTERS) | {kind.value for kind in without_kv_event | awaiting_token_ids}
    assert decided == {kind.value for kind in EventKind}


def test_a_batch_takes_the_streams_number_and_its_last_events_wall_time() -> None:
    batch = to_kv_event_batch(5, EPOCH[2:])
    assert batch == cpb.KvEventBatch(
        sequence_number=5,
        timestamp=(1_700_000_000_500_000_000 + 4) / 1e9,
        events=[cpb.KvCacheEvent(event_id=4, cleared=cpb.KvCacheCleared())],
        dp_rank=0,
    )


def test_a_batch_without_kv_events_is_not_sent() -> None:
    assert to_kv_event_batch(1, EPOCH[1:3]) is None
