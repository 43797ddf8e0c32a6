"""The request journal in the event log: one commit with the step's events, one watermark, recovery plans."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockEvent, EventKind
from nanoserve.allocator.log import EventLog, audit, read_events
from nanoserve.allocator.log.journal import JournalKind, JournalRecord, read_journal, read_request_history
from nanoserve.allocator.log.log_reader import connect
from nanoserve.allocator.log.recovery import RecoveryPlanner
from nanoserve.migrations import upgrade

HOUR_S = 3600.0


def admit(request_id: str, *, arrival_wall_ns: int | None = None, deadline_wall_ns: int | None = None) -> JournalRecord:
    data = {
        "prompt_token_ids": [1, 2, 3],
        "prompt": None,
        "sampling": {"seed": 7, "temperature": 0.0, "max_tokens": 8},
        "max_tokens": 8,
        "arrival_wall_ns": time.time_ns() if arrival_wall_ns is None else arrival_wall_ns,
        "deadline_wall_ns": deadline_wall_ns,
        "recovered_from": None,
        "num_prior_tokens": 0,
    }
    return JournalRecord(JournalKind.ADMIT, request_id, data)


def output(request_id: str, start: int, token_ids: list[int]) -> JournalRecord:
    return JournalRecord(JournalKind.OUTPUT, request_id, {"start": start, "token_ids": token_ids, "text": "x"})


def finish(request_id: str, start: int, reason: str = "length", cause: str | None = None) -> JournalRecord:
    data = {"start": start, "token_ids": [], "text": "", "finish_reason": reason, "abort_cause": cause}
    return JournalRecord(JournalKind.FINISH, request_id, data)


def crash(log: EventLog) -> None:
    """What SIGKILL leaves: the writer stops where it is, the pool's lock goes with the process."""
    log._writer.abandon()
    log._release()


@pytest.fixture
def url(log_url: str) -> str:
    upgrade(log_url)
    return log_url


def test_journal_only_step_commits_and_moves_the_journal_watermark(url: str, pool_id: str) -> None:
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4)
    log.append_batch(1, [BlockEvent(EventKind.ALLOCATE, (7,), "a")], journal=[admit("a")])
    log.append_batch(2, [], journal=[output("a", 0, [11, 12])])  # a decode step that took no block
    assert (log.last_seq, log.last_journal_seq) == (2, 2)
    assert log.flush(10)
    assert (log.durable_seq, log.durable_journal_seq) == (2, 2)
    log.close(10)
    with connect(url) as conn:
        entries = read_journal(conn, pool_id)
        history = read_request_history(conn, pool_id, "a")
    assert [(e.journal_seq, e.kind, e.step) for e in entries] == [(1, "admit", 1), (2, "output", 2)]
    assert history is not None
    assert (history.token_ids, history.finish) == ([11, 12], None)
    assert [event.kind for event in read_events(url, pool_id, 1)] == ["pool_init", "allocate", "pool_close"]
    assert audit(url, pool_id).clean is False  # block 7 held at POOL_CLOSE: a leak, the journal changes nothing


def test_a_journal_commit_whose_acknowledgement_was_lost_is_recognised(url: str, pool_id: str) -> None:
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4)
    writer = log._writer
    real_commit = writer._commit
    lost = []

    def commit_then_lose_ack(rows: list, last_seq: int, head_hash: bytes, closed_seq: int | None) -> None:
        real_commit(rows, last_seq, head_hash, closed_seq)
        if not lost:
            lost.append(last_seq)
            raise sa.exc.OperationalError("COMMIT", {}, Exception("connection lost after commit"))

    writer._commit = commit_then_lose_ack  # type: ignore[method-assign]
    log.append_batch(1, [], journal=[admit("a"), output("a", 0, [5])])
    assert log.flush(10)
    log.close(10)
    with connect(url) as conn:
        assert [e.journal_seq for e in read_journal(conn, pool_id)] == [1, 2]


def test_recovery_readmits_unfinished_requests_and_ends_the_rest(url: str, pool_id: str) -> None:
    old_ns = time.time_ns() - int(2 * HOUR_S * 1e9)
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4)
    log.append_batch(
        1,
        [BlockEvent(EventKind.ALLOCATE, (7,), "running"), BlockEvent(EventKind.ALLOCATE, (6,), "done")],
        journal=[
            admit("done"),
            admit("running"),
            admit("late", deadline_wall_ns=time.time_ns() - 1),
            admit("old", arrival_wall_ns=old_ns),
            admit("cancelled"),
        ],
    )
    log.append_batch(
        2,
        [BlockEvent(EventKind.FREE, (6,), "done")],
        journal=[
            output("running", 0, [9, 8]),
            output("done", 0, [4]),
            finish("done", 1),
            finish("cancelled", 0, "abort", "cancelled"),
        ],
    )
    assert log.flush(10)
    crash(log)

    planner = RecoveryPlanner(retention_s=HOUR_S)
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, prepare_journal=planner)
    assert (log.epoch, log.last_journal_seq, log.durable_journal_seq) == (2, 4, 4)
    assert planner.recovered_epoch == 1
    assert [history.request_id for history in planner.recovered] == ["running"]
    assert planner.recovered[0].token_ids == [9, 8]
    assert planner.ended == {"late": "deadline", "old": "not_recovered"}
    log.close(10)
    with connect(url) as conn:
        entries = read_journal(conn, pool_id, 2)
        running = read_request_history(conn, pool_id, "running")
        late = read_request_history(conn, pool_id, "late")
    recover = entries[0]
    assert (recover.kind, recover.data["epoch"], recover.data["recovered"]) == ("recover", 1, ["running"])
    assert recover.data["holders"] == {"running": [7]}  # who held what at the crash, from the audit
    assert [(e.kind, e.request_id) for e in entries[1:]] == [
        ("admit", "running"),
        ("finish", "late"),
        ("finish", "old"),
    ]
    assert entries[1].data["recovered_from"] == 1
    assert entries[1].data["num_prior_tokens"] == 2
    assert running is not None
    assert (running.epochs, running.token_ids) == ([1, 2], [9, 8])
    assert late is not None
    assert late.finish is not None
    assert late.finish["abort_cause"] == "deadline"
    assert audit(url, pool_id, 1).clean  # the crashed epoch: open, not a violation


def test_a_closed_epoch_is_not_recovered(url: str, pool_id: str) -> None:
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4)
    log.append_batch(1, [], journal=[admit("a")])
    log.close(10)
    planner = RecoveryPlanner(retention_s=HOUR_S)
    EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, prepare_journal=planner).close(10)
    assert (planner.recovered_epoch, planner.recovered) == (None, [])


def test_a_crash_before_the_new_epoch_commits_recovers_the_same_requests_again(url: str, pool_id: str) -> None:
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4)
    log.append_batch(1, [], journal=[admit("a")])
    assert log.flush(10)
    crash(log)

    class Dies(RecoveryPlanner):
        def __call__(self, *args: object) -> list[JournalRecord]:
            super().__call__(*args)  # type: ignore[arg-type]
            raise RuntimeError("killed during recovery")

    with pytest.raises(RuntimeError):
        EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, prepare_journal=Dies(retention_s=HOUR_S))
    planner = RecoveryPlanner(retention_s=HOUR_S)
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, prepare_journal=planner)
    assert log.epoch == 2
    assert [history.request_id for history in planner.recovered] == ["a"]
    log.close(10)
