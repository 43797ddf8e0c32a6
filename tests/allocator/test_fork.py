"""Forked block tables (parallel sampling): shared by reference, the partly filled last block copied on write."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.allocator import (
    BlockAllocator,
    BlockEvent,
    BlockTable,
    EventKind,
    FreeReason,
    KVCacheExhausted,
    PoolState,
    apply,
)
from nanoserve.allocator.log import EventLog, audit, replay
from nanoserve.allocator.log.record_codec import decode_block_event, encode_block_record, split_record
from nanoserve.migrations import upgrade


def forked_pool() -> tuple[BlockAllocator, BlockTable, list[BlockTable]]:
    """A parent of 10 tokens in blocks [0, 1, 2] (block 2 holds 2 of 4) and two children forked from it."""
    pool = BlockAllocator(8, 4)
    parent = BlockTable(pool, "r")
    parent.append_tokens(10)
    children = [parent.fork("r#0"), parent.fork("r#1")]
    return pool, parent, children


def test_fork_takes_a_reference_on_every_block_of_the_parent() -> None:
    pool, _, children = forked_pool()
    assert [child.block_ids for child in children] == [[0, 1, 2], [0, 1, 2]]
    assert [child.num_tokens for child in children] == [10, 10]
    assert [pool.ref_count(block_id) for block_id in (0, 1, 2, 3)] == [3, 3, 3, 0]
    assert pool.take_events() == [
        BlockEvent(EventKind.ALLOCATE_FOR, (0, 1, 2), "r"),
        BlockEvent(EventKind.FORK, (0, 1, 2), "r#0", ref_counts=(2, 2, 2), parent="r", partial=True),
        BlockEvent(EventKind.FORK, (0, 1, 2), "r#1", ref_counts=(3, 3, 3), parent="r", partial=True),
    ]
    assert pool.state().copy_on_write == {2}


def test_the_first_write_of_each_child_copies_the_partly_filled_block() -> None:
    pool, _, children = forked_pool()
    pool.take_events()
    children[0].append_tokens(1)
    children[1].append_tokens(3)  # 2 into the copy, 1 into a new block
    assert [child.block_ids for child in children] == [[0, 1, 3], [0, 1, 4, 5]]
    assert [child.take_copies() for child in children] == [[(2, 3)], [(2, 4)]]
    assert pool.take_events() == [
        BlockEvent(EventKind.COPY, (2, 3), "r#0", ref_counts=(2,), parent="r"),
        BlockEvent(EventKind.COPY, (2, 4), "r#1", ref_counts=(1,), parent="r"),
        BlockEvent(EventKind.ALLOCATE_FOR, (5,), "r#1"),
    ]
    assert pool.state().copy_on_write == set()  # only the parent holds block 2 now
    children[0].append_tokens(1)  # block 3 is its own: written in place
    assert (children[0].block_ids, children[0].take_copies(), pool.take_events()) == ([0, 1, 3], [], [])


def test_a_parent_with_full_blocks_only_shares_them_and_children_take_new_blocks() -> None:
    pool = BlockAllocator(8, 4)
    parent = BlockTable(pool, "r")
    parent.append_tokens(8)
    child = parent.fork("r#0")
    child.append_tokens(1)
    assert (child.block_ids, child.take_copies()) == ([0, 1, 2], [])
    assert [event.kind for event in pool.take_events()] == [
        EventKind.ALLOCATE_FOR,
        EventKind.FORK,
        EventKind.ALLOCATE_FOR,
    ]
    assert pool.state().copy_on_write == set()


def test_a_copy_that_does_not_fit_changes_nothing() -> None:
    pool = BlockAllocator(3, 4)
    parent = BlockTable(pool, "r")
    parent.append_tokens(10)
    child = parent.fork("r#0")
    pool.take_events()
    with pytest.raises(KVCacheExhausted):
        child.append_tokens(1)
    assert (child.block_ids, child.num_tokens, child.take_copies(), pool.take_events()) == ([0, 1, 2], 10, [], [])


def test_releasing_every_table_frees_the_pool_in_any_order() -> None:
    pool, parent, children = forked_pool()
    children[0].append_tokens(1)
    parent_state = pool.state()
    children[1].release(FreeReason.ABORTED)
    parent.release(FreeReason.FINISHED)
    children[0].release(FreeReason.PREEMPTED)
    assert pool.num_free == 8
    assert pool.num_shared == 0
    events = pool.take_events()
    rebuilt = PoolState.fresh(8, 4)
    for event in events:
        apply(rebuilt, event)
    assert rebuilt == pool.state() != parent_state


def test_fork_refuses_bad_input_and_emits_nothing() -> None:
    pool = forked_pool()[0]
    pool.take_events()
    with pytest.raises(ValueError, match="is held by 'r#0' already"):
        pool.fork("r", "r#0", [0, 1, 2], partial=True)
    with pytest.raises(ValueError, match="into itself"):
        pool.fork("r", "r", [0], partial=False)
    with pytest.raises(ValueError, match="not held by 'x'"):
        pool.fork("x", "y", [0], partial=False)
    with pytest.raises(ValueError, match="empty"):
        pool.fork("r", "y", [], partial=False)
    assert pool.take_events() == []
    BlockTable(pool, "z").append_tokens(1)
    pool.take_events()
    with pytest.raises(ValueError, match="alone"):
        pool.copy_on_write("z", "z", 3)
    with pytest.raises(ValueError, match="not by both"):
        pool.copy_on_write("z", "r", 3)
    assert pool.take_events() == []


@pytest.mark.parametrize(
    "event",
    [
        BlockEvent(EventKind.FORK, (0, 1, 2), "t/a|b#1", ref_counts=(2, 2, 2), parent="t/a|b", partial=True),
        BlockEvent(EventKind.FORK, (4,), "c", ref_counts=(2,), parent="p", partial=False),
        BlockEvent(EventKind.COPY, (2, 5), "t/a|b#1", ref_counts=(1,), parent="t/a|b"),
    ],
)
def test_fork_and_copy_records_decode_to_the_event_they_encode(event: BlockEvent) -> None:
    fields = split_record(encode_block_record(7, 9, event, 3, 0, 0))
    assert decode_block_event(fields[2], fields[3], fields[5], fields[8]) == event


def violations_of(events: list[BlockEvent]) -> list[tuple[str, int | None, str | None]]:
    found: list[tuple[str, int | None, str | None]] = []
    state = PoolState.fresh(8, 4)
    for event in events:
        apply(state, event, lambda rule, message, block_id, owner: found.append((rule, block_id, owner)))
    return found


FORKED = [
    BlockEvent(EventKind.ALLOCATE_FOR, (0, 1, 2), "r"),
    BlockEvent(EventKind.FORK, (0, 1, 2), "c", ref_counts=(2, 2, 2), parent="r", partial=True),
]


def test_the_transition_names_each_broken_fork_rule() -> None:
    assert violations_of(FORKED) == []
    assert violations_of([*FORKED, BlockEvent(EventKind.ALLOCATE, (3,), "c")]) == [("append_to_shared", 2, "c")]
    assert violations_of([*FORKED, BlockEvent(EventKind.ALLOCATE, (3,), "r")]) == [("append_to_shared", 2, "r")]
    assert violations_of([*FORKED, BlockEvent(EventKind.FORK, (3,), "d", parent="r")]) == [("fork_of_unheld", 3, "d")]
    assert violations_of([*FORKED, BlockEvent(EventKind.COPY, (2, 3), "c", parent="x")]) == [
        ("copy_source_not_parents", 2, "c")
    ]
    assert violations_of([*FORKED, BlockEvent(EventKind.COPY, (2, 3), "d", parent="r")]) == [("copy_of_unheld", 2, "d")]
    alone = [BlockEvent(EventKind.ALLOCATE_FOR, (0,), "r"), BlockEvent(EventKind.COPY, (0, 1), "r", parent="r")]
    assert violations_of(alone) == [("copy_of_unshared", 0, "r")]


def test_audit_names_a_planted_append_into_a_shared_block_at_its_seq(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    log = EventLog.open(url, num_blocks=8, block_size=4)
    pool, _, children = forked_pool()
    children[0].append_tokens(1)
    log.append_batch(1, pool.take_events())  # seqs 2..5: ALLOCATE_FOR, FORK, FORK, COPY
    planted = BlockEvent(EventKind.ALLOCATE_FOR, (6,), "r#1")  # r#1 filled shared block 2, then took block 6
    log.append_batch(2, [planted])  # seq 6
    log.close()
    report = audit(url)
    assert [(v.seq, v.rule, v.block_id, v.owner) for v in report.violations if v.rule != "leaked_block"] == [
        (6, "append_to_shared", 2, "r#1")
    ]
    assert replay(url, until_seq=5).violations == []
