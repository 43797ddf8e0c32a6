"""Segment archival: the older part of the open epoch leaves the live log while the server runs.

A server that never restarts writes one epoch forever; archiving whole epochs
(``archive``) never touches it. ``archive_due_segment`` cuts the pool's newest
epoch at a verified checkpoint (a SNAPSHOT at seq ``c`` whose stored hash is
``sha256(hash[c - 1] + record[c])``) once the rows from the epoch's current
start (1, or its previous cut) grow past ``RetentionPolicy.retention_bytes``,
or once the checkpoint is older than ``retention_s``, and moves seqs
``first..c - 1`` into ``DIR/<pool>-epoch-<N>-seq-<first>.db``:

1. the file is written beside its final name (``.partial``, mode 0600) with the
   log's schema (``prepare_archive``): the epoch's ``pool_epochs`` row as of the
   cut (``durable_seq`` c, ``head_hash`` hash[c], open), the epoch's earlier
   ``archived_segments`` rows (so the file starts at its own cut, as the live
   log does), and seqs ``first..c`` as stored: the checkpoint row too, so the
   file ends with a whole batch and audits clean alone, and the ``allocator_keys``
   rows holding the keys those rows name by id (``key_refs``; the live log keeps
   them, as rows after the cut may name the same keys). The rows' hash chain is
   checked while they are copied; a break is ``ArchiveError`` and nothing moves;
2. its sha256 is taken and it is renamed to its final name;
3. one transaction of the live log writes the ``archived_segments`` row
   (``first..c - 1``, head hash hash[c - 1], path, digest, size) and deletes
   the epoch's events before ``c``.

A crash before 3 leaves a file the next pass writes again (the same name); after
3 the rows are in the file only. Only rows before a durable checkpoint are
deleted; the writer appends after ``durable_seq``, so the two never touch the
same row. On SQLite the deletion holds the write lock for its transaction: the
engine's next commit waits (its writer retries; nothing is dropped).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator.log.archive import (
    ROW_OVERHEAD_BYTES,
    ArchiveError,
    ManifestEntry,
    PrepareArchive,
    RetentionPolicy,
    archive_path,
    file_sha256,
)
from nanoserve.allocator.log.companion import CompanionSegment, SegmentCompanion
from nanoserve.allocator.log.hash_chain import genesis_hash
from nanoserve.allocator.log.key_refs import KeyChunks
from nanoserve.allocator.log.key_table import KEY_COLUMNS, has_key_table, rows_holding, stored_keys
from nanoserve.allocator.log.packed_rows import expand_packed, key_ids_of
from nanoserve.allocator.log.record_codec import NUM_FIELDS, split_record
from nanoserve.allocator.log.row_scan import (
    has_packed_rows,
    last_stored_seq,
    latest_snapshot_seq,
    record_at,
    stored_hash,
)
from nanoserve.allocator.log.schema import allocator_events, allocator_keys, archived_segments, pool_epochs
from nanoserve.allocator.log.segment import epoch_cut, has_segments_table
from nanoserve.allocator.log.store import create_log_engine

COPY_CHUNK_ROWS = 2_000
_WALL_FIELD = 6  # a record's wall_time_ns field (``record_codec``)


@dataclass(frozen=True)
class SegmentEntry(ManifestEntry):
    """One archived segment as the manifest names it (``schema.ArchivedSegment``): an epoch's entry's
    fields for the seqs ``first_seq..last_seq``, the companion rows that moved with them, and
    ``num_row_bytes``: the live event bytes it removed (records plus ROW_OVERHEAD_BYTES a row), not stored."""

    companion_first_seq: int | None = None
    companion_last_seq: int | None = None
    companion_head_hash: bytes | None = None
    num_row_bytes: int = 0

    def manifest_row(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        del row["num_row_bytes"], row["recovered_by"]  # a segment is of an open epoch: nothing recovered it
        return row


@dataclass
class LiveSize:
    """The open epoch's stored event bytes from its cut on, measured a range at a time.

    through_seq: rows up to here are counted in num_bytes (0: none yet).
    """

    epoch: int = 0
    through_seq: int = 0
    num_bytes: int = 0


def measure_live(conn: sa.Connection, pool_id: str, epoch: int, size: LiveSize) -> int:
    """Adds the rows stored after ``size.through_seq`` to ``size`` (a new epoch starts it over); its bytes."""
    if size.epoch != epoch:
        size.epoch, size.through_seq, size.num_bytes = epoch, 0, 0
    events = allocator_events
    payload: sa.ColumnElement[Any] = sa.func.length(events.c.record)
    if has_packed_rows(conn):  # a packed row's records
        payload = payload + sa.func.coalesce(sa.func.length(events.c.records), 0)
    count, text, last = conn.execute(
        sa.select(
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(payload), 0),
            sa.func.max(events.c.seq),
        ).where(events.c.pool_id == pool_id, events.c.epoch == epoch, events.c.seq > size.through_seq)
    ).one()
    if last is not None:
        size.through_seq = int(last)
        size.num_bytes += int(text) + int(count) * ROW_OVERHEAD_BYTES
    return size.num_bytes


def due_cut(
    conn: sa.Connection, pool_id: str, epoch: int, policy: RetentionPolicy, now_ns: int, size: LiveSize
) -> int | None:
    """The checkpoint seq to cut ``epoch`` at (its rows before it archived), or None when nothing is due.

    Size bound: the rows from the current start weigh more than
    ``retention_bytes``: the newest checkpoint. Age bound: the newest checkpoint
    written at or before ``now_ns - retention_s``. The later of the two.
    """
    start = _start_seq(conn, pool_id, epoch)
    candidates: list[int] = []
    if policy.retention_bytes > 0 and measure_live(conn, pool_id, epoch, size) > policy.retention_bytes:
        newest = latest_snapshot_seq(conn, pool_id, epoch, None)
        if newest is not None:
            candidates.append(newest)
    if policy.retention_s > 0:
        older = _last_seq_at_or_before(conn, pool_id, epoch, start, now_ns - int(policy.retention_s * 1e9))
        snapshot = None if older is None else latest_snapshot_seq(conn, pool_id, epoch, older)
        if snapshot is not None:
            candidates.append(snapshot)
    cut = max(candidates, default=None)
    if cut is None or cut <= start or not _checkpoint_links(conn, pool_id, epoch, cut):
        return None
    return cut


def archive_segment(
    live: sa.Engine,
    pool_id: str,
    epoch: int,
    cut_seq: int,
    dest_dir: Path,
    prepare_archive: PrepareArchive,
    companion: SegmentCompanion | None = None,
) -> SegmentEntry:
    """Moves seqs (current start)..cut_seq - 1 of ``epoch`` into a segment file (steps 1-3 of the module doc),
    with the companion rows ``companion`` lets go (``CompanionSegment``), copied and deleted beside them.

    Raises ArchiveError when ``cut_seq`` is no verified checkpoint after the
    epoch's current start, or when the rows to move do not hash-chain.
    """
    with live.connect() as conn:
        row = conn.execute(
            sa.select(pool_epochs).where(pool_epochs.c.pool_id == pool_id, pool_epochs.c.epoch == epoch)
        ).first()
        if row is None or not has_segments_table(conn):
            raise ArchiveError(f"pool {pool_id!r} has no epoch {epoch} in the live log (or it predates migration 0007)")
        cut = epoch_cut(conn, pool_id, epoch)
        first_seq, previous = (1, genesis_hash(pool_id, epoch)) if cut is None else (cut.first_seq, cut.previous_hash)
        if cut_seq <= first_seq or not _checkpoint_links(conn, pool_id, epoch, cut_seq):
            raise ArchiveError(
                f"seq {cut_seq} of pool {pool_id!r} epoch {epoch} is no verified checkpoint after seq {first_seq}"
            )
        head = stored_hash(conn, pool_id, epoch, cut_seq - 1)
        cut_hash = stored_hash(conn, pool_id, epoch, cut_seq)
        assert head is not None, "a linked checkpoint has the hash before it"
        assert cut_hash is not None, "a linked checkpoint has its own hash"
        epoch_row = dict(row._mapping, durable_seq=cut_seq, head_hash=cut_hash, closed_seq=None)
        earlier = [
            dict(r._mapping)
            for r in conn.execute(
                sa.select(archived_segments).where(
                    archived_segments.c.pool_id == pool_id, archived_segments.c.epoch == epoch
                )
            )
        ]
        moved = None if companion is None else companion.segment(conn, pool_id, epoch)
        if moved is not None and moved.end_seq <= moved.first_seq:
            moved = None

    dest_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = archive_path(dest_dir, pool_id, epoch).with_suffix(f".seq-{first_seq:012d}.db")
    partial = final.with_name(final.name + ".partial")
    partial.unlink(missing_ok=True)
    os.close(os.open(partial, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    url = f"sqlite:///{partial}"
    prepare_archive(url)
    num_row_bytes = _copy_segment(live, url, epoch_row, earlier, first_seq, cut_seq, previous)
    if moved is not None:
        _copy_companions(live, url, pool_id, epoch, moved)
    digest = file_sha256(partial)
    num_bytes = partial.stat().st_size
    os.replace(partial, final)

    entry = SegmentEntry(
        pool_id=pool_id,
        epoch=epoch,
        first_seq=first_seq,
        last_seq=cut_seq - 1,
        head_hash=head,
        path=str(final.resolve()),
        sha256=digest,
        num_bytes=num_bytes,
        archived_wall_ns=time.time_ns(),
        companion_first_seq=None if moved is None else moved.first_seq,
        companion_last_seq=None if moved is None else moved.end_seq - 1,
        companion_head_hash=None if moved is None else moved.head_hash,
        num_row_bytes=num_row_bytes,
    )
    events = allocator_events
    with live.begin() as conn:
        # pool_epochs before the tables, as every writer of them locks them (epoch_partitions)
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f"LOCK TABLE ONLY {pool_epochs.name} IN ROW EXCLUSIVE MODE")
        conn.execute(sa.insert(archived_segments).values(**entry.manifest_row()))
        conn.execute(
            sa.delete(events).where(events.c.pool_id == pool_id, events.c.epoch == epoch, events.c.seq < cut_seq)
        )
        if moved is not None:
            for table, column in _companion_tables(conn, moved):
                in_epoch = (table.c.pool_id == pool_id, table.c.epoch == epoch)
                conn.execute(sa.delete(table).where(*in_epoch, table.c[column] < moved.end_seq))
    return entry


def archive_due_segment(
    url: str,
    dest_dir: Path,
    policy: RetentionPolicy,
    prepare_archive: PrepareArchive,
    pool_id: str,
    size: LiveSize,
    *,
    companion: SegmentCompanion | None = None,
    now_ns: int | None = None,
) -> list[SegmentEntry]:
    """Archives the segment of ``pool_id``'s newest epoch that ``policy`` no longer keeps: [] or [entry].

    size: the newest epoch's measured bytes, kept by a caller that runs this
    repeatedly (the archiver) so each row is measured once. companion: what of
    the companion rows (the request journal) moves with it (None: none).
    """
    if not policy.enabled:
        return []
    live = create_log_engine(url)
    try:
        with live.connect() as conn:
            if not has_segments_table(conn):
                return []
            epoch = conn.execute(
                sa.select(sa.func.max(pool_epochs.c.epoch)).where(pool_epochs.c.pool_id == pool_id)
            ).scalar()
            if epoch is None:
                return []
            now = time.time_ns() if now_ns is None else now_ns
            cut = due_cut(conn, pool_id, epoch, policy, now, size)
        if cut is None:
            return []
        entry = archive_segment(live, pool_id, epoch, cut, dest_dir, prepare_archive, companion)
        size.num_bytes -= entry.num_row_bytes
        return [entry]
    finally:
        live.dispose()


def segment_manifest(url: str, pool_id: str | None = None) -> list[SegmentEntry]:
    """The live log's segment manifest rows (of ``pool_id``, or all), by pool, epoch and first seq."""
    live = create_log_engine(url, read_only=True)
    try:
        with live.connect() as conn:
            if not has_segments_table(conn):
                return []
            table = archived_segments
            query = sa.select(table).order_by(table.c.pool_id, table.c.epoch, table.c.first_seq)
            if pool_id is not None:
                query = query.where(table.c.pool_id == pool_id)
            return [SegmentEntry(**row._mapping) for row in conn.execute(query)]
    finally:
        live.dispose()


