"""The event log under real faults (issue 9): a full disk, a PostgreSQL server that stops, a deleted file.

Each has one outcome: while the store cannot take commits the log says it is not durable and
why, keeps every event (bounded by ``max_pending_batches``, beyond which the caller waits), and
loses nothing once the store is back; ``close(timeout_s)`` is bounded and names what it could
not write; a SQLite file deleted under the writer fails the log for good and claims nothing durable.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import (
    EventLog,
    EventLogError,
    EventLogIncompleteError,
    LogFileLostError,
    PoolLockLostError,
    SecondWriterError,
    audit,
    read_events,
)
from nanoserve.allocator.log.pool_lock import advisory_key
from nanoserve.allocator.log.reader import connect, list_epochs
from nanoserve.migrations import upgrade

from ..faults import PgCluster, Tmpfs

NUM_BLOCKS = 8


def churn(pool: BlockAllocator, log: EventLog, num_steps: int) -> None:
    """``num_steps`` engine steps of one allocate and one free each."""
    for _ in range(num_steps):
        block_id = pool.allocate(f"r{uuid.uuid4().hex[:6]}")
        pool.free(block_id, FreeReason.FINISHED)
        log.append_batch(None, pool.take_events(), pool.snapshot)


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true within {timeout_s} s"
        time.sleep(0.02)


def stored_epoch(url: str, pool_id: str) -> tuple[int, int | None]:
    """(durable_seq, closed_seq) of the pool's only epoch, as stored."""
    with connect(url) as conn:
        (info,) = list_epochs(conn, pool_id)
    return info.durable_seq, info.closed_seq


# -- SQLite on a full disk --------------------------------------------------------------------------

needs_tmpfs = pytest.mark.skipif(not Tmpfs.available(), reason="needs root and a tmpfs mount")


@pytest.fixture
def media() -> Iterator[Tmpfs]:
    with Tmpfs(4 << 20) as tmpfs:
        yield tmpfs


def open_on(folder: Path, **kwargs: object) -> tuple[str, EventLog]:
    url = f"sqlite:///{folder / 'log.db'}"
    upgrade(url)
    return url, EventLog.open(url, pool_id="p", num_blocks=NUM_BLOCKS, block_size=16, **kwargs)  # type: ignore[arg-type]


@needs_tmpfs
def test_full_disk_stalls_the_log_at_its_bound_and_it_recovers_without_loss(media: Tmpfs) -> None:
    url, log = open_on(media.path, max_pending_batches=4)
    pool = BlockAllocator(NUM_BLOCKS, 16)
    churn(pool, log, 3)
    assert log.flush(timeout_s=10)
    assert (log.durable, log.num_pending_batches, log.pending_bytes) == (True, 0, 0)

    media.fill()
    churn(pool, log, 1)
    wait_until(lambda: not log.durable)
    reason = log.not_durable_reason()
    assert reason is not None
    assert f"commits to {url} have failed for " in reason
    assert "(OperationalError: database or disk is full); 2 event(s) wait" in reason
    churn(pool, log, 3)  # the bound: 4 batches wait, the one being retried included
    assert log.num_pending_batches == 4
    assert 4 * 2 * 50 < log.pending_bytes < 4 * 2 * 100  # two records of 50 to 100 bytes a batch

    blocked = threading.Thread(target=churn, args=(pool, log, 1))
    blocked.start()
    blocked.join(0.5)
    assert blocked.is_alive()  # the fifth batch waits for room: memory stays bounded

    media.free()
    blocked.join(10)
    assert not blocked.is_alive()
    assert log.flush(timeout_s=10)
    assert log.durable
    last_seq = log.last_seq
    log.close(final_state=pool.snapshot())
    report = audit(url, "p")
    assert (report.clean, report.closed, report.last_seq) == (True, True, last_seq + 1)
    assert [event.seq for event in read_events(url, "p")] == list(range(1, last_seq + 2))  # nothing lost


