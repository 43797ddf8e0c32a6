"""Archival: finished epochs move into one SQLite file each, verifiable, and out of the live log."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import sqlalchemy as sa

from nanoserve.allocator.log import audit_all, read_events
from nanoserve.allocator.log.archive import (
    ArchiveError,
    RetentionPolicy,
    archive_due,
    archive_epoch,
    due_epochs,
    file_sha256,
    manifest,
)
from nanoserve.allocator.log.reader import connect, list_epochs
from nanoserve.allocator.log.store import create_log_engine
from nanoserve.migrations import upgrade

from .test_audit import write_log

SECOND_NS = 1_000_000_000


def _count(url: str, table: str, pool_id: str, epoch: int | None = None) -> int:
    """Rows of ``table`` of one pool (of one ``epoch`` when given)."""
    engine = sa.create_engine(url)
    where = "WHERE pool_id = :p" + ("" if epoch is None else " AND epoch = :e")
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(sa.text(f"SELECT count(*) FROM {table} {where}"), {"p": pool_id, "e": epoch}).scalar()
            )
    finally:
        engine.dispose()


def _set_opened(url: str, pool_id: str, epoch: int, opened_ns: int) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE pool_epochs SET opened_wall_ns = :t WHERE pool_id = :p AND epoch = :e"),
                {"t": opened_ns, "p": pool_id, "e": epoch},
            )
    finally:
        engine.dispose()


def test_archived_epochs_leave_the_live_log_and_audit_clean_in_their_files(
    log_url: str, pool_id: str, tmp_path: Path
) -> None:
    for _ in range(3):
        write_log(log_url, pool_id)  # epochs 1, 2, 3: 12 events each
    engine = sa.create_engine(log_url)
    try:
        with engine.begin() as conn:  # a companion row per epoch: the request journal's move with their epoch
            for epoch in (1, 2, 3):
                conn.execute(
                    sa.text(
                        "INSERT INTO request_journal (pool_id, epoch, journal_seq, request_id, kind, step, wall_ns, "
                        "record) VALUES (:p, :e, 1, 'A', 'admit', NULL, 5, :r)"
                    ),
                    {"p": pool_id, "e": epoch, "r": f'{{"epoch": {epoch}}}'},
                )
    finally:
        engine.dispose()
    dest = tmp_path / "archive"
    entries = archive_due(log_url, dest, RetentionPolicy(retention_bytes=1), upgrade, pool_id=pool_id)

    assert [(e.epoch, e.first_seq, e.last_seq) for e in entries] == [(1, 1, 12), (2, 1, 12)]
    assert manifest(log_url, pool_id) == entries
    with connect(log_url) as conn:
        assert [info.epoch for info in list_epochs(conn, pool_id)] == [3]  # the newest stays
    assert [event.epoch for event in read_events(log_url, pool_id, epoch=3)] == [3] * 12  # the newest's events
    assert _count(log_url, "allocator_events", pool_id) == _count(log_url, "allocator_events", pool_id, epoch=3)
    assert _count(log_url, "request_journal", pool_id) == 1
    for entry in entries:
        path = Path(entry.path)
        assert path.name == f"{pool_id}-epoch-{entry.epoch:08d}.db"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert file_sha256(path) == entry.sha256
        assert path.stat().st_size == entry.num_bytes
        assert not path.with_name(path.name + "-wal").exists()
        [report] = audit_all(f"sqlite:///{path}", pool_id)
        assert (report.epoch, report.num_events, report.last_seq, report.closed, report.clean) == (
            entry.epoch,
            12,
            12,
            True,
            True,
        )
        with connect(f"sqlite:///{path}") as conn:
            [info] = list_epochs(conn, pool_id)
            assert info.head_hash == entry.head_hash
            journal = conn.execute(sa.text("SELECT epoch, record FROM request_journal")).all()
            assert [tuple(row) for row in journal] == [(entry.epoch, f'{{"epoch": {entry.epoch}}}')]
    assert stat.S_IMODE(dest.stat().st_mode) == 0o700
    # archiving again finds nothing more to do: the newest epoch is kept whatever the policy
    assert archive_due(log_url, dest, RetentionPolicy(retention_bytes=1), upgrade, pool_id=pool_id) == []


def test_the_newest_epoch_is_never_archived(log_url: str, pool_id: str, tmp_path: Path) -> None:
    write_log(log_url, pool_id)
    write_log(log_url, pool_id)
    live = create_log_engine(log_url)
    try:
        with pytest.raises(ArchiveError, match=f"epoch 2 is the newest of pool '{pool_id}': it is never archived"):
            archive_epoch(live, pool_id, 2, tmp_path, upgrade)
        with pytest.raises(ArchiveError, match=f"pool '{pool_id}' has no epoch 7 in the live log"):
            archive_epoch(live, pool_id, 7, tmp_path, upgrade)
    finally:
        live.dispose()


@pytest.mark.usefixtures("one_row_per_event")  # identical epochs: no group commit packs them apart
def test_due_epochs_by_age_and_by_size(log_url: str, pool_id: str) -> None:
    for _ in range(4):
        write_log(log_url, pool_id)
    now_ns = 1_000 * SECOND_NS
    for epoch, opened_s in ((1, 100), (2, 200), (3, 500), (4, 900)):
        _set_opened(log_url, pool_id, epoch, opened_s * SECOND_NS)
    live = create_log_engine(log_url)
    try:
        with live.connect() as conn:
            assert due_epochs(conn, pool_id, RetentionPolicy(), now_ns) == []  # both off: keep everything
            # epoch 1 ended at 200 s, 2 at 500 s, 3 at 900 s; now is 1000 s
            assert due_epochs(conn, pool_id, RetentionPolicy(retention_s=500), now_ns) == [1, 2]
            assert due_epochs(conn, pool_id, RetentionPolicy(retention_s=50), now_ns) == [1, 2, 3]
            assert due_epochs(conn, pool_id, RetentionPolicy(retention_s=900), now_ns) == []
            [sizes] = {tuple(_sizes(conn, pool_id).values())}
            assert len(set(sizes)) == 1  # four identical epochs
            one = sizes[0]
            assert one > 12 * 96  # twelve events' records and their overhead
            # the open (newest) epoch does not count: 3 and 2 fit in two epochs' bytes
            assert due_epochs(conn, pool_id, RetentionPolicy(retention_bytes=2 * one), now_ns) == [1]
            assert due_epochs(conn, pool_id, RetentionPolicy(retention_bytes=3 * one), now_ns) == []
            assert due_epochs(conn, pool_id, RetentionPolicy(retention_bytes=1), now_ns) == [1, 2, 3]
            # sizes measured once are taken from the caller's dict
            sizes = {(pool_id, epoch): 10 * one for epoch in (1, 2, 3)}
            assert due_epochs(conn, pool_id, RetentionPolicy(retention_bytes=3 * one), now_ns, sizes) == [1, 2, 3]
            fresh: dict[tuple[str, int], int] = {}
            assert due_epochs(conn, pool_id, RetentionPolicy(retention_bytes=2 * one), now_ns, fresh) == [1]
            assert fresh == {(pool_id, 1): one, (pool_id, 2): one, (pool_id, 3): one}
    finally:
        live.dispose()


def _sizes(conn: sa.Connection, pool_id: str) -> dict[int, int]:
    from nanoserve.allocator.log.archive import epoch_bytes, epoch_tables

    return epoch_bytes(conn, epoch_tables(conn), pool_id)


def test_a_policy_refuses_negative_bounds() -> None:
    with pytest.raises(ValueError, match="retention_s must be >= 0 seconds"):
        RetentionPolicy(retention_s=-1)
    with pytest.raises(ValueError, match="retention_bytes must be >= 0"):
        RetentionPolicy(retention_bytes=-1)
