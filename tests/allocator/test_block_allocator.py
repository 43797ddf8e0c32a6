"""BlockAllocator: exact block ids, LIFO reuse, all-or-nothing, clear errors, and the events it emits."""

from __future__ import annotations

import pickle

import pytest

from nanoserve.allocator import BlockAllocator, BlockEvent, EventKind, FreeReason, KVCacheExhausted, PoolState, apply


@pytest.fixture
def pool() -> BlockAllocator:
    return BlockAllocator(num_blocks=6, block_size=16)


def test_issue_trace_gives_exact_block_ids(pool: BlockAllocator) -> None:
    assert pool.allocate_for(40, "A") == [0, 1, 2]
    assert pool.allocate_for(20, "B") == [3, 4]
    assert pool.allocate_for(16, "C") == [5]
    with pytest.raises(KVCacheExhausted) as info:
        pool.allocate_for(1, "X")
    assert (info.value.requested, info.value.available) == (1, 0)
    assert pool.num_free == 0
    pool.free_all([0, 1, 2])
    assert pool.num_free == 3
    assert pool.allocate_for(30, "D") == [2, 1]
    assert pool.num_free == 1
    assert pool.state().owners == {1: "D", 2: "D", 3: "B", 4: "B", 5: "C"}


def test_issue_trace_with_prefix_caching_keeps_the_head_of_a_cached_prompt(pool: BlockAllocator) -> None:
    """The trace above where A's two full blocks were registered: what prefix caching changes."""
    from nanoserve.allocator import BlockTable, extend_block_keys

    a = BlockTable(pool, "A")
    a.append_tokens(40)
    a.register(extend_block_keys([], list(range(40)), 16), 40)  # blocks 0 and 1 are full; 2 is not
    assert pool.allocate_for(20, "B") == [3, 4]
    assert pool.allocate_for(16, "C") == [5]
    a.release()
    assert (pool.num_free, pool.num_cached_free) == (3, 2)
    assert pool.state().cached_free == [1, 0]  # A's tail is evicted first
    pool.take_events()
    assert pool.allocate_for(30, "D") == [1, 2]  # the never-cached block 2 and block 1, evicted (on top)
    assert [(e.kind, e.block_ids) for e in pool.take_events()] == [
        (EventKind.EVICT, (1,)),
        (EventKind.ALLOCATE_FOR, (1, 2)),
    ]
    assert pool.state().owners == {1: "D", 2: "D", 3: "B", 4: "B", 5: "C"}
    assert list(pool.state().block_keys) == [0]  # A's head stays cached


def test_fresh_pool_hands_out_ascending_ids(pool: BlockAllocator) -> None:
    assert [pool.allocate("A") for _ in range(3)] == [0, 1, 2]


def test_free_reuses_last_freed_block_first(pool: BlockAllocator) -> None:
    for _ in range(3):
        pool.allocate("A")
    pool.free(0)
    pool.free(2)
    assert pool.allocate("B") == 2
    assert pool.allocate("B") == 0


def test_free_all_pushes_in_given_order(pool: BlockAllocator) -> None:
    pool.allocate_for(48, "A")
    pool.free_all([2, 0, 1])
    assert pool.state().free_block_ids == [5, 4, 3, 2, 0, 1]


def test_allocate_for_exhausted_reserves_nothing(pool: BlockAllocator) -> None:
    pool.allocate_for(64, "A")
    with pytest.raises(KVCacheExhausted) as info:
        pool.allocate_for(33, "B")
    assert (info.value.requested, info.value.available) == (3, 2)
    assert pool.num_free == 2
    assert pool.state().owners == {0: "A", 1: "A", 2: "A", 3: "A"}


def test_allocate_on_empty_pool_raises_exhausted() -> None:
    pool = BlockAllocator(num_blocks=1, block_size=4)
    pool.allocate("A")
    with pytest.raises(KVCacheExhausted, match="requested 1 blocks, 0 free"):
        pool.allocate("B")


def test_double_free_names_the_block(pool: BlockAllocator) -> None:
    block_id = pool.allocate("A")
    pool.free(block_id)
    with pytest.raises(ValueError, match="block 0 is already free"):
        pool.free(block_id)


def test_foreign_block_is_refused(pool: BlockAllocator) -> None:
    with pytest.raises(ValueError, match=r"block 6 does not belong to this pool \(block ids are 0..5\)"):
        pool.free(6)


def test_free_all_with_one_bad_block_frees_nothing(pool: BlockAllocator) -> None:
    pool.allocate_for(32, "A")
    with pytest.raises(ValueError, match="block 3 is already free"):
        pool.free_all([0, 1, 3])
    assert pool.num_allocated == 2


def test_free_all_refuses_a_block_listed_twice(pool: BlockAllocator) -> None:
    pool.allocate_for(32, "A")
    with pytest.raises(ValueError, match="block 1 is listed twice"):
        pool.free_all([1, 0, 1])
    assert pool.num_allocated == 2


