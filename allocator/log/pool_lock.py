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

A PostgreSQL lock dies with its session (the database restarted, the
connection was cut) while the writer lives on. Three rules keep one writer per
pool across that:

* **Fence.** Every commit's guard update carries ``fence``: true only while
  the session that took the lock (its backend pid, on the server started at
  the same ``pg_postmaster_start_time()``) still holds it, checked inside the
  commit's transaction. A writer whose session died commits nothing.
* **Re-take before writing.** The writer checks the lock's session when idle
  (every half second) and after a failed commit, and takes the lock again on a
  new connection (``ensure_held``) before its next commit; if another session
  holds it, the writer stops with ``PoolLockLostError``.
* **Yield after a restart.** A server that opens the pool finds its newest
  epoch open while PostgreSQL has been up for less than ``RESTART_WINDOW_S``:
  that epoch's writer may be alive and reconnecting. It gives the lock back
  and watches it for ``RETAKE_GRACE_S`` from then (a loaded machine may take
  seconds to start PostgreSQL and open the log, so the grace is not counted
  from the database's start); if the lock was taken meanwhile,
  ``SecondWriterError``; if not, the epoch's writer is gone and the open goes
  on (``yield_to_reconnecting_writer``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import urllib.parse
from datetime import datetime
from typing import IO, NamedTuple

import sqlalchemy as sa
import structlog

from nanoserve.allocator.log.errors import PoolLockLostError, SecondWriterError, is_store_unavailable
from nanoserve.allocator.log.schema import pool_epochs

log = structlog.get_logger(__name__)

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


# seconds a new server watches the lock of an open epoch, so that its live writer can take it again after
# the database restarted (it retries at least every second: ``writer.RETRY_DELAYS_S``, its idle check every
# half), and how long after PostgreSQL's start a server yields so
RETAKE_GRACE_S = 5.0
RESTART_WINDOW_S = 60.0
_POLL_S = 0.1

# the advisory lock of a bigint key, as pg_locks shows it: high half in classid, low half in objid, objsubid 1
_HELD_BY = """EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted
    AND classid = CAST(:lock_classid AS oid) AND objid = CAST(:lock_objid AS oid) AND objsubid = 1"""


class LockSession(NamedTuple):
    """The PostgreSQL session holding an advisory lock: its backend pid on the server started at ``started``."""

    pid: int
    started: datetime


class PoolLock:
    """A held pool lock; ``release()`` once (the log's ``close``), idempotent.

    On PostgreSQL ``session`` names the session holding it (None while it is
    lost and not yet taken again); ``fence`` is the SQL condition a commit
    adds so that it lands only while that session holds the lock.
    """

    def __init__(
        self,
        pool_id: str,
        connection: sa.Connection | None,
        lock_file: IO[bytes] | None,
        engine: sa.Engine | None = None,
        session: LockSession | None = None,
    ) -> None:
        self.pool_id = pool_id
        self._engine = engine  # PostgreSQL: where the lock is taken again after its session ended
        self._connection = connection  # PostgreSQL: the session that holds the advisory lock
        self.session = session
        self._lock_file = lock_file  # SQLite: the open file the flock is on
        self._mutex = threading.Lock()  # the writer thread checks the connection, close() releases it

    @classmethod
    def acquire(cls, engine: sa.Engine, pool_id: str) -> PoolLock:
        """Takes ``pool_id``'s lock in the log behind ``engine`` without waiting.

        Raises SecondWriterError when another live writer holds it, and the
        database's or the file system's errors when the lock cannot be asked for.
        """
        if engine.dialect.name == "postgresql":
            connection, session = _advisory_lock(engine, pool_id)
            if session is None:
                raise _held_elsewhere(engine, pool_id)
            return cls(pool_id, connection, None, engine, session)
        if engine.dialect.name == "sqlite":
            database = engine.url.database
            if not database or database == ":memory:" or database.startswith("file::memory:"):
                return cls(pool_id, None, None)
            return cls(pool_id, None, _file_lock(lock_file_path(database, pool_id), pool_id))
        raise ValueError(f"no pool lock for {engine.dialect.name!r} databases (SQLite and PostgreSQL have one)")

    @property
    def fence(self) -> sa.ColumnElement[bool] | sa.TextClause | None:
        """PostgreSQL: SQL true only while ``session`` holds the lock (a commit's WHERE adds it; with no
        session it is false); None for a lock that cannot be lost with a session (SQLite)."""
        if self._engine is None:
            return None
        session = self.session
        if session is None:
            return sa.false()
        classid, objid = _lock_halves(self.pool_id)
        return sa.text(f"{_HELD_BY} AND pid = :lock_pid) AND pg_postmaster_start_time() = :lock_started").bindparams(
            lock_classid=classid, lock_objid=objid, lock_pid=session.pid, lock_started=session.started
        )

    def describe(self) -> str:
        """The lock in words, for messages: ``PostgreSQL advisory lock <key> on <url, no password>``."""
        if self._engine is None:
            return "its lock file"
        url = self._engine.url.render_as_string(hide_password=True)
        return f"PostgreSQL advisory lock {advisory_key(self.pool_id)} on {url}"

    def ensure_held(self) -> bool:
        """Make sure the lock is held before a commit: its session answers, or the lock is taken again
        on a new connection. True when held; False when another session holds it (the pool is lost).

        Raises the store's errors when it cannot be reached (the caller retries later). A lock
        that lives with the process (SQLite) is always held.
        """
        if self._engine is None:
            return True
        with self._mutex:
            if self._connection is not None and self._session_answers(self._connection):
                return True
            self._connection, self.session = None, None
            connection, session = _advisory_lock(self._engine, self.pool_id)
            if session is None:
                return False
            self._connection, self.session = connection, session
            return True

    def hold(self, epoch: int, durable_seq: int) -> None:
        """``ensure_held`` for the writer of ``epoch``: a lock taken again on a new session is logged
        (``event_log_pool_lock_retaken``). Raises PoolLockLostError when another server holds it, the
        store's errors when it cannot be reached."""
        session = self.session
        if not self.ensure_held():
            raise PoolLockLostError(self.pool_id, epoch, durable_seq, self.describe())
        if self.session != session:
            log.warning("event_log_pool_lock_retaken", pool_id=self.pool_id, epoch=epoch, durable_seq=durable_seq)

    def release(self) -> None:
        """Gives the pool up. Never raises for a store that is away: a lost PostgreSQL session has
        released its lock already (the server ends a session's locks with it)."""
        with self._mutex:
            connection, self._connection = self._connection, None
            self.session = None
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

    @staticmethod
    def _session_answers(connection: sa.Connection) -> bool:
        try:
            connection.execute(sa.text("SELECT 1")).scalar()
            connection.commit()
        except sa.exc.SQLAlchemyError as exc:
            if not is_store_unavailable(exc):
                raise
            connection.invalidate()
            connection.close()
            return False
        return True


def yield_to_reconnecting_writer(engine: sa.Engine, lock: PoolLock, sleep: float = _POLL_S) -> PoolLock:
    """``lock``, or the pool's lock taken again after giving a reconnecting writer its chance.

    PostgreSQL only: when the pool's newest epoch is open and the server has
    been up for less than ``RESTART_WINDOW_S``, that epoch's writer may be alive
    and about to take its lock again (its session died with the restart).
    ``lock`` is released and watched for ``RETAKE_GRACE_S``: taken by another
    session -> SecondWriterError; still free -> taken again here
    (SecondWriterError if that fails) and returned.
    """
    if engine.dialect.name != "postgresql":
        return lock
    with engine.connect() as conn:
        closed_seq = conn.execute(
            sa.select(pool_epochs.c.closed_seq)
            .where(pool_epochs.c.pool_id == lock.pool_id)
            .order_by(pool_epochs.c.epoch.desc())
            .limit(1)
        ).one_or_none()
        uptime_s = float(
            conn.execute(sa.text("SELECT extract(epoch FROM now() - pg_postmaster_start_time())")).scalar_one()
        )
    if closed_seq is None or closed_seq[0] is not None or uptime_s >= RESTART_WINDOW_S:
        return lock
    lock.release()
    deadline = time.monotonic() + RETAKE_GRACE_S
    classid, objid = _lock_halves(lock.pool_id)
    held = sa.text(f"SELECT {_HELD_BY})").bindparams(lock_classid=classid, lock_objid=objid)
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            if conn.execute(held).scalar():
                raise _held_elsewhere(engine, lock.pool_id)
        time.sleep(sleep)
    return PoolLock.acquire(engine, lock.pool_id)


def _lock_halves(pool_id: str) -> tuple[int, int]:
    """(classid, objid) of the pool's advisory lock in pg_locks: the key's high and low 32 bits, unsigned."""
    unsigned = advisory_key(pool_id) & (2**64 - 1)
    return unsigned >> 32, unsigned & 0xFFFFFFFF


def _held_elsewhere(engine: sa.Engine, pool_id: str) -> SecondWriterError:
    url = engine.url.render_as_string(hide_password=True)
    return SecondWriterError(
        f"pool {pool_id!r} is being written by another live server (its PostgreSQL advisory lock "
        f"{advisory_key(pool_id)} on {url} is held): give this server another pool id "
        "(--pool-id / NANOSERVE_POOL_ID), or stop the other server first"
    )


def _advisory_lock(engine: sa.Engine, pool_id: str) -> tuple[sa.Connection | None, LockSession | None]:
    """(connection, its session) holding the pool's lock, or (None, None) when another session holds it."""
    connection = engine.connect()
    try:
        held, pid, started = connection.execute(
            sa.text("SELECT pg_try_advisory_lock(:key), pg_backend_pid(), pg_postmaster_start_time()"),
            {"key": advisory_key(pool_id)},
        ).one()
        connection.commit()  # no transaction left open for the log's life; the session lock stays
    except BaseException:
        connection.close()
        raise
    if not held:
        connection.close()
        return None, None
    return connection, LockSession(pid, started)


def _file_lock(path: str, pool_id: str) -> IO[bytes] | None:
    if fcntl is None:  # pragma: no cover - Windows
        return None
    # 0600 like the database beside it; held open for the log's life, closed by release()
    lock_file = os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
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
