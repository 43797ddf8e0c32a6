"""Archival: finished epochs move out of the live log into one SQLite file each.

A busy server writes hundreds of bytes per generated token; nothing else ever
deletes a row, so the live log would grow forever. ``archive_due`` moves the
epochs a ``RetentionPolicy`` no longer keeps into ``DIR/<pool>-epoch-<N>.db``:

1. the file is written beside its final name (``.partial``, mode 0600) with the
   log's schema (``prepare_archive``, the migrations, passed in by the caller:
   the log never imports them) and the epoch's rows copied exactly as stored:
   its ``pool_epochs`` row, its events, its stored keys (``allocator_keys``), the
   rows of every companion table keyed by (pool_id, epoch) (the request journal), so the hash chain verifies there
   as it did here and ``nanoserve log show/state/plot/audit --url sqlite:///FILE``
   read it like any log;
2. its sha256 is taken and it is renamed to its final name;
3. one transaction of the live log writes the manifest row (``archived_epochs``:
   seq range, head hash, path, digest, size) and removes the epoch's rows: on
   PostgreSQL it detaches and drops the epoch's partitions (migration 0010,
   ``epoch_partitions``), then, there as on SQLite, deletes the rows left by
   (pool_id, epoch), the leading columns of every such table's primary key (an
   index range): on PostgreSQL only those in a DEFAULT partition (an epoch whose
   partitions could not be made) and its ``pool_epochs`` row.

A crash before 3 leaves a file the next run overwrites; after 3 the epoch is in
the archive only. Invariant: a pool's newest epoch is never archived (it is the
open one, or the one the next ``open`` numbers after), so epoch numbers never
go back and the open epoch's rows are never touched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from nanoserve.allocator.log.epoch_partitions import (
    drop_epoch_partitions,
    not_a_partition,
    partitioned_tables,
    run_with_partition_locks,
)
from nanoserve.allocator.log.errors import EventLogError
from nanoserve.allocator.log.row_scan import has_packed_rows
from nanoserve.allocator.log.schema import allocator_events, archived_epochs, pool_epochs
from nanoserve.allocator.log.store import create_log_engine

# rows copied per INSERT into an archive
COPY_CHUNK_ROWS = 2_000
# bytes counted per stored row besides its record text (keys, hash, index entries)
ROW_OVERHEAD_BYTES = 96
ARCHIVE_SUFFIX = ".db"

PrepareArchive = Callable[[str], None]
# (live log connection, pool_id, epoch) -> the epoch whose RECOVER record took it over, or None: the
# request journal's (``engine.journal.store.recovering_epoch``), passed in by the caller as the migrations are
RecoveryOf = Callable[[sa.Connection, str, int], int | None]


class ArchiveError(EventLogError):
    """An epoch cannot be archived, or an archive does not match its manifest."""


@dataclass(frozen=True)
class RetentionPolicy:
    """What the live log keeps; 0 turns a bound off, both 0 keep everything (nothing is archived).

    retention_s: an epoch that ended (its successor opened) longer ago than
        this many seconds is archived.
    retention_bytes: the newest finished epochs are kept while their stored
        bytes (record text plus ROW_OVERHEAD_BYTES a row) add up to at most
        this; the older ones are archived. The open epoch does not count here
        (it is never archived whole; ``segment_archive`` cuts it by the same
        bounds, so a server that never restarts stays within them too).
    Either bound archives an epoch; a pool's newest epoch is always kept whole.
    """

    retention_s: float = 0.0
    retention_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.retention_s >= 0:
            raise ValueError(f"retention_s must be >= 0 seconds (0: off), got {self.retention_s}")
        if self.retention_bytes < 0:
            raise ValueError(f"retention_bytes must be >= 0 (0: off), got {self.retention_bytes}")

    @property
    def enabled(self) -> bool:
        return self.retention_s > 0 or self.retention_bytes > 0


@dataclass(frozen=True)
class ManifestEntry:
    """One archived epoch as the live log's manifest names it (see ``schema.ArchivedEpoch``)."""

    pool_id: str
    epoch: int
    first_seq: int
    last_seq: int
    head_hash: bytes
    path: str
    sha256: str
    num_bytes: int
    archived_wall_ns: int
    recovered_by: int | None = None  # the epoch that recovered it after its crash (migration 0012)


