"""The server's archiver thread: due epochs leave the live log, each pass at most once at a time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nanoserve.allocator import BlockAllocator
from nanoserve.allocator.log import EventLog
from nanoserve.allocator.log.archive import RetentionPolicy, manifest
from nanoserve.allocator.log.reader import connect, list_epochs
from nanoserve.migrations import upgrade
from nanoserve.service.log_retention import LogArchiver, default_archive_dir


def _epochs(url: str, pool_id: str, count: int) -> None:
    for _ in range(count):
        with EventLog.open(url, pool_id=pool_id, num_blocks=4, block_size=16) as log:
            pool = BlockAllocator(4, 16)
            pool.allocate("A")
            log.append_batch(None, pool.take_events(), pool.snapshot)
            pool.free(0)
            log.append_batch(None, pool.take_events(), pool.snapshot)


def test_a_pass_archives_the_due_epochs_of_its_pool_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    _epochs(url, "mine", 3)
    _epochs(url, "other", 2)
    archiver = LogArchiver(url, "mine", tmp_path / "arch", RetentionPolicy(retention_bytes=1))
    assert [(e.pool_id, e.epoch) for e in archiver.run_once()] == [("mine", 1), ("mine", 2)]
    assert archiver.run_once() == []
    assert archiver.passes == 2
    assert [(e.pool_id, e.epoch) for e in manifest(url)] == [("mine", 1), ("mine", 2)]
    with connect(url) as conn:
        assert [(i.pool_id, i.epoch) for i in list_epochs(conn)] == [("mine", 3), ("other", 1), ("other", 2)]
    assert sorted(p.name for p in (tmp_path / "arch").iterdir()) == ["mine-epoch-00000001.db", "mine-epoch-00000002.db"]


def test_the_thread_archives_at_start_and_stops_cleanly(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    _epochs(url, "p", 2)
    archiver = LogArchiver(url, "p", tmp_path / "arch", RetentionPolicy(retention_bytes=1), interval_s=0.05)
    archiver.start()
    deadline = time.monotonic() + 10
    while not archiver.archived and time.monotonic() < deadline:
        time.sleep(0.02)
    archiver.stop(timeout_s=10)
    assert [e.epoch for e in archiver.archived] == [1]
    assert archiver.passes >= 1
    archiver.stop()  # twice: nothing more


def test_a_failed_pass_is_retried_not_fatal(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'missing' / 'log.db'}"  # no such folder: every pass fails
    archiver = LogArchiver(url, "p", tmp_path / "arch", RetentionPolicy(retention_s=1), interval_s=0.02)
    archiver.start()
    time.sleep(0.2)
    archiver.stop(timeout_s=10)
    assert archiver.passes == 0
    assert archiver.archived == []


def test_the_default_archive_folder() -> None:
    assert default_archive_dir("sqlite:////var/lib/nanoserve/log.db") == Path("/var/lib/nanoserve/log.db.archive")
    assert default_archive_dir("postgresql+psycopg://u@h/db") == Path("nanoserve-log-archive")


def test_an_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0 seconds, got 0"):
        LogArchiver("sqlite:///x.db", "p", tmp_path, RetentionPolicy(retention_s=1), interval_s=0)