@needs_tmpfs
def test_close_on_a_full_disk_is_bounded_and_names_what_it_could_not_write(media: Tmpfs) -> None:
    url, log = open_on(media.path)
    pool = BlockAllocator(NUM_BLOCKS, 16)
    churn(pool, log, 3)
    assert log.flush(timeout_s=10)
    durable_seq = log.durable_seq
    media.fill()
    churn(pool, log, 2)
    wait_until(lambda: not log.durable)

    started = time.monotonic()
    with pytest.raises(EventLogIncompleteError) as info:
        log.close(timeout_s=0.5, final_state=pool.snapshot())
    assert time.monotonic() - started < 3.0
    error = info.value
    # the 4 block events and POOL_CLOSE after the last durable seq
    assert (error.first_seq, error.last_seq, error.num_events) == (durable_seq + 1, durable_seq + 5, 5)
    assert str(error) == (
        f"event log {url} is incomplete: 5 events (seqs {durable_seq + 1}..{durable_seq + 5}) not written: "
        "the store did not take them within 0.5 s; its last error: OperationalError: database or disk is full; "
        "the epoch stays open"
    )

    media.free()
    time.sleep(1.2)  # longer than the writer's longest retry delay: it was abandoned, it commits nothing more
    assert stored_epoch(url, "p") == (durable_seq, None)  # open: the next start sees a crashed epoch
    report = audit(url, "p")
    assert (report.clean, report.crashed, report.last_seq) == (True, True, durable_seq)


# -- PostgreSQL that stops --------------------------------------------------------------------------


@pytest.fixture
def pg_log_url(pg_cluster: PgCluster) -> Iterator[str]:
    """A fresh database on the throwaway cluster, which is running again after the test."""
    name = f"faults_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_cluster.url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = pg_cluster.url(name)
    upgrade(url)
    yield url
    pg_cluster.start_if_stopped()


def test_stopped_postgresql_makes_the_log_not_durable_and_close_is_bounded(
    pg_cluster: PgCluster, pg_log_url: str
) -> None:
    log = EventLog.open(pg_log_url, pool_id="p", num_blocks=NUM_BLOCKS, block_size=16)
    pool = BlockAllocator(NUM_BLOCKS, 16)
    churn(pool, log, 3)
    assert log.flush(timeout_s=10)

    pg_cluster.stop()
    churn(pool, log, 2)
    wait_until(lambda: not log.durable)
    reason = log.not_durable_reason()
    assert reason is not None
    assert f"commits to {pg_log_url} have failed for " in reason
    assert "OperationalError" in reason

    pg_cluster.start()  # back: the retries commit everything, nothing lost
    assert log.flush(timeout_s=15)
    assert log.durable

    pg_cluster.stop()
    churn(pool, log, 2)
    durable_seq = log.durable_seq
    started = time.monotonic()
    with pytest.raises(EventLogIncompleteError) as info:
        log.close(timeout_s=1.0, final_state=pool.snapshot())
    assert time.monotonic() - started < 4.0
    assert (info.value.first_seq, info.value.num_events) == (durable_seq + 1, 5)
    assert "its last error: OperationalError" in str(info.value)

    pg_cluster.start()
    assert stored_epoch(pg_log_url, "p") == (durable_seq, None)
    report = audit(pg_log_url, "p")
    assert (report.clean, report.crashed, report.last_seq) == (True, True, durable_seq)


# -- PostgreSQL restarted under a live writer: the pool lock outlives its session -----------------------


def lock_session_pid(log: EventLog) -> int:
    session = log._pool_lock.session  # the session holding the pool's advisory lock
    assert session is not None
    return session.pid


def test_restarted_postgresql_the_writer_takes_its_lock_again_and_resumes(
    pg_cluster: PgCluster, pg_log_url: str
) -> None:
    log = EventLog.open(pg_log_url, pool_id="p", num_blocks=NUM_BLOCKS, block_size=16)
    pool = BlockAllocator(NUM_BLOCKS, 16)
    churn(pool, log, 3)
    assert log.flush(timeout_s=10)
    assert log.durable_seq == 7
    old_pid = lock_session_pid(log)

    pg_cluster.stop("immediate")  # a crash: every session, the lock's included, dies
    pg_cluster.start()
    wait_until(lambda: log._pool_lock.session is not None and lock_session_pid(log) != old_pid)  # idle re-take
    churn(pool, log, 2)
    assert log.flush(timeout_s=15)
    assert (log.durable_seq, log.durable) == (11, True)
    log.close(timeout_s=10, final_state=pool.snapshot())

    assert stored_epoch(pg_log_url, "p") == (12, 12)
    report = audit(pg_log_url, "p")
    assert (report.clean, report.crashed, report.last_seq) == (True, False, 12)