def test_free_all_of_nothing_is_a_no_op(pool: BlockAllocator) -> None:
    pool.free_all([])
    assert pool.num_free == 6


def test_can_allocate_counts_free_blocks(pool: BlockAllocator) -> None:
    pool.allocate_for(64, "A")
    assert pool.can_allocate(2)
    assert not pool.can_allocate(3)


def test_owner_of_reports_holder_and_none_when_free(pool: BlockAllocator) -> None:
    block_id = pool.allocate("A")
    assert pool.owner_of(block_id) == "A"
    pool.free(block_id, FreeReason.FINISHED)
    assert pool.owner_of(block_id) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0, "block_size": 16}, "num_blocks must be an int >= 1, got 0"),
        ({"num_blocks": 4, "block_size": 0}, "block_size must be an int >= 1, got 0"),
    ],
)
def test_bad_pool_size_is_refused(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockAllocator(**kwargs)


def test_bad_num_tokens_is_refused(pool: BlockAllocator) -> None:
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1, got 0"):
        pool.allocate_for(0, "A")


def test_empty_owner_is_refused(pool: BlockAllocator) -> None:
    with pytest.raises(ValueError, match="owner must be a non-empty str"):
        pool.allocate("")


def test_bad_reason_is_refused_and_frees_nothing(pool: BlockAllocator) -> None:
    block_id = pool.allocate("A")
    with pytest.raises(ValueError, match="reason must be a FreeReason or None, got 'done'"):
        pool.free(block_id, "done")  # type: ignore[arg-type]
    assert pool.owner_of(block_id) == "A"


def test_every_change_is_emitted_in_order(pool: BlockAllocator) -> None:
    pool.allocate_for(40, "A")
    pool.allocate("B")
    pool.free(3, FreeReason.PREEMPTED)
    pool.free_all([2, 0], FreeReason.FINISHED)
    assert pool.take_events() == [
        BlockEvent(EventKind.ALLOCATE_FOR, (0, 1, 2), "A"),
        BlockEvent(EventKind.ALLOCATE, (3,), "B"),
        BlockEvent(EventKind.FREE, (3,), "B", FreeReason.PREEMPTED),
        BlockEvent(EventKind.FREE_ALL, (2, 0), "A", FreeReason.FINISHED),
    ]


def test_take_events_drains_the_pending_list(pool: BlockAllocator) -> None:
    pool.allocate("A")
    assert pool.num_pending_events == 1
    assert len(pool.take_events()) == 1
    assert (pool.num_pending_events, pool.take_events()) == (0, [])


def test_free_all_emits_one_event_per_run_of_one_owner(pool: BlockAllocator) -> None:
    pool.allocate_for(32, "A")
    pool.allocate("B")
    pool.take_events()
    pool.free_all([1, 2, 0])
    assert pool.take_events() == [
        BlockEvent(EventKind.FREE_ALL, (1,), "A"),
        BlockEvent(EventKind.FREE_ALL, (2,), "B"),
        BlockEvent(EventKind.FREE_ALL, (0,), "A"),
    ]


def test_a_refused_call_emits_nothing(pool: BlockAllocator) -> None:
    pool.allocate_for(96, "A")
    pool.take_events()
    with pytest.raises(KVCacheExhausted):
        pool.allocate("B")
    with pytest.raises(ValueError, match="listed twice"):
        pool.free_all([0, 0])
    with pytest.raises(ValueError, match="owner must be a non-empty str"):
        pool.allocate_for(1, "")
    assert pool.take_events() == []


def test_taken_events_applied_to_a_fresh_pool_give_its_state(pool: BlockAllocator) -> None:
    pool.allocate_for(40, "A")
    pool.allocate("B")
    pool.free_all([1, 0])
    pool.allocate_for(17, "C")
    pool.free(3)
    rebuilt = PoolState.fresh(6, 16)
    for event in pool.take_events():
        apply(rebuilt, event)
    assert rebuilt == pool.state()
    assert (rebuilt.free_block_ids, rebuilt.owners) == ([5, 4, 3], {0: "C", 1: "C", 2: "A"})


def test_state_is_a_copy(pool: BlockAllocator) -> None:
    state = pool.state()
    state.free_block_ids.pop()
    state.owners[0] = "X"
    assert pool.owner_of(0) is None
    assert pool.allocate("A") == 0


def test_snapshot_refuses_while_events_are_pending(pool: BlockAllocator) -> None:
    pool.allocate("A")
    with pytest.raises(AssertionError, match="1 events are still pending: take them before a snapshot"):
        pool.snapshot()
    pool.take_events()
    assert pool.snapshot().owners == {0: "A"}


def test_exhausted_error_survives_pickling() -> None:
    error = pickle.loads(pickle.dumps(KVCacheExhausted(3, 1)))
    assert (error.requested, error.available, str(error)) == (3, 1, "KV cache exhausted: requested 3 blocks, 1 free")
