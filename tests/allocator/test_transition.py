"""``apply``: the one transition function, its rules, and what it does with an event that breaks one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.allocator import TRANSITIONS, BlockEvent, EventKind, FreeReason, PoolState, apply

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


Change = tuple[int, "str | None", "str | None"]


def apply_observing(state: PoolState, event: BlockEvent) -> list[Change]:
    changes: list[Change] = []
    apply(state, event, lambda *_: None, lambda block_id, old, new: changes.append((block_id, old, new)))
    return changes


def cached_pool() -> PoolState:
    """Blocks 0 and 1 registered by A; B shares both; block 2 held by A alone, never cached."""
    state = PoolState.fresh(6, 16)
    apply(state, BlockEvent(EventKind.ALLOCATE_FOR, (0, 1, 2), "A"))
    apply(state, BlockEvent(EventKind.REGISTER, (0, 1), "A", keys=("k0", "k1"), parent_keys=(None, "k0")))
    apply(state, BlockEvent(EventKind.SHARE, (0, 1), "B", keys=("k0", "k1"), ref_counts=(2, 2)))
    return state


def test_observe_sees_each_block_taken_and_freed_in_order() -> None:
    state = PoolState.fresh(6, 16)
    assert apply_observing(state, BlockEvent(EventKind.ALLOCATE_FOR, (0, 1), "A")) == [(0, None, "A"), (1, None, "A")]
    assert apply_observing(state, BlockEvent(EventKind.FREE_ALL, (1, 0), "A", FreeReason.FINISHED)) == [
        (1, "A", None),
        (0, "A", None),
    ]


def test_observe_sees_broken_rules_only_as_far_as_they_change_holders() -> None:
    state = pool_with([5, 4], {0: "A", 1: "B"})
    assert apply_observing(state, BlockEvent(EventKind.ALLOCATE, (0,), "C")) == []  # held: skipped
    assert apply_observing(state, BlockEvent(EventKind.FREE, (3,), "A")) == []  # free already
    assert apply_observing(state, BlockEvent(EventKind.FREE, (1,), "A")) == [(1, "B", None)]  # freed all the same


def test_releasing_a_shared_block_hands_it_to_the_next_holder() -> None:
    state = cached_pool()
    release = BlockEvent(EventKind.RELEASE, (1, 0), "A", FreeReason.FINISHED, keys=("k1", "k0"), ref_counts=(1, 1))
    assert apply_observing(state, release) == [(1, "A", "B"), (0, "A", "B")]
    assert state.owners == {0: "B", 1: "B", 2: "A"}


def test_sharing_is_a_holder_change_only_off_the_cached_free_list() -> None:
    state = cached_pool()
    assert apply_observing(state, BlockEvent(EventKind.SHARE, (0,), "C", keys=("k0",), ref_counts=(3,))) == []
    for owner in ("A", "B", "C"):
        release = BlockEvent(EventKind.RELEASE, (0,), owner, keys=("k0",))
        apply(state, release, lambda *_: None)
    assert state.cached_free == [0]
    assert apply_observing(state, BlockEvent(EventKind.SHARE, (0,), "D", keys=("k0",), ref_counts=(1,))) == [
        (0, None, "D")
    ]
    assert apply_observing(state, BlockEvent(EventKind.EVICT, (1,), "", keys=("k1",))) == []  # held by B


KEYS = ("k0", "k1", "k2")
CACHE_KINDS = (EventKind.SHARE, EventKind.RELEASE, EventKind.EVICT, EventKind.CACHE_RESET)


def draw_event(data: st.DataObject, state: PoolState) -> BlockEvent:
    """A block event on a pool of 4 (block 4 is foreign), rules broken or not.

    Half the time its blocks and keys are drawn from what the pool holds (blocks of
    the owner, registered ones with their keys), so that registering, sharing and
    handing a shared block over come up often; otherwise anything.
    """
    kind = data.draw(st.sampled_from(sorted(TRANSITIONS, key=lambda kind: kind.value)))
    owner = data.draw(st.sampled_from("ABC"))
    candidates = sorted(state.block_keys) if kind in CACHE_KINDS else [b for b in range(4) if b not in state.owners]
    if kind in (EventKind.REGISTER, EventKind.FREE, EventKind.FREE_ALL, EventKind.RELEASE):
        candidates = [b for b in sorted(state.owners) if owner in state.holders(b)]
    if candidates and data.draw(st.booleans()):
        block_ids = tuple(data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=2, unique=True)))
    else:
        block_ids = tuple(data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=2)))
    keys = tuple(
        state.block_keys[b][0] if b in state.block_keys else data.draw(st.sampled_from(KEYS)) for b in block_ids
    )
    reason = data.draw(st.sampled_from([None, *FreeReason]))
    if kind is EventKind.REGISTER:
        return BlockEvent(
            kind,
            block_ids,
            owner,
            None,
            tuple(data.draw(st.sampled_from(KEYS)) for _ in block_ids),
            (None,) * len(block_ids),
        )
    if kind in CACHE_KINDS:
        return BlockEvent(kind, block_ids, owner, reason if kind is EventKind.RELEASE else None, keys)
    return BlockEvent(kind, block_ids, owner, reason)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_observed_holder_changes_rebuild_the_owner_map_after_every_event(data: st.DataObject) -> None:
    """The observe contract: a mirror kept only from (block, old, new) equals ``owners``, broken rules included."""
    state = PoolState.fresh(4, 16)
    mirror: dict[int, str] = {}

    def observe(block_id: int, old: str | None, new: str | None) -> None:
        assert mirror.get(block_id) == old
        if new is None:
            del mirror[block_id]
        else:
            mirror[block_id] = new

    for _ in range(data.draw(st.integers(0, 40))):
        apply(state, draw_event(data, state), lambda *_: None, observe)
        assert mirror == state.owners