def epoch_tables(conn: sa.Connection) -> list[sa.Table]:
    """The live log's tables whose rows belong to one (pool_id, epoch), ``pool_epochs`` first.

    Found by reflection, so a companion table (the request journal) is moved
    with its epoch without the log importing its owner; on PostgreSQL a
    partitioned table is one table (its partitions are left out).
    """
    metadata = sa.MetaData()
    metadata.reflect(conn, only=not_a_partition(conn))
    tables = [pool_epochs.name]
    for name, table in sorted(metadata.tables.items()):
        if name in (pool_epochs.name, archived_epochs.name):
            continue
        if {"pool_id", "epoch"} <= set(table.columns.keys()):
            tables.append(name)
    return [metadata.tables[name] for name in tables]


def epoch_bytes(
    conn: sa.Connection, tables: list[sa.Table], pool_id: str, epochs: list[int] | None = None
) -> dict[int, int]:
    """epoch -> its stored bytes: record text (or packed records, a body) plus ROW_OVERHEAD_BYTES a row, over ``tables``
    (of ``epochs`` only, when given: one scan of their rows)."""
    sizes: dict[int, int] = {}
    for table in tables:
        size = sa.func.count() * ROW_OVERHEAD_BYTES
        # an event's record text, a packed row's records; a companion table's binary body; stored keys
        for payload in ("record", "records", "body", "block_keys"):
            if payload in table.columns:
                size = size + sa.func.coalesce(sa.func.sum(sa.func.length(table.c[payload])), 0)
        query = sa.select(table.c.epoch, size).where(table.c.pool_id == pool_id).group_by(table.c.epoch)
        if epochs is not None:
            query = query.where(table.c.epoch.in_(epochs))
        for epoch, num_bytes in conn.execute(query):
            sizes[epoch] = sizes.get(epoch, 0) + int(num_bytes)
    return sizes


def due_epochs(
    conn: sa.Connection,
    pool_id: str,
    policy: RetentionPolicy,
    now_ns: int,
    sizes: dict[tuple[str, int], int] | None = None,
) -> list[int]:
    """The epochs of ``pool_id`` that ``policy`` no longer keeps, oldest first (never the newest).

    sizes: (pool_id, epoch) -> stored bytes of finished epochs measured before;
    a finished epoch never changes, so a caller that passes the same dict on
    every call (the archiver) measures each epoch once. The newest epoch is not
    measured: it is never archived and does not count against ``retention_bytes``.
    """
    if not policy.enabled:
        return []
    rows = conn.execute(
        sa.select(pool_epochs.c.epoch, pool_epochs.c.opened_wall_ns)
        .where(pool_epochs.c.pool_id == pool_id)
        .order_by(pool_epochs.c.epoch)
    ).all()
    finished = [epoch for epoch, _ in rows[:-1]]
    due: set[int] = set()
    if policy.retention_s > 0:
        cutoff_ns = now_ns - int(policy.retention_s * 1e9)
        for (epoch, _), (_, next_opened_ns) in itertools.pairwise(rows):
            if next_opened_ns <= cutoff_ns:  # it ended when the next one opened, or before
                due.add(epoch)
    if policy.retention_bytes > 0 and finished:
        known = {} if sizes is None else sizes
        unmeasured = [epoch for epoch in finished if (pool_id, epoch) not in known]
        if unmeasured:
            measured = epoch_bytes(conn, epoch_tables(conn), pool_id, unmeasured)
            known.update({(pool_id, epoch): measured.get(epoch, 0) for epoch in unmeasured})
        kept_bytes = 0
        for epoch in reversed(finished):
            kept_bytes += known[(pool_id, epoch)]
            if kept_bytes > policy.retention_bytes:
                due.add(epoch)
    return sorted(due)


