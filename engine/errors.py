"""Domain errors the engine raises; the service maps each to one gRPC status."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine will never serve as given (-> INVALID_ARGUMENT).

    ``field`` names the offending input (``max_tokens``, ``prompt``, ...); the
    message names the limit.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFullError(RuntimeError):
    """Running + waiting requests number ``max_num_seqs + max_num_waiting`` (-> RESOURCE_EXHAUSTED).

    Free running slots count as room: a burst of requests arriving between two
    steps is refused only beyond what the next step can run plus the queue.
    """


class EngineDeadError(RuntimeError):
    """The engine loop has stopped or failed (-> UNAVAILABLE)."""


class RequestNotFoundError(KeyError):
    """No live request has this id (-> NOT_FOUND)."""


class DuplicateRequestError(ValueError):
    """A live request already has this id (-> ALREADY_EXISTS)."""


class PrefixCacheResetRefusedError(RuntimeError):
    """The prefix cache cannot be reset now: blocks are held by requests, or caching is off
    (-> FAILED_PRECONDITION)."""


class EventLogNotDurableError(RuntimeError):
    """The event log cannot make new events durable now (its store is away, read-only, full, or the
    log failed): new requests are refused (-> UNAVAILABLE) until it recovers."""


class EventLogUnusableError(RuntimeError):
    """The event log could not be prepared or opened at start (store down, read-only, full, no
    schema, an unknown schema revision, another writer): the engine does not start.

    ``url`` names the store (password hidden); the message says the cause in one line.
    """

    def __init__(self, url: str, cause: str) -> None:
        super().__init__(f"event log {url} is unusable: {cause}")
        self.url = url
        self.cause = cause


class JournalDisabledError(RuntimeError):
    """The server keeps no request journal (no event log, or the journal turned off): nothing can be
    resumed (-> FAILED_PRECONDITION)."""


class RequestEndedAtRecoveryError(RuntimeError):
    """A Resume reached a request that the restart after a crash ended without running it again (its
    journaled FINISH has an ``abort_detail``): its final output has been sent, and this names why in
    words, which the Finish message cannot carry (-> FAILED_PRECONDITION)."""


class StreamBufferFullError(RuntimeError):
    """A stream's reader fell behind past ``--max-stream-buffer-messages`` or
    ``--max-stream-buffer-bytes``: its request was aborted (cause slow_consumer) and
    its blocks freed (-> RESOURCE_EXHAUSTED). The message names the bound passed."""


class JournalGapError(RuntimeError):
    """A request's journaled history has a hole: a journal row missing or altered, or a released
    delta missing, so its outputs cannot be streamed whole (-> DATA_LOSS)."""

    def __init__(self, request_id: str, where: str) -> None:
        super().__init__(f"request {request_id!r}: its journal is damaged ({where}); its history cannot be resumed")
        self.request_id = request_id
        self.where = where
