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
    """The waiting queue holds ``max_num_waiting`` requests (-> RESOURCE_EXHAUSTED)."""


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
