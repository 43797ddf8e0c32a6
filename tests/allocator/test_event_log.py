"""EventLog: every event the engine appends is one durable, chained record, a step's events one batch."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, BlockEvent, EventKind, FreeReason, PoolState
from nanoserve.allocator.log import (
    EventLog,
    EventLogError,
    EventLogIncompleteError,
    LogNotFoundError,
    SecondWriterError,
    audit,
    read_events,
    replay,
)


def open_log(url: str, pool_id: str, **kwargs: object) -> EventLog:
    kwargs.setdefault("num_blocks", 6)
    kwargs.setdefault("block_size", 16)
    return EventLog.open(url, pool_id=pool_id, **kwargs)  # type: ignore[arg-type]


def persist(pool: BlockAllocator, log: EventLog, step: int | None = None) -> None:
    """What the engine does at the end of a step: the pool's pending events become one batch."""
    log.append_batch(step, pool.take_events(), pool.snapshot)


def run_trace(pool: BlockAllocator, log: EventLog) -> None:
    pool.allocate_for(40, "A")
    persist(pool, log)
    pool.allocate_for(20, "B")
    persist(pool, log)
    pool.allocate_for(16, "C")
    pool.free_all([0, 1, 2], FreeReason.FINISHED)
    persist(pool, log, step=7)
    pool.allocate_for(30, "D")
    persist(pool, log)


def test_trace_is_recorded_event_by_event(log_url: str, pool_id: str) -> None:
    log = open_log(log_url, pool_id)
    pool = BlockAllocator(6, 16)
    run_trace(pool, log)
    log.close(final_state=pool.snapshot())
    events = read_events(log_url, pool_id)
    assert [(e.seq, e.kind, e.block_ids, e.owner, e.step, e.reason) for e in events] == [
        (1, "pool_init", (), None, None, None),
        (2, "allocate_for", (0, 1, 2), "A", None, None),
        (3, "allocate_for", (3, 4), "B", None, None),
        (4, "allocate_for", (5,), "C", 7, None),
        (5, "free_all", (0, 1, 2), "A", 7, "finished"),
        (6, "allocate_for", (2, 1), "D", None, None),
        (7, "pool_close", (), None, None, None),
    ]
    assert events[0].data == {"num_blocks": 6, "block_size": 16, "model": None, "config": None}
    assert events[-1].data == {"num_free": 1, "num_allocated": 5}


def test_step_events_are_sealed_in_one_batch(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id) as log:
        run_trace(BlockAllocator(6, 16), log)
    assert [e.batch_seq for e in read_events(log_url, pool_id)] == [1, 2, 3, 5, 5, 6, 7]


def test_events_are_stamped_with_the_time_of_their_batch(log_url: str, pool_id: str) -> None:
    pool = BlockAllocator(6, 16)
    pool.allocate("A")
    pool.allocate("B")
    with open_log(log_url, pool_id) as log:
        before_ns = time.time_ns()
        persist(pool, log, step=1)
        after_ns = time.time_ns()
    first, second = read_events(log_url, pool_id)[1:3]
    assert before_ns <= first.wall_time_ns <= after_ns
    assert (second.wall_time_ns, second.monotonic_ns) == (first.wall_time_ns, first.monotonic_ns)
    assert first.monotonic_ns <= time.monotonic_ns()


def test_replay_equals_live_state(log_url: str, pool_id: str) -> None:
    log = open_log(log_url, pool_id)
    pool = BlockAllocator(6, 16)
    run_trace(pool, log)
    log.flush()
    assert replay(log_url, pool_id) == pool.state()
    log.close()


def test_replay_until_seq_gives_the_past_pool(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id) as log:
        run_trace(BlockAllocator(6, 16), log)
    past = replay(log_url, pool_id, until_seq=4)
    assert (past.free_block_ids, past.owners, past.last_seq) == (
        [],
        {0: "A", 1: "A", 2: "A", 3: "B", 4: "B", 5: "C"},
        4,
    )


