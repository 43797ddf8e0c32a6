"""A batch the store refuses as data is a loud, bounded failure, never a retry loop (issue 30).

SQLite gets a trigger planted that refuses one owner (the store's own
constraint); PostgreSQL gets a request id with a NUL, slipped past the engine's
validation by calling the log directly (its text fields cannot hold one). Either
way: no retry, the writer fails with LogRefusedError naming the first refused
seq, the epoch is consistent up to the seq before (audit clean, nothing half
written), and ``close`` names what was not written.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
import structlog

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog, EventLogIncompleteError, LogRefusedError, audit
from nanoserve.allocator.log.errors import is_refused_as_data, is_store_unavailable
from nanoserve.migrations import upgrade

NUM_BLOCKS = 8
REFUSED_OWNER = {"sqlite": "poison", "postgres": "poi\x00son"}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(kind, url) of a migrated log; SQLite's refuses owner 'poison' through a trigger."""
    if request.param == "postgres":
        url = request.getfixturevalue("pg_url")
        upgrade(url)
        return "postgres", url
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TRIGGER refuse_poison BEFORE INSERT ON allocator_events WHEN NEW.owner = 'poison' "
                "BEGIN SELECT RAISE(ABORT, 'owner poison refused'); END"
            )
        )
    engine.dispose()
    return "sqlite", url


def _step(pool: BlockAllocator, log: EventLog, owner: str) -> None:
    block_id = pool.allocate(owner)
    pool.free(block_id, FreeReason.FINISHED)
    log.append_batch(None, pool.take_events(), pool.snapshot)


@pytest.mark.usefixtures("one_row_per_event")  # the store refuses one event's row
def test_a_refused_batch_fails_the_log_once_without_retrying(store: tuple[str, str]) -> None:
    kind, url = store
    pool_id = f"refused-{uuid.uuid4().hex[:8]}"
    log = EventLog.open(url, pool_id=pool_id, num_blocks=NUM_BLOCKS, block_size=16)
    pool = BlockAllocator(NUM_BLOCKS, 16)
    _step(pool, log, "good-1")
    assert log.flush(timeout_s=10)
    assert log.durable_seq == 3

    started = time.monotonic()
    with structlog.testing.capture_logs() as lines:
        _step(pool, log, REFUSED_OWNER[kind])  # seqs 4 and 5
        with pytest.raises(LogRefusedError) as info:
            log.flush(timeout_s=10)
    assert time.monotonic() - started < 2.0  # bounded: no backoff loop
    assert log.failed
    assert not log.healthy
    assert log.durable_seq == 3
    assert (info.value.first_seq, info.value.last_seq) == (4, 5)
    assert str(info.value).startswith(f"the store refused pool {pool_id!r} epoch 1 seqs 4..5 as data (")
    assert log._writer.num_retries == 0
    refused = [line for line in lines if line["event"] == "event_log_batch_refused"]
    assert [(line["first_seq"], line["last_seq"], line["log_level"]) for line in refused] == [(4, 5, "error")]
    assert [line["event"] for line in lines].count("event_log_commit_failed") == 0

    with pytest.raises(LogRefusedError):  # later batches are refused at once, not queued
        _step(pool, log, "good-2")
    with pytest.raises(EventLogIncompleteError, match=r"\(seqs 4\.\.\d+\) not written: the store refused"):
        log.close(timeout_s=1.0, final_state=pool.snapshot())
    report = audit(url, pool_id, 1)  # consistent up to seq 3: nothing of the refused group was written
    assert (report.last_seq, report.closed, report.violations) == (3, False, [])


def test_store_errors_are_classified_away_or_refused() -> None:
    import sqlite3

    def wrapped(cls: type[sa.exc.DBAPIError], orig: Exception) -> sa.exc.DBAPIError:
        return cls("INSERT ...", {}, orig)

    assert is_store_unavailable(wrapped(sa.exc.OperationalError, sqlite3.OperationalError("database is locked")))
    assert not is_refused_as_data(wrapped(sa.exc.OperationalError, sqlite3.OperationalError("disk is full")))
    assert is_refused_as_data(wrapped(sa.exc.IntegrityError, sqlite3.IntegrityError("CHECK constraint failed")))
    assert is_refused_as_data(wrapped(sa.exc.DataError, sqlite3.DataError("string too long")))
    assert is_refused_as_data(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert not is_refused_as_data(ConnectionRefusedError("refused"))
