"""The open epoch's journal rows leave the live log with a segment; unfinished requests keep theirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog
from nanoserve.allocator.log.archive import RetentionPolicy
from nanoserve.allocator.log.reader import connect
from nanoserve.allocator.log.segment_archive import LiveSize, archive_due_segment
from nanoserve.engine.journal.journal_chain import StepRow
from nanoserve.engine.journal.journal_segment import JournalSegments
from nanoserve.engine.journal.recovery import RecoveryPlanner
from nanoserve.engine.journal.step_codec import encode_step
from nanoserve.engine.journal.store import (
    JournalRecord,
    audit_journal,
    read_journal,
    read_request_history,
    step_entries,
    unnamed_request_id,
)
from nanoserve.migrations import upgrade
from nanoserve.service.cli.main import main

from .test_journal import HOUR_S, admit, crash, finish, output

BY_SIZE = RetentionPolicy(retention_bytes=1)
ADMIT = {"prompt_token_ids": [1], "sampling": {"seed": 7}}
OUTPUT = {"start": 0, "token_ids": [5], "text": "x"}


class Steps:
    """An open epoch whose steps carry block events and journal records; a SNAPSHOT every 4 events."""

    def __init__(self, url: str, pool_id: str) -> None:
        self.log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, num_events_per_snapshot=4)
        self.pool = BlockAllocator(8, 4)
        self.blocks: dict[str, int] = {}
        self.step = 0

    def run(self, *records: JournalRecord) -> None:
        """One step: an ADMIT takes a block for its request, a FINISH frees it."""
        self.step += 1
        for record in records:
            if record.kind.value == "admit":
                self.blocks[record.request_id] = self.pool.allocate(record.request_id)
            elif record.kind.value == "finish":
                self.pool.free(self.blocks.pop(record.request_id), FreeReason.FINISHED)
        self.log.append_batch(self.step, self.pool.take_events(), self.pool.snapshot, journal=list(records))


def _journal_rows(url: str, pool_id: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            query = "SELECT count(*) FROM journal_steps WHERE pool_id = :p"
            return int(conn.execute(sa.text(query), {"p": pool_id}).scalar_one())
    finally:
        engine.dispose()


def test_finished_requests_rows_move_and_recovery_takes_over_exactly_the_unfinished(
    log_url: str, pool_id: str, tmp_path: Path
) -> None:
    upgrade(log_url)
    steps = Steps(log_url, pool_id)
    steps.run(admit("a"), admit("x"))  # journal seqs 1-2
    steps.run(output("a", 0, [5, 6]), finish("x", 0, "abort", "cancelled"))  # 3-4
    steps.run(finish("a", 2))  # 5
    steps.run(admit("b"))  # 6: the oldest request still running from here on
    steps.run(output("b", 0, [7]))  # 7
    steps.run(admit("c"), output("b", 1, [8]))  # 8-9
    steps.run(output("c", 0, [9]), finish("c", 1))  # 10-11: c ends after b began: its rows stay with b's
    assert steps.log.flush(10)
    journal = JournalSegments()
    [segment] = archive_due_segment(log_url, tmp_path, BY_SIZE, upgrade, pool_id, LiveSize(), companion=journal)

    assert (segment.companion_first_seq, segment.companion_last_seq) == (1, 5)
    assert _journal_rows(log_url, pool_id) == 4  # steps 4..7 stay
    with connect(log_url) as conn:
        assert audit_journal(conn, pool_id) == []  # the kept rows chain from the manifest's head hash
        assert read_request_history(conn, pool_id, "a") is None  # archived: Resume answers NOT_FOUND
        b = read_request_history(conn, pool_id, "b")
        assert b is not None
        assert b.token_ids == [7, 8]
    with connect(f"sqlite:///{segment.path}") as conn:
        assert audit_journal(conn, pool_id) == []
        assert [(e.journal_seq, e.kind, e.request_id) for e in read_journal(conn, pool_id)][-1] == (5, "finish", "a")
    assert archive_due_segment(log_url, tmp_path, BY_SIZE, upgrade, pool_id, LiveSize(), companion=journal) == []

    steps.run(output("b", 2, [10]))  # 12: then the server dies
    assert steps.log.flush(10)
    crash(steps.log)
    planner = RecoveryPlanner(retention_s=HOUR_S)
    log = EventLog.open(log_url, pool_id=pool_id, num_blocks=8, block_size=4, prepare_journal=planner)
    assert [(history.request_id, history.token_ids) for history in planner.recovered] == [("b", [7, 8, 10])]
    assert planner.ended == {}
    log.close(10)


def test_log_audit_archive_names_a_changed_journal_row_in_a_segment_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    steps = Steps(url, "p")
    for number in range(4):  # journal seqs 1..8: each request admitted, then finished a step later
        steps.run(admit(f"r{number}"))
        steps.run(finish(f"r{number}", 0))
    assert steps.log.flush(10)
    [segment] = archive_due_segment(
        url, tmp_path / "arch", BY_SIZE, upgrade, "p", LiveSize(), companion=JournalSegments()
    )
    assert (segment.companion_first_seq, segment.companion_last_seq) == (1, 8)  # nobody is running: all of it
    capsys.readouterr()
    assert main(["log", "audit", "--archive", segment.path, "--url", url]) == 0
    assert main(["log", "audit", "--url", url]) == 0
    capsys.readouterr()

    archive = sa.create_engine(f"sqlite:///{segment.path}")
    try:
        with archive.begin() as conn:  # another wall time for journal row 3 (seq 3); its stored hash stays
            conn.execute(sa.text("UPDATE journal_steps SET wall_ns = wall_ns + 1 WHERE first_seq = 3"))
    finally:
        archive.dispose()
    assert main(["log", "audit", "--archive", segment.path]) == 1
    out = capsys.readouterr().out
    assert "request journal damaged: pool 'p' epoch 1: journal records 3..3 altered (hash mismatch)" in out
    steps.log.close(10)


def test_outputs_after_the_cut_of_a_request_admitted_before_it_are_named_by_its_finish(
    log_url: str, pool_id: str, tmp_path: Path
) -> None:
    upgrade(log_url)
    steps = Steps(log_url, pool_id)
    steps.run(admit("a"), admit("x"))  # 1-2: a's ADMIT leaves with the segment
    steps.run(finish("x", 0))  # 3
    steps.run(admit("b"))  # 4: the oldest request still running: the cut
    steps.run(output("a", 0, [5]), output("b", 0, [7]))  # 5-6: a's OUTPUT is stored by a's ADMIT's seq (1)
    steps.run(finish("a", 1))  # 7
    assert steps.log.flush(10)
    [segment] = archive_due_segment(
        log_url, tmp_path, BY_SIZE, upgrade, pool_id, LiveSize(), companion=JournalSegments()
    )
    assert (segment.companion_first_seq, segment.companion_last_seq) == (1, 3)
    with connect(log_url) as conn:
        entries = read_journal(conn, pool_id)
        b = read_request_history(conn, pool_id, "b")
    assert [(e.journal_seq, e.kind, e.request_id) for e in entries] == [
        (4, "admit", "b"),
        (5, "output", "a"),
        (6, "output", "b"),
        (7, "finish", "a"),
    ]
    assert b is not None
    assert b.token_ids == [7]
    steps.log.close(10)


def test_a_segment_file_names_an_output_whose_admit_and_finish_lie_in_other_parts_by_its_admit_seq() -> None:
    # a's ADMIT (seq 1) is in an older segment file, its FINISH still live: this file holds seqs 2..4
    rows = [
        StepRow(1, 2, 3, 2, 20, encode_step([("admit", "c", ADMIT), ("output", "a", OUTPUT)], [None, 1]), b""),
        StepRow(1, 4, 4, 3, 30, encode_step([("output", "c", OUTPUT)], [2]), b""),
    ]
    assert [(e.journal_seq, e.kind, e.request_id) for e in step_entries(rows)] == [
        (2, "admit", "c"),
        (3, "output", unnamed_request_id(1)),
        (4, "output", "c"),
    ]
    assert unnamed_request_id(1) == "<ADMIT at journal seq 1>"
