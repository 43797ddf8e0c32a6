"""``ResumeMessages``: each engine output a Resume streams, converted and serialized once.

Callers resuming the same finished request get the same output objects from the engine's
cache of decoded journals (``resume_followers``); converting a 256-token output with its
logprobs takes about a millisecond of the event loop, and serializing it a fraction of that,
so a crowd of callers resuming one request (a reconnect storm) would pay both once per caller.
Here the serialized message is kept as long as its output lives, and each caller is handed the
same bytes (``interceptors._passing_bytes`` sends them as they are).
"""

from __future__ import annotations

import weakref

from nanoserve.engine.core.outputs import RequestOutput
from nanoserve.service.grpc import convert


class ResumeMessages:
    """Invariant: ``_messages`` holds the bytes for an output only while that output is alive
    (a finalizer drops them when the output is collected, before its id can be reused). A new
    request taking a finished one's id has new outputs, so its callers never get the old bytes."""

    def __init__(self) -> None:
        # id(output) -> the caller's request id -> the serialized ResumeResponse
        self._messages: dict[int, dict[str, bytes]] = {}

    def message(self, output: RequestOutput, request_id: str) -> bytes:
        """``convert.to_resume_response(output)`` with ``request_id`` (the caller's own id), serialized;
        the same ``bytes`` object for every caller of that output and id."""
        key = id(output)
        by_request_id = self._messages.get(key)
        if by_request_id is None:
            by_request_id = self._messages[key] = {}
            weakref.finalize(output, self._messages.pop, key, None)
        serialized = by_request_id.get(request_id)
        if serialized is None:
            response = convert.to_resume_response(output)
            response.request_id = request_id
            serialized = by_request_id[request_id] = response.SerializeToString()
        return serialized