def test_a_second_server_after_a_restart_is_refused_while_the_first_lives(
    pg_cluster: PgCluster, pg_log_url: str
) -> None:
    log = EventLog.open(pg_log_url, pool_id="p", num_blocks=NUM_BLOCKS, block_size=16)
    pool = BlockAllocator(NUM_BLOCKS, 16)
    churn(pool, log, 1)
    assert log.flush(timeout_s=10)

    pg_cluster.stop("immediate")
    pg_cluster.start()
    # at once: the first writer may not hold its lock yet; the second yields until it does
    with pytest.raises(SecondWriterError) as info:
        EventLog.open(pg_log_url, pool_id="p", num_blocks=NUM_BLOCKS, block_size=16)
    assert str(info.value).startswith("pool 'p' is being written by another live server")
    churn(pool, log, 1)
    assert log.flush(timeout_s=15)
    assert log.durable_seq == 5
    log.close(timeout_s=10)
    with connect(pg_log_url) as conn:
        assert [info.epoch for info in list_epochs(conn, "p")] == [1]  # the second opened nothing


def test_a_writer_whose_lock_another_session_took_stops_writing(pg_log_url: str) -> None:
    log = EventLog.open(pg_log_url, pool_id="p", num_blocks=NUM_BLOCKS, block_size=16)
    pool = BlockAllocator(NUM_BLOCKS, 16)
    churn(pool, log, 1)
    assert log.flush(timeout_s=10)
    thief = sa.create_engine(pg_log_url)
    with thief.connect() as conn:
        # the lock's session is cut, and another session takes the pool before the writer is back
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": lock_session_pid(log)}).scalar()
        assert conn.execute(sa.text("SELECT pg_try_advisory_lock(:key)"), {"key": advisory_key("p")}).scalar()
        churn(pool, log, 1)
        wait_until(lambda: log.failed)
        assert isinstance(log._writer.error, PoolLockLostError)
        assert not log.durable
        assert str(log._writer.error).startswith(
            f"pool 'p' lost its lock (PostgreSQL advisory lock {advisory_key('p')} on {pg_log_url}) when its "
            "database session ended, and another server took it: this server stops writing pool 'p' epoch 1 "
            "at seq 3"
        )
        with pytest.raises(EventLogIncompleteError) as info:
            log.close(timeout_s=2)
        assert (info.value.first_seq, info.value.last_seq) == (4, 5)
        assert stored_epoch(pg_log_url, "p") == (3, None)  # nothing after the lock was lost
    thief.dispose()


# -- a deleted SQLite file ----------------------------------------------------------------------------


def test_deleted_file_fails_the_log_loudly_and_nothing_is_called_durable(tmp_path: Path) -> None:
    _, log = open_on(tmp_path)
    pool = BlockAllocator(NUM_BLOCKS, 16)
    churn(pool, log, 3)
    assert log.flush(timeout_s=10)
    assert log.durable_seq == 7
    for suffix in ("", "-wal", "-shm"):
        Path(f"{tmp_path / 'log.db'}{suffix}").unlink(missing_ok=True)

    wait_until(lambda: log.failed, timeout_s=3.0)  # noticed while idle, within the writer's half-second wake-up
    assert log.durable_seq == 0  # what it committed went with the file
    assert not log.durable
    reason = log.not_durable_reason()
    assert reason is not None
    assert reason.startswith(f"the event log failed: the event log file '{tmp_path / 'log.db'}' was deleted")
    with pytest.raises(LogFileLostError):
        churn(pool, log, 1)
    with pytest.raises(EventLogIncompleteError, match=r"7 events \(seqs 1\.\.7\) not written: the event log file"):
        log.close(final_state=pool.snapshot())


def test_replaced_file_fails_the_log_at_its_next_commit(tmp_path: Path) -> None:
    _, log = open_on(tmp_path)
    pool = BlockAllocator(NUM_BLOCKS, 16)
    churn(pool, log, 1)
    assert log.flush(timeout_s=10)
    (tmp_path / "log.db").rename(tmp_path / "moved.db")
    (tmp_path / "log.db").write_bytes(b"")  # another file at the path
    churn(pool, log, 1)
    with pytest.raises(EventLogError, match="was replaced by another file"):
        log.flush(timeout_s=5)
    assert log.durable_seq == 0
