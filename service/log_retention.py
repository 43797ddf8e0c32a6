"""The running server's archiver: a background thread that keeps the live event log within its retention.

Every ``interval_s`` it runs ``archive_due`` on the server's log and pool: the
epochs ``--event-log-retention-s`` / ``--event-log-retention-bytes`` no longer
keep move into ``--event-log-archive-dir`` (``nanoserve.allocator.log.archive``);
then ``archive_due_segment``: the open epoch's rows before a verified checkpoint,
once they outgrow the same bounds, move into a segment file
(``nanoserve.allocator.log.segment_archive``), so a server that never restarts
keeps its live log flat. It runs on a thread of its own, never on the engine's,
and through its own connections; it deletes only rows before a durable
checkpoint, never a row the engine's writer still writes, so the two meet only
as two writers of the same database. A failed pass is logged and retried at
the next interval; it never stops the server.

Invariant: at most one pass runs at a time; ``stop`` waits for the pass in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import structlog

from nanoserve.allocator.log.archive import ManifestEntry, RetentionPolicy, archive_due
from nanoserve.allocator.log.segment_archive import LiveSize, SegmentEntry, archive_due_segment
from nanoserve.engine.journal.journal_segment import JournalSegments

log = structlog.get_logger("nanoserve.service")

# how often the archiver looks for epochs to archive, seconds
RETENTION_INTERVAL_S = 60.0
# the archive folder's name beside a SQLite log file, when none is configured: <file>.archive
SQLITE_ARCHIVE_SUFFIX = ".archive"
# the archive folder when none is configured and the log is not a SQLite file (relative to the working directory)
DEFAULT_ARCHIVE_DIR = "nanoserve-log-archive"


def default_archive_dir(url: str) -> Path:
    """Where archives go when ``--event-log-archive-dir`` is unset: ``<log file>.archive`` beside a
    SQLite log, ``./nanoserve-log-archive`` otherwise."""
    from nanoserve.allocator.log.store import sqlite_file

    path = sqlite_file(url)
    return path.with_name(path.name + SQLITE_ARCHIVE_SUFFIX) if path is not None else Path(DEFAULT_ARCHIVE_DIR)


class LogArchiver:
    """Archives ``pool_id``'s epochs of the log at ``url`` that ``policy`` no longer keeps, every ``interval_s``.

    passes: passes finished so far; archived: every epoch archived so far, in order;
    segments: every segment of the open epoch archived so far, in order. on_segments: called (on the
    archiver's thread) after a pass that moved segments of the open epoch out of the store; the
    server drops the stored events its catch-ups keep (``StoredEvents.forget``).
    """

    def __init__(
        self,
        url: str,
        pool_id: str,
        dest_dir: Path,
        policy: RetentionPolicy,
        interval_s: float = RETENTION_INTERVAL_S,
        on_segments: Callable[[], object] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s}")
        self.url = url
        self.pool_id = pool_id
        self.dest_dir = dest_dir
        self.policy = policy
        self.interval_s = interval_s
        self.on_segments = on_segments
        self.passes = 0
        self.archived: list[ManifestEntry] = []
        self.segments: list[SegmentEntry] = []
        self._live_size = LiveSize()  # the open epoch's bytes since its cut, measured a range at a time
        self._journal = JournalSegments()  # the open epoch's journal rows scanned so far
        self._sizes: dict[tuple[str, int], int] = {}  # finished epochs' bytes, measured once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanoserve-log-archiver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Ends the thread after the pass in flight (if any); safe to call twice or unstarted."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def run_once(self) -> list[ManifestEntry]:
        """One pass: archives the epochs due and returns them, then the open epoch's due segment (appended to
        ``segments``); also what the thread runs."""
        from nanoserve.engine.journal.store import recovering_epoch
        from nanoserve.migrations import upgrade

        entries = archive_due(
            self.url,
            self.dest_dir,
            self.policy,
            upgrade,
            pool_id=self.pool_id,
            sizes=self._sizes,
            recovery_of=recovering_epoch,
        )
        for entry in entries:
            _log_archived("event_log_epoch_archived", entry)
        self.archived.extend(entries)
        segments = archive_due_segment(
            self.url, self.dest_dir, self.policy, upgrade, self.pool_id, self._live_size, companion=self._journal
        )
        for segment in segments:
            _log_archived("event_log_segment_archived", segment)
        self.segments.extend(segments)
        if segments and self.on_segments is not None:
            self.on_segments()
        self.passes += 1
        return entries

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception as exc:  # the store away, a full disk: try again at the next interval
                log.warning("event_log_archive_failed", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
            self._stop.wait(self.interval_s)


def _log_archived(event: str, entry: ManifestEntry) -> None:
    """One line per file the archiver wrote: what it holds and where (an epoch's, or a segment's)."""
    log.info(
        event,
        pool_id=entry.pool_id,
        epoch=entry.epoch,
        first_seq=entry.first_seq,
        last_seq=entry.last_seq,
        num_bytes=entry.num_bytes,
        path=entry.path,
        sha256=entry.sha256,
    )
