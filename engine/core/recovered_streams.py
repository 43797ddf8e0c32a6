"""Streams for the requests crash recovery re-admitted: adopted at start, followed by Resume.

Recovery (``nanoserve.engine.journal.recovery``) re-admits a crashed epoch's
unfinished requests into the engine before it starts; nobody called for them
in this process, so each gets a detached stream that nobody iterates: a
client follows it with Resume, and the server records its ending from its
``finished`` like any other request's. Each still ends at the deadline its
original call journaled.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from nanoserve.engine.core.outputs import AbortCause
from nanoserve.engine.core.request import Request
from nanoserve.engine.core.request_stream import RequestStream, StreamRegistry

if TYPE_CHECKING:
    from nanoserve.engine.core.async_llm_engine import AsyncLLMEngine


def adopt_recovered(
    requests: list[Request], owner: AsyncLLMEngine, registry: StreamRegistry, loop: asyncio.AbstractEventLoop
) -> list[RequestStream]:
    """One detached stream per recovered request (already in the engine), registered as handed over
    in ``registry``, its abort at the journaled deadline scheduled on ``loop``; returns them in
    ``requests``' order. Event loop only."""
    streams = []
    for request in requests:
        stream = RequestStream(request.request_id, request.metrics.arrival_time)
        stream._engine = owner
        stream.request = request
        stream.detached = True
        registry.add(stream)
        registry.hand_over(stream)
        if request.deadline_wall_ns is not None:
            delay_s = max(0.0, (request.deadline_wall_ns - time.time_ns()) / 1e9)
            loop.call_later(delay_s, stream.abort, AbortCause.DEADLINE)
        streams.append(stream)
    return streams
