"""LogReads: reads beyond the bound wait for a reader thread; none is refused."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nanoserve.engine.core.log_reads import LogReads, ReadPacer


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


async def test_a_freed_thread_goes_to_the_next_tenant_in_turn_not_to_the_biggest_crowd() -> None:
    reads = LogReads(1)
    release = threading.Event()
    order: list[str] = []

    def read(name: str) -> str:
        if name == "first":
            release.wait(timeout=10)
        order.append(name)
        return name

    first = asyncio.ensure_future(reads.run(read, "first", scope="acme"))
    await asyncio.sleep(0.05)
    crowd = [asyncio.ensure_future(reads.run(read, f"acme-{i}", scope="acme")) for i in range(3)]
    await asyncio.sleep(0)
    lone = asyncio.ensure_future(reads.run(read, "blue-0", scope="blue"))
    await asyncio.sleep(0)
    assert (reads.num_running, reads.num_waiting) == (1, 4)
    release.set()
    await asyncio.gather(first, *crowd, lone)
    assert order == ["first", "acme-0", "blue-0", "acme-1", "acme-2"]
    assert (reads.num_running, reads.num_waiting) == (0, 0)
    reads.shutdown()


async def test_one_tenant_holds_at_most_its_bound_so_another_tenants_read_starts_at_once() -> None:
    reads = LogReads(3, max_per_scope=2)
    release = threading.Event()
    started: list[str] = []

    def read(name: str) -> str:
        started.append(name)
        if name.startswith("acme"):
            release.wait(timeout=30)
        return name

    crowd = [asyncio.ensure_future(reads.run(read, f"acme-{i}", scope="acme")) for i in range(5)]
    for _ in range(200):  # the crowd's first two reads reach their threads
        if len(started) == 2:
            break
        await asyncio.sleep(0.01)
    assert (reads.num_running, reads.num_waiting, reads.num_running_of("acme")) == (2, 3, 2)
    assert sorted(started) == ["acme-0", "acme-1"]  # the third thread stays free for another tenant
    assert await reads.run(read, "blue-0", scope="blue") == "blue-0"  # while acme's reads still block
    assert (reads.num_running, reads.num_running_of("acme")) == (2, 2)
    release.set()
    assert await asyncio.gather(*crowd) == [f"acme-{i}" for i in range(5)]
    assert (reads.num_running, reads.num_waiting) == (0, 0)
    reads.shutdown()


def test_a_tenant_bound_below_one_is_refused_and_above_the_threads_is_the_threads() -> None:
    with pytest.raises(ValueError, match=r"^max_tenant_log_reads must be >= 1, got 0$"):
        LogReads(4, max_per_scope=0)
    assert LogReads(2, max_per_scope=8).max_per_scope == 2
    assert LogReads(4).max_per_scope == 4


async def test_a_waiting_read_cancelled_passes_its_turn_on() -> None:
    reads = LogReads(1)
    release = threading.Event()
    ran: list[str] = []

    def read(name: str) -> None:
        if name == "holder":
            release.wait(timeout=10)
        ran.append(name)

    holder = asyncio.ensure_future(reads.run(read, "holder", scope="acme"))
    await asyncio.sleep(0.05)
    leaving = asyncio.ensure_future(reads.run(read, "leaving", scope="blue"))
    staying = asyncio.ensure_future(reads.run(read, "staying", scope="acme"))
    await asyncio.sleep(0)
    leaving.cancel()
    release.set()
    await asyncio.gather(holder, staying)
    assert ran == ["holder", "staying"]
    assert (reads.num_running, reads.num_waiting) == (0, 0)
    reads.shutdown()


async def test_calls_asking_for_one_key_before_its_read_starts_share_it_later_ones_read_again() -> None:
    reads = LogReads(1)
    release = threading.Event()
    num_reads = {"page-1": 0, "holder": 0}

    def read(key: str) -> list[str]:
        num_reads[key] += 1
        if key == "holder":
            release.wait(timeout=10)
        return [f"{key} read {num_reads[key]}"]

    holder = asyncio.ensure_future(reads.run(read, "holder"))  # takes the only thread
    await asyncio.sleep(0.05)
    crowd = [asyncio.ensure_future(reads.run_shared("page-1", read, "page-1")) for _ in range(5)]
    other_scope = asyncio.ensure_future(reads.run_shared("page-1", read, "page-1", scope="blue"))
    await asyncio.sleep(0.05)
    assert reads.num_waiting == 2  # the crowd's one read and the other scope's own
    release.set()
    pages = await asyncio.gather(*crowd)
    assert pages == [["page-1 read 1"]] * 5
    assert all(page is pages[0] for page in pages)
    assert await other_scope == ["page-1 read 2"]  # another tenant's call never shares this tenant's read
    assert await reads.run_shared("page-1", read, "page-1") == ["page-1 read 3"]  # asked after it ran: read anew
    await holder
    assert num_reads == {"page-1": 3, "holder": 1}
    reads.shutdown()


async def test_a_started_shared_read_is_not_joined_and_its_error_reaches_every_caller() -> None:
    reads = LogReads(2)
    started, release = threading.Event(), threading.Event()
    num_reads = 0

    def read() -> None:
        nonlocal num_reads
        num_reads += 1
        number = num_reads
        started.set()
        release.wait(timeout=10)
        raise LookupError(f"read {number} failed")

    first = [asyncio.ensure_future(reads.run_shared("page-1", read)) for _ in range(2)]
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
    late = asyncio.ensure_future(reads.run_shared("page-1", read))  # the first read already queried the store
    first[0].cancel()  # a caller leaving does not end the read for the others
    release.set()
    with pytest.raises(LookupError, match="read 1 failed"):
        await first[1]
    with pytest.raises(LookupError, match="read 2 failed"):
        await late
    assert first[0].cancelled()
    assert num_reads == 2
    assert (reads.num_running, reads.num_waiting) == (0, 0)
    reads.shutdown()


class _FakeTime:
    """A clock that moves only when a paced reader sleeps, so waits are exact."""

    def __init__(self) -> None:
        self.now_s = 100.0
        self.slept_s: list[float] = []

    def clock(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.slept_s.append(seconds)
        self.now_s += seconds


def _pacer(rate: float, busy: list[bool], fake: _FakeTime) -> ReadPacer:
    return ReadPacer(rate, lambda: busy[0], clock=fake.clock, sleep=fake.sleep)


async def test_while_requests_run_one_scope_gets_the_whole_rate_first_come_first_served() -> None:
    fake = _FakeTime()
    pacer = _pacer(1000.0, [True], fake)
    await pacer.take("acme", 100)  # the first items go at once
    assert fake.now_s == 100.0
    await pacer.take("acme", 100)  # then 100 items at 1,000 a second: 0.1 s after the first
    assert fake.now_s == pytest.approx(100.1)
    await pacer.take("acme", 50)
    assert fake.now_s == pytest.approx(100.2)
    assert pacer.num_paced_s == pytest.approx(0.2)


async def test_two_scopes_reading_share_the_rate_evenly() -> None:
    fake = _FakeTime()
    pacer = _pacer(1000.0, [True], fake)
    await pacer.take("acme", 100)  # charged at 1,000 a second: acme read alone
    await pacer.take("blue", 100)  # blue's first items go at once too
    assert fake.now_s == 100.0
    await pacer.take("acme", 100)  # after acme's first 100 (0.1 s), charged at its half: 500 a second
    assert fake.now_s == pytest.approx(100.1)
    await pacer.take("acme", 1)  # so the next go 100 / 500 = 0.2 s later
    assert fake.now_s == pytest.approx(100.3)


async def test_a_scope_silent_past_the_window_no_longer_takes_a_share() -> None:
    fake = _FakeTime()
    pacer = _pacer(1000.0, [True], fake)
    await pacer.take("blue", 10)
    fake.now_s += 2.0  # blue has not read for 2 s, past the 1 s window
    await pacer.take("acme", 100)
    await pacer.take("acme", 100)
    assert fake.now_s == pytest.approx(102.1)  # acme alone: the whole 1,000 a second


async def test_nothing_is_paced_while_the_engine_is_idle_or_without_a_limit() -> None:
    fake = _FakeTime()
    busy = [False]
    idle = _pacer(1000.0, busy, fake)
    unlimited = _pacer(0.0, [True], fake)
    for _ in range(5):
        await idle.take("acme", 10_000)
        await unlimited.take("acme", 10_000)
    assert fake.slept_s == []


async def test_a_paced_reader_goes_on_as_soon_as_the_engine_goes_idle() -> None:
    fake = _FakeTime()
    busy = [True]
    pacer = _pacer(100.0, busy, fake)
    await pacer.take("acme", 1000)
    slept: list[float] = []

    async def sleep_then_idle(seconds: float) -> None:
        slept.append(seconds)
        fake.now_s += seconds
        busy[0] = False  # the last request ended during the first wait

    pacer._sleep = sleep_then_idle
    await pacer.take("acme", 1000)  # would wait 10 s at 100 a second
    assert slept == [pytest.approx(0.05)]  # one look (MAX_PACE_SLEEP_S), then on at once


def test_a_negative_rate_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="max_read_items_per_s must be >= 0"):
        ReadPacer(-1.0, lambda: True)
