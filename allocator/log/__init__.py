"""The allocator's event log: append-only, hash-chained, replayed and audited.

Built on the pure allocator (``nanoserve.allocator``), never the reverse: the
engine takes the allocator's events once per step and appends them here
(``EventLog.append_batch``); ``replay`` and ``audit`` rebuild the pool from the
stored records with the allocator's own transition function. The schema comes
from ``nanoserve.migrations``, which the log never imports.
"""

from nanoserve.allocator.log.audit import AuditReport, audit, audit_all
from nanoserve.allocator.log.database import DEFAULT_EVENT_LOG_URL
from nanoserve.allocator.log.event import Event
from nanoserve.allocator.log.event_log import EventLog
from nanoserve.allocator.log.event_stream import EventStream, EventStreamLagged
from nanoserve.allocator.log.log_reader import EpochInfo, LogNotFoundError, read_events
from nanoserve.allocator.log.log_writer import EventLogError, SecondWriterError
from nanoserve.allocator.log.pool_lock import PoolLock
from nanoserve.allocator.log.replay import replay

__all__ = [
    "DEFAULT_EVENT_LOG_URL",
    "AuditReport",
    "EpochInfo",
    "Event",
    "EventLog",
    "EventLogError",
    "EventStream",
    "EventStreamLagged",
    "LogNotFoundError",
    "PoolLock",
    "SecondWriterError",
    "audit",
    "audit_all",
    "read_events",
    "replay",
]
