"""The event log's errors, and the one place a store's own error becomes one of them.

Every error the log raises on purpose is here, named after what the caller can
do about it:

- ``LogNotFoundError`` (a ValueError): the URL, pool or epoch names no stored log.
- ``LogDamagedError`` (a ValueError): stored data that cannot be read as a record;
  ``LogReadError``, one of them, when the store itself cannot read the rows from a seq on.
- ``EventLogError``: the log cannot record. Its kinds:
  ``SecondWriterError`` (another writer holds the epoch),
  ``LogUnavailableError`` (the store cannot be reached or written now: retry later),
  ``LogFileLostError`` (the SQLite file was deleted or replaced under the writer),
  ``EventLogIncompleteError`` (the epoch ended with events that are not durable).

``store_error(url, exc)`` turns a SQLAlchemy or driver error into a
``LogUnavailableError`` whose message names the store (password hidden) and
the cause in one line, without SQLAlchemy's SQL echo and help link.
"""

from __future__ import annotations

import sqlite3
import sys

import sqlalchemy as sa

__all__ = [
    "EventLogError",
    "EventLogIncompleteError",
    "LogDamagedError",
    "LogFileLostError",
    "LogNotFoundError",
    "LogReadError",
    "LogUnavailableError",
    "SecondWriterError",
    "is_decode_error",
    "is_store_unavailable",
    "safe_url",
    "store_cause",
    "store_error",
]


class LogNotFoundError(ValueError):
    """The URL, pool or epoch names no stored log."""


class LogDamagedError(ValueError):
    """Stored data that cannot be read as a record (damaged file, wrong column type, bad encoding)."""


class LogReadError(LogDamagedError):
    """The store failed to read an epoch's rows from ``seq`` on (a damaged page: ``database disk image is
    malformed``); the rows before it were read."""

    def __init__(self, seq: int, cause: str) -> None:
        self.seq = seq
        self.cause = cause
        super().__init__(f"rows from seq {seq} on could not be read: {cause}")


class EventLogError(RuntimeError):
    """The event log cannot record: the writer failed for good."""


class SecondWriterError(EventLogError):
    """Another writer holds (or took over) this pool epoch."""


class LogUnavailableError(EventLogError):
    """The log's store cannot be reached or written now (down, read-only, full); retrying later may work."""


class LogFileLostError(EventLogError):
    """The SQLite file the writer writes is no longer the file at its path: deleted or replaced.

    Everything the writer committed to it is gone with it.
    """


class EventLogIncompleteError(EventLogError):
    """The epoch ended without every event durable: seqs ``first_seq..last_seq`` are not in the store.

    ``num_events`` of them; ``reason`` says why (the store's last error, a
    timeout, a lost file). The epoch has no POOL_CLOSE: the next start and
    ``nanoserve log epochs`` see it as open (crashed).
    """

    def __init__(self, url: str, first_seq: int, last_seq: int, reason: str) -> None:
        self.url = url
        self.first_seq = first_seq
        self.last_seq = last_seq
        self.reason = reason
        count = f"{self.num_events} event{'' if self.num_events == 1 else 's'}"
        super().__init__(
            f"event log {safe_url(url)} is incomplete: {count} ({self.seq_range}) not written: {reason}; "
            "the epoch stays open"
        )

    @property
    def num_events(self) -> int:
        return max(0, self.last_seq - self.first_seq + 1)

    @property
    def seq_range(self) -> str:
        if self.num_events == 0:
            return "(none)"
        return f"seq {self.first_seq}" if self.num_events == 1 else f"seqs {self.first_seq}..{self.last_seq}"


def safe_url(url: str) -> str:
    """``url`` with its password hidden, for messages and logs."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


def store_cause(exc: BaseException) -> str:
    """One line naming a store error: the driver's message, without SQLAlchemy's SQL echo."""
    orig = getattr(exc, "orig", None)
    cause = orig if isinstance(orig, BaseException) else exc
    lines = str(cause).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


def store_error(url: str, exc: BaseException) -> LogUnavailableError:
    """A ``LogUnavailableError`` naming the store at ``url`` and the cause of ``exc``."""
    error = LogUnavailableError(f"event log store {safe_url(url)} is unavailable: {store_cause(exc)}")
    error.__cause__ = exc
    return error


def is_store_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store cannot be reached or written now (not that our SQL or data is wrong).

    SQLAlchemy's OperationalError and InterfaceError, and the drivers' own:
    connection refused or lost, server shutting down, database locked,
    read-only, disk full, file cannot be opened.
    """
    if is_decode_error(exc):  # SQLite reports text it cannot decode as an OperationalError
        return False
    if isinstance(exc, (sa.exc.OperationalError, sa.exc.InterfaceError)):
        return True
    if isinstance(exc, sa.exc.DBAPIError):
        return bool(exc.connection_invalidated)
    return isinstance(exc, _driver_unavailable_types())


def is_decode_error(exc: BaseException) -> bool:
    """SQLite's error for a TEXT value that is not valid UTF-8 (a damaged record, not a store fault)."""
    orig = getattr(exc, "orig", None)
    return "could not decode to utf-8" in str(orig if orig is not None else exc).lower()


def _driver_unavailable_types() -> tuple[type[BaseException], ...]:
    """The drivers' own OperationalError and InterfaceError (raised where SQLAlchemy does not wrap them)."""
    types: list[type[BaseException]] = [sqlite3.OperationalError, sqlite3.InterfaceError]
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None:
        types += [psycopg.OperationalError, psycopg.InterfaceError]
    return tuple(types)
