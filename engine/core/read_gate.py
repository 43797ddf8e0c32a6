"""LoopShare and ReadGate: while requests run, the read paths send only in the event loop's spare time.

The read paths (Resume, WatchEvents and SubscribeKvEvents catch-up) read on threads of their
own (``log_reads.LogReads``), but what they read goes out on the event loop: one gRPC message
per stored event or journaled output, each sent by grpcio's per-message code under the GIL
(about 0.1-0.2 ms of one core per message on a 2-core machine). A hundred subscribers catching
up on a few hundred events each is some 20,000 sends: the loop then runs flat out, holds the
GIL most of the time, and the engine thread, which needs the GIL between its kernels, makes
tokens at half its idle rate (issue 31, ``bench/read_paths.py``).

So, while requests run, a read path sends its next batch (64 stored events, or one journaled
output) only when its turn at the ``ReadGate`` comes, and the gate hands turns out only while
the loop thread's CPU time over the last ``window_s`` seconds is under ``max_loop_share`` of
one core (``LoopShare``); with more, a turn waits until the share comes down, but never more
than ``max_wait_s``, so readers keep moving (slowly) when generation alone keeps the loop that
busy. Turns go round robin by request-id scope (tenant), oldest first within one, as the
reader threads do. With nothing running, turns are not taken: reads go at full speed. Live
tokens and live events never wait here; a Generate stream's own sends count in the share.

The cost is the readers' time: while a stream runs, a crowd of catch-ups takes several times
longer than on an idle server (figures in docs/engine.md).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable

DEFAULT_WINDOW_S = 0.1  # LoopShare's window: long enough to hold a few turns, short enough to follow a burst
DEFAULT_MAX_WAIT_S = 0.05  # the longest one turn waits: the readers' floor is 1 / this turns a second


class LoopShare:
    """The CPU time of the thread that calls it, as a share of one core over the last ``window_s`` seconds.

    Call from one thread only (the event loop's): ``cpu`` is that thread's clock
    (``time.thread_time``, seconds of CPU), ``wall`` a monotonic clock (seconds).
    Invariant: ``_samples`` holds (wall, cpu) pairs, oldest first, the first being the newest
    one taken at least ``window_s`` before the last (when there is one).
    """

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        *,
        wall: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._wall = wall
        self._cpu = cpu
        self._samples: collections.deque[tuple[float, float]] = collections.deque()

    def excess_s(self, max_share: float) -> float:
        """Takes a sample; returns the seconds the thread must stay idle for its share since the
        window's start to come down to ``max_share`` (in (0, 1]): 0.0 when it is there already,
        or when less than half a window has been sampled."""
        now_wall, now_cpu = self._wall(), self._cpu()
        samples = self._samples
        samples.append((now_wall, now_cpu))
        while len(samples) > 1 and samples[1][0] <= now_wall - self.window_s:
            samples.popleft()
        first_wall, first_cpu = samples[0]
        span_s = now_wall - first_wall
        if span_s < self.window_s / 2:
            return 0.0
        return max(0.0, (now_cpu - first_cpu) / max_share - span_s)


class ReadGate:
    """Turns for the read paths' sends, one caller at a time, while ``busy()`` holds.

    A turn goes once ``loop_share`` says the loop is under ``max_loop_share`` of a core, or
    once it has waited ``max_wait_s`` (the floor); ``max_loop_share`` 0 (or 1 and above) takes
    no turns at all. Invariant (event loop only): ``_held`` is True while a caller holds the
    gate; every waiting caller's future is in ``_waiting`` under its scope, the scopes in
    round-robin order (next first); a caller handed the gate as it was cancelled passes it on.

    busy: whether the engine has requests running (read at each turn).
    """

    def __init__(
        self,
        max_loop_share: float,
        busy: Callable[[], bool],
        *,
        loop_share: LoopShare | None = None,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not max_loop_share >= 0:
            raise ValueError(f"max_read_loop_share must be >= 0 (0: off), got {max_loop_share}")
        self.max_loop_share = max_loop_share
        self._busy = busy
        self._loop_share = loop_share if loop_share is not None else LoopShare()
        self._max_wait_s = max_wait_s
        self._sleep = sleep
        self._held = False
        self._waiting: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]] = collections.OrderedDict()
        self.num_turns = 0  # turns taken (figures for the benchmark and tests)
        self.num_waited_s = 0.0  # seconds turns waited for the loop's share, in all

    @property
    def enabled(self) -> bool:
        return 0 < self.max_loop_share < 1

    async def turn(self, scope: str) -> None:
        """Waits for ``scope``'s turn and for the loop's share (event loop only); returns at once
        while nothing runs or the gate is off."""
        if not self.enabled or not self._busy():
            return
        if self._held or self._waiting:
            await self._wait_in_line(scope)
        else:
            self._held = True
        try:
            self.num_turns += 1
            waited_s = 0.0
            while waited_s < self._max_wait_s and self._busy():
                excess_s = self._loop_share.excess_s(self.max_loop_share)
                if excess_s <= 0:
                    break
                pause_s = min(excess_s, self._max_wait_s - waited_s)
                await self._sleep(pause_s)
                waited_s += pause_s
            self.num_waited_s += waited_s
        finally:
            self._pass_on()

    async def _wait_in_line(self, scope: str) -> None:
        await wait_for_turn(self._waiting, scope, self._pass_on)

    def _pass_on(self) -> None:
        """The holder is done: the gate goes to the oldest caller of the next scope in turn."""
        while self._waiting:
            turn = pop_turn(self._waiting, next(iter(self._waiting)))
            if not turn.done():
                turn.set_result(None)
                return  # _held stays True: the gate is that caller's now
        self._held = False


async def wait_for_turn(
    waiting: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]],
    scope: str,
    pass_on: Callable[[], None],
) -> None:
    """Queues a turn under ``scope`` in ``waiting`` (scopes in round-robin order, each oldest first)
    and returns once someone hands it over (sets its result). A caller cancelled in line leaves it;
    one cancelled as it was handed the turn calls ``pass_on()`` so that the next in line gets it."""
    turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting.setdefault(scope, collections.deque()).append(turn)
    try:
        await turn
    except BaseException:
        if turn.done() and not turn.cancelled():
            pass_on()
        else:
            queue = waiting.get(scope)
            if queue is not None and turn in queue:
                queue.remove(turn)
                if not queue:
                    del waiting[scope]
        raise


def pop_turn(
    waiting: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]], scope: str
) -> asyncio.Future[None]:
    """Takes ``scope``'s oldest turn out of ``waiting`` and moves the scope to the back of the
    round robin (or drops it when it has no turn left)."""
    queue = waiting[scope]
    turn = queue.popleft()
    if queue:
        waiting.move_to_end(scope)
    else:
        del waiting[scope]
    return turn
