"""The audit's seq range to plot for a violation: ``plot_range`` and the holdings ``HoldingStarts`` follows."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.allocator import BlockAllocator, BlockEvent, EventKind, FreeReason
from nanoserve.allocator.log import EventLog, audit, read_events
from nanoserve.allocator.log.plot_range import HoldingStarts, plot_range
from nanoserve.migrations import upgrade


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A migrated SQLite log."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    return url


def small_trace(url: str) -> None:
    """Seq 1 POOL_INIT; steps 0, 1 and 3; seq 9 POOL_CLOSE with B still holding block 2."""
    with EventLog.open(url, pool_id="p", num_blocks=4, block_size=16) as log:
        pool = BlockAllocator(4, 16)
        pool.allocate_for(20, "A")  # seq 2: A [0, 1]
        pool.allocate("B")  # seq 3: B [2]
        log.append_batch(0, pool.take_events(), pool.snapshot)
        pool.free_all([0, 1], FreeReason.PREEMPTED)  # seq 4: the stack is now [3, 0, 1], top last
        pool.allocate("C")  # seq 5: C [1]
        log.append_batch(1, pool.take_events(), pool.snapshot)
        pool.allocate_for(16, "A")  # seq 6: A [0]
        pool.free_all([1, 0], FreeReason.FINISHED)  # seq 7: C frees [1], seq 8: A frees [0] (one event per owner)
        log.append_batch(3, pool.take_events(), pool.snapshot)


def test_plot_range_runs_from_the_holding_to_the_violation() -> None:
    assert plot_range(seq=500, holding_start_seq=120, last_seq=1000) == (120, 519)  # margin (500-120)//20 = 19
    assert plot_range(seq=500, holding_start_seq=None, last_seq=1000) == (400, 505)  # 100 events of context
    assert plot_range(seq=30, holding_start_seq=None, last_seq=31) == (1, 31)  # within the epoch
    assert plot_range(seq=12, holding_start_seq=None, last_seq=10) == (1, 10)  # a seq past the stored rows


def test_holding_start_finds_the_blocks_last_holding_before_the_seq(url: str) -> None:
    small_trace(url)
    holdings = HoldingStarts()
    holdings.apply(read_events(url))
    assert holdings.starts == {0: [2, 6], 1: [2, 5], 2: [3]}
    assert holdings.holding_start(seq=9, block_id=2) == 3  # B's, still held at POOL_CLOSE
    assert holdings.holding_start(seq=7, block_id=1) == 5  # C's
    assert holdings.holding_start(seq=5, block_id=1) == 2  # A's, before C took it
    assert holdings.holding_start(seq=2, block_id=0) is None
    assert holdings.holding_start(seq=8, block_id=None) is None


def test_audit_names_the_seq_range_to_plot_for_a_leak(url: str) -> None:
    small_trace(url)
    report = audit(url)
    [leak] = report.violations
    assert (leak.seq, leak.rule, leak.block_id, leak.owner, leak.plot_range) == (9, "leaked_block", 2, "B", (3, 9))
    assert "seq 9 block 2 owner 'B': leaked_block: block still allocated at POOL_CLOSE (plot --from 3 --to 9)" in (
        report.render()
    )


def test_audit_names_the_seq_range_to_plot_for_a_double_free(url: str) -> None:
    log = EventLog.open(url, pool_id="p", num_blocks=4, block_size=4)
    pool = BlockAllocator(4, 4)
    pool.allocate_for(8, "A")  # seq 2
    log.append_batch(None, pool.take_events(), pool.snapshot)
    pool.allocate("B")  # seq 3
    log.append_batch(None, pool.take_events(), pool.snapshot)
    pool.free_all([0, 1], FreeReason.FINISHED)  # seq 4
    log.append_batch(None, pool.take_events(), pool.snapshot)
    log.append_batch(
        None, [BlockEvent(EventKind.FREE, (0,), "A", FreeReason.FINISHED)]
    )  # seq 5: a double free of block 0
    log.flush()
    report = audit(url)
    [double_free] = report.violations
    assert (double_free.rule, double_free.block_id, double_free.plot_range) == ("free_of_free_block", 0, (2, 5))
