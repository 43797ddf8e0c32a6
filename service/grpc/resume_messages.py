"""``ResumeMessages``: each engine output a Resume streams, converted to its message once.

Callers resuming the same finished request get the same output objects from the engine's
cache of decoded journals (``resume_followers``); converting a 256-token output with its
logprobs takes about a millisecond of the event loop, so a crowd of callers resuming one
request (a reconnect storm) would convert it once per caller. Here the message is kept as
long as its output lives, and each caller gets a copy (copying is done in C, about 30 µs).
"""

from __future__ import annotations

import weakref

from nanoserve.engine.core.outputs import RequestOutput
from nanoserve.service.grpc import convert
from nanoserve.v1 import generation_pb2 as pb


class ResumeMessages:
    """Invariant: ``_messages`` holds a message for an output only while that output is alive
    (a finalizer drops it when the output is collected, before its id can be reused)."""

    def __init__(self) -> None:
        self._messages: dict[int, pb.ResumeResponse] = {}  # id(output) -> its converted message

    def message(self, output: RequestOutput, request_id: str) -> pb.ResumeResponse:
        """``convert.to_resume_response(output)`` with ``request_id`` (the caller's own id), a fresh copy."""
        key = id(output)
        converted = self._messages.get(key)
        if converted is None:
            converted = convert.to_resume_response(output)
            self._messages[key] = converted
            weakref.finalize(output, self._messages.pop, key, None)
        message = pb.ResumeResponse()
        message.CopyFrom(converted)
        message.request_id = request_id
        return message
