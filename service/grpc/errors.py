"""Errors the service itself raises; ``interceptors.STATUS_BY_ERROR`` maps them."""

from __future__ import annotations


class EventLogDisabledError(RuntimeError):
    """The server keeps no event log, so there are no events to watch or audit (-> FAILED_PRECONDITION)."""


class UnimplementedError(RuntimeError):
    """An RPC of a contract nanoserve speaks that it does not serve (-> UNIMPLEMENTED); the
    message says what is missing."""


class KvEventsUnavailableError(RuntimeError):
    """The log cannot say what the prefix cache holds in a gateway's terms (a REGISTER logged
    without token ids) (-> FAILED_PRECONDITION)."""


class SeqOutOfRangeError(RuntimeError):
    """A WatchEvents ``from_seq`` past the seq the epoch's next event will take: the events in
    between would be skipped without a word (-> OUT_OF_RANGE). The message names both seqs."""
