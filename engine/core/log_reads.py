"""LogReads: the threads that read the log and the journal for clients, a bounded number at a time;
ReadPacer: how fast what they read goes out while the engine generates.

Resume and WatchEvents catch-up read the store and decode what they read.
That work grows with the length of requests and epochs and with the number of
callers; run on the event loop, or on as many threads as there are callers, it
takes the loop and the GIL from the engine thread and generation slows down.
Here it runs on ``num_threads`` threads of its own: a caller beyond them waits
its turn (it is never refused), and the engine thread competes with at most
``num_threads`` readers for the GIL, whatever the number of callers.

Reading is half the cost: turning what was read into messages and sending them runs
on the event loop, under the same GIL, and a crowd of readers catching up at once
took most of it from a running stream. ``ReadPacer`` spreads that work out while
requests run: the read paths hand out at most ``max_items_per_s`` items a second
(a Resume's journaled tokens, a catch-up's stored events), shared evenly by the
request-id scopes (tenants) reading at the moment, first come first served within
one; with nothing running, reads go at full speed. Live tokens and live events are
never paced: they come at the engine's own rate.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

from nanoserve.engine.core.read_gate import ReadGate, pop_turn, wait_for_turn

T = TypeVar("T")

MAX_PACE_SLEEP_S = 0.05  # a paced reader looks again this often whether the engine went idle


class LogReads:
    """A pool of ``num_threads`` reader threads (``max_concurrent_log_reads``), taken in turns by scope.

    Invariant: at most ``num_threads`` reads run at once, and at most ``max_per_scope``
    (``max_tenant_log_reads``) of one request-id scope (tenant), so another tenant's read
    finds a thread at once while one tenant has a crowd; ``num_waiting`` counts the calls
    queued behind them (event loop only). A freed thread goes to the next scope in turn that
    has a call waiting and is under its bound, round robin, and within a scope to its oldest
    call: a tenant with a crowd of readers waits behind itself, not in front of another's one.
    ``run_shared`` makes the calls of one scope that ask for the same read before it starts one read.
    """

    def __init__(self, num_threads: int, max_per_scope: int | None = None) -> None:
        if num_threads < 1:
            raise ValueError(f"max_concurrent_log_reads must be >= 1, got {num_threads}")
        if max_per_scope is not None and max_per_scope < 1:
            raise ValueError(f"max_tenant_log_reads must be >= 1, got {max_per_scope}")
        self.num_threads = num_threads
        self.max_per_scope = num_threads if max_per_scope is None else min(max_per_scope, num_threads)
        self.num_running = 0  # reads holding a thread now
        self.num_waiting = 0  # reads queued for a thread
        self._running: dict[str, int] = {}  # scope -> its reads holding a thread now (> 0)
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="nanoserve-log-read")
        # scope -> its waiting calls' turns, oldest first; scopes in round-robin order, next first
        self._waiting: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]] = collections.OrderedDict()
        # (scope, key) -> its shared read that has not taken a thread yet (run_shared)
        self._unstarted: dict[tuple[str, Hashable], asyncio.Task[Any]] = {}

    async def run(self, read: Callable[..., T], *args: object, scope: str = "") -> T:
        """``read(*args)`` on a reader thread once ``scope``'s turn comes (blocking reads: a query, its
        decoding)."""
        return await self._run(read, args, scope, None)

    async def run_shared(self, key: Hashable, read: Callable[..., T], *args: object, scope: str = "") -> T:
        """``run(read, *args, scope=scope)``, one read for the calls of ``scope`` that ask with the same ``key``
        before it starts: each gets its result (the same object: do not change it) or its error.

        A call never joins a read that has started: what the read returns was in the store by the time
        the read started, so it holds everything stored before each of its callers asked (a catch-up
        that subscribed to live events first misses nothing). The read runs to its end even if its
        callers are cancelled.
        """
        shared = (scope, key)
        task = self._unstarted.get(shared)
        if task is None:
            task = asyncio.ensure_future(self._run(read, args, scope, lambda: self._forget_unstarted(shared, task)))
            task.add_done_callback(functools.partial(self._shared_read_done, shared))
            self._unstarted[shared] = task
        return await asyncio.shield(task)

    def _forget_unstarted(self, shared: tuple[str, Hashable], task: asyncio.Task[Any] | None) -> None:
        if task is not None and self._unstarted.get(shared) is task:
            del self._unstarted[shared]

    def _shared_read_done(self, shared: tuple[str, Hashable], task: asyncio.Task[Any]) -> None:
        self._forget_unstarted(shared, task)  # it ended before its turn came (cancelled by shutdown)
        if not task.cancelled():
            task.exception()  # its callers got the error; with none left, asyncio need not log it

    async def _run(
        self, read: Callable[..., T], args: tuple[object, ...], scope: str, on_start: Callable[[], None] | None
    ) -> T:
        """``read(*args)`` on a thread in ``scope``'s turn; ``on_start()`` on the loop as it takes the thread."""
        if self.num_running < self.num_threads and self._under_bound(scope) and self._next_scope() is None:
            self._take(scope)
        else:
            await self._wait_turn(scope)
        try:
            if on_start is not None:
                on_start()
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(read, *args))
        finally:
            self._release(scope)

    def num_running_of(self, scope: str) -> int:
        """The reads of ``scope`` holding a thread now."""
        return self._running.get(scope, 0)

    async def _wait_turn(self, scope: str) -> None:
        """Queues the call under ``scope`` until a finishing read hands it its thread."""
        self.num_waiting += 1
        try:
            # handed the thread as it was cancelled: pass it on
            await wait_for_turn(self._waiting, scope, lambda: self._release(scope))
        finally:
            self.num_waiting -= 1

    def _under_bound(self, scope: str) -> bool:
        return self._running.get(scope, 0) < self.max_per_scope

    def _next_scope(self) -> str | None:
        """The first scope in turn with a call waiting that may take a thread."""
        return next((scope for scope in self._waiting if self._under_bound(scope)), None)

    def _take(self, scope: str) -> None:
        self.num_running += 1
        self._running[scope] = self._running.get(scope, 0) + 1

    def _release(self, scope: str) -> None:
        """A read of ``scope`` ended: the free threads go to the scopes in turn that wait."""
        self.num_running -= 1
        self._running[scope] -= 1
        if not self._running[scope]:
            del self._running[scope]
        while self.num_running < self.num_threads and (next_scope := self._next_scope()) is not None:
            turn = pop_turn(self._waiting, next_scope)
            if not turn.done():
                self._take(next_scope)
                turn.set_result(None)

    def shutdown(self) -> None:
        """Stops taking reads; the ones running finish on their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class ReadPacer:
    """A token bucket over the items the read paths send, per request-id scope, while ``busy()``.

    Invariant: while ``busy()`` holds, the scopes that took items in the last ``window_s``
    seconds each get ``max_items_per_s`` divided by their number; a scope's callers wait in
    the order they asked. ``max_items_per_s`` 0 paces nothing.

    busy: whether the engine has requests running (the event loop's view, read on each call).
    gate: after the items, each call takes a turn there (None: no gate).
    """

    def __init__(
        self,
        max_items_per_s: float,
        busy: Callable[[], bool],
        window_s: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        gate: ReadGate | None = None,
    ) -> None:
        if max_items_per_s < 0:
            raise ValueError(f"max_read_items_per_s must be >= 0 (0: no limit), got {max_items_per_s}")
        self.max_items_per_s = max_items_per_s
        self._busy = busy
        self._window_s = window_s
        self._clock = clock  # seconds; time.monotonic
        self._sleep = sleep
        self._next_s: dict[str, float] = {}  # scope -> when its next items may go (time.monotonic())
        self._last_s: dict[str, float] = {}  # scope -> when it last took items
        self.num_paced_s = 0.0  # seconds readers waited here, in all (a figure for the benchmark)
        self.gate = gate

    async def take(self, scope: str, num_items: int) -> None:
        """Waits until ``scope`` may send ``num_items`` more items (event loop only), then for its
        turn at ``gate`` (``read_gate.ReadGate``: the loop's spare time). Returns at once while
        nothing runs, and as soon as the engine goes idle during a wait."""
        await self._take_items(scope, num_items)
        if self.gate is not None:
            await self.gate.turn(scope)

    async def _take_items(self, scope: str, num_items: int) -> None:
        if self.max_items_per_s <= 0 or not self._busy():
            return
        now = self._clock()
        self._last_s[scope] = now
        for other in [s for s, last in self._last_s.items() if now - last > self._window_s]:
            del self._last_s[other]
            self._next_s.pop(other, None)
        share = self.max_items_per_s / len(self._last_s)
        start = max(now, self._next_s.get(scope, now))
        self._next_s[scope] = start + num_items / share
        while (wait_s := start - self._clock()) > 0 and self._busy():
            await self._sleep(min(wait_s, MAX_PACE_SLEEP_S))
        self.num_paced_s += max(0.0, self._clock() - now)
