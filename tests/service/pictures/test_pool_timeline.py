"""The pool's timeline (held intervals, occupancy) read from the log, against replay: an observer of ``apply``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from nanoserve.allocator import BlockAllocator, BlockEvent, EventKind, FreeReason
from nanoserve.allocator.log import EventLog, audit, replay
from nanoserve.migrations import upgrade
from nanoserve.service.pictures.pool_timeline import BlockInterval, PoolTimeline, read_timeline
from tests.allocator.test_plot_range import small_trace


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A migrated SQLite log."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    return url


class _Forged(str):
    """A kind as stored text, for a record no allocator of this version makes."""

    @property
    def value(self) -> str:
        return str(self)


def test_small_trace_gives_exact_intervals(url: str) -> None:
    small_trace(url)
    timeline = read_timeline(url)
    spans = [
        (i.block_id, i.owner, i.start_seq, i.end_seq, i.start_step, i.end_step, i.end_reason)
        for i in timeline.intervals()
    ]
    assert spans == [
        (0, "A", 2, 4, 0, 1, "preempted"),
        (1, "A", 2, 4, 0, 1, "preempted"),
        (2, "B", 3, None, 0, None, None),
        (1, "C", 5, 7, 1, 3, "finished"),
        (0, "A", 6, 8, 3, 3, "finished"),
    ]
    assert (timeline.pool_id, timeline.epoch, timeline.num_blocks, timeline.block_size) == ("p", 1, 4, 16)
    assert (timeline.closed_seq, timeline.last_seq, timeline.owners) == (9, 9, ["A", "B", "C"])


def test_occupancy_counts_blocks_and_the_owners_holding_them(url: str) -> None:
    small_trace(url)
    timeline = read_timeline(url)
    assert list(timeline.seqs) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert timeline.steps == [None, 0, 0, 1, 1, 3, 3, 3, None]
    assert list(timeline.num_allocated) == [0, 2, 3, 1, 2, 3, 2, 1, 1]
    assert list(timeline.num_holding) == [0, 1, 2, 1, 2, 3, 2, 1, 1]


def test_interval_times_are_the_events_wall_times(url: str) -> None:
    small_trace(url)
    timeline = read_timeline(url)
    first = timeline.interval(0)
    assert (first.start_wall_ns, first.end_wall_ns) == (timeline.wall_ns[1], timeline.wall_ns[3])
    assert timeline.interval(2).end_wall_ns is None


def test_block_tables_list_each_owners_blocks_in_the_order_given(url: str) -> None:
    with EventLog.open(url, pool_id="p", num_blocks=8, block_size=4) as log:
        pool = BlockAllocator(8, 4)
        pool.allocate_for(8, "A")  # 0, 1
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.allocate("B")  # 2
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.free(1)  # the stack top is 1 again
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.allocate("B")  # 1
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.allocate("A")  # 3
        log.append_batch(None, pool.take_events(), pool.snapshot)
    tables = read_timeline(url, until_seq=6).block_tables()
    assert {owner: [i.block_id for i in intervals] for owner, intervals in tables.items()} == {
        "A": [0, 3],
        "B": [2, 1],
    }
    assert [i.start_seq for i in tables["B"]] == [3, 5]


def test_reading_in_pages_gives_the_same_timeline(url: str) -> None:
    small_trace(url)
    whole, paged = read_timeline(url), read_timeline(url, num_events_per_page=3)
    assert paged.intervals() == whole.intervals()
    assert (paged.seqs, paged.num_allocated, paged.num_holding) == (whole.seqs, whole.num_allocated, whole.num_holding)


def test_until_seq_stops_the_timeline_there(url: str) -> None:
    small_trace(url)
    timeline = read_timeline(url, until_seq=4)
    assert timeline.last_seq == 4
    assert timeline.owners_now() == {2: "B"}
    assert timeline.interval(2) == BlockInterval(2, "B", 3, None, 0, None, timeline.wall_ns[2], None, None)


def _owners_by_timeline(timeline: PoolTimeline, seq: int) -> dict[int, str]:
    """block -> owner after event ``seq``, from the intervals alone."""
    return {
        i.block_id: i.owner
        for i in timeline.intervals()
        if i.start_seq <= seq and (i.end_seq is None or i.end_seq > seq)
    }


def test_owners_equal_replay_after_every_event_of_a_random_workload(url: str) -> None:
    rng = random.Random(5)
    with EventLog.open(url, pool_id="p", num_blocks=12, block_size=4) as log:
        pool = BlockAllocator(12, 4)
        held: list[list[int]] = []
        for step in range(60):
            for _ in range(rng.randint(1, 3)):
                if held and (rng.random() < 0.45 or not pool.can_allocate(3)):
                    reason = rng.choice([FreeReason.FINISHED, FreeReason.ABORTED, FreeReason.PREEMPTED, None])
                    pool.free_all(held.pop(rng.randrange(len(held))), reason)
                else:
                    held.append(pool.allocate_for(rng.randint(1, 12), f"r{step}"))
            log.append_batch(step, pool.take_events(), pool.snapshot)
    timeline = read_timeline(url)
    assert timeline.num_events > 100
    for seq in timeline.seqs:
        state = replay(url, until_seq=seq)
        assert _owners_by_timeline(timeline, seq) == state.owners, f"seq {seq}"
        assert timeline.num_allocated[seq - 1] == state.num_allocated
        assert timeline.num_holding[seq - 1] == len(set(state.owners.values()))


def test_broken_rules_change_the_timeline_as_they_change_replay(url: str) -> None:
    """Double frees, frees by another owner, allocations of held and foreign blocks, as replay applies them."""
    rng = random.Random(11)
    log = EventLog.open(url, pool_id="p", num_blocks=6, block_size=4)
    for _ in range(80):
        blocks = tuple(rng.sample(range(7), rng.randint(1, 3)))  # block 6 is not in the pool
        if rng.random() < 0.5:
            log.append_batch(None, [BlockEvent(EventKind.ALLOCATE_FOR, blocks, rng.choice("XYZ"), None)])
        else:
            log.append_batch(
                None,
                [
                    BlockEvent(
                        EventKind.FREE_ALL,
                        blocks,
                        rng.choice("XYZ"),
                        rng.choice([FreeReason.FINISHED, FreeReason.PREEMPTED, None]),
                    )
                ],
            )
    log.close()
    assert not audit(url).clean
    timeline = read_timeline(url)
    for seq in timeline.seqs:
        assert _owners_by_timeline(timeline, seq) == replay(url, until_seq=seq).owners, f"seq {seq}"


def test_unknown_kinds_are_counted_and_change_nothing(url: str) -> None:
    log = EventLog.open(url, pool_id="p", num_blocks=4, block_size=4)
    log.append_batch(None, [BlockEvent(EventKind.ALLOCATE, (0,), "A", None)])
    log.append_batch(
        None, [BlockEvent(_Forged("ref_taken"), (0,), "B", None)]
    )  # a kind from a later version of the log
    log.close()
    timeline = read_timeline(url)
    assert timeline.unknown_kinds == {"ref_taken": 1}
    assert timeline.owners_now() == {0: "A"}
    assert list(timeline.num_allocated) == [0, 1, 1, 1]


def test_a_cut_epoch_starts_from_its_checkpoint_with_the_blocks_held_there(url: str, tmp_path: Path) -> None:
    """Issue 30: seqs 1..44 archived as a segment; the live part starts at the SNAPSHOT at 45, where
    "keep" holds blocks 0 and 1 (taken at seq 2, archived) and r19 block 2. The picture starts there with them held."""
    from nanoserve.allocator.log.archive import RetentionPolicy
    from nanoserve.allocator.log.segment_archive import LiveSize, archive_due_segment
    from tests.allocator.test_segment_archive import Busy

    busy = Busy(url, "default")
    busy.run(20)  # seqs 1..46, snapshots at 12, 23, 34, 45
    [entry] = archive_due_segment(
        url, tmp_path / "arch", RetentionPolicy(retention_bytes=1_000), upgrade, "default", LiveSize()
    )
    assert (entry.first_seq, entry.last_seq) == (1, 44)
    busy.run(1)  # 47, 48: r20 takes block 2 and frees it
    busy.close()  # 49 frees keep's blocks, 50 POOL_CLOSE

    timeline = read_timeline(url)
    assert (timeline.seqs[0], timeline.last_seq, timeline.num_blocks, timeline.closed_seq) == (45, 50, 8, 50)
    spans = [(i.block_id, i.owner, i.start_seq, i.end_seq, i.end_reason) for i in timeline.intervals()]
    assert spans == [
        (0, "keep", 45, 49, "finished"),
        (1, "keep", 45, 49, "finished"),
        (2, "r19", 45, 46, "finished"),  # r19 took block 2 at seq 44, in the batch the checkpoint follows
        (2, "r20", 47, 48, "finished"),
    ]
    assert list(timeline.num_allocated) == [3, 2, 3, 2, 0, 0]
