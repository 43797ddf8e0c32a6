"""The event log's background writer: encode, hash, group-commit, retry, publish.

The caller's thread (the engine's) hands each step's events over as one
``Batch`` and appends it to ``pending`` (a deque: appending is one atomic call,
no lock); it does nothing per event but count seqs. The writer thread takes
every ready batch, seals its records (``batch``: encoded, hash-chained), and
commits them in one transaction (group commit), then advances
``durable_seq`` and hands the committed events to subscribers.

Each commit moves the epoch row's guard (``epoch_guard``): a second writer
cannot interleave, and a retry after an unknown outcome (the commit went
through but the acknowledgement was lost) recognises its own group by the
stored hash. Companion rows (the engine's request journal) ride in the same
transaction, stored by their own table (``companion``); a companion-only
retry recognises itself through that table.

Faults: a commit that fails because the store is away, read-only or full is
retried with backoff, never dropped, while ``healthy`` is False (the caller
blocks once ``max_pending_batches`` wait). A group the store refuses as data
(``errors.is_refused_as_data``: a DataError, a constraint) is never retried: the
writer fails with ``LogRefusedError`` naming the group's first seq, its
transaction rolled back, so the epoch stays consistent up to the seq before. A SQLite file that is no longer the
file at its path (deleted or replaced: checked after every commit and every
idle half second) is fatal: everything committed to it is gone, so
``durable_seq`` drops to 0. ``abandon`` stops the writer without committing
what is left (a bounded shutdown): nothing is committed after it returns.

The pool's lock (``pool_lock``): on PostgreSQL it dies with its session. Every
commit is fenced by it (``PoolLock.fence``, in the commit's transaction); the
writer checks the lock's session when idle and after a failed or fenced-off
commit, and takes the lock again before it writes anything more. When another
server took it meanwhile the writer stops for good with ``PoolLockLostError``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
import structlog
from sqlalchemy.engine import Engine

from nanoserve.allocator.log.batch import Batch, Companions, seal_companion_rows, seal_event_rows
from nanoserve.allocator.log.database_file import DatabaseFile
from nanoserve.allocator.log.epoch_guard import EpochGuard, GuardMoved, check_own_commit, commit_group
from nanoserve.allocator.log.errors import (
    EventLogError,
    LogFileLostError,
    LogRefusedError,
    SecondWriterError,
    is_integrity_error,
    is_refused_as_data,
    store_cause,
)
from nanoserve.allocator.log.key_refs import KeyIds
from nanoserve.allocator.log.pool_lock import PoolLock
from nanoserve.allocator.log.store import Row
from nanoserve.allocator.log.subscription import Subscriber, Subscribers

log = structlog.get_logger(__name__)

MAX_EVENTS_PER_COMMIT = 20_000
RETRY_DELAYS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)


__all__ = ["MAX_EVENTS_PER_COMMIT", "Batch", "Companions", "EventLogError", "LogWriter", "SecondWriterError"]

# bytes a record is taken to need before the writer has measured any (the mean of a short trace)
_RECORD_BYTES_GUESS = 80
# seconds the writer thread sleeps while idle; it checks its SQLite file each time
_IDLE_WAIT_S = 0.5


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
    pool_lock: the pool's lock, held by this writer's log; it fences every
        commit and is taken again after its session ends (None: no lock to keep).
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
        pool_lock: PoolLock | None = None,
    ) -> None:
        self._engine = engine
        self._pool_lock = pool_lock
        self._lock_suspect = False  # a commit failed: check the lock's session before the next one
        self.pool_id = pool_id
        self.epoch = epoch
        self.writer_id = writer_id
        self.durable_seq = durable_seq
        # companion records committed (they move with durable_seq: the same commits, under the same lock)
        self.durable_companion_seq = 0
        self._companion: Companions = Companions(None, [], 0)  # companion rows of the group being committed
        self._key_ids = KeyIds()  # the epoch's stored keys (``key_refs``): committed, and staged by the group's try
        self._durable_listeners: list[Callable[[], None]] = []
        self._written_seq = durable_seq  # the durable_seq this writer last stored in the epoch row
        self._head_hash = head_hash  # hash of the last event handed to a commit
        self._chained_seq = durable_seq
        self.max_pending_batches = max_pending_batches
        self._bounded = True  # False once the caller may no longer block (shutdown)
        self.pending: deque[Batch] = deque()
        self._wakeup = threading.Event()
        self._progress = threading.Condition()  # notified after every commit or failure
        self._subscribers = Subscribers()
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
        self._database_file = DatabaseFile(database_file) if database_file is not None else None
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

    def wait_durable(self, seq: int, timeout_s: float | None = None, companion_seq: int = 0) -> bool:
        """Wait until ``durable_seq >= seq`` (and ``durable_companion_seq >= companion_seq``); False on
        timeout. Raises the writer's fatal error."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._progress:
            while self.durable_seq < seq or self.durable_companion_seq < companion_seq:
                if self.error is not None:
                    raise self.error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._progress.wait(0.1 if remaining is None else min(remaining, 0.1))
        return True

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(events)`` on the writer thread after each commit; returns unsubscribe."""
        return self._subscribers.add(callback)

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
            woken = self._wakeup.wait(_IDLE_WAIT_S)
            self._wakeup.clear()
            try:
                self._check_file()
                if not woken and not self.pending and not self._abandoned:
                    self._check_lock_idle()
                while self.pending and not self._abandoned:
                    group = self._take_group()
                    self._companion = self.seal_companions(group)
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
        if self._database_file is not None:
            self._database_file.check(self.pool_id, self.epoch, self._chained_seq)

    def seal_first(self, batch: Batch) -> tuple[list[Row], bytes]:
        """Rows and head hash of the epoch's first batch, committed by ``EventLog.open`` itself."""
        rows, last_seq, head_hash, _ = self.seal_rows([batch])
        self.durable_seq = self._written_seq = last_seq
        return rows, head_hash

    def seal_companions(self, batches: list[Batch]) -> Companions:
        """The companion rows of ``batches``, in companion seq order, with their table."""
        return seal_companion_rows(batches, self.pool_id, self.epoch, self.writer_id)

    def add_durable_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the writer thread after every commit (it must be quick)."""
        self._durable_listeners.append(callback)

    def seal_rows(self, batches: list[Batch]) -> tuple[list[Row], int, bytes, int | None]:
        """Rows with their encoded records and chained hashes; each row's batch_seq is its batch's last seq."""
        sealed = seal_event_rows(batches, self.pool_id, self.epoch, self._chained_seq + 1, self._head_hash)
        self._head_hash, self._chained_seq = sealed.head_hash, sealed.last_seq
        return sealed

    def _commit_with_retry(self, rows: list[Row], last_seq: int, head_hash: bytes, closed_seq: int | None) -> None:
        attempt = 0
        companion = self._companion
        self._inflight_bytes = sum(len(row[5]) for row in rows) + companion.num_bytes
        while True:
            if self._abandoned:
                raise _Abandoned
            try:
                if self._lock_suspect:
                    self._hold_lock()
                self._commit(rows, last_seq, head_hash, closed_seq)
                break
            except GuardMoved:
                session = self._pool_lock.session if self._pool_lock is not None else None
                self._hold_lock()
                if self._pool_lock is not None and self._pool_lock.session != session:
                    continue  # the fence was down: the lock is held again, the commit is tried again
                self._check_already_committed(last_seq, head_hash)
                break  # the try whose acknowledgement was lost committed what is still staged
            except (sa.exc.SQLAlchemyError, self._engine.dialect.loaded_dbapi.Error) as exc:
                self._lock_suspect = self._pool_lock is not None
                # a companion-only commit leaves the guard where it was: a retry after a lost
                # acknowledgement meets its own companion rows (the driver's IntegrityError)
                if companion.rows and is_integrity_error(exc) and self._companion_committed(companion):
                    break
                if is_refused_as_data(exc):
                    raise self._refused(exc, last_seq) from exc
                self._note_failure(exc, last_seq, attempt)
                self._sleep(RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)])
                attempt += 1
        self._key_ids.commit()  # the group is committed, and with it the keys its last try staged
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
        self._num_committed_records += len(rows) + len(companion.rows)
        self._num_committed_bytes += self._inflight_bytes
        with self._progress:
            self.durable_seq = last_seq
            if companion.rows:
                self.durable_companion_seq = companion.last_seq
            self._num_inflight_batches = 0
            self._inflight_bytes = 0
            self._progress.notify_all()
        for listener in self._durable_listeners:
            listener()
        if rows:
            self._subscribers.publish(rows)

    def _hold_lock(self) -> None:
        """``PoolLock.hold``: PoolLockLostError when another server holds the lock; the store's errors when away."""
        if self._pool_lock is not None:
            self._pool_lock.hold(self.epoch, self.durable_seq)
        self._lock_suspect = False

    def _check_lock_idle(self) -> None:
        """Idle: take the pool's lock again as soon as the store is back (before another server can)."""
        if self._pool_lock is None or self._pool_lock.fence is None:
            return
        try:
            self._hold_lock()
        except (sa.exc.SQLAlchemyError, self._engine.dialect.loaded_dbapi.Error) as exc:
            if self.healthy:
                log.warning("event_log_pool_lock_unreachable", pool_id=self.pool_id, error=store_cause(exc))
                self.failing_since = time.monotonic()
            self.healthy = False
            self.last_error = store_cause(exc)
            return
        if not self.healthy and not self.pending and self._num_inflight_batches == 0:
            self.healthy = True
            self.failing_since = None

    def _refused(self, exc: BaseException, last_seq: int) -> LogRefusedError:
        """The error for a group the store refused as data, logged loudly with its first seq."""
        first_seq = self._written_seq + 1
        error = LogRefusedError(self.pool_id, self.epoch, first_seq, last_seq, store_cause(exc))
        log.error(
            "event_log_batch_refused",
            pool_id=self.pool_id,
            epoch=self.epoch,
            first_seq=first_seq,
            last_seq=last_seq,
            durable_seq=self.durable_seq,
            error=error.cause,
        )
        self.last_error = error.cause
        return error

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
        guard = EpochGuard(self.pool_id, self.epoch, self.writer_id, self._written_seq)
        fence = self._pool_lock.fence if self._pool_lock is not None else None
        commit_group(self._engine, guard, rows, last_seq, head_hash, closed_seq, self._companion, fence, self._key_ids)

    def _companion_committed(self, companion: Companions) -> bool:
        """Whether this epoch's companion table already holds the group's last row (our own earlier attempt)."""
        assert companion.table is not None, "only a group with companion rows asks"
        with self._engine.connect() as conn:
            return companion.table.holds(conn, self.pool_id, self.epoch, companion.last_seq)

    def _check_already_committed(self, last_seq: int, head_hash: bytes) -> None:
        """After the guard moved: our own earlier attempt (fine) or another writer (fatal)."""
        guard = EpochGuard(self.pool_id, self.epoch, self.writer_id, self._written_seq)
        check_own_commit(self._engine, guard, last_seq, head_hash, self.durable_seq)
        log.info("event_log_duplicate_commit_recognised", pool_id=self.pool_id, epoch=self.epoch, last_seq=last_seq)

    def _fail(self, error: EventLogError) -> None:
        log.error("event_log_writer_failed", pool_id=self.pool_id, epoch=self.epoch, error=str(error))
        self.healthy = False
        self.error = error
        with self._progress:
            if isinstance(error, LogFileLostError):
                self.durable_seq = 0  # what was committed went with the file
                self.durable_companion_seq = 0
            self._progress.notify_all()