def test_snapshot_replay_equals_full_replay(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id, num_blocks=8, num_events_per_snapshot=5) as log:
        pool = BlockAllocator(8, 16)
        for round_index in range(6):
            owner = f"r{round_index}"
            block_ids = pool.allocate_for(16 * (1 + round_index % 3), owner)
            persist(pool, log)
            pool.free(block_ids[0], FreeReason.PREEMPTED)
            persist(pool, log)
    kinds = [e.kind for e in read_events(log_url, pool_id)]
    assert kinds.count("snapshot") == 2
    for until_seq in (None, 8, 13, 16):
        from_snapshot = replay(log_url, pool_id, until_seq=until_seq)
        full = replay(log_url, pool_id, until_seq=until_seq, from_snapshot=False)
        assert from_snapshot == full
        assert from_snapshot.violations == full.violations == []


def test_each_open_starts_a_new_epoch(log_url: str, pool_id: str) -> None:
    for expected_epoch in (1, 2):
        with open_log(log_url, pool_id) as log:
            assert log.epoch == expected_epoch


def test_second_writer_on_the_same_epoch_is_refused(log_url: str, pool_id: str) -> None:
    """Even with the pool free (its writer gone), an epoch that exists is never written twice."""
    with open_log(log_url, pool_id):
        pass
    with pytest.raises(SecondWriterError, match=f"pool '{pool_id}' epoch 1 already has a writer"):
        open_log(log_url, pool_id, epoch=1)


def test_a_second_live_writer_of_the_pool_is_refused_naming_the_pool(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id) as log:
        for epoch in (None, 1, 7):  # whatever epoch it would pick
            with pytest.raises(SecondWriterError, match=f"pool '{pool_id}' is being written by another live server"):
                open_log(log_url, pool_id, epoch=epoch)
        assert log.healthy
        with open_log(log_url, f"{pool_id}-other") as other:  # another pool of the same log is free
            assert other.epoch == 1
    with open_log(log_url, pool_id) as next_log:  # closing frees the pool
        assert next_log.epoch == 2


