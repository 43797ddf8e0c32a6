"""SQLAlchemy models of the event log: one row per epoch; one row per event, or per run of block events.

The tables are created only by the Alembic migrations in ``nanoserve.migrations``;
``Base.metadata`` is the migrations' ``target_metadata`` (``alembic check`` proves
they agree), shared with the tables of the log's companion rows, which their
owners declare on this ``Base`` (the engine's request journal:
``nanoserve.engine.journal.schema``). Constraint names follow one naming
convention so that migrations are portable between SQLite and PostgreSQL.
On PostgreSQL the tables keyed by (pool_id, epoch) are partitioned per epoch
(migration 0010); the partitions' names and the statement that makes one live
here, beside the tables, for the migration and the log alike.
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from sqlalchemy import (
    BigInteger,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


# On PostgreSQL (migration 0010) every table keyed by (pool_id, epoch) but pool_epochs is partitioned
# by this key: one partition per epoch, named by ``epoch_partition_name``, and a DEFAULT one.
EPOCH_PARTITION_KEY = "RANGE (pool_id, epoch)"
MAX_IDENTIFIER_BYTES = 63  # PostgreSQL's NAMEDATALEN - 1
# the statement creating one epoch's partition; format()ed by the server, which quotes each part
_PARTITION_DDL = "CREATE TABLE IF NOT EXISTS %I PARTITION OF %I FOR VALUES FROM (%L, %s) TO (%L, %s)"


def epoch_partition_name(table: str, pool_id: str, epoch: int) -> str:
    """``<table>_p<12 hex of sha256(pool_id)>_e<epoch>``: the partition of ``table`` holding one epoch's rows.

    A pool id is any string of up to 128 characters; its digest makes the name a plain
    identifier of at most 63 bytes (the table's name is shortened, never the suffix).
    """
    suffix = f"_p{hashlib.sha256(pool_id.encode()).hexdigest()[:12]}_e{epoch}"
    return table[: MAX_IDENTIFIER_BYTES - len(suffix)] + suffix


def default_partition_name(table: str) -> str:
    """``<table>_default``: the partition of ``table`` holding rows of an epoch without a partition of its own."""
    return f"{table}_default"


def create_epoch_partition(conn: sa.Connection, table: str, pool_id: str, epoch: int) -> None:
    """``CREATE TABLE IF NOT EXISTS <partition> PARTITION OF <table> FOR VALUES FROM (pool_id, epoch) TO
    (pool_id, epoch + 1)`` (PostgreSQL). The statement is written by the server's ``format``, which quotes
    the names and the pool id (no injection), and sent without parameters, so that a ``%`` in the pool
    id stays itself (the driver rewrites placeholders only in a statement sent with parameters)."""
    name = epoch_partition_name(table, pool_id, epoch)
    ddl = conn.execute(sa.select(sa.func.format(_PARTITION_DDL, name, table, pool_id, epoch, pool_id, epoch + 1)))
    conn.execution_options(no_parameters=True).exec_driver_sql(ddl.scalar_one())


class PoolEpoch(Base):
    """One run of one pool: opened by POOL_INIT, ended by POOL_CLOSE or a crash.

    ``writer_id`` names the only process allowed to append to this epoch; each
    group commit advances ``durable_seq``/``head_hash`` only where they still
    hold the values that writer last wrote, which refuses a second writer and
    lets a retried commit recognise itself. ``closed_seq`` is set by the commit
    that carries POOL_CLOSE; an epoch without it crashed.
    """

    __tablename__ = "pool_epochs"

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    writer_id: Mapped[str] = mapped_column(String(64))
    num_blocks: Mapped[int] = mapped_column(Integer)
    block_size: Mapped[int] = mapped_column(Integer)
    model: Mapped[str | None] = mapped_column(String(512))
    opened_wall_ns: Mapped[int] = mapped_column(BigInteger)
    durable_seq: Mapped[int] = mapped_column(BigInteger)  # last committed seq (0: none)
    head_hash: Mapped[bytes] = mapped_column(LargeBinary(32))  # hash of the event at durable_seq
    closed_seq: Mapped[int | None] = mapped_column(BigInteger)  # seq of POOL_CLOSE, None while open


class AllocatorEvent(Base):
    """One allocator event, or a packed run of them. ``seq`` is assigned by the allocator's process: 1, 2, 3, ...

    ``record`` holds the whole event as one line (see ``record_codec``): the
    canonical payload that ``hash`` = sha256(previous hash + record) covers,
    so replay hashes the stored text as it is and parses it once. ``kind`` and
    ``owner`` repeat two of its fields so that SQL can filter on them; replay
    checks that they agree with the record. ``block_key`` repeats the first
    block key of a prefix-cache event likewise (NULL for other kinds and for
    rows written before migration 0002).

    A packed row (migration 0008, ``packed_rows``) holds the block events
    ``seq..last_seq`` of one group commit: ``records`` is their record lines,
    each exactly as the chain covers it, joined by ``\\n`` and compressed;
    ``hash`` is the chain's hash at ``last_seq`` (readers recompute the ones
    between as they expand the row); ``kind`` is 'packed', ``record`` empty,
    ``owner`` and ``block_key`` NULL. Every other row has ``last_seq`` and
    ``records`` NULL: rows written before 0008, and every POOL_INIT, SNAPSHOT
    and POOL_CLOSE row (recovery finds the newest SNAPSHOT by its ``kind``,
    and a segment is cut at one, so a cut never splits a packed row).
    A packed row whose ``records`` begin with byte 1 (migration 0009) names
    its prefix-cache keys by key id (``key_refs``, ``allocator_keys``).
    """

    __tablename__ = "allocator_events"
    __table_args__ = (
        ForeignKeyConstraint(["pool_id", "epoch"], ["pool_epochs.pool_id", "pool_epochs.epoch"]),
        # only the rows with a key (migration 0011): a packed row's is NULL, and a query for a key implies one
        Index(
            "ix_allocator_events_block_key",
            "block_key",
            sqlite_where=sa.text("block_key IS NOT NULL"),
            postgresql_where=sa.text("block_key IS NOT NULL"),
        ),
    )

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # a packed row's first seq
    kind: Mapped[str] = mapped_column(String(32))
    owner: Mapped[str | None] = mapped_column(String(256))
    record: Mapped[str] = mapped_column(Text)
    hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    # the first key of a prefix-cache event (migration 0002), for SQL; the record holds them all
    block_key: Mapped[str | None] = mapped_column(String(64))
    last_seq: Mapped[int | None] = mapped_column(BigInteger)  # a packed row's last seq (migration 0008)
    records: Mapped[bytes | None] = mapped_column(LargeBinary)  # a packed row's records, compressed


class AllocatorKey(Base):
    """The prefix-cache keys one group commit stored first in its epoch (migration 0009, ``key_refs``).

    Key ids ``first_key_id, first_key_id + 1, ...`` are the keys in
    ``block_keys``, 32 bytes each, back to back; the records of the epoch's
    packed rows name them by id (``key_refs``), so each key's bytes are
    stored once per epoch. Written in the transaction of the packed rows
    that first refer to them; deleted with their epoch (an archive file
    carries the rows its events refer to). On SQLite the table is stored
    by its primary key (WITHOUT ROWID): no index beside it repeats the key.
    """

    __tablename__ = "allocator_keys"
    __table_args__ = (
        ForeignKeyConstraint(["pool_id", "epoch"], ["pool_epochs.pool_id", "pool_epochs.epoch"]),
        {"sqlite_with_rowid": False},
    )

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_key_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    block_keys: Mapped[bytes] = mapped_column(LargeBinary)


# The Table objects: ``__table__`` is typed as a FromClause, which has no ``name`` and takes no INSERT.
pool_epochs = Base.metadata.tables[PoolEpoch.__tablename__]
allocator_events = Base.metadata.tables[AllocatorEvent.__tablename__]
allocator_keys = Base.metadata.tables[AllocatorKey.__tablename__]


class ArchivedEpoch(Base):
    """One epoch moved out of the live log into an archive file (``archive.archive_epoch``).

    The epoch's rows (its ``pool_epochs`` row, its events, its companion rows)
    are in the SQLite file at ``path`` exactly as they were stored, so the hash
    chain from the epoch's genesis to ``head_hash`` (the hash at ``last_seq``)
    still verifies there; ``sha256`` is the hex digest of that file as written,
    ``num_bytes`` its size. Written in the transaction that deletes the rows
    from the live log (migration 0004).

    The archive file holds its own epoch's row too (its ``sha256`` empty and
    ``num_bytes`` 0: a file cannot hold its own digest), so that a reader of
    the file alone knows the epoch is finished (a pool's newest epoch is never
    archived); ``recovered_by`` (migration 0012) is the epoch whose RECOVER
    record took a crashed epoch over, None when it closed or none did.
    """

    __tablename__ = "archived_epochs"

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_seq: Mapped[int] = mapped_column(BigInteger)  # 0 with last_seq 0: the epoch held no event
    last_seq: Mapped[int] = mapped_column(BigInteger)
    head_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    archived_wall_ns: Mapped[int] = mapped_column(BigInteger)
    recovered_by: Mapped[int | None] = mapped_column(Integer)  # migration 0012


archived_epochs = Base.metadata.tables[ArchivedEpoch.__tablename__]


class ArchivedSegment(Base):
    """The older part of an epoch moved out of the live log while the epoch stays open (``segment_archive``).

    Seqs ``first_seq..last_seq`` (the epoch's rows before a verified SNAPSHOT
    checkpoint at ``last_seq + 1``) are in the SQLite file at ``path``, which
    also holds the checkpoint row itself; they are gone from the live log,
    whose first kept row is that checkpoint. ``head_hash`` is the stored hash
    at ``last_seq``: the live log's audit starts at ``last_seq + 1`` chained
    from it, and the file's audit ends with it, so the two together verify
    the whole chain. ``sha256`` is the file's hex digest as written,
    ``num_bytes`` its size. Written in the transaction that deletes the rows
    (migration 0007). An epoch archived later whole carries these rows into
    its own file, so that file's audit starts at the same cut.

    The companion columns name the companion rows (the request journal's)
    that moved in the same transaction: companion seqs
    ``companion_first_seq..companion_last_seq`` and the companion chain's hash
    at ``companion_last_seq``, where the kept companion rows' chain starts
    (all NULL: none moved).
    """

    __tablename__ = "archived_segments"

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    head_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    archived_wall_ns: Mapped[int] = mapped_column(BigInteger)
    companion_first_seq: Mapped[int | None] = mapped_column(BigInteger)
    companion_last_seq: Mapped[int | None] = mapped_column(BigInteger)
    companion_head_hash: Mapped[bytes | None] = mapped_column(LargeBinary(32))


archived_segments = Base.metadata.tables[ArchivedSegment.__tablename__]
