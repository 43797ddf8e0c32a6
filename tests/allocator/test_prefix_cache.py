"""Prefix caching in the allocator: exact block ids, eviction order, verification, events and rules."""

from __future__ import annotations

import base64

import pytest

from nanoserve.allocator import (
    BlockAllocator,
    BlockEvent,
    BlockTable,
    EventKind,
    FreeReason,
    PoolState,
    apply,
    block_key,
    extend_block_keys,
)
from nanoserve.allocator.log.record_codec import decode_block_event, encode_block_record, split_record

BLOCK_SIZE = 2


def cached_table(pool: BlockAllocator, owner: str, tokens: list[int]) -> BlockTable:
    """A table holding ``tokens``, its full blocks registered (as after the forward pass)."""
    table = BlockTable(pool, owner)
    table.append_tokens(len(tokens))
    table.register(extend_block_keys([], tokens, BLOCK_SIZE), len(tokens))
    return table


def test_release_keeps_keys_and_evicts_tail_first_after_never_cached_blocks() -> None:
    pool = BlockAllocator(6, BLOCK_SIZE)
    table = cached_table(pool, "A", [1, 2, 3, 4, 5, 6])
    assert table.block_ids == [0, 1, 2]
    table.release(FreeReason.FINISHED)
    state = pool.state()
    assert state.cached_free == [2, 1, 0]  # the tail is least recently used
    assert state.free_block_ids == [5, 4, 3]
    assert pool.num_free == 6
    assert pool.num_cached_free == 3
    pool.take_events()
    assert pool.allocate_for(4, "B") == [3, 4]  # never-cached blocks first
    assert pool.allocate_for(4, "C") == [2, 5]  # the evicted LRU block (A's tail) goes on top of the stack
    events = pool.take_events()
    assert [(e.kind, e.block_ids, e.owner) for e in events] == [
        (EventKind.ALLOCATE_FOR, (3, 4), "B"),
        (EventKind.EVICT, (2,), "C"),
        (EventKind.ALLOCATE_FOR, (2, 5), "C"),
    ]
    assert sorted(pool.state().block_keys) == [0, 1]


def test_share_prefix_takes_references_and_release_drops_them() -> None:
    pool = BlockAllocator(8, BLOCK_SIZE)
    tokens = [7, 7, 8, 8, 9]
    a = cached_table(pool, "A", tokens)
    keys = extend_block_keys([], tokens, BLOCK_SIZE)
    b = BlockTable(pool, "B")
    assert b.share_prefix(keys[:2]) == 4
    assert b.block_ids == [0, 1]
    state = pool.state()
    assert state.holders(0) == ["A", "B"]
    assert state.ref_count(1) == 2
    events = pool.take_events()
    assert events[-1] == BlockEvent(EventKind.SHARE, (0, 1), "B", None, (keys[0].key, keys[1].key), (), (2, 2))
    a.release(FreeReason.ABORTED)
    state = pool.state()
    assert state.owners == {0: "B", 1: "B"}
    assert state.sharers == {}
    assert state.free_block_ids[-1] == 2  # A's unregistered partial block went back as never-cached
    released = pool.take_events()
    assert [(e.kind, e.block_ids, e.ref_counts) for e in released] == [
        (EventKind.FREE_ALL, (2,), ()),
        (EventKind.RELEASE, (1, 0), (1, 1)),
    ]


def test_lookup_checks_tokens_so_a_forced_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_key, "digest", lambda payload: "0" * 64)
    pool = BlockAllocator(8, BLOCK_SIZE)
    cached_table(pool, "A", [1, 2, 3, 4, 5])
    assert pool.state().key_blocks == {"0" * 64: 0}  # block 1's key was taken by block 0: not registered
    other = extend_block_keys([], [1, 2, 9, 9], BLOCK_SIZE)
    assert pool.share_prefix("B", other) == [0]  # block 0 really holds [1, 2]
    assert pool.share_prefix("C", extend_block_keys([], [3, 4], BLOCK_SIZE)) == []  # same key, other tokens


def test_salt_separates_keys() -> None:
    pool = BlockAllocator(8, BLOCK_SIZE)
    table = BlockTable(pool, "A")
    table.append_tokens(3)
    table.register(extend_block_keys([], [1, 2, 3], BLOCK_SIZE, ("tenant-a",)), 3)
    assert pool.share_prefix("B", extend_block_keys([], [1, 2, 3], BLOCK_SIZE, ("tenant-b",))) == []
    assert pool.share_prefix("C", extend_block_keys([], [1, 2, 3], BLOCK_SIZE, ("tenant-a",))) == [0]