def archive_path(dest_dir: Path, pool_id: str, epoch: int) -> Path:
    """``dest_dir/<pool id, characters other than letters, digits, . _ - as _>-epoch-<8 digits>.db``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", pool_id)
    return dest_dir / f"{safe}-epoch-{epoch:08d}{ARCHIVE_SUFFIX}"


def file_sha256(path: Path) -> str:
    """The hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def archive_epoch(
    live: sa.Engine,
    pool_id: str,
    epoch: int,
    dest_dir: Path,
    prepare_archive: PrepareArchive,
    recovery_of: RecoveryOf | None = None,
) -> ManifestEntry:
    """Moves one epoch of the live log into its archive file (steps 1-3 of the module doc).

    live: an engine on the live log (migrated to 0004 or later).
    prepare_archive: called with the archive's SQLite URL; creates the log's schema there.
    recovery_of: names the epoch that recovered a crashed one, for its manifest row (None: not known).
    The file holds its own manifest row too (``sha256`` empty, ``num_bytes`` 0), so that its readers know
    the epoch is finished and, where ``recovered_by`` says, who recovered it.
    Raises ArchiveError for the pool's newest epoch, an epoch not in the log,
    or an archive whose schema lacks one of the epoch's tables; PartitionLocksBusy
    (PostgreSQL) when the tables stayed locked (the file is written again next time).
    """
    with live.connect() as conn:
        newest = conn.execute(sa.select(sa.func.max(pool_epochs.c.epoch)).where(pool_epochs.c.pool_id == pool_id))
        newest_epoch = newest.scalar()
        if newest_epoch is None or not conn.execute(_epoch_row(pool_id, epoch)).first():
            raise ArchiveError(f"pool {pool_id!r} has no epoch {epoch} in the live log")
        if epoch == newest_epoch:
            raise ArchiveError(f"epoch {epoch} is the newest of pool {pool_id!r}: it is never archived")
        tables = epoch_tables(conn)
        partitioned = partitioned_tables(conn)
        head = conn.execute(_epoch_row(pool_id, epoch)).one()
        events = allocator_events.c
        # a packed row's key is its first seq: the epoch ends at its last row's last_seq
        end = sa.func.coalesce(events.last_seq, events.seq) if has_packed_rows(conn) else events.seq
        first_seq, last_seq = conn.execute(
            sa.select(sa.func.min(events.seq), sa.func.max(end)).where(events.pool_id == pool_id, events.epoch == epoch)
        ).one()
        closed = conn.execute(
            sa.select(pool_epochs.c.closed_seq).where(pool_epochs.c.pool_id == pool_id, pool_epochs.c.epoch == epoch)
        ).scalar()
        recovered_by = recovery_of(conn, pool_id, epoch) if recovery_of is not None and closed is None else None

    dest_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = archive_path(dest_dir, pool_id, epoch)
    partial = final.with_name(final.name + ".partial")
    partial.unlink(missing_ok=True)
    os.close(os.open(partial, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    url = f"sqlite:///{partial}"
    prepare_archive(url)
    entry = ManifestEntry(
        pool_id=pool_id,
        epoch=epoch,
        first_seq=int(first_seq or 0),
        last_seq=int(last_seq or 0),
        head_hash=bytes(head.head_hash),
        path=str(final.resolve()),
        sha256="",
        num_bytes=0,
        archived_wall_ns=time.time_ns(),
        recovered_by=recovered_by,
    )
    _copy_epoch(live, url, tables, pool_id, epoch, entry)
    entry = dataclasses.replace(entry, sha256=file_sha256(partial), num_bytes=partial.stat().st_size)
    os.replace(partial, final)

    def remove(conn: sa.Connection) -> None:
        conn.execute(sa.insert(archived_epochs).values(**_manifest_values(conn, entry)))
        drop_epoch_partitions(conn, partitioned, pool_id, epoch)
        for table in reversed(tables):  # pool_epochs, which the others reference, last
            conn.execute(sa.delete(table).where(table.c.pool_id == pool_id, table.c.epoch == epoch))

    if partitioned:
        run_with_partition_locks(live, partitioned, remove)
    else:
        with live.begin() as conn:
            remove(conn)
    return entry


def _epoch_row(pool_id: str, epoch: int) -> sa.Select[tuple[bytes]]:
    return sa.select(pool_epochs.c.head_hash).where(pool_epochs.c.pool_id == pool_id, pool_epochs.c.epoch == epoch)


def _copy_epoch(
    live: sa.Engine, archive_url: str, tables: list[sa.Table], pool_id: str, epoch: int, entry: ManifestEntry
) -> None:
    """Copies the epoch's rows of ``tables`` into the archive at ``archive_url`` as stored, and ``entry`` (its
    own manifest row, without digest and size) into its manifest; leaves it one file."""
    archive = sa.create_engine(archive_url)
    try:
        with archive.begin() as out:
            target = sa.MetaData()
            target.reflect(out)
            for table in tables:
                if table.name not in target.tables:
                    raise ArchiveError(f"the archive's schema has no table {table.name!r} (migrate nanoserve)")
                into = target.tables[table.name]
                for chunk in _chunks(live, table, pool_id, epoch):
                    out.execute(sa.insert(into), chunk)
            out.execute(sa.insert(target.tables[archived_epochs.name]).values(**_manifest_values(target, entry)))
        with archive.connect() as out:
            out.exec_driver_sql("PRAGMA journal_mode=DELETE")  # one file: no -wal beside it
    finally:
        archive.dispose()


def _chunks(live: sa.Engine, table: sa.Table, pool_id: str, epoch: int) -> Iterator[list[dict[str, object]]]:
    key = list(table.primary_key.columns)
    query = sa.select(table).where(table.c.pool_id == pool_id, table.c.epoch == epoch).order_by(*key)
    with live.connect() as conn:
        result = conn.execution_options(stream_results=True).execute(query)
        while rows := result.fetchmany(COPY_CHUNK_ROWS):
            yield [dict(row._mapping) for row in rows]


def archive_due(
    url: str,
    dest_dir: Path,
    policy: RetentionPolicy,
    prepare_archive: PrepareArchive,
    *,
    pool_id: str | None = None,
    now_ns: int | None = None,
    sizes: dict[tuple[str, int], int] | None = None,
    recovery_of: RecoveryOf | None = None,
) -> list[ManifestEntry]:
    """Archives every epoch ``policy`` no longer keeps, of ``pool_id`` (None: every pool), oldest first.

    sizes: as for ``due_epochs``, kept by a caller that runs this repeatedly. recovery_of: as for
    ``archive_epoch``.
    """
    live = create_log_engine(url)
    try:
        with live.connect() as conn:
            pools = (
                [pool_id]
                if pool_id is not None
                else list(conn.execute(sa.select(pool_epochs.c.pool_id).distinct()).scalars())
            )
            now = time.time_ns() if now_ns is None else now_ns
            due = [(pool, epoch) for pool in pools for epoch in due_epochs(conn, pool, policy, now, sizes)]
        return [archive_epoch(live, pool, epoch, dest_dir, prepare_archive, recovery_of) for pool, epoch in due]
    finally:
        live.dispose()


def manifest(url: str, pool_id: str | None = None) -> list[ManifestEntry]:
    """The live log's manifest rows (of ``pool_id``, or all), by pool and epoch."""
    live = create_log_engine(url, read_only=True)
    try:
        with live.connect() as conn:
            return manifest_rows(conn, pool_id)
    finally:
        live.dispose()


def manifest_rows(conn: sa.Connection, pool_id: str | None = None) -> list[ManifestEntry]:
    """``manifest`` on an open connection; none where the log predates the manifest table (a log or an
    archive file before migration 0012 has no ``recovered_by``: None)."""
    inspector = sa.inspect(conn)
    if not inspector.has_table(archived_epochs.name):
        return []
    stored = {column["name"] for column in inspector.get_columns(archived_epochs.name)}
    columns = [column for column in archived_epochs.columns if column.name in stored]
    query = sa.select(*columns).order_by(archived_epochs.c.pool_id, archived_epochs.c.epoch)
    if pool_id is not None:
        query = query.where(archived_epochs.c.pool_id == pool_id)
    return [ManifestEntry(**row._mapping) for row in conn.execute(query)]


def _manifest_values(conn: sa.Connection | sa.MetaData, entry: ManifestEntry) -> dict[str, object]:
    """``entry``'s columns that the manifest table at ``conn`` has (before migration 0012: no recovered_by)."""
    if isinstance(conn, sa.MetaData):
        stored = set(conn.tables[archived_epochs.name].columns.keys())
    else:
        stored = {column["name"] for column in sa.inspect(conn).get_columns(archived_epochs.name)}
    return {name: value for name, value in dataclasses.asdict(entry).items() if name in stored}