def _start_seq(conn: sa.Connection, pool_id: str, epoch: int) -> int:
    cut = epoch_cut(conn, pool_id, epoch)
    return 1 if cut is None else cut.first_seq


def _checkpoint_links(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> bool:
    """Whether ``seq`` is a SNAPSHOT whose stored hash is sha256(stored hash of seq - 1 + its record)."""
    events = allocator_events
    row = conn.execute(
        sa.select(events.c.kind, events.c.record, events.c.hash).where(
            events.c.pool_id == pool_id, events.c.epoch == epoch, events.c.seq == seq
        )
    ).first()
    previous = stored_hash(conn, pool_id, epoch, seq - 1)
    if row is None or previous is None or row.kind != "snapshot" or type(row.record) is not str:
        return False
    return hashlib.sha256(previous + row.record.encode()).digest() == bytes(row.hash)


def _wall_ns(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> int | None:
    record = record_at(conn, pool_id, epoch, seq)
    fields = split_record(record) if type(record) is str else []
    try:
        return int(fields[_WALL_FIELD]) if len(fields) == NUM_FIELDS else None
    except ValueError:
        return None


def _last_seq_at_or_before(conn: sa.Connection, pool_id: str, epoch: int, start: int, cutoff_ns: int) -> int | None:
    """The highest stored seq written at or before ``cutoff_ns`` (records' times rise with seq): a binary
    search over the primary key, about log2(rows) reads. None when none is, or a record read is damaged."""
    last = last_stored_seq(conn, pool_id, epoch, None)
    if last is None:
        return None
    low, high, found = start, int(last), None
    while low <= high:
        middle = (low + high) // 2
        wall = _wall_ns(conn, pool_id, epoch, middle)
        if wall is None:
            return None
        if wall <= cutoff_ns:
            found, low = middle, middle + 1
        else:
            high = middle - 1
    return found


def _copy_segment(
    live: sa.Engine,
    archive_url: str,
    epoch_row: dict[str, Any],
    earlier: list[dict[str, Any]],
    first_seq: int,
    cut_seq: int,
    previous: bytes,
) -> int:
    """Writes the file's rows (step 1), checking the chain, and the stored keys they name (``key_refs``: kept
    in the live log too, for the rows after the cut); the bytes of seqs first_seq..cut_seq - 1."""
    archive = sa.create_engine(archive_url)
    num_row_bytes = 0
    expected = first_seq
    pool_id, epoch = epoch_row["pool_id"], epoch_row["epoch"]
    key_ids: set[int] = set()
    try:
        with archive.begin() as out, live.connect() as keys_conn:
            keys = stored_keys(keys_conn, pool_id, epoch)
            out.execute(sa.insert(pool_epochs), [epoch_row])
            if earlier:
                out.execute(sa.insert(archived_segments), earlier)
            for chunk in _event_chunks(live, epoch_row["pool_id"], epoch_row["epoch"], first_seq, cut_seq):
                for row in chunk:
                    for seq, record, hash_ in _events_of(row, previous, keys):
                        if (
                            seq != expected
                            or type(record) is not str
                            or hashlib.sha256(previous + record.encode()).digest() != hash_
                        ):
                            raise ArchiveError(
                                f"seq {expected} of pool {epoch_row['pool_id']!r} epoch {epoch_row['epoch']} is "
                                "missing or does not chain: run `nanoserve log audit`; nothing was archived"
                            )
                        previous, expected = bytes(hash_), expected + 1
                    if row["seq"] < cut_seq:
                        num_row_bytes += len(row["record"]) + len(row.get("records") or b"") + ROW_OVERHEAD_BYTES
                    key_ids |= key_ids_of(row.get("records"))
                out.execute(sa.insert(allocator_events), chunk)
            if expected != cut_seq + 1:
                raise ArchiveError(f"seqs {expected}..{cut_seq} of epoch {epoch_row['epoch']} are missing")
            if key_ids and has_key_table(keys_conn):
                held = rows_holding(keys_conn, pool_id, epoch, key_ids)
                held_rows = [dict(zip(KEY_COLUMNS, (pool_id, epoch, *row), strict=True)) for row in held]
                out.execute(sa.insert(allocator_keys), held_rows)
        with archive.connect() as out:
            out.exec_driver_sql("PRAGMA journal_mode=DELETE")  # one file: no -wal beside it
    finally:
        archive.dispose()
    return num_row_bytes


def _events_of(row: dict[str, Any], previous: bytes, keys: KeyChunks) -> list[tuple[Any, Any, Any]]:
    """(seq, record, hash) of each event a stored row holds (a packed row chained from ``previous``)."""
    if row.get("last_seq") is None:
        return [(row["seq"], row["record"], row["hash"])]
    expanded = expand_packed(row["seq"], row["last_seq"], row["records"], row["hash"], previous, keys)
    return [(seq, record, hash_) for seq, _, _, record, hash_ in expanded]


def _companion_tables(conn: sa.Connection, moved: CompanionSegment) -> list[tuple[sa.Table, str]]:
    """The companion's tables as the live log holds them (reflected: the log does not import their owner)."""
    metadata = sa.MetaData()
    return [(sa.Table(name, metadata, autoload_with=conn), column) for name, column in moved.tables]


def _copy_companions(live: sa.Engine, archive_url: str, pool_id: str, epoch: int, moved: CompanionSegment) -> None:
    """Copies the companion rows below ``moved.end_seq`` into the archive, as stored."""
    archive = sa.create_engine(archive_url)
    try:
        with live.connect() as conn, archive.begin() as out:
            target = sa.MetaData()
            target.reflect(out)
            for table, column in _companion_tables(conn, moved):
                if table.name not in target.tables:
                    raise ArchiveError(f"the archive's schema has no table {table.name!r} (migrate nanoserve)")
                query = sa.select(table).where(
                    table.c.pool_id == pool_id, table.c.epoch == epoch, table.c[column] < moved.end_seq
                )
                result = conn.execution_options(stream_results=True).execute(query)
                while rows := result.fetchmany(COPY_CHUNK_ROWS):
                    out.execute(sa.insert(target.tables[table.name]), [dict(row._mapping) for row in rows])
    finally:
        archive.dispose()


def _event_chunks(
    live: sa.Engine, pool_id: str, epoch: int, first_seq: int, last_seq: int
) -> Iterator[list[dict[str, Any]]]:
    events = allocator_events
    query = (
        sa.select(events)
        .where(
            events.c.pool_id == pool_id, events.c.epoch == epoch, events.c.seq >= first_seq, events.c.seq <= last_seq
        )
        .order_by(events.c.seq)
    )
    with live.connect() as conn:
        result = conn.execution_options(stream_results=True).execute(query)
        while rows := result.fetchmany(COPY_CHUNK_ROWS):
            yield [dict(row._mapping) for row in rows]
