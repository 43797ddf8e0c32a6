"""DurabilityGate: a step's outputs reach their streams only once the log has made their journal records durable.

With the request journal kept (and ``stream_before_durable`` off), a client
never sees a token that a crash could take back: each step's outputs wait,
in step order, until the log's durable journal seq reaches the step's last
journal seq (its watermark). The log's writer thread says when it committed
(``on_durable``); the release itself runs on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from nanoserve.engine.core.engine_inbox import call_soon
from nanoserve.engine.core.outputs import RequestOutput

if TYPE_CHECKING:
    from nanoserve.allocator.log import EventLog

# a step's refusals: (serial, the error its stream gets)
Failures = list[tuple[int, BaseException]]


class DurabilityGate:
    """Holds each step's outputs until their journal batch is durable, then dispatches them in step order.

    Invariant: ``_held`` is in step order and every held watermark is above
    the durable journal seq seen at the last release; a step is dispatched
    only after every step before it.

    dispatch: called on the event loop with a step's outputs and refusals.
    log: the engine's event log, read for its ``durable_journal_seq`` (None: nothing is durable).
    """

    def __init__(
        self, dispatch: Callable[[list[RequestOutput], Failures], None], log: Callable[[], EventLog | None]
    ) -> None:
        self._dispatch = dispatch
        self._log = log
        self._loop: asyncio.AbstractEventLoop | None = None
        # (journal seq that must be durable, outputs, refusals, time.monotonic() at the step's end), in step order
        self._held: deque[tuple[int, list[RequestOutput], Failures, float]] = deque()
        # called with the seconds each step's outputs waited for durability (the server's histogram)
        self.observe_wait: Callable[[float], None] | None = None

    def attach(self, loop: asyncio.AbstractEventLoop, log: EventLog) -> None:
        """Listens to ``log``'s commits; releases run on ``loop``."""
        self._loop = loop
        log.add_durable_listener(self.on_durable)

    def submit(
        self, watermark: int | None, outputs: list[RequestOutput], failures: Failures, made_s: float = 0.0
    ) -> None:
        """Dispatches a step's outputs once the journal records that hold them are durable
        (``watermark``: the step's last journal seq; None: at once). ``made_s``: the step's end
        (time.monotonic()), for ``observe_wait``. Event loop only."""
        if watermark is None:
            self._dispatch(outputs, failures)
            return
        self._held.append((watermark, outputs, failures, made_s))
        self.release()

    def on_durable(self) -> None:
        """The writer committed (writer thread): wake the loop only when outputs wait. Skipping is
        safe: a step held after this check is checked against the then durable seq when it arrives."""
        if self._held:
            call_soon(self._loop, self.release)

    def release(self) -> None:
        """Dispatches held steps, in order, up to the log's durable journal seq."""
        log = self._log()
        durable = log.durable_journal_seq if log is not None else 0
        held = self._held
        observe = self.observe_wait
        while held and held[0][0] <= durable:
            _, outputs, failures, made_s = held.popleft()
            self._dispatch(outputs, failures)
            if observe is not None and outputs:
                observe(time.monotonic() - made_s)

    def release_all(self, outputs: list[RequestOutput]) -> None:
        """The engine stopped: every held step goes out (the log reports what it could not take),
        then ``outputs``, the final outputs of the shutdown's aborts."""
        while self._held:
            _, held_outputs, failures, _ = self._held.popleft()
            self._dispatch(held_outputs, failures)
        self._dispatch(outputs, [])

    def drop(self) -> None:
        """The engine failed: what is held is never dispatched (its streams end otherwise)."""
        self._held.clear()