def test_reset_refuses_while_blocks_are_held_and_drops_every_key_when_idle() -> None:
    pool = BlockAllocator(4, BLOCK_SIZE)
    table = cached_table(pool, "A", [1, 2, 3, 4])
    assert pool.reset_prefix_cache() is False
    table.release()
    assert pool.reset_prefix_cache("admin") is True
    state = pool.state()
    assert state.block_keys == {}
    assert state.cached_free == []
    assert state.free_block_ids == [3, 2, 1, 0]
    keys = extend_block_keys([], [1, 2, 3, 4], BLOCK_SIZE)
    assert pool.take_events()[-1] == BlockEvent(
        EventKind.CACHE_RESET, (1, 0), "admin", None, (keys[1].key, keys[0].key)
    )


def test_every_cache_kind_round_trips_through_its_record() -> None:
    keys = ("ab" * 32, "cd" * 32)
    events = [
        BlockEvent(EventKind.REGISTER, (3, 4), "r|1", None, keys, (None, keys[0])),
        BlockEvent(EventKind.REGISTER, (3, 4), "r|1", None, keys, (None, keys[0]), (), ((7, 0), (65535, 12))),
        BlockEvent(EventKind.SHARE, (3, 4), "r2", None, keys, (), (2, 3)),
        BlockEvent(EventKind.RELEASE, (4, 3), "r2", FreeReason.PREEMPTED, keys, (), (1, 0)),
        BlockEvent(EventKind.EVICT, (3,), "r3", None, keys[:1]),
        BlockEvent(EventKind.CACHE_RESET, (), "admin"),
    ]
    for event in events:
        record = encode_block_record(9, 9, event, 2, 0, 0)
        _, _, kind, block_text, _, reason_text, _, _, tail = split_record(record)
        assert decode_block_event(kind, block_text, reason_text, tail) == event


def test_register_records_carry_each_blocks_token_ids() -> None:
    pool = BlockAllocator(4, BLOCK_SIZE)
    cached_table(pool, "A", [5, 6, 7, 8, 9])
    register = pool.take_events()[-1]
    keys = extend_block_keys([], [5, 6, 7, 8], BLOCK_SIZE)
    assert register == BlockEvent(
        EventKind.REGISTER, (0, 1), "A", None, (keys[0].key, keys[1].key), (None, keys[0].key), (), ((5, 6), (7, 8))
    )
    record = encode_block_record(3, 3, register, 1, 0, 0)

    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    first, second = (b64(bytes.fromhex(key.key)) for key in keys)
    # keys as base64url bytes, the second's parent "^" (the entry before), token ids as varints
    assert split_record(record)[5] == f";~{first}::{b64(bytes([5, 6]))},~{second}:^:{b64(bytes([7, 8]))}"


def test_a_register_record_written_before_token_ids_still_decodes() -> None:
    key, parent = "ab" * 32, "cd" * 32
    event = decode_block_event("register", "3,4", f";{parent}:,{key}:{parent}", "A")
    assert event == BlockEvent(EventKind.REGISTER, (3, 4), "A", None, (parent, key), (None, parent))
    assert event.token_ids == ()


@pytest.mark.parametrize(
    "entries",
    [f"{'ab' * 32}::1.2,{'cd' * 32}:{'ab' * 32}", f"{'ab' * 32}::1.x", f"{'ab' * 32}::1:2"],
    ids=["tokens_on_some_blocks", "not_a_token_id", "too_many_parts"],
)
def test_a_malformed_register_entry_is_refused(entries: str) -> None:
    with pytest.raises(ValueError, match="register"):
        decode_block_event("register", "3,4" if "," in entries else "3", f";{entries}", "A")


def collect(state: PoolState, *events: BlockEvent) -> list[tuple[str, int | None]]:
    found: list[tuple[str, int | None]] = []
    for event in events:
        apply(state, event, lambda rule, message, block_id, owner: found.append((rule, block_id)))
    return found


def test_rules_of_the_cache_are_reported() -> None:
    key = "11" * 32
    state = PoolState.fresh(4, BLOCK_SIZE)
    assert collect(
        state,
        BlockEvent(EventKind.ALLOCATE, (0,), "A"),
        BlockEvent(EventKind.REGISTER, (1,), "A", None, (key,), (None,)),  # not held by A
        BlockEvent(EventKind.REGISTER, (0,), "A", None, (key,), (None,)),
        BlockEvent(EventKind.REGISTER, (0,), "A", None, ("22" * 32,), (None,)),  # twice
        BlockEvent(EventKind.SHARE, (0,), "B", None, (key,), (), (3,)),  # count is 2
        BlockEvent(EventKind.RELEASE, (0,), "A", None, (key,), (), (1,)),
        BlockEvent(EventKind.RELEASE, (0,), "B", None, (key,), (), (0,)),
        BlockEvent(EventKind.ALLOCATE, (0,), "C"),  # still cached: no EVICT came first
        BlockEvent(EventKind.SHARE, (0,), "D", None, (key,), (), (2,)),  # its key is gone
    ) == [
        ("register_of_unheld", 1),
        ("double_register", 0),
        ("ref_count_mismatch", 0),
        ("stale_key", 0),
        ("ref_on_evicted", 0),
    ]
    assert state.owners == {0: "C"}
    assert state.block_keys == {}
    assert state.key_blocks == {}
