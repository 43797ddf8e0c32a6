"""``PoolLock``: at most one live writer per pool id in a log, across processes and machines.

Replicas share one log, each under its own pool id; two servers started with the
same ``--pool-id`` would each open an epoch of that pool and interleave them, and
no audit could tell which blocks were whose. ``EventLog.open`` therefore takes
the pool's lock before it picks the new epoch, and holds it until ``close``:

* PostgreSQL: ``pg_try_advisory_lock(key)`` on a connection held open for the
  log's life (a session lock: the server releases it when the session ends, so a
  crashed or killed writer never leaves it behind). ``key`` is the first 8 bytes
  of sha256("nanoserve pool " + pool_id), signed: the lock names the pool, not a
  table row, so a pool that has no epoch yet is locked too.
* SQLite: ``flock(LOCK_EX | LOCK_NB)`` on ``<database>.pool-<pool id>.lock``
  beside the database file (the kernel releases it when the process exits, crash
  included; the empty file stays, harmless). Local file systems only: ``flock``
  over NFS is not a lock. An in-memory database has no other process to exclude.

A second writer gets ``SecondWriterError`` naming the pool id and what to do.
If the PostgreSQL session holding the lock is lost (the database restarted),
the lock goes with it; the writer's own commits fail over the same outage and
the epoch's ``writer_id`` guard still refuses a second writer of that epoch.
"""

from __future__ import annotations

import hashlib
import os
import urllib.parse
from typing import IO

import sqlalchemy as sa

from nanoserve.allocator.log.errors import SecondWriterError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock
    fcntl = None  # type: ignore[assignment]


def advisory_key(pool_id: str) -> int:
    """The pool's PostgreSQL advisory lock key: a signed 64-bit integer from sha256."""
    digest = hashlib.sha256(f"nanoserve pool {pool_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def lock_file_path(database: str, pool_id: str) -> str:
    """``<database>.pool-<pool id, percent-encoded>.lock``: beside the SQLite file, one per pool."""
    return f"{database}.pool-{urllib.parse.quote(pool_id, safe='')}.lock"


class PoolLock:
    """A held pool lock; ``release()`` once (the log's ``close``), idempotent."""

    def __init__(self, pool_id: str, connection: sa.Connection | None, lock_file: IO[bytes] | None) -> None:
        self.pool_id = pool_id
        self._connection = connection  # PostgreSQL: the session that holds the advisory lock
        self._lock_file = lock_file  # SQLite: the open file the flock is on

    @classmethod
    def acquire(cls, engine: sa.Engine, pool_id: str) -> PoolLock:
        """Takes ``pool_id``'s lock in the log behind ``engine`` without waiting.

        Raises SecondWriterError when another live writer holds it, and the
        database's or the file system's errors when the lock cannot be asked for.
        """
        if engine.dialect.name == "postgresql":
            return cls(pool_id, _advisory_lock(engine, pool_id), None)
        if engine.dialect.name == "sqlite":
            database = engine.url.database
            if not database or database == ":memory:" or database.startswith("file::memory:"):
                return cls(pool_id, None, None)
            return cls(pool_id, None, _file_lock(lock_file_path(database, pool_id), pool_id))
        raise ValueError(f"no pool lock for {engine.dialect.name!r} databases (SQLite and PostgreSQL have one)")

    def release(self) -> None:
        """Gives the pool up. Never raises for a store that is away: a lost PostgreSQL session has
        released its lock already (the server ends a session's locks with it)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": advisory_key(self.pool_id)})
                connection.commit()
            except sa.exc.SQLAlchemyError:
                connection.invalidate()  # the session is gone, and its lock with it
            finally:
                connection.close()  # ends the session's hold even if the unlock failed
        lock_file, self._lock_file = self._lock_file, None
        if lock_file is not None:
            lock_file.close()  # closing the file releases its flock


def _advisory_lock(engine: sa.Engine, pool_id: str) -> sa.Connection:
    connection = engine.connect()
    try:
        key = advisory_key(pool_id)
        held = connection.execute(sa.text("SELECT pg_try_advisory_lock(:key)"), {"key": key}).scalar()
        connection.commit()  # no transaction left open for the log's life; the session lock stays
    except BaseException:
        connection.close()
        raise
    if not held:
        connection.close()
        url = engine.url.render_as_string(hide_password=True)
        raise SecondWriterError(
            f"pool {pool_id!r} is being written by another live server (its PostgreSQL advisory lock {key} on "
            f"{url} is held): give this server another pool id (--pool-id / NANOSERVE_POOL_ID), "
            "or stop the other server first"
        )
    return connection


def _file_lock(path: str, pool_id: str) -> IO[bytes] | None:
    if fcntl is None:  # pragma: no cover - Windows
        return None
    lock_file = open(path, "ab")  # noqa: SIM115 - held open for the log's life, closed by release()
    try:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        raise SecondWriterError(
            f"pool {pool_id!r} is being written by another live server (the lock file {os.path.abspath(path)} "
            "is held): give this server another pool id (--pool-id / NANOSERVE_POOL_ID), "
            "or stop the other server first"
        ) from None
    except BaseException:
        lock_file.close()
        raise
    return lock_file