def test_writer_stops_when_another_writer_takes_the_epoch(log_url: str, pool_id: str) -> None:
    log = open_log(log_url, pool_id)
    pool = BlockAllocator(6, 16)
    engine = sa.create_engine(log_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE pool_epochs SET writer_id = 'intruder' WHERE pool_id = :p"), {"p": pool_id})
    engine.dispose()
    pool.allocate("A")
    persist(pool, log)
    with pytest.raises(SecondWriterError, match="held by another writer"):
        log.flush(timeout_s=10)
    assert not log.healthy
    pool.allocate("B")
    with pytest.raises(SecondWriterError):
        persist(pool, log)
    with pytest.raises(EventLogIncompleteError, match=r"1 event \(seq 2\) not written: .* held by another writer"):
        log.close()


def test_flush_makes_durable_seq_reach_last_seq(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id) as log:
        pool = BlockAllocator(6, 16)
        for _ in range(6):
            pool.allocate("A")
            persist(pool, log)
        assert log.flush(timeout_s=10)
        assert log.durable_seq == log.last_seq == 7


def test_sync_mode_commits_before_returning(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id, sync=True) as log:
        pool = BlockAllocator(6, 16)
        pool.allocate("A")
        persist(pool, log)
        assert log.durable_seq == 2
        assert [e.kind for e in read_events(log_url, pool_id)] == ["pool_init", "allocate"]


class FailingDatabase:
    """Makes every statement on the log's engine fail while ``failing`` is set."""

    def __init__(self, log: EventLog) -> None:
        self.failing = threading.Event()
        self.num_failures = 0
        sa.event.listen(log._engine, "before_cursor_execute", self._before)

    def _before(self, *args: object) -> None:
        if self.failing.is_set():
            self.num_failures += 1
            raise sa.exc.OperationalError("INSERT", {}, Exception("database unreachable (test)"))


def wait_until(predicate: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def test_failed_commits_are_retried_and_reported_unhealthy(log_url: str, pool_id: str) -> None:
    log = open_log(log_url, pool_id)
    database = FailingDatabase(log)
    pool = BlockAllocator(6, 16)
    database.failing.set()
    pool.allocate_for(32, "A")
    persist(pool, log)
    assert wait_until(lambda: not log.healthy)
    assert log.durable_seq == 1
    assert wait_until(lambda: database.num_failures >= 2)
    database.failing.clear()
    assert log.flush(timeout_s=10)
    assert log.healthy
    log.close(final_state=pool.snapshot())
    assert [e.block_ids for e in read_events(log_url, pool_id)][1] == (0, 1)
    assert audit(log_url, pool_id).violations[0].rule == "leaked_block"


def test_full_queue_blocks_the_caller_and_drops_nothing(log_url: str, pool_id: str) -> None:
    log = open_log(log_url, pool_id, num_blocks=64, max_pending_batches=2)
    database = FailingDatabase(log)
    pool = BlockAllocator(64, 16)
    database.failing.set()
    done = threading.Event()

    def produce() -> None:
        for _ in range(10):
            pool.allocate("A")
            persist(pool, log)
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    assert wait_until(lambda: database.num_failures >= 1)
    assert not done.wait(0.3)  # the writer holds one group, the queue holds 2 batches: the caller waits
    database.failing.clear()
    producer.join(10)
    assert done.is_set()
    log.close()
    assert [e.seq for e in read_events(log_url, pool_id)] == list(range(1, 13))


def test_lost_commit_acknowledgement_is_recognised_as_duplicate(
    log_url: str, pool_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = open_log(log_url, pool_id)
    writer = log._writer
    real_commit = writer._commit
    calls: list[int] = []

    def commit_then_lose_ack(rows: list, last_seq: int, head_hash: bytes, closed_seq: int | None) -> None:
        calls.append(last_seq)
        real_commit(rows, last_seq, head_hash, closed_seq)
        if len(calls) == 1:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("connection lost after commit (test)"))

    monkeypatch.setattr(writer, "_commit", commit_then_lose_ack)
    pool = BlockAllocator(6, 16)
    pool.allocate("A")
    persist(pool, log)
    assert log.flush(timeout_s=10)
    pool.free(0)
    persist(pool, log)
    log.close()
    assert calls[:2] == [2, 2]  # the retry of seq 2 found it committed
    assert calls[-1] == 4
    assert [e.seq for e in read_events(log_url, pool_id)] == [1, 2, 3, 4]
    assert audit(log_url, pool_id).clean


def test_subscribers_get_committed_events_in_order(log_url: str, pool_id: str) -> None:
    received: list[tuple[int, str]] = []
    with open_log(log_url, pool_id) as log:
        log.subscribe(lambda events: received.extend((e.seq, e.kind) for e in events))
        pool = BlockAllocator(6, 16)
        pool.allocate("A")
        persist(pool, log)
        pool.free(0)
        persist(pool, log)
    assert received == [(2, "allocate"), (3, "free"), (4, "pool_close")]


def test_unsubscribed_callback_gets_nothing_more(log_url: str, pool_id: str) -> None:
    received: list[int] = []
    with open_log(log_url, pool_id) as log:
        unsubscribe = log.subscribe(lambda events: received.extend(e.seq for e in events))
        pool = BlockAllocator(6, 16)
        pool.allocate("A")
        persist(pool, log)
        log.flush()
        unsubscribe()
        pool.allocate("A")
        persist(pool, log)
    assert received == [2]


def test_a_pool_of_another_shape_is_refused_at_snapshot_and_close(log_url: str, pool_id: str) -> None:
    other = BlockAllocator(8, 16)
    message = "pool has num_blocks=8, block_size=16; the log's POOL_INIT says num_blocks=6, block_size=16"
    with open_log(log_url, pool_id, num_events_per_snapshot=1) as log:
        other.allocate("A")
        with pytest.raises(ValueError, match=message):
            persist(other, log)
        with pytest.raises(ValueError, match=message):
            log.close(final_state=other.snapshot())
        assert not log.closed


def test_open_refuses_bad_settings(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="num_events_per_snapshot must be an int >= 1, got 0"):
        EventLog.open(f"sqlite:///{tmp_path}/x.db", num_blocks=4, block_size=16, num_events_per_snapshot=0)


def test_free_all_of_two_owners_records_runs_in_one_batch(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id) as log:
        pool = BlockAllocator(6, 16)
        pool.allocate_for(32, "A")
        persist(pool, log)
        pool.allocate("B")
        persist(pool, log)
        pool.free_all([1, 2, 0])
        persist(pool, log)
        assert pool.state().free_block_ids == [5, 4, 3, 1, 2, 0]
    events = read_events(log_url, pool_id)[3:6]
    assert [(e.seq, e.batch_seq, e.block_ids, e.owner) for e in events] == [
        (4, 6, (1,), "A"),
        (5, 6, (2,), "B"),
        (6, 6, (0,), "A"),
    ]
    assert replay(log_url, pool_id, until_seq=6).free_block_ids == [5, 4, 3, 1, 2, 0]


def test_read_events_filters_by_owner_kind_block_and_limit(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id) as log:
        run_trace(BlockAllocator(6, 16), log)
    assert [e.seq for e in read_events(log_url, pool_id, owner="A")] == [2, 5]
    assert [e.seq for e in read_events(log_url, pool_id, kind="allocate_for", limit=2)] == [2, 3]
    assert [e.seq for e in read_events(log_url, pool_id, block_id=1)] == [2, 5, 6]
    assert [e.seq for e in read_events(log_url, pool_id, from_seq=3, until_seq=5, block_id=4)] == [3]


def test_an_empty_batch_writes_nothing(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id) as log:
        log.append_batch(3, [])
        assert log.last_seq == 1
    assert [e.kind for e in read_events(log_url, pool_id)] == ["pool_init", "pool_close"]


def test_appended_events_keep_their_order_owner_and_reason(log_url: str, pool_id: str) -> None:
    events = [
        BlockEvent(EventKind.ALLOCATE_FOR, (0, 1), "A"),
        BlockEvent(EventKind.FREE, (1,), "A", FreeReason.PREEMPTED),
        BlockEvent(EventKind.ALLOCATE, (1,), "B"),
    ]
    with open_log(log_url, pool_id) as log:
        log.append_batch(4, events)
        assert log.last_seq == 4
    assert [
        (e.seq, e.batch_seq, e.kind, e.block_ids, e.owner, e.step, e.reason) for e in read_events(log_url, pool_id)
    ][1:4] == [
        (2, 4, "allocate_for", (0, 1), "A", 4, None),
        (3, 4, "free", (1,), "A", 4, "preempted"),
        (4, 4, "allocate", (1,), "B", 4, None),
    ]


def test_bad_step_is_refused_before_anything_is_written(log_url: str, pool_id: str) -> None:
    with open_log(log_url, pool_id) as log:
        with pytest.raises(ValueError, match="step must be an int >= 0 or None, got -1"):
            log.append_batch(-1, [BlockEvent(EventKind.ALLOCATE, (0,), "A")])
        assert log.last_seq == 1


def test_append_after_close_is_refused(log_url: str, pool_id: str) -> None:
    log = open_log(log_url, pool_id)
    log.close()
    with pytest.raises(EventLogError, match=f"event log of pool '{pool_id}' epoch 1 is closed"):
        log.append_batch(1, [BlockEvent(EventKind.ALLOCATE, (0,), "A")])


def test_snapshot_is_taken_only_when_due_and_ends_its_batch(log_url: str, pool_id: str) -> None:
    pool = BlockAllocator(6, 16)
    num_calls = 0

    def snapshot() -> PoolState:
        nonlocal num_calls
        num_calls += 1
        return pool.snapshot()

    with open_log(log_url, pool_id, num_events_per_snapshot=3) as log:
        pool.allocate("A")
        pool.allocate("B")
        log.append_batch(1, pool.take_events(), snapshot)  # seqs 2, 3: two events since POOL_INIT
        assert num_calls == 0
        pool.allocate("C")
        log.append_batch(2, pool.take_events(), snapshot)  # seq 4: three, so seq 5 is a SNAPSHOT
        assert (num_calls, log.last_seq) == (1, 5)
        pool.allocate("D")
        log.append_batch(3, pool.take_events(), snapshot)
        assert num_calls == 1
    events = read_events(log_url, pool_id)
    assert [(e.seq, e.batch_seq, e.kind, e.step) for e in events[3:6]] == [
        (4, 5, "allocate", 2),
        (5, 5, "snapshot", 2),
        (6, 6, "allocate", 3),
    ]
    assert events[4].data == {"free_block_ids": [5, 4, 3], "owners": {"0": "A", "1": "B", "2": "C"}}


def test_open_without_the_schema_says_to_migrate(tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/bare.db"
    with pytest.raises(LogNotFoundError, match=r"holds no event log schema \(run `nanoserve db upgrade sqlite:///"):
        EventLog.open(url, num_blocks=4, block_size=16)
