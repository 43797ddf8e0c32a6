"""Segments: the open epoch's rows before a checkpoint move into an archive file while it is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog, audit, audit_all, read_events, replay
from nanoserve.allocator.log.archive import RetentionPolicy, archive_epoch
from nanoserve.allocator.log.audit import audit_epoch
from nanoserve.allocator.log.errors import LogNotFoundError
from nanoserve.allocator.log.reader import connect, resolve_epoch
from nanoserve.allocator.log.segment_archive import (
    LiveSize,
    archive_due_segment,
    due_cut,
    segment_manifest,
)
from nanoserve.allocator.log.store import create_log_engine
from nanoserve.migrations import upgrade

from .test_archive import _count
from .test_audit import execute

BY_SIZE = RetentionPolicy(retention_bytes=1_000)


class Busy:
    """An open epoch of 8 blocks, a SNAPSHOT every 10 events: ``keep`` holds blocks [0, 1] from seq 2 on,
    then each ``run(n)`` adds n requests that take one block and finish (two one-event batches each)."""

    def __init__(self, url: str, pool_id: str) -> None:
        self.log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4, num_events_per_snapshot=10)
        self.pool = BlockAllocator(8, 4)
        self.pool.allocate_for(8, "keep")
        self._persist()
        self.num_requests = 0

    def _persist(self) -> None:
        self.log.append_batch(None, self.pool.take_events(), self.pool.snapshot)

    def run(self, num_requests: int) -> None:
        for _ in range(num_requests):
            blocks = self.pool.allocate_for(4, f"r{self.num_requests}")
            self._persist()
            self.pool.free_all(blocks, FreeReason.FINISHED)
            self._persist()
            self.num_requests += 1
        self.log.flush()

    def close(self) -> None:
        self.pool.free_all([0, 1], FreeReason.FINISHED)
        self._persist()
        self.log.close(final_state=self.pool.snapshot())


def test_a_segment_leaves_the_live_log_and_both_halves_audit_clean(log_url: str, pool_id: str, tmp_path: Path) -> None:
    busy = Busy(log_url, pool_id)
    busy.run(20)  # seqs 1..46: POOL_INIT, keep's, 40 request events, snapshots at 12, 23, 34, 45
    entries = archive_due_segment(log_url, tmp_path / "arch", BY_SIZE, upgrade, pool_id, LiveSize())

    assert [(e.epoch, e.first_seq, e.last_seq) for e in entries] == [(1, 1, 44)]
    assert segment_manifest(log_url, pool_id) == [entries[0].__class__(**{**entries[0].__dict__, "num_row_bytes": 0})]
    assert Path(entries[0].path).name == f"{pool_id}-epoch-00000001.seq-000000000001.db"
    assert _count(log_url, "allocator_events", pool_id) == 2  # the checkpoint at 45 and seq 46
    busy.run(2)  # the epoch goes on past the cut: seqs 47..50
    busy.close()  # 51 frees keep's blocks (held since seq 2: known from the checkpoint only), 52 POOL_CLOSE

    report = audit(log_url, pool_id)
    assert (report.clean, report.closed, report.from_seq, report.num_archived, report.last_seq) == (
        True,
        True,
        45,
        44,
        52,
    )
    assert "seqs 1..44 archived" in report.render()
    [segment] = audit_all(f"sqlite:///{entries[0].path}")
    assert (segment.clean, segment.from_seq, segment.last_seq, segment.state.blocks_by_owner()) == (
        True,
        1,
        45,
        {"keep": [0, 1], "r19": [2]},  # the checkpoint ends r19's allocating batch
    )


def test_a_second_segment_starts_at_the_first_cut(log_url: str, pool_id: str, tmp_path: Path) -> None:
    busy = Busy(log_url, pool_id)
    busy.run(20)
    size = LiveSize()
    archive_due_segment(log_url, tmp_path / "arch", BY_SIZE, upgrade, pool_id, size)
    busy.run(20)  # seqs 47..90
    [second] = archive_due_segment(log_url, tmp_path / "arch", BY_SIZE, upgrade, pool_id, size)

    assert (second.first_seq, second.last_seq) == (45, 88)
    assert [(e.first_seq, e.last_seq) for e in segment_manifest(log_url, pool_id)] == [(1, 44), (45, 88)]
    [file_report] = audit_all(f"sqlite:///{second.path}")  # the file starts at its own cut, as the live log did
    assert (file_report.clean, file_report.from_seq, file_report.last_seq) == (True, 45, 89)
    assert audit(log_url, pool_id).clean
    assert _count(log_url, "allocator_events", pool_id) == 2
    busy.log.close()


def test_nothing_is_cut_within_the_bounds_or_without_a_checkpoint(log_url: str, pool_id: str, tmp_path: Path) -> None:
    busy = Busy(log_url, pool_id)
    busy.run(3)  # seqs 1..8: no checkpoint yet
    assert archive_due_segment(log_url, tmp_path, BY_SIZE, upgrade, pool_id, LiveSize()) == []
    busy.run(20)
    roomy = RetentionPolicy(retention_bytes=1 << 30, retention_s=3600)
    assert archive_due_segment(log_url, tmp_path, roomy, upgrade, pool_id, LiveSize()) == []
    assert [event.seq for event in read_events(log_url, pool_id)] == list(range(1, 53))  # nothing cut
    busy.log.close()


def test_the_age_bound_cuts_at_the_newest_checkpoint_written_before_it(log_url: str, pool_id: str) -> None:
    busy = Busy(log_url, pool_id)
    busy.run(20)
    engine = create_log_engine(log_url)
    try:
        with engine.connect() as conn:
            by_age = RetentionPolicy(retention_s=1)
            assert due_cut(conn, pool_id, 1, by_age, now_ns=1, size=LiveSize()) is None  # everything is younger
            far_future = 2**62
            assert due_cut(conn, pool_id, 1, by_age, now_ns=far_future, size=LiveSize()) == 45
    finally:
        engine.dispose()
    busy.log.close()


def test_a_changed_first_kept_row_breaks_the_link_to_the_manifest(log_url: str, pool_id: str, tmp_path: Path) -> None:
    busy = Busy(log_url, pool_id)
    busy.run(20)
    archive_due_segment(log_url, tmp_path, BY_SIZE, upgrade, pool_id, LiveSize())
    execute(
        log_url,
        "UPDATE allocator_events SET record = record || ' ' WHERE pool_id = :p AND epoch = 1 AND seq = 45",
        p=pool_id,
    )
    report = audit(log_url, pool_id)
    assert [(v.seq, v.rule) for v in report.violations][:1] == [(45, "hash_mismatch")]
    busy.log.close()


def test_recovery_audits_a_crashed_epoch_from_its_cut(log_url: str, pool_id: str, tmp_path: Path) -> None:
    busy = Busy(log_url, pool_id)
    busy.run(20)
    archive_due_segment(log_url, tmp_path, BY_SIZE, upgrade, pool_id, LiveSize())
    busy.pool.allocate_for(4, "running")  # seq 47; then the process dies: no POOL_CLOSE
    busy._persist()
    busy.log.flush()
    with connect(log_url) as conn:
        report = audit_epoch(conn, resolve_epoch(conn, pool_id, 1), from_checkpoint=True)
    assert (report.clean, report.crashed, report.from_seq, report.last_seq) == (True, True, 45, 47)
    assert report.state.blocks_by_owner() == {"keep": [0, 1], "running": [2]}
    busy.log.close()


def test_replay_before_the_cut_names_the_archive(log_url: str, pool_id: str, tmp_path: Path) -> None:
    busy = Busy(log_url, pool_id)
    busy.run(20)
    [entry] = archive_due_segment(log_url, tmp_path, BY_SIZE, upgrade, pool_id, LiveSize())
    with pytest.raises(LogNotFoundError) as info:
        replay(log_url, pool_id, until_seq=30)
    assert str(info.value) == (
        f"seqs 1..44 of pool '{pool_id}' epoch 1 are archived: seq 30 is in {entry.path}; "
        "read it there (--url sqlite:///FILE)"
    )
    assert replay(log_url, pool_id, until_seq=45).blocks_by_owner() == {"keep": [0, 1], "r19": [2]}
    busy.log.close()


def test_an_epoch_archived_whole_after_its_segments_audits_from_its_cut(
    log_url: str, pool_id: str, tmp_path: Path
) -> None:
    busy = Busy(log_url, pool_id)
    busy.run(20)
    archive_due_segment(log_url, tmp_path, BY_SIZE, upgrade, pool_id, LiveSize())
    busy.close()
    EventLog.open(log_url, pool_id=pool_id, num_blocks=8, block_size=4).close()  # epoch 2: 1 is finished
    engine = sa.create_engine(log_url)
    try:
        entry = archive_epoch(engine, pool_id, 1, tmp_path / "epochs", upgrade)
    finally:
        engine.dispose()
    assert segment_manifest(log_url, pool_id) == []  # the epoch's segment rows went into its file
    [report] = audit_all(f"sqlite:///{entry.path}")
    assert (report.clean, report.closed, report.from_seq, report.num_archived) == (True, True, 45, 44)
