"""The messages the event loop sends the engine thread, and the replies' way back.

The inbox is a ``queue.SimpleQueue`` drained by the engine thread before every
step, in the order the messages were sent (``apply_messages``); a reply is an ``asyncio.Future``
resolved on the event loop through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.engine.core.outputs import AbortCause
from nanoserve.engine.core.request import Request
from nanoserve.engine.errors import (
    DuplicateRequestError,
    PrefixCacheResetRefusedError,
    QueueFullError,
    RequestNotFoundError,
)

if TYPE_CHECKING:
    from nanoserve.engine.core.llm_engine import LLMEngine


@dataclass(frozen=True)
class AddRequest:
    request: Request  # processed (tokenized, validated) on the tokenizer thread


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    cause: AbortCause
    serial: int | None  # None: whichever live request has the id (the Abort RPC)
    reply: asyncio.Future[None] | None  # resolved with the verdict (the Abort RPC waits for it)


@dataclass(frozen=True)
class ResetPrefixCache:
    reply: asyncio.Future[int]  # resolved with the blocks reset, or PrefixCacheResetRefusedError


class StopEngine:
    """The engine thread's last message: it ends the engine and returns."""


InboxMessage = AddRequest | AbortRequest | ResetPrefixCache | StopEngine


def call_soon(loop: asyncio.AbstractEventLoop | None, callback: Callable[[], None]) -> None:
    """``callback`` on ``loop`` from another thread; nothing once the loop has closed."""
    if loop is None:
        return
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


def resolve_value(reply: asyncio.Future[int], result: int | BaseException) -> None:
    """Resolves ``reply`` with ``result`` (an error is raised to the waiter) unless it is done."""
    if reply.done():
        return
    if isinstance(result, BaseException):
        reply.set_exception(result)
    else:
        reply.set_result(result)


def resolve(reply: asyncio.Future[None], error: BaseException | None) -> None:
    """Resolves ``reply`` (with ``error`` raised to the waiter when there is one) unless it is done."""
    if reply.done():
        return
    if error is None:
        reply.set_result(None)
    else:
        reply.set_exception(error)


def apply_messages(
    inbox: queue.SimpleQueue[InboxMessage],
    engine: LLMEngine,
    loop: asyncio.AbstractEventLoop,
    failures: list[tuple[int, BaseException]],
) -> bool:
    """Applies the queued messages to ``engine``, in the order they were sent (engine thread only); True
    when asked to stop. An add the engine refuses (duplicate live id, full queue) is appended to
    ``failures`` as (serial, error); replies are resolved on ``loop``."""
    while True:
        try:
            message = inbox.get_nowait()
        except queue.Empty:
            return False
        if isinstance(message, StopEngine):
            return True
        if isinstance(message, AddRequest):
            try:
                engine.add_processed(message.request)
            except (DuplicateRequestError, QueueFullError) as exc:
                failures.append((message.request.serial, exc))
        elif isinstance(message, ResetPrefixCache):
            try:
                num_reset = engine.reset_prefix_cache()
            except PrefixCacheResetRefusedError as exc:
                loop.call_soon_threadsafe(resolve_value, message.reply, exc)
            else:
                loop.call_soon_threadsafe(resolve_value, message.reply, num_reset)
        elif isinstance(message, AbortRequest):
            try:
                engine.abort(message.request_id, message.cause, message.serial)
                verdict: BaseException | None = None
            except RequestNotFoundError as exc:  # ended in the meantime, or never live
                verdict = exc
            if message.reply is not None:
                loop.call_soon_threadsafe(resolve, message.reply, verdict)
