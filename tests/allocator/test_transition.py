"""``apply``: the one transition function, its rules, and what it does with an event that breaks one."""

from __future__ import annotations

import pytest

from nanoserve.allocator import BlockEvent, EventKind, FreeReason, PoolState, apply

Report = tuple[str, str, "int | None", "str | None"]


def pool_with(free: list[int], owners: dict[int, str]) -> PoolState:
    return PoolState(num_blocks=6, block_size=16, free_block_ids=free, owners=owners)


def apply_reporting(state: PoolState, event: BlockEvent) -> list[Report]:
    reports: list[Report] = []
    apply(state, event, lambda rule, message, block_id, owner: reports.append((rule, message, block_id, owner)))
    return reports


def test_fresh_pool_stacks_block_0_on_top() -> None:
    assert PoolState.fresh(4, 16).free_block_ids == [3, 2, 1, 0]


def test_allocate_for_takes_blocks_off_the_top_in_order() -> None:
    state = PoolState.fresh(6, 16)
    apply(state, BlockEvent(EventKind.ALLOCATE_FOR, (0, 1, 2), "A"))
    assert (state.free_block_ids, state.owners) == ([5, 4, 3], {0: "A", 1: "A", 2: "A"})


def test_a_block_below_the_top_is_taken_from_where_it_is() -> None:
    state = PoolState.fresh(6, 16)
    assert apply_reporting(state, BlockEvent(EventKind.ALLOCATE, (3,), "A")) == []
    assert (state.free_block_ids, state.owners) == ([5, 4, 2, 1, 0], {3: "A"})


def test_free_pushes_blocks_in_the_event_order() -> None:
    state = pool_with([5, 4], {0: "A", 1: "A", 2: "A", 3: "B"})
    apply(state, BlockEvent(EventKind.FREE_ALL, (2, 0, 1), "A", FreeReason.FINISHED))
    assert (state.free_block_ids, state.owners) == ([5, 4, 2, 0, 1], {3: "B"})


def test_taking_a_held_block_is_reported_and_skipped() -> None:
    state = pool_with([5, 4, 3], {0: "A", 1: "A", 2: "B"})
    reports = apply_reporting(state, BlockEvent(EventKind.ALLOCATE_FOR, (3, 2), "C"))
    assert reports == [("allocate_of_allocated", "block is held by 'B'", 2, "C")]
    assert (state.free_block_ids, state.owners) == ([5, 4], {0: "A", 1: "A", 2: "B", 3: "C"})


def test_taking_a_block_outside_the_pool_is_reported_and_skipped() -> None:
    state = PoolState.fresh(6, 16)
    assert apply_reporting(state, BlockEvent(EventKind.ALLOCATE, (6,), "A")) == [
        ("foreign_block", "block is not in the pool of 6", 6, "A")
    ]
    assert state == PoolState.fresh(6, 16)


def test_a_state_that_lost_a_block_is_a_bug_not_a_violation() -> None:
    state = pool_with([5, 4], {0: "A"})  # blocks 1, 2, 3 are nowhere
    with pytest.raises(AssertionError, match="block 2 is neither free nor allocated"):
        apply_reporting(state, BlockEvent(EventKind.ALLOCATE, (2,), "B"))


def test_freeing_a_free_block_is_reported_and_skipped() -> None:
    state = pool_with([5, 4, 3, 2, 1], {0: "A"})
    reports = apply_reporting(state, BlockEvent(EventKind.FREE_ALL, (1, 0, 9), "A"))
    assert reports == [
        ("free_of_free_block", "block is not allocated", 1, "A"),
        ("foreign_block", "block is not allocated", 9, "A"),
    ]
    assert (state.free_block_ids, state.owners) == ([5, 4, 3, 2, 1, 0], {})


def test_freeing_another_owners_block_is_reported_and_freed() -> None:
    state = pool_with([5, 4, 3, 2, 1], {0: "A"})
    assert apply_reporting(state, BlockEvent(EventKind.FREE, (0,), "B")) == [
        ("owner_mismatch", "block is held by 'A'", 0, "B")
    ]
    assert (state.free_block_ids, state.owners) == ([5, 4, 3, 2, 1, 0], {})


def test_a_kind_without_a_transition_changes_nothing_and_is_reported() -> None:
    state = PoolState.fresh(6, 16)
    assert apply_reporting(state, BlockEvent(EventKind.SNAPSHOT, (0,), "A")) == [
        ("unknown_kind", "event kind 'snapshot' changes no block", None, "A")
    ]
    assert state == PoolState.fresh(6, 16)


def test_the_allocators_report_raises() -> None:
    state = PoolState.fresh(6, 16)
    with pytest.raises(AssertionError, match=r"allocator broke rule free_of_free_block \(block 0, owner 'A'\)"):
        apply(state, BlockEvent(EventKind.FREE, (0,), "A"))


def test_equality_compares_the_pool_not_where_it_came_from() -> None:
    replayed = PoolState(6, 16, [5, 4], {0: "A"}, last_seq=9, pool_id="p", epoch=2)
    assert replayed == PoolState(6, 16, [5, 4], {0: "A"})
    assert replayed != PoolState(6, 16, [4, 5], {0: "A"})
