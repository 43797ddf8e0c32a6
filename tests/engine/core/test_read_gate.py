"""ReadGate and LoopShare: while requests run, the read paths send in the event loop's spare time."""

from __future__ import annotations

import asyncio

import pytest

from nanoserve.engine.core.log_reads import ReadPacer
from nanoserve.engine.core.read_gate import LoopShare, ReadGate


class _Clocks:
    def __init__(self) -> None:
        self.wall_s = 50.0
        self.cpu_s = 3.0

    def at(self, wall_s: float, cpu_s: float) -> None:
        self.wall_s, self.cpu_s = 50.0 + wall_s, 3.0 + cpu_s


def _share(clocks: _Clocks) -> LoopShare:
    return LoopShare(0.1, wall=lambda: clocks.wall_s, cpu=lambda: clocks.cpu_s)


def test_loop_share_says_how_long_the_loop_must_idle_to_come_down_to_the_share() -> None:
    clocks = _Clocks()
    share = _share(clocks)
    assert share.excess_s(0.25) == 0.0  # one sample: nothing to judge yet
    clocks.at(0.04, 0.04)
    assert share.excess_s(0.25) == 0.0  # less than half the window sampled
    clocks.at(0.1, 0.05)  # 50 ms of CPU in 100 ms: half a core
    assert share.excess_s(0.25) == pytest.approx(0.1)  # 0.05 s / 0.25 = 0.2 s of window: 0.1 s more
    assert share.excess_s(0.5) == 0.0


def test_loop_share_forgets_what_is_older_than_its_window() -> None:
    clocks = _Clocks()
    share = _share(clocks)
    share.excess_s(0.25)
    clocks.at(0.05, 0.05)  # the loop was flat out for 50 ms ...
    share.excess_s(0.25)
    clocks.at(0.2, 0.05)  # ... then idle for 150 ms
    assert share.excess_s(0.25) == 0.0  # measured from 0.05 (the newest sample a window back): idle
    clocks.at(0.31, 0.13)  # then 80 ms of CPU in the last 110 ms
    assert share.excess_s(0.25) == pytest.approx(0.08 / 0.25 - 0.11)  # from the sample at 0.2, not 0.05


class _Excess:
    """A LoopShare stand-in: hands out the excess values given, then 0."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)
        self.shares: list[float] = []

    def excess_s(self, max_share: float) -> float:
        self.shares.append(max_share)
        return self.values.pop(0) if self.values else 0.0


def _gate(excess: _Excess, busy: list[bool], slept: list[float], **kwargs: float) -> ReadGate:
    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    return ReadGate(0.25, lambda: busy[0], loop_share=excess, sleep=sleep, **kwargs)  # type: ignore[arg-type]


async def test_a_turn_waits_until_the_loop_is_under_its_share() -> None:
    excess, slept = _Excess(0.02, 0.01), []
    gate = _gate(excess, [True], slept)
    await gate.turn("acme")
    assert slept == [0.02, 0.01]
    assert excess.shares == [0.25, 0.25, 0.25]
    assert gate.num_turns == 1
    assert gate.num_waited_s == pytest.approx(0.03)


async def test_a_turn_waits_no_longer_than_max_wait_so_readers_keep_moving() -> None:
    excess, slept = _Excess(*[1.0] * 10), []
    gate = _gate(excess, [True], slept, max_wait_s=0.05)
    await gate.turn("acme")  # the loop stays over its share (generation alone keeps it busy)
    assert slept == [0.05]
    await gate.turn("acme")
    assert slept == [0.05, 0.05]


async def test_no_turn_is_taken_while_nothing_runs_or_with_the_gate_off() -> None:
    excess, slept = _Excess(*[1.0] * 10), []
    idle = _gate(excess, [False], slept)
    off = ReadGate(0.0, lambda: True, loop_share=excess)  # type: ignore[arg-type]
    for _ in range(3):
        await idle.turn("acme")
        await off.turn("acme")
    assert slept == []
    assert excess.shares == []
    assert idle.num_turns == off.num_turns == 0
    with pytest.raises(ValueError, match="max_read_loop_share must be >= 0"):
        ReadGate(-0.1, lambda: True)


async def test_a_waiting_turn_goes_on_as_soon_as_the_engine_goes_idle() -> None:
    busy = [True]
    slept: list[float] = []

    async def sleep_then_idle(seconds: float) -> None:
        slept.append(seconds)
        busy[0] = False

    gate = ReadGate(0.25, lambda: busy[0], loop_share=_Excess(*[1.0] * 10), sleep=sleep_then_idle)  # type: ignore[arg-type]
    await gate.turn("acme")
    assert slept == [0.05]  # one wait, then on without another look


async def test_turns_go_round_robin_by_scope_oldest_first_within_one() -> None:
    held = asyncio.Event()
    release = asyncio.Event()
    order: list[str] = []

    async def sleep(seconds: float) -> None:
        if not held.is_set():
            held.set()
            await release.wait()  # the first turn holds the gate until released

    gate = ReadGate(0.25, lambda: True, loop_share=_Excess(0.01), sleep=sleep)  # type: ignore[arg-type]

    async def reader(name: str) -> None:
        await gate.turn(name.split("-")[0])
        order.append(name)

    first = asyncio.create_task(reader("acme-1"))
    await held.wait()
    tasks = [asyncio.create_task(reader(name)) for name in ("acme-2", "acme-3", "acme-4", "blue-1", "blue-2")]
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, *tasks)
    assert order == ["acme-1", "acme-2", "blue-1", "acme-3", "blue-2", "acme-4"]
    assert gate.num_turns == 6
    assert not gate._held
    assert not gate._waiting


async def test_a_cancelled_reader_loses_nothing_for_the_others() -> None:
    held = asyncio.Event()
    release = asyncio.Event()

    async def sleep(seconds: float) -> None:
        held.set()
        await release.wait()

    gate = ReadGate(0.25, lambda: True, loop_share=_Excess(0.01), sleep=sleep)  # type: ignore[arg-type]
    holder = asyncio.create_task(gate.turn("acme"))
    await held.wait()
    waiting = asyncio.create_task(gate.turn("blue"))
    last = asyncio.create_task(gate.turn("cyan"))
    await asyncio.sleep(0)
    waiting.cancel()  # a client that hung up while in line
    holder.cancel()  # and one that hung up holding the gate
    await asyncio.gather(holder, waiting, return_exceptions=True)
    await asyncio.wait_for(last, 1.0)  # the gate went on to the next in line
    assert not gate._held
    assert not gate._waiting


async def test_the_read_pacer_takes_a_turn_at_its_gate_for_each_batch() -> None:
    excess, slept = _Excess(0.02), []
    gate = _gate(excess, [True], slept)
    pacer = ReadPacer(0.0, lambda: True, gate=gate)
    await pacer.take("acme", 64)
    await pacer.take("acme", 64)
    assert gate.num_turns == 2
    assert slept == [0.02]
