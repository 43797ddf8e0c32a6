"""The event log's errors, and the one place a store's own error becomes one of them.

Every error the log raises on purpose is here, named after what the caller can
do about it:

- ``LogNotFoundError`` (a ValueError): the URL, pool or epoch names no stored log.
- ``LogDamagedError`` (a ValueError): stored data that cannot be read as a record;
  ``LogReadError``, one of them, when the store itself cannot read the rows from a seq on.
- ``EventLogError``: the log cannot record. Its kinds:
  ``SecondWriterError`` (another writer holds the epoch),
  ``PoolLockLostError`` (the pool's lock died with its database session and another server took it),
  ``LogUnavailableError`` (the store cannot be reached or written now: retry later),
  ``LogFileLostError`` (the SQLite file was deleted or replaced under the writer),
  ``LogRefusedError`` (the store refused a batch as data: retrying cannot help),
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
    "LogRefusedError",
    "LogUnavailableError",
    "PoolLockLostError",
    "SecondWriterError",
    "is_decode_error",
    "is_refused_as_data",
    "is_store_unavailable",
    "redact_urls",
    "safe_url",
    "store_cause",
    "store_error",
]


class LogNotFoundError(ValueError):
    """The URL, pool or epoch names no stored log."""


class LogFileMissingError(LogNotFoundError):
    """A SQLite log URL names a file that does not exist (a reader never creates one)."""


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


class PoolLockLostError(EventLogError):
    """The pool's lock went with its database session (PostgreSQL restarted, the connection was cut) and
    another server took it before this writer could take it again: this writer stops writing for good.

    ``durable_seq``: the last seq this writer committed; nothing after it is written (the pool is the
    other server's now).
    """

    def __init__(self, pool_id: str, epoch: int, durable_seq: int, lock: str) -> None:
        self.pool_id = pool_id
        self.epoch = epoch
        self.durable_seq = durable_seq
        super().__init__(
            f"pool {pool_id!r} lost its lock ({lock}) when its database session ended, and another server "
            f"took it: this server stops writing pool {pool_id!r} epoch {epoch} at seq {durable_seq}. "
            "Stop one of the two servers (or give each its own --pool-id / NANOSERVE_POOL_ID), then restart "
            "this one"
        )


class LogUnavailableError(EventLogError):
    """The log's store cannot be reached or written now (down, read-only, full); retrying later may work."""


class LogFileLostError(EventLogError):
    """The SQLite file the writer writes is no longer the file at its path: deleted or replaced.

    Everything the writer committed to it is gone with it.
    """


class LogRefusedError(EventLogError):
    """The store refused the batch of seqs ``first_seq..last_seq`` as data (a value it cannot hold, a
    constraint it breaks): the same batch would be refused again, so it is not retried.

    Nothing of the batch was written (its transaction rolled back): the epoch is
    consistent up to ``first_seq - 1`` and stays open. ``cause`` is the store's error, one line.
    """

    def __init__(self, pool_id: str, epoch: int, first_seq: int, last_seq: int, cause: str) -> None:
        self.first_seq = first_seq
        self.last_seq = last_seq
        self.cause = cause
        super().__init__(
            f"the store refused pool {pool_id!r} epoch {epoch} seqs {first_seq}..{last_seq} as data ({cause}); "
            f"not retried: no later event is recorded, the epoch stays open at seq {first_seq - 1}"
        )


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

    def log_fields(self) -> dict[str, object]:
        """The error as a log line's fields: the url (no password), num_events, first_seq, last_seq, reason."""
        return {
            "url": safe_url(self.url),
            "num_events": self.num_events,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "reason": self.reason,
        }

    @property
    def seq_range(self) -> str:
        if self.num_events == 0:
            return "(none)"
        return f"seq {self.first_seq}" if self.num_events == 1 else f"seqs {self.first_seq}..{self.last_seq}"


def safe_url(url: str) -> str:
    """``url`` with its password hidden (``***``), for messages and logs: the one redaction of store URLs.

    A URL without a password comes back unchanged; one SQLAlchemy cannot parse
    loses what lies between the user's ``:`` and the last ``@``.
    """
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError:
        pass
    else:  # a URL without a password is shown as given (SQLAlchemy would escape its ':')
        return url if parsed.password is None else parsed.render_as_string(hide_password=True)
    if "://" not in url or "@" not in url.split("://", 1)[1]:
        return url
    scheme, rest = url.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    user, has_password, _ = credentials.partition(":")
    return f"{scheme}://{user}:***@{host}" if has_password else url


def redact_urls(value: object) -> object:
    """``value`` (JSON-like: dicts, lists, scalars) with every string that holds ``://`` passed through
    ``safe_url``: what a record may store of a configuration without its secrets."""
    if isinstance(value, str):
        return safe_url(value) if "://" in value else value
    if isinstance(value, dict):
        return {key: redact_urls(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_urls(item) for item in value]
    return value


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


def is_refused_as_data(exc: BaseException) -> bool:
    """Whether ``exc`` says the store refused what was sent (a retry sends the same and is refused again).

    SQLAlchemy's or a driver's DataError (PostgreSQL: a NUL in text, a value too
    long, an encoding it cannot hold) or IntegrityError (a constraint or trigger
    refused the row: the caller first rules out its own lost acknowledgement),
    a str the driver cannot encode, SQLite's text it cannot decode. A store that
    is away is never this: anything not named here is retried.
    """
    if is_decode_error(exc):
        return True
    if is_store_unavailable(exc):
        return False
    orig = getattr(exc, "orig", None)
    for error in (exc, orig):
        if isinstance(error, UnicodeError):
            return True
        if error is not None and any(cls.__name__ in ("DataError", "IntegrityError") for cls in type(error).__mro__):
            return True
    return False


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


def is_integrity_error(exc: BaseException) -> bool:
    """A unique key met: SQLAlchemy's IntegrityError, or the driver's (rows inserted through its cursor)."""
    return any(cls.__name__ == "IntegrityError" for cls in type(exc).__mro__)
