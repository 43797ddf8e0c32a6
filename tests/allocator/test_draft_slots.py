"""Speculative decoding in the log: draft slots are an ALLOCATE_FOR that says ``draft``, and the audit
names a ``rejected_draft`` rollback of any block its owner's drafts did not take in that step."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from nanoserve.allocator import BlockAllocator, BlockTable, FreeReason
from nanoserve.allocator.log import EventLog, audit, read_events
from nanoserve.migrations import upgrade


def _events(pool: BlockAllocator) -> list[tuple[str, tuple[int, ...], str, str | None]]:
    return [(event.kind.value, event.block_ids, event.owner, event.reason) for event in pool.take_events()]


def test_draft_slots_are_an_allocate_for_with_reason_draft() -> None:
    pool = BlockAllocator(10, 4)
    table = BlockTable(pool, "A")
    table.append_tokens(6)  # the prompt: blocks 0, 1 (the top of the free stack first)
    table.append_tokens(1)  # the decode token: room in block 1
    table.append_tokens(3, FreeReason.DRAFT)  # three drafts: tokens 7..9, one more block
    assert _events(pool) == [("allocate_for", (0, 1), "A", None), ("allocate_for", (2,), "A", "draft")]
    assert table.truncate(8, FreeReason.REJECTED_DRAFT) == [2]  # one draft accepted: block 2 held only rejected ones
    assert _events(pool) == [("free_all", (2,), "A", "rejected_draft")]


def test_an_allocation_takes_no_free_reason() -> None:
    pool = BlockAllocator(10, 4)
    with pytest.raises(ValueError, match=r"an allocation's reason must be None or FreeReason\.DRAFT"):
        pool.allocate_for(4, "A", FreeReason.FINISHED)
    assert pool.take_events() == []
    assert pool.num_free == 10


def _speculating_log(url: str, pool_id: str, rollback: tuple[int, list[int]]) -> None:
    """Seq 1 POOL_INIT; step 1: seq 2 A's prompt [0, 1]; step 2: seq 3 A's drafts take [2, 3];
    then ``rollback`` = (step, blocks): a rejected_draft free of those blocks (seq 4); A finishes (seq 5)."""
    with EventLog.open(url, pool_id=pool_id, num_blocks=10, block_size=4) as log:
        pool = BlockAllocator(10, 4)
        pool.allocate_for(8, "A")
        log.append_batch(1, pool.take_events())
        pool.allocate_for(5, "A", FreeReason.DRAFT)
        step, blocks = rollback
        if step != 2:
            log.append_batch(2, pool.take_events())
        pool.free_all(blocks, FreeReason.REJECTED_DRAFT)
        log.append_batch(step, pool.take_events())
        pool.free_all([block for block in (0, 1, 2, 3) if block not in blocks], FreeReason.FINISHED)
        log.append_batch(step + 1, pool.take_events())


def test_a_rollback_of_its_own_steps_draft_slots_audits_clean_and_log_show_says_draft(
    log_url: str, pool_id: str
) -> None:
    _speculating_log(log_url, pool_id, rollback=(2, [3]))
    report = audit(log_url, pool_id)
    assert report.clean, report.render()
    events = read_events(log_url, pool_id)
    assert [(e.seq, e.step, e.kind, e.block_ids, e.reason) for e in events[1:5]] == [
        (2, 1, "allocate_for", (0, 1), None),
        (3, 2, "allocate_for", (2, 3), "draft"),
        (4, 2, "free_all", (3,), "rejected_draft"),
        (5, 3, "free_all", (0, 1, 2), "finished"),
    ]


@pytest.mark.parametrize(
    ("rollback", "named"),
    [
        ((2, [1]), [(4, 1)]),  # the prompt's block: accepted (earlier) tokens needed it
        ((2, [2, 3, 1]), [(4, 1)]),  # the drafts' blocks and one more
        ((3, [3]), [(4, 3)]),  # a draft block of step 2, rolled back in step 3
    ],
)
def test_a_rollback_of_a_block_not_taken_for_drafts_in_that_step_is_named_at_its_seq(
    log_url: str, pool_id: str, rollback: tuple[int, list[int]], named: list[tuple[int, int]]
) -> None:
    _speculating_log(log_url, pool_id, rollback=rollback)
    report = audit(log_url, pool_id)
    assert [(v.seq, v.rule, v.block_id, v.owner) for v in report.violations] == [
        (seq, "rollback_of_non_draft", block_id, "A") for seq, block_id in named
    ]


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_a_draft_record_that_is_not_utf8_is_named_by_replay_and_stops_no_audit(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    _speculating_log(url, "p", rollback=(2, [3]))
    with sqlite3.connect(tmp_path / "log.db") as db:  # seq 3's owner "A" (0x41) becomes 0xC1: not UTF-8
        (record,) = db.execute("SELECT CAST(record AS BLOB) FROM allocator_events WHERE seq = 3").fetchone()
        db.execute("UPDATE allocator_events SET record = CAST(? AS TEXT) WHERE seq = 3", (record[:-1] + b"\xc1",))
    report = audit(url, "p")
    assert [(v.seq, v.rule) for v in report.violations][:1] == [(3, "bad_record")]
    assert "rollback_of_non_draft" not in {v.rule for v in report.violations}


def test_a_planted_leak_of_a_draft_block_is_named_with_the_seq_that_took_it(log_url: str, pool_id: str) -> None:
    """Issue 35: A's drafts take blocks 2 and 3 at seq 3; the rollback frees 3 and A's ending frees 0 and 1
    but not 2 (the planted leak). The audit names block 2, owner A, at POOL_CLOSE, and its picture starts
    at seq 3, the draft allocation that took it."""
    with EventLog.open(log_url, pool_id=pool_id, num_blocks=10, block_size=4) as log:
        pool = BlockAllocator(10, 4)
        pool.allocate_for(8, "A")
        log.append_batch(1, pool.take_events())  # seq 2: [0, 1]
        pool.allocate_for(5, "A", FreeReason.DRAFT)
        pool.free_all([3], FreeReason.REJECTED_DRAFT)
        log.append_batch(2, pool.take_events())  # seq 3: drafts take [2, 3]; seq 4: 3 rolled back
        pool.free_all([0, 1], FreeReason.FINISHED)
        log.append_batch(3, pool.take_events())  # seq 5: A ends, block 2 still held
    report = audit(log_url, pool_id)
    assert [(v.seq, v.rule, v.block_id, v.owner, v.plot_range) for v in report.violations] == [
        (6, "leaked_block", 2, "A", (3, 6))
    ]
