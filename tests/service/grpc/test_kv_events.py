"""Logged allocator events -> smg.grpc.common KV cache events: one converter per kind, stream-numbered batches."""

from __future__ import annotations

from typing import Any

import pytest
from smg_grpc_proto.generated import common_pb2 as cpb

from nanoserve.allocator import EventKind
from nanoserve.allocator.log import Event
from nanoserve.service.grpc.errors import KvEventsUnavailableError
from nanoserve.service.grpc.kv_events import (
    KV_EVENT_CONVERTERS,
    MAX_BATCH_IN_EPOCH,
    batch_number,
    block_hash,
    first_batch_to_send,
    split_batch_number,
    to_kv_event_batch,
    to_kv_events,
)


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
    """A new kind must be decided on: converted, or added here as having none."""
    without_kv_event = {
        EventKind.ALLOCATE,
        EventKind.ALLOCATE_FOR,
        EventKind.FREE,
        EventKind.FREE_ALL,
        EventKind.SNAPSHOT,
        EventKind.SHARE,  # references change no block's KV: a router's index sees stores and removals only
        EventKind.RELEASE,
        EventKind.FORK,  # a fork takes references; a copy writes a block no key names (it is partly filled)
        EventKind.COPY,
    }
    decided = set(KV_EVENT_CONVERTERS) | {kind.value for kind in without_kv_event}
    assert decided == {kind.value for kind in EventKind}


KEY_A, KEY_B, KEY_C = "00" * 7 + "01" + "aa" * 24, "ff" * 32, "80" + "00" * 31


def test_a_block_hash_is_the_keys_first_8_bytes_signed() -> None:
    assert (block_hash(KEY_A), block_hash(KEY_B), block_hash(KEY_C)) == (1, -1, -(2**63))


def test_a_register_is_stored_blocks_with_their_token_ids_after_their_parent() -> None:
    register = _event(
        7,
        EventKind.REGISTER,
        (3, 4),
        owner="r1",
        keys=(KEY_B, KEY_C),
        parent_keys=(KEY_A, KEY_B),
        token_ids=((1, 2, 3, 4), (5, 6, 7, 8)),
    )
    assert to_kv_events([register]) == [
        cpb.KvCacheEvent(
            event_id=7,
            stored=cpb.KvBlocksStored(
                blocks=[
                    cpb.KvBlock(block_hash=-1, token_ids=[1, 2, 3, 4], block_size=4),
                    cpb.KvBlock(block_hash=-(2**63), token_ids=[5, 6, 7, 8], block_size=4),
                ],
                parent_block_hash=1,
            ),
        )
    ]


def test_a_first_block_is_stored_without_a_parent_and_a_break_in_the_chain_starts_another_event() -> None:
    register = _event(
        7,
        EventKind.REGISTER,
        (3, 4),
        owner="r1",
        keys=(KEY_A, KEY_C),
        parent_keys=(None, KEY_B),
        token_ids=((1, 2), (5, 6)),
    )
    stored = [event.stored for event in to_kv_events([register])]
    assert stored == [
        cpb.KvBlocksStored(blocks=[cpb.KvBlock(block_hash=1, token_ids=[1, 2], block_size=2)]),
        cpb.KvBlocksStored(
            blocks=[cpb.KvBlock(block_hash=-(2**63), token_ids=[5, 6], block_size=2)], parent_block_hash=-1
        ),
    ]
    assert not stored[0].HasField("parent_block_hash")


def test_an_evict_is_removed_and_a_cache_reset_is_cleared() -> None:
    evict = _event(8, EventKind.EVICT, (3, 4), owner="r2", keys=(KEY_A, KEY_B))
    reset = _event(9, EventKind.CACHE_RESET, (5,), owner="reset", keys=(KEY_C,))
    assert to_kv_events([evict, reset]) == [
        cpb.KvCacheEvent(event_id=8, removed=cpb.KvBlocksRemoved(block_hashes=[1, -1])),
        cpb.KvCacheEvent(event_id=9, cleared=cpb.KvCacheCleared()),
    ]


def test_a_register_logged_without_token_ids_cannot_be_converted() -> None:
    register = _event(7, EventKind.REGISTER, (3,), owner="r1", keys=(KEY_A,), parent_keys=(None,))
    with pytest.raises(KvEventsUnavailableError, match="seq 7 was logged without its blocks' token ids"):
        to_kv_events([register])


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


def test_a_batch_number_carries_its_epoch_in_the_high_bits() -> None:
    assert batch_number(1, 1) == 4_294_967_297
    assert batch_number(3, 7) == 3 * 2**32 + 7
    assert split_batch_number(batch_number(3, 7)) == (3, 7)
    assert split_batch_number(5) == (0, 5)  # a number sent before numbers carried the epoch
    assert batch_number(2, 1) > batch_number(1, MAX_BATCH_IN_EPOCH)
    with pytest.raises(ValueError, match=r"batch_in_epoch must be in 1\.\.4294967295, got 0"):
        batch_number(1, 0)
    with pytest.raises(ValueError, match="epoch must be >= 1, got 0"):
        batch_number(0, 1)


def test_a_cursor_of_an_earlier_epoch_starts_at_the_epochs_first_batch() -> None:
    assert first_batch_to_send(2, 0) == 1
    assert first_batch_to_send(2, batch_number(1, 23)) == 1  # the replica restarted since
    assert first_batch_to_send(2, 23) == 1  # an epoch-less number of an older server
    assert first_batch_to_send(2, batch_number(2, 1)) == 1
    assert first_batch_to_send(2, batch_number(2, 23)) == 23
    assert first_batch_to_send(2, 2 << 32) == 1  # batch 0 of this epoch: from its start
    with pytest.raises(ValueError, match="names epoch 3, but this replica's epoch is 2"):
        first_batch_to_send(2, batch_number(3, 1))
