"""One live writer per pool id: a second server on the same pool is refused, a dead one frees it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from nanoserve.allocator.log import EventLog, SecondWriterError
from nanoserve.allocator.log.pool_lock import advisory_key, lock_file_path

# a writer in another process: opens the pool, says so, then waits to be killed
HOLDER = """
import sys, time
from nanoserve.allocator.log import EventLog
log = EventLog.open(sys.argv[1], pool_id=sys.argv[2], num_blocks=4, block_size=16)
print("holding", log.epoch, flush=True)
time.sleep(600)
"""


def _hold(url: str, pool_id: str) -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, url, pool_id], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    assert holder.stdout.readline().split() == ["holding", "1"]
    return holder


def test_advisory_keys_are_signed_64_bit_and_differ_per_pool() -> None:
    keys = {advisory_key(f"replica-{i}") for i in range(1000)}
    assert len(keys) == 1000
    assert all(-(2**63) <= key < 2**63 for key in keys)
    assert advisory_key("replica-0") == advisory_key("replica-0")


def test_the_lock_file_sits_beside_the_database_one_per_pool() -> None:
    assert lock_file_path("/var/lib/nanoserve/log.db", "replica-0") == "/var/lib/nanoserve/log.db.pool-replica-0.lock"
    assert lock_file_path("log.db", "a/b c") == "log.db.pool-a%2Fb%20c.lock"


def test_a_server_in_another_process_holds_the_pool_until_it_dies(log_url: str, pool_id: str) -> None:
    holder = _hold(log_url, pool_id)
    try:
        with pytest.raises(SecondWriterError) as info:
            EventLog.open(log_url, pool_id=pool_id, num_blocks=4, block_size=16)
        message = str(info.value)
        assert message.startswith(f"pool {pool_id!r} is being written by another live server")
        assert message.endswith(
            "give this server another pool id (--pool-id / NANOSERVE_POOL_ID), or stop the other server first"
        )
        with EventLog.open(log_url, pool_id=f"{pool_id}-b", num_blocks=4, block_size=16) as other:
            assert other.epoch == 1  # the other pool of the same log is free
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no close, the OS (or PostgreSQL) drops the lock
        holder.wait()
    with _open_once_dropped(log_url, pool_id) as log:
        assert log.epoch == 2  # the crashed epoch 1 stays open in the log; audit reports it


def _open_once_dropped(log_url: str, pool_id: str, timeout_s: float = 30.0) -> EventLog:
    """EventLog.open once the dead holder's lock is gone: a file lock goes with the process at once, a
    PostgreSQL advisory lock when its backend sees the connection closed, which a loaded machine (CI's,
    with the suite running) may take a moment to schedule."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return EventLog.open(log_url, pool_id=pool_id, num_blocks=4, block_size=16)
        except SecondWriterError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
