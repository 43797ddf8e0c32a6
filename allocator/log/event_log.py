"""``EventLog``: the allocator's append-only, hash-chained event log.

The allocator emits events; the engine persists them. Once per scheduler step
the engine takes the allocator's pending events and appends them here as one
batch (``append_batch(step, events)``), and each becomes one record ``(seq,
kind, block_ids, owner, step, reason, wall_time_ns, monotonic_ns)``. Sequence
numbers are assigned here, on the engine's thread, in the order the events
were emitted (never by the database, whose sequences leave gaps and reorder
under concurrent writers). The batch is stamped with the time it is appended:
every record of a step carries the step's end, and the seq orders them.
Batches go to a background ``LogWriter`` that encodes, hashes and
group-commits them, so the caller never waits on disk (``sync=True`` waits,
for debugging).

Each ``open`` starts a new epoch of the pool with a POOL_INIT record; ``close``
writes POOL_CLOSE. Every ``num_events_per_snapshot`` events a SNAPSHOT record
holds the full pool state, so replay can start there: the log holds no pool,
so ``append_batch`` asks the caller for one (``snapshot``) when one is due.

The schema must exist: ``nanoserve.migrations.upgrade(url)`` (``nanoserve db
upgrade URL``) creates it, and the engine runs it before ``open``.

Faults have one outcome each. A store that fails (away, read-only, full) makes
``durable`` False (``not_durable_reason`` says why) while the writer retries;
``append_batch`` blocks once ``max_pending_batches`` batches wait. A SQLite
file deleted or replaced under the writer fails the log for good
(``LogFileLostError``). ``close(timeout_s)`` is bounded: what the store has not
taken by then is reported (``EventLogIncompleteError``: how many, from which
seq), and the epoch stays open.

Thread model: ``append_batch``/``flush``/``close`` are called from one thread
(the engine's); ``last_seq`` is that thread's; ``durable_seq``, ``healthy``
and ``subscribe`` are safe from any thread.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator.events import BlockEvent, EventKind
from nanoserve.allocator.log.batch import Batch
from nanoserve.allocator.log.companion import CompanionRecord
from nanoserve.allocator.log.epoch_partitions import create_epoch_partitions
from nanoserve.allocator.log.epoch_row import check_open_args, insert_epoch, newest_epoch
from nanoserve.allocator.log.errors import (
    EventLogError,
    EventLogIncompleteError,
    LogFileLostError,
    is_store_unavailable,
    redact_urls,
    safe_url,
    store_error,
)
from nanoserve.allocator.log.hash_chain import genesis_hash
from nanoserve.allocator.log.pool_lock import PoolLock, yield_to_reconnecting_writer
from nanoserve.allocator.log.snapshot_codec import snapshot_data
from nanoserve.allocator.log.store import (
    DEFAULT_EVENT_LOG_URL,
    create_log_engine,
    sqlite_file,
)
from nanoserve.allocator.log.store_probe import check_schema
from nanoserve.allocator.log.stored_event import Event
from nanoserve.allocator.log.writer import LogWriter
from nanoserve.allocator.pool_state import PoolState

_time_ns = time.time_ns
_monotonic_ns = time.monotonic_ns
_SNAPSHOT = EventKind.SNAPSHOT


class EventLog:
    """One epoch of one pool's log, written by this process only.

    ``last_seq`` is the last sequence number assigned; ``durable_seq`` the last
    one committed (``durable_seq <= last_seq``; every event up to it is in the
    database). ``healthy`` is False while the writer cannot commit;
    ``durable`` is False whenever an event appended now might not reach the
    store (``not_durable_reason`` says why).
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
        pool_lock: PoolLock,
    ) -> None:
        self.url = url
        self._engine = engine
        self._writer = writer
        self._pool_lock = pool_lock  # held from open to close: no other live writer of this pool
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._sync = sync
        self._num_events_per_snapshot = num_events_per_snapshot
        self._seq = writer.durable_seq
        self._journal_seq = writer.durable_companion_seq  # last companion (journal) seq assigned
        self._snapshot_seq = self._seq  # seq of the last SNAPSHOT (or POOL_INIT)
        self._closed = False
        self.close_error: EventLogIncompleteError | None = None  # set when close found events not durable

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
        prepare_journal: Callable[[sa.Engine, str, int], Sequence[CompanionRecord]] | None = None,
    ) -> EventLog:
        """Open a new epoch of ``pool_id`` in the log at ``url`` and write POOL_INIT.

        The pool's lock (``PoolLock``: a PostgreSQL advisory lock, a file lock
        beside a SQLite database) is taken first and held until ``close``, so
        two live servers never write one pool, whatever epoch they would pick.
        On PostgreSQL it fences every commit, and the writer takes it again
        after its session ends (the database restarted); a pool whose newest
        epoch is open on a server up for less than ``RESTART_WINDOW_S`` waits
        ``RETAKE_GRACE_S`` for the epoch's writer to come back first
        (``pool_lock.yield_to_reconnecting_writer``).

        On PostgreSQL the new epoch's partitions are made first
        (``epoch_partitions``); where they cannot be, its rows go to the DEFAULT
        partitions (a warning, once) and the epoch opens all the same.

        epoch: None takes the pool's newest epoch + 1 (1 for a new pool).
        config: JSON-serialisable settings stored in POOL_INIT (URLs in it through ``safe_url``: no password).
        max_pending_batches: batches that may wait for the writer before
            ``append_batch`` blocks (the bound on memory while the store is slow or away).
        prepare_journal: called as ``prepare_journal(engine, pool_id, epoch)``
            once the pool's lock is held and the new epoch's number is known
            (recovery reads the crashed epoch before it there); the companion
            records it returns (the engine's request journal) are committed in
            the same transaction as POOL_INIT, journal seqs 1, 2, ...: the new
            epoch exists with all of them or not at all.
        Raises LogNotFoundError (a ValueError) when the database has no log
        schema (run ``nanoserve.migrations.upgrade(url)`` first),
        SecondWriterError when another live writer holds the pool (its pool-id
        lock), or when that epoch already exists (another writer opened it),
        LogUnavailableError when the store cannot be reached or written (down,
        read-only, full), ValueError on bad arguments.
        """
        check_open_args(pool_id, num_blocks, block_size, num_events_per_snapshot, max_pending_batches, epoch)
        # no secret at rest: a store URL in the config is kept without its password
        init_data = {"num_blocks": num_blocks, "block_size": block_size, "model": model, "config": redact_urls(config)}
        try:
            json.dumps(init_data)
        except TypeError as exc:
            raise ValueError(f"config must be JSON-serialisable: {exc}") from exc
        engine = create_log_engine(url)
        pool_lock: PoolLock | None = None
        try:
            check_schema(engine, url)
            pool_lock = PoolLock.acquire(engine, pool_id)
            pool_lock = yield_to_reconnecting_writer(engine, pool_lock)
            if epoch is None:
                epoch = newest_epoch(engine, pool_id) + 1
            writer = LogWriter(
                engine,
                pool_id,
                epoch,
                uuid.uuid4().hex,
                0,
                genesis_hash(pool_id, epoch),
                max_pending_batches,
                database_file=sqlite_file(url),
                pool_lock=pool_lock,
            )
            create_epoch_partitions(engine, pool_id, epoch)  # PostgreSQL; where it cannot, rows go to DEFAULT
            journal = tuple(prepare_journal(engine, pool_id, epoch)) if prepare_journal is not None else ()
            init = Batch(1, None, _time_ns(), _monotonic_ns(), (), EventKind.POOL_INIT, init_data, journal, 1)
            rows, head_hash = writer.seal_first(init)
            companions = writer.seal_companions([init])
            insert_epoch(engine, writer, num_blocks, block_size, model, rows, head_hash, init.wall_time_ns, companions)
            writer.durable_companion_seq = companions.last_seq
        except Exception as exc:
            if pool_lock is not None:  # the epoch was not opened: the pool is free for the next try
                pool_lock.release()
            engine.dispose()
            if is_store_unavailable(exc):
                raise store_error(url, exc) from exc
            raise
        except BaseException:
            if pool_lock is not None:
                pool_lock.release()
            engine.dispose()
            raise
        writer.start()
        return cls(url, engine, writer, num_blocks, block_size, sync, num_events_per_snapshot, pool_lock)

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
    def last_journal_seq(self) -> int:
        """The last companion (request journal) seq assigned (engine thread)."""
        return self._journal_seq

    @property
    def durable_journal_seq(self) -> int:
        """The last companion (request journal) seq committed: it moves with ``durable_seq``, in the
        same commits."""
        return self._writer.durable_companion_seq

    def add_durable_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the writer thread after every commit; it must be quick (hand off)."""
        self._writer.add_durable_listener(callback)

    @property
    def healthy(self) -> bool:
        writer = self._writer
        return writer.healthy and writer.error is None and (writer.alive or self._closed)

    @property
    def durable(self) -> bool:
        """Whether an event appended now is on its way into the store: open, the writer alive and committing."""
        return self.not_durable_reason() is None

    def not_durable_reason(self) -> str | None:
        """Why an event appended now might not reach the store, in one line; None while it would."""
        writer = self._writer
        if writer.error is not None:
            return f"the event log failed: {writer.error}"
        if self._closed:
            return "the event log is closed"
        if not writer.alive:
            return "the event log writer is not running"
        if not writer.healthy:
            since = writer.failing_since
            failing_s = 0.0 if since is None else time.monotonic() - since
            return (
                f"commits to {safe_url(self.url)} have failed for {failing_s:.1f} s ({writer.last_error}); "
                f"{self.last_seq - self.durable_seq} event(s) wait"
            )
        return None

    @property
    def failed(self) -> bool:
        """The writer stopped for good (second writer, lost file, crash): nothing appended is recorded."""
        return self._writer.error is not None

    @property
    def max_pending_batches(self) -> int:
        return self._writer.max_pending_batches

    @property
    def num_pending_batches(self) -> int:
        """Batches appended and not yet committed."""
        return self._writer.num_pending_batches

    @property
    def pending_bytes(self) -> int:
        """Bytes of the records appended and not yet committed (the part not yet encoded: estimated)."""
        return self._writer.pending_bytes(self.last_seq - self.durable_seq)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the engine's side -------------------------------------------------
    def append_batch(
        self,
        step: int | None,
        events: Sequence[BlockEvent],
        snapshot: Callable[[], PoolState] | None = None,
        journal: Sequence[CompanionRecord] = (),
    ) -> None:
        """Append ``events`` (in emission order) as one batch stamped with scheduler ``step``.

        Seqs ``last_seq + 1, ...`` go to the events in order, and every record
        gets ``step`` (None: outside any step) and the time of this call. The
        batch is committed whole or not at all. No events: nothing is written.
        The log keeps ``events``: hand it a sequence nobody changes afterwards
        (``BlockAllocator.take_events()`` gives a new list each time).

        snapshot: the pool's state after exactly these events (the allocator's
        ``snapshot``); called when ``num_events_per_snapshot`` events have
        passed since the last SNAPSHOT, which then ends the batch. None writes
        no SNAPSHOT.

        journal: the step's companion records (the engine's request journal,
        stored by their own ``table``: ``companion``); they get journal seqs
        ``last_journal_seq + 1, ...`` and commit with the events (a step with
        such records and no events still makes a batch).

        Blocks while ``max_pending_batches`` wait for the writer (never once
        ``close`` or ``unbound`` was called). Raises
        EventLogError (SecondWriterError) once the writer failed for good or
        after ``close``; ValueError on a bad step or a snapshot of another
        pool's shape. A call that raises appends nothing (``last_seq`` stays).
        """
        if not events and not journal:
            return
        if step is not None and (type(step) is not int or step < 0):
            raise ValueError(f"step must be an int >= 0 or None, got {step!r}")
        if self._closed:
            raise EventLogError(f"event log of pool {self.pool_id!r} epoch {self.epoch} is closed")
        first_seq = self._seq + 1
        last_seq = self._seq + len(events)
        data = None
        if events and snapshot is not None and last_seq - self._snapshot_seq >= self._num_events_per_snapshot:
            state = snapshot()
            self._check_shape(state)
            data = snapshot_data(state)
            last_seq += 1
        batch = Batch(
            first_seq,
            step,
            _time_ns(),
            _monotonic_ns(),
            events,
            None if data is None else _SNAPSHOT,
            data,
            journal,
            self._journal_seq + 1,
        )
        self._writer.submit(batch)
        self._seq = last_seq  # only once the batch is queued: a call that raises appends nothing
        self._journal_seq += len(journal)
        if data is not None:
            self._snapshot_seq = last_seq
        if self._sync:  # until durable, or until shutdown unbinds the log (close then bounds the wait)
            while not self._writer.wait_durable(last_seq, 0.5, self._journal_seq) and self._writer.bounded:
                pass

    def _check_shape(self, state: PoolState) -> None:
        if (state.num_blocks, state.block_size) != (self.num_blocks, self.block_size):
            raise ValueError(
                f"pool has num_blocks={state.num_blocks}, block_size={state.block_size}; "
                f"the log's POOL_INIT says num_blocks={self.num_blocks}, block_size={self.block_size}"
            )

    # -- durability and shutdown -------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every appended event is durable; False on timeout."""
        return self._writer.wait_durable(self._seq, timeout_s, self._journal_seq)

    def close(self, timeout_s: float | None = None, final_state: PoolState | None = None) -> None:
        """Write POOL_CLOSE, wait up to ``timeout_s`` for every event to commit, stop the writer.

        final_state: the pool at close (``BlockAllocator.snapshot()``); its
        counts go into POOL_CLOSE (``{"num_free", "num_allocated"}``), None
        records none. ``append_batch`` no longer blocks once close has begun.

        Raises EventLogIncompleteError, naming the seqs that are not durable
        and why, when the writer failed or the store did not take everything
        within ``timeout_s`` (None: wait for ever); the writer is then
        abandoned (nothing more is committed) and the epoch stays open in the
        log, as after a crash (``close_error`` keeps the error). ValueError
        (before anything is written) when ``final_state`` has another shape
        than the log's pool.
        """
        if self._closed:
            if self.close_error is not None:
                raise self.close_error
            return
        summary = None
        if final_state is not None:
            self._check_shape(final_state)
            summary = {"num_free": final_state.num_free, "num_allocated": final_state.num_allocated}
        writer = self._writer
        writer.unbound()
        reason: str | None = None
        try:
            if writer.error is None:
                seq = self._seq + 1
                writer.submit(Batch(seq, None, _time_ns(), _monotonic_ns(), (), EventKind.POOL_CLOSE, summary))
                self._seq = seq
                if not writer.wait_durable(seq, timeout_s):
                    reason = f"the store did not take them within {timeout_s} s"
                    if writer.last_error is not None and not writer.healthy:
                        reason += f"; its last error: {writer.last_error}"
        except EventLogError:
            pass  # the writer's own error, reported below
        finally:
            self._closed = True
        if writer.error is not None:
            reason = str(writer.error)
        if reason is None:
            writer.stop()
            self._release()
            return
        if not writer.abandon():
            reason += "; a commit was still in the store's hands and may have landed"
        first_seq = 1 if isinstance(writer.error, LogFileLostError) else writer.durable_seq + 1
        self.close_error = EventLogIncompleteError(self.url, first_seq, self._seq, reason)
        self._release()
        raise self.close_error

    def _release(self) -> None:
        """The epoch is over, closed or not: the pool is free for the next server, the connections go."""
        try:
            self._pool_lock.release()
        finally:
            self._engine.dispose()

    def unbound(self) -> None:
        """From now on ``append_batch`` never waits for room (shutdown: the last steps must reach ``close``).

        Safe from any thread; wakes an ``append_batch`` that is waiting."""
        self._writer.unbound()

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
