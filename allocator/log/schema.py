"""SQLAlchemy models of the event log: one row per epoch, one row per event.

The tables are created only by the Alembic migrations in ``nanoserve.migrations``;
these models are the migrations' ``target_metadata`` (``alembic check`` proves
they agree). Constraint names follow one naming convention so that migrations
are portable between SQLite and PostgreSQL.
"""

from __future__ import annotations

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
    """One allocator event. ``seq`` is assigned by the allocator's process: 1, 2, 3, ...

    ``record`` holds the whole event as one line (see ``event_chain.encode_record``):
    the canonical payload that ``hash`` = sha256(previous hash + record) covers,
    so replay hashes the stored text as it is and parses it once. ``kind`` and
    ``owner`` repeat two of its fields so that SQL can filter on them; replay
    checks that they agree with the record. ``block_key`` repeats the first
    block key of a prefix-cache event likewise (NULL for other kinds and for
    rows written before migration 0002).
    """

    __tablename__ = "allocator_events"
    __table_args__ = (ForeignKeyConstraint(["pool_id", "epoch"], ["pool_epochs.pool_id", "pool_epochs.epoch"]),)

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    owner: Mapped[str | None] = mapped_column(String(256))
    record: Mapped[str] = mapped_column(Text)
    hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    # the first key of a prefix-cache event (migration 0002), for SQL; the record holds them all
    block_key: Mapped[str | None] = mapped_column(String(64), index=True)


class RequestJournalEntry(Base):
    """One record of the request journal: an admission, a step's released output, an ending.

    Written in the same transaction as the allocator events of the same scheduler
    step (one group commit), so a request's tokens are durable exactly when its
    step's block events are. ``journal_seq`` numbers the epoch's journal records
    1, 2, 3, ... on the engine's thread; ``kind`` is a ``JournalKind`` value and
    ``record`` its JSON payload (``nanoserve.allocator.log.journal``). The index
    on (pool_id, request_id) serves ``Resume`` and ``nanoserve log show --owner``
    across epochs.
    """

    __tablename__ = "request_journal"
    __table_args__ = (
        ForeignKeyConstraint(["pool_id", "epoch"], ["pool_epochs.pool_id", "pool_epochs.epoch"]),
        Index("ix_request_journal_pool_id_request_id", "pool_id", "request_id"),
    )

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    journal_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(256))
    kind: Mapped[str] = mapped_column(String(16))
    step: Mapped[int | None] = mapped_column(BigInteger)
    wall_ns: Mapped[int] = mapped_column(BigInteger)
    record: Mapped[str] = mapped_column(Text)


# The Table objects: ``__table__`` is typed as a FromClause, which has no ``name`` and takes no INSERT.
pool_epochs = Base.metadata.tables[PoolEpoch.__tablename__]
allocator_events = Base.metadata.tables[AllocatorEvent.__tablename__]
request_journal = Base.metadata.tables[RequestJournalEntry.__tablename__]
