"""SQLAlchemy model of the request journal: one row per journal record.

Declared on the event log's ``Base`` (``nanoserve.allocator.log.schema``): its
rows reference the log's epochs, and the migrations' one ``target_metadata``
holds both, so ``alembic check`` compares it with the migrations (0003, 0005, 0006) like the
log's own tables. The log itself never imports this module: it stores the rows
through the companion protocol (``store.JournalTable``).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKeyConstraint, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from nanoserve.allocator.log.schema import Base


class RequestJournalEntry(Base):
    """One record of the request journal: an admission, a step's released output, an ending.

    Written in the same transaction as the allocator events of the same scheduler
    step (one group commit), so a request's tokens are durable exactly when its
    step's block events are. ``journal_seq`` numbers the epoch's journal records
    1, 2, 3, ... on the engine's thread; ``kind`` is a ``JournalKind`` value and
    ``record`` its JSON payload (``nanoserve.engine.journal.records``). The index
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


# The Table object: ``__table__`` is typed as a FromClause, which has no ``name`` and takes no INSERT.
request_journal = Base.metadata.tables[RequestJournalEntry.__tablename__]


class JournalStepRow(Base):
    """One scheduler step's journal records, binary (``step_codec``) and hash-chained (``journal_chain``).

    Replaces ``request_journal``'s row per record (migration 0005): the records
    ``first_seq..last_seq`` of the epoch, each journal seq in exactly one row, the
    rows of an epoch contiguous; ``hash`` chains the row to the epoch's row before.
    ``request_journal`` stays for logs written before, read as they are.
    """

    __tablename__ = "journal_steps"
    __table_args__ = (ForeignKeyConstraint(["pool_id", "epoch"], ["pool_epochs.pool_id", "pool_epochs.epoch"]),)

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int | None] = mapped_column(BigInteger)
    wall_ns: Mapped[int] = mapped_column(BigInteger)
    body: Mapped[bytes] = mapped_column(LargeBinary)
    hash: Mapped[bytes] = mapped_column(LargeBinary(32))


class JournalRequestIndex(Base):
    """Where a request's history is: one row per ADMIT (fresh or a re-admission) and per FINISH record.

    ``Resume`` and recovery find a request's step rows from here: in each epoch
    that holds one of these, its records run from the first of them to its
    FINISH (or the epoch's end). About two rows per request, not one per token.
    """

    __tablename__ = "journal_requests"
    __table_args__ = (
        ForeignKeyConstraint(["pool_id", "epoch"], ["pool_epochs.pool_id", "pool_epochs.epoch"]),
        Index("ix_journal_requests_pool_id_request_id", "pool_id", "request_id"),
    )

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    journal_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(256))


class JournalCheckpointRow(Base):
    """The requests of an epoch's journal live after journal seq ``last_seq`` (migration 0006).

    Written every few thousand records with the step row that ends at ``last_seq``
    (``live_requests``): ``body`` lists each request admitted there without a
    FINISH yet, with its ADMIT's seq; ``hash`` binds it to that step row's hash.
    Recovery starts from an epoch's newest checkpoint and reads only the step rows
    after it, so its cost does not grow with the epoch.
    """

    __tablename__ = "journal_checkpoints"
    __table_args__ = (ForeignKeyConstraint(["pool_id", "epoch"], ["pool_epochs.pool_id", "pool_epochs.epoch"]),)

    pool_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    body: Mapped[bytes] = mapped_column(LargeBinary)
    hash: Mapped[bytes] = mapped_column(LargeBinary(32))


journal_steps = Base.metadata.tables[JournalStepRow.__tablename__]
journal_requests = Base.metadata.tables[JournalRequestIndex.__tablename__]
journal_checkpoints = Base.metadata.tables[JournalCheckpointRow.__tablename__]
