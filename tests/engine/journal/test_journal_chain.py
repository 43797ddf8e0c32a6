"""The journal under the hash chain: one row per step, a deleted or altered row named, Resume refused."""

from __future__ import annotations

import grpc
import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockEvent, EventKind
from nanoserve.allocator.log import EventLog
from nanoserve.allocator.log.reader import connect
from nanoserve.allocator.log.store import create_log_engine
from nanoserve.engine.errors import JournalGapError
from nanoserve.engine.journal.journal_chain import JournalDamage
from nanoserve.engine.journal.records import JournalKind, encode_journal
from nanoserve.engine.journal.schema import journal_requests, journal_steps, request_journal
from nanoserve.engine.journal.step_codec import decode_step, encode_step
from nanoserve.engine.journal.store import JournalRecord, audit_journal, read_journal, read_request_history
from nanoserve.service.cli.main import main
from nanoserve.service.grpc.interceptors import status_for


def admit(request_id: str) -> JournalRecord:
    data = {
        "prompt_token_ids": [1, 2, 3],
        "prompt": None,
        "sampling": {"seed": 7},
        "max_tokens": 8,
        "arrival_wall_ns": 1,
        "deadline_wall_ns": None,
        "recovered_from": None,
        "num_prior_tokens": 0,
    }
    return JournalRecord(JournalKind.ADMIT, request_id, data)


def output(request_id: str, start: int, token_ids: list[int]) -> JournalRecord:
    return JournalRecord(JournalKind.OUTPUT, request_id, {"start": start, "token_ids": token_ids, "text": "x"})


def written_log(url: str, pool_id: str) -> None:
    """Epoch 1: three steps of two requests (journal seqs 1-2, 3-4, 5-6), closed."""
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4)
    log.append_batch(1, [BlockEvent(EventKind.ALLOCATE, (7,), "a")], journal=[admit("a"), admit("b")])
    log.append_batch(2, [], journal=[output("a", 0, [11]), output("b", 0, [21])])
    log.append_batch(3, [BlockEvent(EventKind.FREE, (7,), "a")], journal=[output("a", 1, [12]), output("b", 1, [22])])
    assert log.flush(10)
    log.close(10)


def execute(url: str, statement: sa.Executable) -> None:
    engine = create_log_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(statement)
    finally:
        engine.dispose()


@pytest.fixture
def url(log_url: str, pool_id: str) -> str:
    written_log(log_url, pool_id)
    return log_url


def test_a_step_is_one_row_and_requests_are_indexed_once(url: str, pool_id: str) -> None:
    with connect(url) as conn:
        steps = conn.execute(
            sa.select(journal_steps.c.first_seq, journal_steps.c.last_seq, journal_steps.c.step)
            .where(journal_steps.c.pool_id == pool_id)
            .order_by(journal_steps.c.first_seq)
        ).all()
        indexed = conn.execute(
            sa.select(journal_requests.c.journal_seq, journal_requests.c.request_id)
            .where(journal_requests.c.pool_id == pool_id)
            .order_by(journal_requests.c.journal_seq)
        ).all()
        entries = read_journal(conn, pool_id)
        history = read_request_history(conn, pool_id, "b")
    assert [tuple(row) for row in steps] == [(1, 2, 1), (3, 4, 2), (5, 6, 3)]
    assert [tuple(row) for row in indexed] == [(1, "a"), (2, "b")]
    assert [(e.journal_seq, e.kind, e.request_id, e.step) for e in entries] == [
        (1, "admit", "a", 1),
        (2, "admit", "b", 1),
        (3, "output", "a", 2),
        (4, "output", "b", 2),
        (5, "output", "a", 3),
        (6, "output", "b", 3),
    ]
    assert history is not None
    assert history.token_ids == [21, 22]


def test_a_clean_journal_audits_clean(url: str, pool_id: str, capsys: pytest.CaptureFixture[str]) -> None:
    with connect(url) as conn:
        assert audit_journal(conn, pool_id) == []
    assert main(["log", "audit", "--url", url, "--pool", pool_id]) == 0
    assert "request journal damaged" not in capsys.readouterr().out


