"""PostgreSQL's epoch partitions at run time: made when an epoch opens, dropped when it is archived.

Migration 0010 partitions every table keyed by (pool_id, epoch) but ``pool_epochs``
by that key (``schema.EPOCH_PARTITION_KEY``): one partition per epoch and a DEFAULT
one. They are found in the catalog by their partition key, not by name, so the
request journal's tables are partitioned with the log's without the log importing
their owner. ``EventLog.open`` makes the new epoch's partitions before its first
rows (``create_epoch_partitions``); where that fails the rows go to the DEFAULT
partition, which takes any key, and the log runs on. ``archive.archive_epoch``
detaches and drops an archived epoch's partitions (``drop_epoch_partitions``).

Locks: making or dropping a partition takes ACCESS EXCLUSIVE on the partitioned
table and SHARE ROW EXCLUSIVE on ``pool_epochs``, which every partition's foreign
key references. Every transaction that writes these tables writes ``pool_epochs``
first (a group commit moves its epoch's ``durable_seq``, ``open`` inserts the
epoch's row, segment archival locks it first), and ``run_with_partition_locks``
takes ``pool_epochs`` first, then the tables, each NOWAIT: it never waits while it
holds a lock, so it is never part of a deadlock (two pools opening at once take
turns). A busy lock rolls the transaction back; it is tried again after a pause,
``LOCK_ATTEMPTS`` times. SQLite has no partitions: every function here is a no-op.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import sqlalchemy as sa
import structlog

from nanoserve.allocator.log.errors import EventLogError, is_store_unavailable
from nanoserve.allocator.log.schema import (
    EPOCH_PARTITION_KEY,
    create_epoch_partition,
    epoch_partition_name,
    pool_epochs,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

LOCK_ATTEMPTS = 40
FIRST_PAUSE_S = 0.005  # doubled after each busy try, up to MAX_PAUSE_S: about 7 s over all tries
MAX_PAUSE_S = 0.2
# bound on any lock the statements take besides the ones locked NOWAIT (the DEFAULT partition's)
LOCK_TIMEOUT_MS = 2_000
_LOCK_NOT_AVAILABLE = "55P03"  # SQLSTATE of NOWAIT's refusal and of lock_timeout

_warned = False  # a failed creation is logged as a warning once per process, then at debug level


class PartitionLocksBusy(EventLogError):
    """The locks that making or dropping partitions needs stayed busy through every try."""


def partitioned_tables(conn: sa.Connection) -> list[str]:
    """The tables of the current schema partitioned by (pool_id, epoch), by name ([] on SQLite or before 0010)."""
    if conn.dialect.name != "postgresql":
        return []
    query = sa.text(
        "SELECT c.relname FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND pg_get_partkeydef(c.oid) = :key ORDER BY c.relname"
    )
    return list(conn.execute(query, {"key": EPOCH_PARTITION_KEY}).scalars())


def run_with_partition_locks(engine: sa.Engine, tables: list[str], work: Callable[[sa.Connection], T]) -> T:
    """``work(conn)`` in one transaction that holds ``pool_epochs`` (SHARE ROW EXCLUSIVE) and ``tables``
    (ACCESS EXCLUSIVE, the partitioned tables only, not their partitions), taken NOWAIT in that order.

    Raises PartitionLocksBusy when a lock was busy on each of ``LOCK_ATTEMPTS`` tries
    (about 7 s); any other database error as it comes.
    """
    quote = engine.dialect.identifier_preparer.quote
    pause_s = FIRST_PAUSE_S
    for attempt in range(LOCK_ATTEMPTS):
        if attempt:
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, MAX_PAUSE_S)
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}")
                conn.exec_driver_sql(f"LOCK TABLE ONLY {quote(pool_epochs.name)} IN SHARE ROW EXCLUSIVE MODE NOWAIT")
                if tables:
                    names = ", ".join(quote(table) for table in tables)
                    conn.exec_driver_sql(f"LOCK TABLE ONLY {names} IN ACCESS EXCLUSIVE MODE NOWAIT")
                return work(conn)
        except sa.exc.OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                raise
    raise PartitionLocksBusy(f"the locks on {pool_epochs.name} and {', '.join(tables)} stayed busy")


def create_epoch_partitions(engine: sa.Engine, pool_id: str, epoch: int) -> bool:
    """Makes epoch ``epoch`` of ``pool_id`` its partition of every partitioned table (idempotent).

    Returns False when they could not be made (a busy lock, rows of that epoch
    already in DEFAULT, no privilege): the epoch's rows then go to the DEFAULT
    partition, which archival empties the same way (a warning is logged once per
    process). True where made, and on SQLite.
    """
    global _warned
    if engine.dialect.name != "postgresql":
        return True
    try:
        with engine.connect() as conn:
            tables = partitioned_tables(conn)
        if tables:
            run_with_partition_locks(engine, tables, lambda conn: _create(conn, tables, pool_id, epoch))
    except (sa.exc.SQLAlchemyError, PartitionLocksBusy) as exc:
        if _store_away(exc):
            raise  # open reports the store as unavailable, as it would at the epoch's first rows
        emit = log.debug if _warned else log.warning
        _warned = True
        emit("event_log_epoch_partitions_not_made", pool_id=pool_id, epoch=epoch, error=str(exc).splitlines()[0])
        return False
    return True


def _store_away(exc: BaseException) -> bool:
    """Whether ``exc`` says the store is away (not a busy lock, a rolled-back transaction or a refusal)."""
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None) or ""
    return is_store_unavailable(exc) and not sqlstate.startswith(("40", "55"))


def _create(conn: sa.Connection, tables: list[str], pool_id: str, epoch: int) -> None:
    for table in tables:
        create_epoch_partition(conn, table, pool_id, epoch)


def drop_epoch_partitions(conn: sa.Connection, tables: list[str], pool_id: str, epoch: int) -> list[str]:
    """Detaches and drops the partitions of ``tables`` holding epoch ``epoch`` of ``pool_id``; returns their names.

    ``conn`` holds the locks of ``run_with_partition_locks``. A table whose
    partition is missing (its rows are in DEFAULT) is left to the caller's DELETE.
    """
    if not tables:  # SQLite, or a schema before 0010
        return []
    quote = conn.dialect.identifier_preparer.quote
    wanted = {epoch_partition_name(table, pool_id, epoch): table for table in tables}
    query = sa.text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace "
        "WHERE n.nspname = current_schema() AND p.relname = ANY(:parents) AND c.relname = ANY(:names) "
        "ORDER BY c.relname"
    )
    found = list(conn.execute(query, {"parents": list(tables), "names": list(wanted)}).scalars())
    for name in found:
        conn.exec_driver_sql(f"ALTER TABLE {quote(wanted[name])} DETACH PARTITION {quote(name)}")
        conn.exec_driver_sql(f"DROP TABLE {quote(name)}")
    return found


def not_a_partition(conn: sa.Connection) -> Callable[[str, sa.MetaData], bool]:
    """A ``MetaData.reflect(only=...)`` filter that leaves out partitions: their rows are their parent's."""
    if conn.dialect.name != "postgresql":
        return lambda name, _metadata: True
    query = sa.text(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND c.relispartition"
    )
    partitions = set(conn.execute(query).scalars())
    return lambda name, _metadata: name not in partitions
