"""LogReads: the threads that read the log and the journal for clients, a bounded number at a time.

Resume and WatchEvents catch-up read the store and decode what they read.
That work grows with the length of requests and epochs and with the number of
callers; run on the event loop, or on as many threads as there are callers, it
takes the loop and the GIL from the engine thread and generation slows down.
Here it runs on ``num_threads`` threads of its own: a caller beyond them waits
its turn (it is never refused), and the engine thread competes with at most
``num_threads`` readers for the GIL, whatever the number of callers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class LogReads:
    """A pool of ``num_threads`` reader threads (``max_concurrent_log_reads``).

    Invariant: at most ``num_threads`` reads run at once; ``num_waiting``
    counts the calls queued behind them (event loop only).
    """

    def __init__(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError(f"max_concurrent_log_reads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        self.num_running = 0  # reads on a thread now
        self.num_waiting = 0  # reads queued for a thread
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="nanoserve-log-read")
        self._slots = asyncio.Semaphore(num_threads)

    async def run(self, read: Callable[..., T], *args: object) -> T:
        """``read(*args)`` on a reader thread once one is free (blocking reads: a query, its decoding)."""
        self.num_waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.num_waiting -= 1
        self.num_running += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(read, *args))
        finally:
            self.num_running -= 1
            self._slots.release()

    def shutdown(self) -> None:
        """Stops taking reads; the ones running finish on their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
