"""LogReads: reads beyond the bound wait for a reader thread; none is refused."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nanoserve.engine.core.log_reads import LogReads


async def test_reads_beyond_the_bound_wait_their_turn_and_all_complete() -> None:
    reads = LogReads(2)
    release = threading.Event()
    threads: set[str] = set()

    def read(value: int) -> int:
        threads.add(threading.current_thread().name)
        release.wait(timeout=10)
        return value * 10

    calls = [asyncio.ensure_future(reads.run(read, value)) for value in range(6)]
    for _ in range(100):
        await asyncio.sleep(0.01)
        if reads.num_running == 2:
            break
    assert (reads.num_running, reads.num_waiting) == (2, 4)
    release.set()
    assert await asyncio.gather(*calls) == [0, 10, 20, 30, 40, 50]
    assert (reads.num_running, reads.num_waiting) == (0, 0)
    assert len(threads) <= 2
    assert all(name.startswith("nanoserve-log-read") for name in threads)
    reads.shutdown()


async def test_a_waiting_read_cancelled_never_runs() -> None:
    reads = LogReads(1)
    release = threading.Event()
    ran: list[int] = []

    def read(value: int) -> None:
        ran.append(value)
        release.wait(timeout=10)

    first = asyncio.ensure_future(reads.run(read, 1))
    second = asyncio.ensure_future(reads.run(read, 2))
    await asyncio.sleep(0.05)
    second.cancel()
    release.set()
    await first
    with pytest.raises(asyncio.CancelledError):
        await second
    assert ran == [1]
    reads.shutdown()


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_concurrent_log_reads must be >= 1, got 0"):
        LogReads(0)