def test_a_deleted_row_is_named_and_resume_across_it_is_data_loss(url: str, pool_id: str) -> None:
    execute(url, sa.delete(journal_steps).where(journal_steps.c.pool_id == pool_id, journal_steps.c.first_seq == 3))
    with connect(url) as conn:
        assert audit_journal(conn, pool_id) == [JournalDamage(1, "missing", 3, 4)]
        with pytest.raises(JournalGapError, match=r"journal records 3\.\.4 missing") as raised:
            read_request_history(conn, pool_id, "b")
    assert status_for(raised.value) is grpc.StatusCode.DATA_LOSS


def test_log_audit_and_log_requests_name_a_deleted_row(
    url: str, pool_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    execute(url, sa.delete(journal_steps).where(journal_steps.c.pool_id == pool_id, journal_steps.c.first_seq == 3))
    capsys.readouterr()
    assert main(["log", "audit", "--url", url, "--pool", pool_id]) == 1
    line = f"request journal damaged: pool {pool_id!r} epoch 1: journal records 3..4 missing"
    assert line in capsys.readouterr().out
    assert main(["log", "requests", "--url", url, "--pool", pool_id]) == 1
    assert line in capsys.readouterr().out


def test_an_altered_row_is_named(url: str, pool_id: str) -> None:
    with connect(url) as conn:
        body = conn.execute(
            sa.select(journal_steps.c.body).where(journal_steps.c.pool_id == pool_id, journal_steps.c.first_seq == 5)
        ).scalar_one()
    records = decode_step(body)  # a's token 12 becomes 13: a body that decodes, but not the one hashed
    forged = encode_step(
        [
            (r.kind, r.request_id or "", {**r.data, "token_ids": [13]} if r.data["token_ids"] == [12] else r.data)
            for r in records
        ],
        [r.admit_seq for r in records],
    )
    assert forged != body
    assert [r.data["token_ids"] for r in decode_step(forged)] == [[13], [22]]
    execute(
        url,
        sa.update(journal_steps)
        .where(journal_steps.c.pool_id == pool_id, journal_steps.c.first_seq == 5)
        .values(body=forged),
    )
    with connect(url) as conn:
        assert audit_journal(conn, pool_id) == [JournalDamage(1, "altered", 5, 6)]
        with pytest.raises(JournalGapError, match=r"5\.\.6 altered"):
            read_request_history(conn, pool_id, "a")


def test_rows_of_the_old_layout_still_read(log_url: str, pool_id: str) -> None:
    log = EventLog.open(log_url, pool_id=pool_id, num_blocks=8, block_size=4)
    log.close(10)
    old = [
        (pool_id, 1, 1, "a", "admit", 1, 10, encode_journal(admit("a").data)),
        (pool_id, 1, 2, "a", "output", 2, 20, encode_journal({"start": 0, "token_ids": [5, 6], "text": "hi"})),
        (
            pool_id,
            1,
            3,
            "a",
            "finish",
            3,
            30,
            encode_journal({"start": 2, "token_ids": [], "text": "", "finish_reason": "length"}),
        ),
    ]
    columns = ("pool_id", "epoch", "journal_seq", "request_id", "kind", "step", "wall_ns", "record")
    execute(log_url, sa.insert(request_journal).values([dict(zip(columns, row, strict=True)) for row in old]))
    with connect(log_url) as conn:
        entries = read_journal(conn, pool_id)
        history = read_request_history(conn, pool_id, "a")
        assert audit_journal(conn, pool_id) == []
    assert [(e.journal_seq, e.kind, e.wall_ns) for e in entries] == [
        (1, "admit", 10),
        (2, "output", 20),
        (3, "finish", 30),
    ]
    assert history is not None
    assert (history.token_ids, history.text, history.finish is not None) == ([5, 6], "hi", True)
