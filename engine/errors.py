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
