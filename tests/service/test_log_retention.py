"""The server's archiver thread: due epochs leave the live log, each pass at most once at a time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nanoserve.allocator import BlockAllocator
from nanoserve.allocator.log import EventLog, audit, audit_all, read_events
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


def _count_allocations(url: str) -> int:
    """ALLOCATE events stored in pool p's epoch 1 (packed rows read as their events)."""
    return len(read_events(url, "p", 1, kind="allocate"))


def test_the_default_archive_folder() -> None:
    assert default_archive_dir("sqlite:////var/lib/nanoserve/log.db") == Path("/var/lib/nanoserve/log.db.archive")
    assert default_archive_dir("postgresql+psycopg://u@h/db") == Path("nanoserve-log-archive")


def test_an_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0 seconds, got 0"):
        LogArchiver("sqlite:///x.db", "p", tmp_path, RetentionPolicy(retention_s=1), interval_s=0)


def test_the_open_epoch_sheds_segments_while_it_is_written(tmp_path: Path) -> None:
    """The archiver's thread cuts the epoch the writer is appending to; nothing is lost on either side."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    log = EventLog.open(url, pool_id="p", num_blocks=4, block_size=16, num_events_per_snapshot=10)
    pool = BlockAllocator(4, 16)
    archiver = LogArchiver(url, "p", tmp_path / "arch", RetentionPolicy(retention_bytes=2_000), interval_s=0.01)
    archiver.start()
    deadline = time.monotonic() + 60
    num_steps = 0
    while (len(archiver.segments) < 3 or num_steps < 300) and time.monotonic() < deadline:
        block = pool.allocate(f"r{num_steps}")
        log.append_batch(num_steps, pool.take_events(), pool.snapshot)
        pool.free(block)
        log.append_batch(num_steps, pool.take_events(), pool.snapshot)
        num_steps += 1
        if num_steps % 50 == 0:
            log.flush()
    log.close(final_state=pool.snapshot())
    archiver.stop(timeout_s=30)

    segments = archiver.segments
    assert len(segments) >= 3
    assert [s.first_seq for s in segments[1:]] == [s.last_seq + 1 for s in segments[:-1]]  # back to back from 1
    assert segments[0].first_seq == 1
    report = audit(url, "p")
    assert (report.clean, report.closed, report.from_seq) == (True, True, segments[-1].last_seq + 1)
    files = [url] + [f"sqlite:///{segment.path}" for segment in segments]  # they share only snapshot rows
    assert sum(_count_allocations(file) for file in files) == num_steps  # every allocation, once
    for segment in segments:
        [file_report] = audit_all(f"sqlite:///{segment.path}")
        assert (file_report.clean, file_report.from_seq, file_report.last_seq) == (
            True,
            segment.first_seq,
            segment.last_seq + 1,
        )


def test_a_serving_engine_sheds_events_and_journal_while_requests_stream(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An engine that never restarts: its epoch is cut between and during batches; both halves audit clean."""
    from nanoserve.engine import LLM, SamplingParams, TokensPrompt
    from nanoserve.engine.journal.store import audit_journal, read_request_history

    url = f"sqlite:///{tmp_path / 'log.db'}"
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=32,
        block_size=4,
        event_log_url=url,
        num_events_per_snapshot=8,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    archiver = LogArchiver(url, "default", tmp_path / "arch", RetentionPolicy(retention_bytes=1), interval_s=0.01)
    try:
        first = llm.generate([TokensPrompt([5 + i, 6, 7, 8, 9]) for i in range(4)], params)
        # generate returns before the writer's last commit (the FINISH rows) is durable: cut only after it
        # (the cut found no journal row to archive, now and then, under load)
        assert llm.engine.event_log is not None
        assert llm.engine.event_log.flush(30)
        archiver.run_once()  # everyone in the first batch finished: their events and journal rows leave
        [segment] = archiver.segments
        assert (segment.first_seq, segment.companion_first_seq) == (1, 1)
        archiver.start()  # from here on it cuts while the second batch streams
        second = llm.generate([TokensPrompt([15 + i, 6, 7, 8, 9]) for i in range(6)], params)
    finally:
        archiver.stop(timeout_s=30)
        llm.shutdown()

    assert [len(output.outputs[0].token_ids) for output in first + second] == [12] * 10
    report = audit(url, "default")
    assert (report.clean, report.closed, report.num_archived) == (True, True, archiver.segments[-1].last_seq)
    with connect(url) as conn:
        assert audit_journal(conn, "default") == []
        assert read_request_history(conn, "default", first[0].request_id) is None  # archived: NOT_FOUND
    for entry in archiver.segments:
        [file_report] = audit_all(f"sqlite:///{entry.path}")
        assert (file_report.clean, file_report.last_seq) == (True, entry.last_seq + 1)
        with connect(f"sqlite:///{entry.path}") as conn:
            assert audit_journal(conn, "default") == []
