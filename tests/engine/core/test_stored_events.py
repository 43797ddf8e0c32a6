"""StoredEvents: a page of stored events is read and decoded once, then only its tail, for every catch-up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nanoserve.allocator import BlockAllocator
from nanoserve.allocator.log import Event, EventLog, read_events
from nanoserve.engine.core import stored_events
from nanoserve.engine.core.log_reads import LogReads
from nanoserve.engine.core.stored_events import StoredEvents
from nanoserve.migrations import upgrade


@pytest.fixture
def event_log(tmp_path: Path) -> Iterator[EventLog]:
    url = f"sqlite:///{tmp_path / 'events.db'}"
    upgrade(url)
    log = EventLog.open(url, pool_id="p", num_blocks=8, block_size=4, sync=True)
    yield log
    log.close()


@pytest.fixture
def reads_made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(from_seq, until_seq) of each query the store was asked, in order."""
    made: list[tuple[int, int]] = []

    def counted(url: str, pool_id: str, epoch: int, from_seq: int, until_seq: int) -> list[Event]:
        made.append((from_seq, until_seq))
        return read_events(url, pool_id, epoch, from_seq, until_seq)

    monkeypatch.setattr(stored_events, "read_events", counted)
    return made


def commit(log: EventLog, pool: BlockAllocator, owner: str) -> None:
    """One step's events, committed (the log writes synchronously): an allocation of one block."""
    pool.allocate_for(4, owner)
    log.append_batch(None, pool.take_events(), pool.snapshot)


async def test_a_page_is_read_once_then_only_its_tail_and_handed_out_as_the_same_events(
    event_log: EventLog, reads_made: list[tuple[int, int]]
) -> None:
    pool = BlockAllocator(8, 4)
    commit(event_log, pool, "A")  # seq 1 pool_init, 2 allocate_for
    stored = StoredEvents(LogReads(2), num_events_per_page=4, max_events=8)

    first = await stored.page(event_log, 1)
    again = await stored.page(event_log, 1)  # nothing newer is durable: the store is not asked
    commit(event_log, pool, "B")  # seq 3
    grown = await stored.page(event_log, 1)

    assert [(e.seq, e.kind) for e in first] == [(1, "pool_init"), (2, "allocate_for")]
    assert again is first
    assert [(e.seq, e.owner) for e in grown] == [(1, None), (2, "A"), (3, "B")]
    assert grown[:2] == first  # the decoded events themselves, not copies:
    assert all(kept is old for kept, old in zip(grown, first, strict=False))
    assert reads_made == [(1, 4), (3, 4)]
    assert stored.num_events == 3


async def test_a_full_page_is_never_read_again_and_the_next_page_starts_after_it(
    event_log: EventLog, reads_made: list[tuple[int, int]]
) -> None:
    pool = BlockAllocator(8, 4)
    for owner in "ABCD":
        commit(event_log, pool, owner)  # seqs 1..5
    stored = StoredEvents(num_events_per_page=4, max_events=8)

    full = await stored.page(event_log, 1)
    commit(event_log, pool, "E")  # seq 6
    assert await stored.page(event_log, 1) is full
    assert [e.seq for e in await stored.page(event_log, 5)] == [5, 6]
    assert reads_made == [(1, 4), (5, 8)]


async def test_forget_reads_the_page_again_from_its_first_seq(
    event_log: EventLog, reads_made: list[tuple[int, int]]
) -> None:
    pool = BlockAllocator(8, 4)
    commit(event_log, pool, "A")
    stored = StoredEvents(num_events_per_page=4, max_events=8)
    first = await stored.page(event_log, 1)

    stored.forget()  # an archived segment cut the epoch's first rows

    again = await stored.page(event_log, 1)
    assert [e.seq for e in again] == [1, 2]
    assert again[0] is not first[0]
    assert reads_made == [(1, 4), (1, 4)]


async def test_kept_events_are_bounded_and_the_least_recently_asked_page_goes_first(
    event_log: EventLog, reads_made: list[tuple[int, int]]
) -> None:
    pool = BlockAllocator(8, 4)
    for owner in "ABCDEF":
        commit(event_log, pool, owner)  # seqs 1..7
    stored = StoredEvents(num_events_per_page=2, max_events=4)

    await stored.page(event_log, 1)  # seqs 1, 2
    await stored.page(event_log, 3)  # seqs 3, 4
    await stored.page(event_log, 1)  # asked again: the most recent
    await stored.page(event_log, 5)  # seqs 5, 6: page 3 goes
    assert stored.num_events == 4
    await stored.page(event_log, 1)
    await stored.page(event_log, 3)
    assert reads_made == [(1, 2), (3, 4), (5, 6), (3, 4)]


def test_page_and_bound_out_of_range_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"num_events_per_page must be >= 1, got 0"):
        StoredEvents(num_events_per_page=0)
    with pytest.raises(ValueError, match=r"max_events must be >= num_events_per_page \(1000\), got 999"):
        StoredEvents(max_events=999)
