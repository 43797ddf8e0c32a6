"""Journal checkpoints: recovery reads the crashed epoch's journal from its newest verified checkpoint on."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from nanoserve.allocator.log import EventLog
from nanoserve.allocator.log.reader import connect
from nanoserve.engine.journal.journal_chain import JournalDamage
from nanoserve.engine.journal.live_requests import LiveCheckpoints, LiveRequests, decode_live, encode_live
from nanoserve.engine.journal.recovery import RecoveryPlanner
from nanoserve.engine.journal.schema import journal_steps
from nanoserve.engine.journal.step_codec import decode_step
from nanoserve.engine.journal.store import JOURNAL_TABLE, JournalRecord, audit_journal, read_journal

from .test_journal import HOUR_S, admit, crash, finish, output

# one list per step: each becomes one step row; with a checkpoint every 4 records they fall after
# seqs 4, 8 and 13, and the requests live at the crash are long (admitted at seq 4), e (11) and f (14)
STEPS: list[list[JournalRecord]] = [
    [admit("a"), admit("b")],  # seqs 1-2
    [finish("a", 0), admit("long")],  # 3-4: checkpoint {b, long}
    [output("long", 0, [5]), finish("b", 0)],  # 5-6
    [admit("c"), output("long", 1, [6])],  # 7-8: checkpoint {long, c}
    [finish("c", 0), admit("d")],  # 9-10
    [admit("e"), output("long", 2, [7]), finish("d", 0)],  # 11-13: checkpoint {long, e}
    [admit("f")],  # 14
]


@pytest.fixture
def url(log_url: str) -> str:
    return log_url


@pytest.fixture
def every_4_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(JOURNAL_TABLE.checkpoints, "records_per_checkpoint", 4)


def write_and_crash(url: str, pool_id: str) -> None:
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4)
    for step, records in enumerate(STEPS, 1):
        log.append_batch(step, [], journal=records)
    assert log.flush(10)
    crash(log)


def recover(url: str, pool_id: str) -> RecoveryPlanner:
    planner = RecoveryPlanner(retention_s=HOUR_S)
    EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, prepare_journal=planner).close(10)
    return planner


def test_the_journal_checkpoints_its_live_requests_every_n_records(
    url: str, pool_id: str, every_4_records: None
) -> None:
    write_and_crash(url, pool_id)
    with connect(url) as conn:
        rows = conn.execute(
            sa.text(
                "SELECT last_seq, body FROM journal_checkpoints WHERE pool_id = :p AND epoch = 1 ORDER BY last_seq"
            ),
            {"p": pool_id},
        ).all()
    assert [(last_seq, decode_live(bytes(body)).admitted) for last_seq, body in rows] == [
        (4, {"b": 2, "long": 4}),
        (8, {"long": 4, "c": 7}),
        (13, {"long": 4, "e": 11}),
    ]


def test_recovery_reads_no_journal_row_before_the_checkpoint_of_requests_that_finished(
    url: str, pool_id: str, every_4_records: None
) -> None:
    write_and_crash(url, pool_id)
    with sa.create_engine(url).begin() as conn:  # a or b's first row unreadable: recovery must not need it
        conn.execute(
            sa.text("UPDATE journal_steps SET body = :b WHERE pool_id = :p AND epoch = 1 AND first_seq = 1"),
            {"b": b"\x01not zlib", "p": pool_id},
        )
    planner = recover(url, pool_id)
    assert planner.journal_from_seq == 13
    assert [history.request_id for history in planner.recovered] == ["long", "e", "f"]
    assert planner.recovered[0].token_ids == [5, 6, 7]
    assert planner.ended == {}
    with connect(url) as conn:  # the full check (`log audit`) still names the damaged row
        assert audit_journal(conn, pool_id, 1) == [JournalDamage(1, "altered", 1, 2)]


def test_a_journal_checkpoint_that_does_not_link_is_not_trusted(url: str, pool_id: str, every_4_records: None) -> None:
    write_and_crash(url, pool_id)
    forged = encode_live(LiveRequests({"long": 4}))  # e dropped from the newest checkpoint: its hash breaks
    with sa.create_engine(url).begin() as conn:
        conn.execute(
            sa.text("UPDATE journal_checkpoints SET body = :b WHERE pool_id = :p AND epoch = 1 AND last_seq = 13"),
            {"b": forged, "p": pool_id},
        )
    planner = recover(url, pool_id)
    assert planner.journal_from_seq == 0  # the whole journal read instead
    assert [history.request_id for history in planner.recovered] == ["long", "e", "f"]


def test_an_epoch_without_a_journal_checkpoint_is_read_whole(url: str, pool_id: str) -> None:
    write_and_crash(url, pool_id)  # 14 records, fewer than a checkpoint's
    planner = recover(url, pool_id)
    assert planner.journal_from_seq == 0
    assert [history.request_id for history in planner.recovered] == ["long", "e", "f"]


def test_the_journal_audit_names_a_checkpoint_that_does_not_link(url: str, pool_id: str, every_4_records: None) -> None:
    write_and_crash(url, pool_id)
    forged = encode_live(LiveRequests({"long": 4}))
    with sa.create_engine(url).begin() as conn:
        conn.execute(
            sa.text("UPDATE journal_checkpoints SET body = :b WHERE pool_id = :p AND epoch = 1 AND last_seq = 8"),
            {"b": forged, "p": pool_id},
        )
    with connect(url) as conn:
        damages = audit_journal(conn, pool_id, 1)
    assert damages == [JournalDamage(1, "checkpoint", 8, 8)]
    assert damages[0].describe() == "epoch 1: journal checkpoint at record 8 altered (hash mismatch)"


def test_admit_seqs_name_each_output_and_finish_by_its_live_admission() -> None:
    checkpoints = LiveCheckpoints()
    assert checkpoints.admit_seqs("p", 1, 1, [("admit", "a"), ("output", "a"), ("admit", "b")]) == [None, 1, None]
    checkpoints.follow("p", 1, 1, [("admit", "a"), ("output", "a"), ("admit", "b")], b"h")
    # b finishes and is admitted again (seq 6): its later output names the new admission; x was never admitted
    step = [("output", "a"), ("finish", "b"), ("admit", "b"), ("output", "b"), ("output", "x"), ("recover", "")]
    assert checkpoints.admit_seqs("p", 1, 4, step) == [1, 3, None, 6, None, None]
    assert checkpoints.admit_seqs("p", 2, 9, [("output", "a")]) == [None]  # an epoch not followed from seq 1


def test_the_log_stores_an_output_by_its_admission_not_its_id(log_url: str, pool_id: str) -> None:
    log = EventLog.open(log_url, pool_id=pool_id, num_blocks=8, block_size=4)
    uuid_id = "9f8e7d6c5b4a39281706f5e4d3c2b1a0"
    log.append_batch(1, [], journal=[admit(uuid_id), output(uuid_id, 0, [5])])
    log.append_batch(2, [], journal=[output(uuid_id, 1, [6]), finish(uuid_id, 2)])
    assert log.flush(10)
    log.close(10)
    with connect(log_url) as conn:
        bodies = conn.execute(
            sa.select(journal_steps.c.body)
            .where(journal_steps.c.pool_id == pool_id)
            .order_by(journal_steps.c.first_seq)
        ).scalars()
        rows = [[(r.kind, r.request_id, r.admit_seq) for r in decode_step(body)] for body in bodies]
        entries = read_journal(conn, pool_id)
    assert rows == [[("admit", uuid_id, None), ("output", None, 1)], [("output", None, 1), ("finish", uuid_id, 1)]]
    assert [(e.journal_seq, e.kind, e.request_id) for e in entries] == [
        (1, "admit", uuid_id),
        (2, "output", uuid_id),
        (3, "output", uuid_id),
        (4, "finish", uuid_id),
    ]
