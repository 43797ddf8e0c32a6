"""The event log's background writer: encode, hash, group-commit, retry, publish.

The caller's thread (the engine's) hands each step's events over as one
``Batch`` and appends it to ``pending`` (a deque: appending is one atomic call,
no lock); it does nothing per event but count seqs. The writer thread takes
every ready batch, encodes its records (``record_codec``), chains their hashes,
and commits them in one transaction (group commit), then advances
``durable_seq`` and hands the committed events to subscribers.

Each commit first moves the epoch row's ``(durable_seq, head_hash)`` from the
values this writer last wrote to the new ones, guarded by ``writer_id``. A
second writer therefore cannot interleave, and a retry after an unknown outcome
(the commit went through but the acknowledgement was lost) finds the guard
already moved and recognises its own batch by the stored hash.

Faults: a commit that fails because the store is away, read-only or full is
retried with backoff, never dropped, while ``healthy`` is False (the caller
blocks once ``max_pending_batches`` wait). A SQLite file that is no longer the
file at its path (deleted or replaced: checked after every commit and every
idle half second) is fatal: everything committed to it is gone, so
``durable_seq`` drops to 0. ``abandon`` stops the writer without committing
what is left (a bounded shutdown): nothing is committed after it returns.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa
import structlog
from sqlalchemy.engine import Engine

from nanoserve.allocator.events import BlockEvent, EventKind
from nanoserve.allocator.log.database import Row, insert_rows
from nanoserve.allocator.log.errors import EventLogError, LogFileLostError, SecondWriterError, store_cause
from nanoserve.allocator.log.event import Event
from nanoserve.allocator.log.event_chain import chain_hash
from nanoserve.allocator.log.journal import JournalRecord, JournalRow, encode_journal, insert_journal_rows
from nanoserve.allocator.log.record_codec import decode_event, encode_block_record, encode_data_record
from nanoserve.allocator.log.schema import allocator_events, pool_epochs, request_journal

log = structlog.get_logger(__name__)

Subscriber = Callable[[Sequence[Event]], None]


class Batch(NamedTuple):
    """Records ``first_seq..last_seq`` of one epoch, committed together or not at all.

    events: block events, seqs ``first_seq``, ``first_seq + 1``, ...
    data_kind, data: one POOL_INIT, SNAPSHOT or POOL_CLOSE record after the
        events, carrying ``data`` (JSON-serialisable); None for none.
    journal: request journal records of the same step, journal seqs
        ``first_journal_seq``, ... (stored in ``request_journal``, same transaction).
    Every record of the batch carries ``step`` and the batch's two times.
    (A NamedTuple: the engine's thread makes one per step, at the cost of a tuple.)
    """

    first_seq: int
    step: int | None
    wall_time_ns: int
    monotonic_ns: int
    events: Sequence[BlockEvent] = ()
    data_kind: EventKind | None = None
    data: Any = None
    journal: Sequence[JournalRecord] = ()
    first_journal_seq: int = 0

    @property
    def num_records(self) -> int:
        return len(self.events) + (self.data_kind is not None)

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.num_records - 1


MAX_EVENTS_PER_COMMIT = 20_000
RETRY_DELAYS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)


__all__ = ["MAX_EVENTS_PER_COMMIT", "Batch", "EventLogError", "LogWriter", "SecondWriterError"]

# bytes a record is taken to need before the writer has measured any (the mean of a short trace)
_RECORD_BYTES_GUESS = 80
# seconds the writer thread sleeps while idle; it checks its SQLite file each time
_IDLE_WAIT_S = 0.5


class _GuardMoved(Exception):
    """The epoch row no longer holds what this writer last wrote."""


class _Abandoned(Exception):
    """``abandon`` was called: stop without committing."""


class LogWriter:
    """Commits sealed batches for one (pool_id, epoch) from a background thread.

    ``durable_seq`` only grows, and every event at or below it is committed
    (it drops to 0 only when the SQLite file is found deleted or replaced:
    then nothing is). ``healthy`` is False while commits fail (they are
    retried with backoff, never dropped; ``failing_since`` and ``last_error``
    say since when and why) and after a fatal error (``error`` is then set and
    every later ``submit`` raises it).

    database_file: the SQLite file being written, whose identity (device,
        inode) is checked; None for other stores.
    """

    def __init__(
        self,
        engine: Engine,
        pool_id: str,
        epoch: int,
        writer_id: str,
        durable_seq: int,
        head_hash: bytes,
        max_pending_batches: int,
        database_file: Path | None = None,
    ) -> None:
        self._engine = engine
        self.pool_id = pool_id
        self.epoch = epoch
        self.writer_id = writer_id
        self.durable_seq = durable_seq
        # journal records committed (they move with durable_seq: the same commits, under the same lock)
        self.durable_journal_seq = 0
        self._journal_rows: list[JournalRow] = []  # journal rows of the group being committed
        self._durable_listeners: list[Callable[[], None]] = []
        self._written_seq = durable_seq  # the durable_seq this writer last stored in the epoch row
        self._head_hash = head_hash  # hash of the last event handed to a commit
        self._chained_seq = durable_seq
        self.max_pending_batches = max_pending_batches
        self._bounded = True  # False once the caller may no longer block (shutdown)
        self.pending: deque[Batch] = deque()
        self._wakeup = threading.Event()
        self._progress = threading.Condition()  # notified after every commit or failure
        self._subscribers: list[Subscriber] = []
        self._subscribers_lock = threading.Lock()
        self._stopping = False
        self._abandoned = False
        self.healthy = True
        self.error: BaseException | None = None
        self.num_retries = 0
        self.failing_since: float | None = None  # time.monotonic() of the first failed commit of this outage
        self.last_error: str | None = None  # the store's last error, one line
        self._num_inflight_batches = 0  # batches of the group being committed
        self._inflight_bytes = 0
        self._num_committed_records = 0
        self._num_committed_bytes = 0
        self._database_file = database_file
        self._file_identity = _identity(database_file) if database_file is not None else None
        self._thread = threading.Thread(target=self._run, name=f"event-log-writer-{pool_id}-{epoch}", daemon=True)

    def start(self) -> None:
        """Start the writer thread (after the epoch's first record is committed)."""
        self._thread.start()

    # -- caller side -------------------------------------------------------
    def submit(self, batch: Batch) -> None:
        """Queue one sealed batch; blocks while ``max_pending_batches`` wait to be committed (the group
        being committed included), until ``unbound``."""
        if self.error is not None:
            raise self.error
        pending = self.pending
        if len(pending) + self._num_inflight_batches >= self.max_pending_batches and self._bounded:
            self._wait_for_room()
        pending.append(batch)
        if not self._wakeup.is_set():
            self._wakeup.set()

    def _wait_for_room(self) -> None:
        with self._progress:
            while self.num_pending_batches >= self.max_pending_batches and self.error is None and self._bounded:
                self._progress.wait(0.1)
        if self.error is not None:
            raise self.error

    def unbound(self) -> None:
        """Let ``submit`` queue past ``max_pending_batches`` from now on, and wake a caller waiting for room.

        For shutdown: the last steps must reach ``close``, which bounds the wait instead.
        """
        self._bounded = False
        with self._progress:
            self._progress.notify_all()

    @property
    def bounded(self) -> bool:
        """Whether ``submit`` still waits for room (False after ``unbound``)."""
        return self._bounded

    @property
    def num_pending_batches(self) -> int:
        """Batches submitted and not yet committed (the group being committed included)."""
        return len(self.pending) + self._num_inflight_batches

    def pending_bytes(self, num_pending_records: int) -> int:
        """Bytes of ``num_pending_records`` records not yet committed: the group being committed
        exactly, the rest at the mean record size committed so far."""
        mean = self._num_committed_bytes / self._num_committed_records if self._num_committed_records else 0
        inflight_bytes = self._inflight_bytes
        num_queued = max(0, num_pending_records - (self._chained_seq - self.durable_seq))
        return inflight_bytes + round(num_queued * (mean or _RECORD_BYTES_GUESS))

    def wait_durable(self, seq: int, timeout_s: float | None = None, journal_seq: int = 0) -> bool:
        """Wait until ``durable_seq >= seq`` (and ``durable_journal_seq >= journal_seq``); False on
        timeout. Raises the writer's fatal error."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._progress:
            while self.durable_seq < seq or self.durable_journal_seq < journal_seq:
                if self.error is not None:
                    raise self.error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._progress.wait(0.1 if remaining is None else min(remaining, 0.1))
        return True

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(events)`` on the writer thread after each commit; returns unsubscribe."""
        with self._subscribers_lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._subscribers_lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def stop(self, timeout_s: float | None = None) -> None:
        """Commit what is queued, then end the thread."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    def abandon(self, timeout_s: float = 1.0) -> bool:
        """Stop without committing what is queued; True when the thread has ended.

        A commit already in the store's hands may still finish within
        ``timeout_s``; after this returns True nothing more is committed (False:
        the thread is stuck in the store, and a commit it started may land).
        """
        self._abandoned = True
        self._stopping = True
        self._wakeup.set()
        with self._progress:
            self._progress.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- writer thread -----------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wakeup.wait(_IDLE_WAIT_S)
            self._wakeup.clear()
            try:
                self._check_file()
                while self.pending and not self._abandoned:
                    group = self._take_group()
                    self._journal_rows = self.seal_journal(group)
                    self._commit_with_retry(*self.seal_rows(group))
            except _Abandoned:
                return
            except EventLogError as exc:
                self._fail(exc)
                return
            except BaseException as exc:  # a bug here must not hang callers in backpressure
                self._fail(EventLogError(f"event log writer crashed: {exc!r}"))
                raise
            if self._abandoned or (self._stopping and not self.pending):
                return

    def _take_group(self) -> list[Batch]:
        batches: list[Batch] = []
        num_events = 0
        pending = self.pending
        while pending and num_events < MAX_EVENTS_PER_COMMIT:
            batch = pending.popleft()
            batches.append(batch)
            num_events += batch.num_records
        self._num_inflight_batches = len(batches)
        with self._progress:
            self._progress.notify_all()
        return batches

    def _check_file(self) -> None:
        """Raise LogFileLostError when the SQLite file at the path is not the one this writer opened."""
        if self._database_file is None:
            return
        identity = _identity(self._database_file)
        if identity != self._file_identity:
            what = "deleted" if identity is None else "replaced by another file"
            raise LogFileLostError(
                f"the event log file {str(self._database_file)!r} was {what} while this server wrote it: "
                f"pool {self.pool_id!r} epoch {self.epoch} is lost with it (seqs 1..{self._chained_seq}); "
                "no later event is recorded"
            )

    def seal_first(self, batch: Batch) -> tuple[list[Row], bytes]:
        """Rows and head hash of the epoch's first batch, committed by ``EventLog.open`` itself."""
        rows, last_seq, head_hash, _ = self.seal_rows([batch])
        self.durable_seq = self._written_seq = last_seq
        return rows, head_hash

    def seal_journal(self, batches: list[Batch]) -> list[JournalRow]:
        """The request journal rows of ``batches``, in journal seq order."""
        rows: list[JournalRow] = []
        pool_id, epoch = self.pool_id, self.epoch
        for batch in batches:
            journal_seq = batch.first_journal_seq
            for record in batch.journal:
                data = encode_journal(record.data)
                rows.append(
                    (
                        pool_id,
                        epoch,
                        journal_seq,
                        record.request_id,
                        record.kind.value,
                        batch.step,
                        batch.wall_time_ns,
                        data,
                    )
                )
                journal_seq += 1
        return rows

    def add_durable_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the writer thread after every commit (it must be quick)."""
        self._durable_listeners.append(callback)

    def seal_rows(self, batches: list[Batch]) -> tuple[list[Row], int, bytes, int | None]:
        """Rows with their encoded records and chained hashes; each row's batch_seq is its batch's last seq."""
        rows: list[Row] = []
        previous = self._head_hash
        pool_id, epoch = self.pool_id, self.epoch
        closed_seq = None
        seq = self._chained_seq + 1
        for batch in batches:
            assert batch.first_seq == seq, f"batch from seq {batch.first_seq} sealed where seq {seq} was due"
            batch_seq, step, wall_ns, mono_ns = batch.last_seq, batch.step, batch.wall_time_ns, batch.monotonic_ns
            for event in batch.events:
                record = encode_block_record(seq, batch_seq, event, step, wall_ns, mono_ns)
                previous = chain_hash(previous, record)
                key = event.keys[0] if event.keys else None
                rows.append((pool_id, epoch, seq, event.kind.value, event.owner, record, previous, key))
                seq += 1
            if batch.data_kind is not None:
                record = encode_data_record(seq, batch_seq, batch.data_kind, batch.data, step, wall_ns, mono_ns)
                previous = chain_hash(previous, record)
                if batch.data_kind is EventKind.POOL_CLOSE:
                    closed_seq = seq
                rows.append((pool_id, epoch, seq, batch.data_kind.value, None, record, previous, None))
                seq += 1
        self._head_hash = previous
        self._chained_seq = seq - 1
        return rows, seq - 1, previous, closed_seq

    def _commit_with_retry(self, rows: list[Row], last_seq: int, head_hash: bytes, closed_seq: int | None) -> None:
        attempt = 0
        journal_rows = self._journal_rows
        self._inflight_bytes = sum(len(row[5]) for row in rows) + sum(len(row[7]) for row in journal_rows)
        while True:
            if self._abandoned:
                raise _Abandoned
            try:
                self._commit(rows, last_seq, head_hash, closed_seq)
                break
            except _GuardMoved:
                self._check_already_committed(last_seq, head_hash)
                break
            except (sa.exc.SQLAlchemyError, self._engine.dialect.loaded_dbapi.Error) as exc:
                # a journal-only commit leaves the guard where it was: a retry after a lost
                # acknowledgement meets its own journal rows (the driver's IntegrityError)
                if journal_rows and _is_integrity_error(exc) and self._journal_committed(journal_rows[-1][2]):
                    break
                self._note_failure(exc, last_seq, attempt)
                self._sleep(RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)])
                attempt += 1
        self._check_file()  # a commit into a deleted file is not durable
        if not self.healthy:
            log.info(
                "event_log_commit_recovered",
                pool_id=self.pool_id,
                epoch=self.epoch,
                last_seq=last_seq,
                failed_for_s=round(time.monotonic() - (self.failing_since or time.monotonic()), 3),
            )
        self.healthy = True
        self.failing_since = None
        self._written_seq = last_seq
        self._num_committed_records += len(rows) + len(journal_rows)
        self._num_committed_bytes += self._inflight_bytes
        with self._progress:
            self.durable_seq = last_seq
            if journal_rows:
                self.durable_journal_seq = journal_rows[-1][2]
            self._num_inflight_batches = 0
            self._inflight_bytes = 0
            self._progress.notify_all()
        for listener in self._durable_listeners:
            listener()
        if rows:
            self._publish(rows)

    def _note_failure(self, exc: BaseException, last_seq: int, attempt: int) -> None:
        """One failed commit: unhealthy until a commit succeeds; a warning line per attempt."""
        self.healthy = False
        if self.failing_since is None:
            self.failing_since = time.monotonic()
        self.last_error = store_cause(exc)
        self.num_retries += 1
        log.warning(
            "event_log_commit_failed",
            pool_id=self.pool_id,
            epoch=self.epoch,
            last_seq=last_seq,
            durable_seq=self.durable_seq,
            attempt=attempt + 1,
            retry_in_s=RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)],
            error=self.last_error,
        )
        with self._progress:
            self._progress.notify_all()

    def _sleep(self, delay_s: float) -> None:
        """Wait before a retry; ``abandon`` cuts it short."""
        with self._progress:
            if not self._abandoned:
                self._progress.wait(delay_s)

    def _commit(self, rows: list[Row], last_seq: int, head_hash: bytes, closed_seq: int | None) -> None:
        table = pool_epochs
        guard = (
            sa.update(table)
            .where(
                table.c.pool_id == self.pool_id,
                table.c.epoch == self.epoch,
                table.c.writer_id == self.writer_id,
                table.c.durable_seq == self._written_seq,
            )
            .values(durable_seq=last_seq, head_hash=head_hash, closed_seq=closed_seq)
        )
        with self._engine.begin() as conn:
            if conn.execute(guard).rowcount != 1:
                raise _GuardMoved
            if rows:
                insert_rows(conn, rows)
            insert_journal_rows(conn, self._journal_rows)

    def _journal_committed(self, journal_seq: int) -> bool:
        """Whether this epoch's journal already holds ``journal_seq`` (our own earlier attempt)."""
        table = request_journal
        with self._engine.connect() as conn:
            found = conn.execute(
                sa.select(table.c.journal_seq).where(
                    table.c.pool_id == self.pool_id, table.c.epoch == self.epoch, table.c.journal_seq == journal_seq
                )
            ).scalar_one_or_none()
        return found is not None

    def _check_already_committed(self, last_seq: int, head_hash: bytes) -> None:
        """After the guard moved: our own earlier attempt (fine) or another writer (fatal)."""
        with self._engine.connect() as conn:
            row = conn.execute(
                sa.select(pool_epochs.c.writer_id, pool_epochs.c.durable_seq).where(
                    pool_epochs.c.pool_id == self.pool_id, pool_epochs.c.epoch == self.epoch
                )
            ).one_or_none()
            stored_hash = conn.execute(
                sa.select(allocator_events.c.hash).where(
                    allocator_events.c.pool_id == self.pool_id,
                    allocator_events.c.epoch == self.epoch,
                    allocator_events.c.seq == last_seq,
                )
            ).scalar_one_or_none()
        if row is None or row.writer_id != self.writer_id:
            raise SecondWriterError(
                f"pool {self.pool_id!r} epoch {self.epoch} is held by another writer; "
                f"this writer ({self.writer_id}) stops at seq {self.durable_seq}"
            )
        if stored_hash != head_hash:
            raise EventLogError(
                f"pool {self.pool_id!r} epoch {self.epoch}: stored log diverged at seq <= {last_seq} "
                f"(durable_seq in the database is {row.durable_seq})"
            )
        log.info("event_log_duplicate_commit_recognised", pool_id=self.pool_id, epoch=self.epoch, last_seq=last_seq)

    def _publish(self, rows: list[Row]) -> None:
        with self._subscribers_lock:
            subscribers = list(self._subscribers)
        if not subscribers:
            return
        events = [
            decode_event(pool_id, epoch, seq, record, hash_) for pool_id, epoch, seq, _, _, record, hash_, _ in rows
        ]
        for callback in subscribers:
            try:
                callback(events)
            except Exception as exc:  # one broken consumer must not stop the log
                log.warning("event_log_subscriber_failed", error=repr(exc))
                with self._subscribers_lock:
                    if callback in self._subscribers:
                        self._subscribers.remove(callback)

    def _fail(self, error: EventLogError) -> None:
        log.error("event_log_writer_failed", pool_id=self.pool_id, epoch=self.epoch, error=str(error))
        self.healthy = False
        self.error = error
        with self._progress:
            if isinstance(error, LogFileLostError):
                self.durable_seq = 0  # what was committed went with the file
                self.durable_journal_seq = 0
            self._progress.notify_all()


def _is_integrity_error(exc: BaseException) -> bool:
    """A unique key met: SQLAlchemy's IntegrityError, or the driver's (rows inserted through its cursor)."""
    return any(cls.__name__ == "IntegrityError" for cls in type(exc).__mro__)


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``; None when there is none."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino
