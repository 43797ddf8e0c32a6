"""The allocator's event log: append-only, hash-chained, replayed and audited.

Built on the pure allocator (``nanoserve.allocator``), never the reverse: the
engine takes the allocator's events once per step and appends them here
(``EventLog.append_batch``); ``replay`` and ``audit`` rebuild the pool from the
stored records with the allocator's own transition function. The schema comes
from ``nanoserve.migrations``, which the log never imports.
"""

from nanoserve.allocator.log.audit import AuditReport, audit, audit_all
from nanoserve.allocator.log.errors import (
    EventLogError,
    EventLogIncompleteError,
    LogDamagedError,
    LogFileLostError,
    LogNotFoundError,
    LogReadError,
    LogRefusedError,
    LogUnavailableError,
    PoolLockLostError,
    SecondWriterError,
)
from nanoserve.allocator.log.event_log import EventLog
from nanoserve.allocator.log.pool_lock import PoolLock
from nanoserve.allocator.log.reader import Damage, EpochInfo, read_events, scan_events
from nanoserve.allocator.log.replay import replay
from nanoserve.allocator.log.store import DEFAULT_EVENT_LOG_URL
from nanoserve.allocator.log.store_probe import check_filesystem, probe_store
from nanoserve.allocator.log.stored_event import Event
from nanoserve.allocator.log.subscription import EventStream, EventStreamLagged

__all__ = [
    "DEFAULT_EVENT_LOG_URL",
    "AuditReport",
    "Damage",
    "EpochInfo",
    "Event",
    "EventLog",
    "EventLogError",
    "EventLogIncompleteError",
    "EventStream",
    "EventStreamLagged",
    "LogDamagedError",
    "LogFileLostError",
    "LogRefusedError",
    "LogNotFoundError",
    "PoolLock",
    "LogReadError",
    "LogUnavailableError",
    "PoolLockLostError",
    "SecondWriterError",
    "audit",
    "audit_all",
    "check_filesystem",
    "probe_store",
    "read_events",
    "replay",
    "scan_events",
]
