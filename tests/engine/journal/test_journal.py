"""The request journal in the event log: one commit with the step's events, one watermark, recovery plans."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockEvent, EventKind
from nanoserve.allocator.log import EventLog, audit, read_events
from nanoserve.allocator.log.reader import connect
from nanoserve.engine.journal.records import JournalKind
from nanoserve.engine.journal.recovery import RecoveryPlanner
from nanoserve.engine.journal.store import JournalRecord, read_journal, read_request_history
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


def test_recovery_reads_only_the_tail_since_the_last_checkpoint(
    url: str, pool_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    from nanoserve.allocator import BlockAllocator

    replay_module = importlib.import_module("nanoserve.allocator.log.replay")
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, num_events_per_snapshot=5)
    pool = BlockAllocator(8, 4)
    previous: list[int] = []
    for step in range(1, 21):  # each step takes a block and frees the last step's but r7's and r14's
        if step - 1 not in (7, 14):
            pool.free_all(previous)
        previous = pool.allocate_for(4, f"r{step}")
        log.append_batch(step, pool.take_events(), pool.snapshot, journal=[admit(f"r{step}")] if step == 20 else [])
    assert log.flush(10)
    crash(log)
    with connect(url) as conn:
        snapshot_seqs = [
            row[0]
            for row in conn.execute(
                sa.text("SELECT seq FROM allocator_events WHERE pool_id = :p AND epoch = 1 AND kind = 'snapshot'"),
                {"p": pool_id},
            )
        ]
    checkpoint = max(snapshot_seqs)
    assert len(snapshot_seqs) >= 3
    assert checkpoint > 10
    real_event_rows = replay_module.event_rows
    first_seqs: list[int] = []

    def tail_only(conn: sa.Connection, pool: str, epoch: int, from_seq: int = 1, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        first_seqs.append(from_seq)
        assert from_seq >= checkpoint, f"recovery read seq {from_seq}, before its checkpoint at {checkpoint}"
        return real_event_rows(conn, pool, epoch, from_seq, *args, **kwargs)

    monkeypatch.setattr(replay_module, "event_rows", tail_only)
    planner = RecoveryPlanner(retention_s=HOUR_S)
    new_log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, prepare_journal=planner)
    new_log.close(10)
    monkeypatch.setattr(replay_module, "event_rows", real_event_rows)
    assert first_seqs
    assert min(first_seqs) == checkpoint
    full = audit(url, pool_id, 1)
    with connect(url) as conn:
        recover = read_journal(conn, pool_id, 2)[0]
    expected_holders = {owner: list(blocks) for owner, blocks in full.state.blocks_by_owner().items()}
    assert recover.data["holders"] == expected_holders != {}
    assert recover.data["last_seq"] == full.last_seq
    assert planner.recovered_epoch == 1
    assert [history.request_id for history in planner.recovered] == ["r20"]


def test_a_checkpoint_whose_hash_does_not_link_is_not_trusted(url: str, pool_id: str) -> None:
    from nanoserve.allocator import BlockAllocator
    from nanoserve.allocator.log.audit import audit_epoch
    from nanoserve.allocator.log.reader import resolve_epoch

    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, num_events_per_snapshot=3)
    pool = BlockAllocator(8, 4)
    for step in range(1, 7):
        blocks = pool.allocate_for(4, f"r{step}")
        log.append_batch(step, pool.take_events(), pool.snapshot)
        if step % 2 == 0:
            pool.free_all(blocks)
            log.append_batch(step, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    crash(log)
    with connect(url) as conn:
        info = resolve_epoch(conn, pool_id, 1)
        trusted = audit_epoch(conn, info, from_checkpoint=True)
        checkpoint = trusted.from_seq
        assert checkpoint > 1
        assert trusted.clean
        assert trusted.num_events == trusted.last_seq - checkpoint + 1
    with sa.create_engine(url).begin() as conn:  # the checkpoint's record altered: its hash no longer links
        conn.execute(
            sa.text("UPDATE allocator_events SET record = record || ' ' WHERE pool_id = :p AND epoch = 1 AND seq = :s"),
            {"p": pool_id, "s": checkpoint},
        )
    with connect(url) as conn:
        distrusted = audit_epoch(conn, resolve_epoch(conn, pool_id, 1), from_checkpoint=True)
    assert distrusted.from_seq != checkpoint
    assert [v.seq for v in distrusted.violations if v.rule == "hash_mismatch"] == [checkpoint]
