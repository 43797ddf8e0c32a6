"""``EventLog``: the allocator's append-only, hash-chained event log.

Every allocator change becomes one record ``(seq, kind, block_ids, owner, step,
reason, wall_time_ns, monotonic_ns)``. The sequence number is assigned here, on
the allocator's thread, in the order the changes happened (never by the
database, whose sequences leave gaps and reorder under concurrent writers).
Records of one scheduler step (``begin_step``/``end_step``) are sealed into one
batch; outside a step every record is a batch of its own. Batches go to a
background ``LogWriter`` that hashes and group-commits them, so the caller never
waits on disk (``sync=True`` waits, for debugging).

Each ``open`` starts a new epoch of the pool with a POOL_INIT record; ``close``
writes POOL_CLOSE. Every ``num_events_per_snapshot`` events a SNAPSHOT record
holds the full pool state, so replay can start there.

Thread model: ``record``/``begin_step``/``end_step``/``close`` are called from
the allocator's one thread; ``durable_seq``, ``healthy`` and ``subscribe`` are
safe from any thread.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from nanoserve.allocator.database import DEFAULT_EVENT_LOG_URL, Row, create_log_engine, insert_rows
from nanoserve.allocator.event_chain import genesis_hash
from nanoserve.allocator.events import Event, EventKind
from nanoserve.allocator.log_writer import Batch, EventLogError, LogWriter, Record, SecondWriterError
from nanoserve.allocator.schema import pool_epochs

if TYPE_CHECKING:
    from nanoserve.allocator.block_allocator import BlockAllocator

_time_ns = time.time_ns
_monotonic_ns = time.monotonic_ns
_SNAPSHOT = EventKind.SNAPSHOT.value


class EventLog:
    """One epoch of one pool's log, written by this process only.

    ``last_seq`` is the last sequence number assigned; ``durable_seq`` the last
    one committed (``durable_seq <= last_seq``; every event up to it is in the
    database). ``healthy`` is False while the writer cannot commit.
    """

    def __init__(
        self,
        url: str,
        engine: sa.Engine,
        writer: LogWriter,
        num_blocks: int,
        block_size: int,
        sync: bool,
        num_events_per_snapshot: int,
    ) -> None:
        self.url = url
        self._engine = engine
        self._writer = writer
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._sync = sync
        self._num_events_per_snapshot = num_events_per_snapshot
        self._seq = writer.durable_seq
        self._snapshot_seq = self._seq
        self._step: int | None = None
        self._batch: Batch = []  # records of the open step, not yet sealed
        self._allocator: BlockAllocator | None = None
        self._closed = False

    @classmethod
    def open(
        cls,
        url: str = DEFAULT_EVENT_LOG_URL,
        *,
        pool_id: str = "default",
        num_blocks: int,
        block_size: int,
        model: str | None = None,
        config: dict[str, Any] | None = None,
        sync: bool = False,
        num_events_per_snapshot: int = 10_000,
        max_pending_batches: int = 4096,
        epoch: int | None = None,
        upgrade: bool = True,
    ) -> EventLog:
        """Open a new epoch of ``pool_id`` in the log at ``url`` and write POOL_INIT.

        epoch: None takes the pool's newest epoch + 1 (1 for a new pool).
        upgrade: migrate the database to the newest schema first (Alembic).
        config: JSON-serialisable settings stored in POOL_INIT.
        Raises SecondWriterError when that epoch already exists (another
        writer opened it), ValueError on bad arguments, and SQLAlchemy's
        errors when the database cannot be reached.
        """
        _check_open_args(pool_id, num_blocks, block_size, num_events_per_snapshot, max_pending_batches, epoch)
        init_data = {"num_blocks": num_blocks, "block_size": block_size, "model": model, "config": config}
        try:
            json.dumps(init_data)
        except TypeError as exc:
            raise ValueError(f"config must be JSON-serialisable: {exc}") from exc
        if upgrade:
            from nanoserve.migrations import upgrade as upgrade_schema

            upgrade_schema(url)
        engine = create_log_engine(url)
        try:
            if epoch is None:
                epoch = _newest_epoch(engine, pool_id) + 1
            writer = LogWriter(
                engine, pool_id, epoch, uuid.uuid4().hex, 0, genesis_hash(pool_id, epoch), max_pending_batches
            )
            init: Record = (1, EventKind.POOL_INIT.value, (), None, None, None, _time_ns(), _monotonic_ns(), init_data)
            rows, head_hash = writer.seal_first([init])
            _insert_epoch(engine, writer, num_blocks, block_size, model, rows, head_hash, init[6])
        except BaseException:
            engine.dispose()
            raise
        writer.start()
        return cls(url, engine, writer, num_blocks, block_size, sync, num_events_per_snapshot)

    # -- identity and progress ---------------------------------------------
    @property
    def pool_id(self) -> str:
        return self._writer.pool_id

    @property
    def epoch(self) -> int:
        return self._writer.epoch

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def durable_seq(self) -> int:
        return self._writer.durable_seq

    @property
    def healthy(self) -> bool:
        writer = self._writer
        return writer.healthy and writer.error is None and (writer.alive or self._closed)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the allocator's side ----------------------------------------------
    def attach(self, allocator: BlockAllocator) -> None:
        """Bind the pool whose changes this log records (called by ``BlockAllocator``).

        ValueError when the pool's shape differs from POOL_INIT's, or a pool is
        already attached.
        """
        if self._allocator is not None:
            raise ValueError(f"event log of pool {self.pool_id!r} epoch {self.epoch} already has an allocator")
        if (allocator.num_blocks, allocator.block_size) != (self.num_blocks, self.block_size):
            raise ValueError(
                f"allocator has num_blocks={allocator.num_blocks}, block_size={allocator.block_size}; "
                f"the log's POOL_INIT says num_blocks={self.num_blocks}, block_size={self.block_size}"
            )
        assert allocator.num_allocated == 0, "attach the log before the first allocation"
        self._allocator = allocator

    def record(self, kind: str, block_ids: tuple[int, ...], owner: str, reason: str | None, last: bool = True) -> None:
        """Append one event (allocator thread).

        Outside a step the call's events form one batch, sealed at its ``last``
        event (an allocator call that records several events passes
        ``last=False`` for all but the final one).
        """
        self._seq = seq = self._seq + 1
        self._batch.append((seq, kind, block_ids, owner, self._step, reason, _time_ns(), _monotonic_ns(), None))
        if last and self._step is None:
            self._seal()

    def begin_step(self, step: int) -> None:
        """Stamp the following events with scheduler step ``step``."""
        if self._batch:
            self._seal()
        self._step = step

    def end_step(self) -> None:
        """Seal the step's events into one batch for the writer (none if the step changed nothing)."""
        self._step = None
        if self._batch:
            self._seal()

    def _seal(self, may_snapshot: bool = True) -> None:
        if self._closed:
            raise EventLogError(f"event log of pool {self.pool_id!r} epoch {self.epoch} is closed")
        batch = self._batch
        self._batch = []
        if (
            may_snapshot
            and self._allocator is not None
            and self._seq - self._snapshot_seq >= self._num_events_per_snapshot
        ):
            self._seq = self._snapshot_seq = self._seq + 1
            batch.append(
                (
                    self._seq,
                    _SNAPSHOT,
                    (),
                    None,
                    self._step,
                    None,
                    _time_ns(),
                    _monotonic_ns(),
                    self._allocator.snapshot_data(),
                )
            )
        self._writer.submit(batch)
        if self._sync:
            self._writer.wait_durable(self._seq)

    # -- durability and shutdown -------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Seal any open records and wait until they are durable; False on timeout."""
        if self._batch:
            self._seal()
        return self._writer.wait_durable(self._seq, timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Write POOL_CLOSE, wait for every event to commit, stop the writer.

        Raises EventLogError when the writer failed or did not finish within
        ``timeout_s``; the epoch then stays open in the log (a crash).
        """
        if self._closed:
            return
        try:
            if self._batch:
                self._seal()
            allocator = self._allocator
            summary = (
                None
                if allocator is None
                else {"num_free": allocator.num_free, "num_allocated": allocator.num_allocated}
            )
            self._step = None
            self._seq = seq = self._seq + 1
            self._batch = [
                (seq, EventKind.POOL_CLOSE.value, (), None, None, None, _time_ns(), _monotonic_ns(), summary)
            ]
            self._seal(may_snapshot=False)
            if not self._writer.wait_durable(seq, timeout_s):
                raise EventLogError(
                    f"event log did not commit seq {seq} within {timeout_s} s (durable_seq {self.durable_seq})"
                )
        finally:
            self._closed = True
            self._writer.stop(timeout_s)
            self._engine.dispose()
        if self._writer.error is not None:
            raise self._writer.error

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- live events -------------------------------------------------------
    def subscribe(self, callback: Callable[[Sequence[Event]], None]) -> Callable[[], None]:
        """Call ``callback(events)`` with each group of newly committed events.

        The callback runs on the writer thread, in seq order, and must be quick
        (hand off, do not block): ``EventStream`` wraps it for asyncio. A
        callback that raises is unsubscribed. Returns the function that
        unsubscribes. Events committed before the call are not replayed; read
        them with ``read_events`` and drop duplicates by seq.
        """
        return self._writer.subscribe(callback)


def _check_open_args(
    pool_id: str,
    num_blocks: int,
    block_size: int,
    num_events_per_snapshot: int,
    max_pending_batches: int,
    epoch: int | None,
) -> None:
    if type(pool_id) is not str or not 0 < len(pool_id) <= 128:
        raise ValueError(f"pool_id must be a str of 1..128 characters, got {pool_id!r}")
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_events_per_snapshot", num_events_per_snapshot),
        ("max_pending_batches", max_pending_batches),
    ):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if epoch is not None and (type(epoch) is not int or epoch < 1):
        raise ValueError(f"epoch must be an int >= 1 or None, got {epoch!r}")


def _newest_epoch(engine: sa.Engine, pool_id: str) -> int:
    with engine.connect() as conn:
        newest = conn.execute(
            sa.select(sa.func.max(pool_epochs.c.epoch)).where(pool_epochs.c.pool_id == pool_id)
        ).scalar()
    return newest or 0


def _insert_epoch(
    engine: sa.Engine,
    writer: LogWriter,
    num_blocks: int,
    block_size: int,
    model: str | None,
    rows: list[Row],
    head_hash: bytes,
    opened_wall_ns: int,
) -> None:
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.insert(pool_epochs).values(
                    pool_id=writer.pool_id,
                    epoch=writer.epoch,
                    writer_id=writer.writer_id,
                    num_blocks=num_blocks,
                    block_size=block_size,
                    model=model,
                    opened_wall_ns=opened_wall_ns,
                    durable_seq=rows[-1][2],
                    head_hash=head_hash,
                    closed_seq=None,
                )
            )
            insert_rows(conn, rows)
    except sa.exc.IntegrityError as exc:
        raise SecondWriterError(
            f"pool {writer.pool_id!r} epoch {writer.epoch} already has a writer; "
            "open a new epoch (epoch=None) or use another pool_id"
        ) from exc
