"""The paged KV cache's block allocator, event-sourced.

``BlockAllocator`` hands out fixed-size KV blocks; ``BlockTable`` maps one
sequence's token positions onto them. With an ``EventLog`` attached, every
change is an event in an append-only, hash-chained log that ``replay`` and
``audit`` rebuild and check. Pure bookkeeping: no torch, nothing from the engine.
"""

from nanoserve.allocator.block_allocator import BlockAllocator, FreeReason, KVCacheExhausted
from nanoserve.allocator.block_table import BlockTable
from nanoserve.allocator.events import Event, EventKind
from nanoserve.allocator.log.audit import AuditReport, audit, audit_all
from nanoserve.allocator.log.database import DEFAULT_EVENT_LOG_URL
from nanoserve.allocator.log.event_log import EventLog
from nanoserve.allocator.log.event_stream import EventStream, EventStreamLagged
from nanoserve.allocator.log.log_reader import EpochInfo, LogNotFoundError, read_events
from nanoserve.allocator.log.log_writer import EventLogError, SecondWriterError
from nanoserve.allocator.log.replay import replay
from nanoserve.allocator.pool_state import PoolState, Violation

__all__ = [
    "DEFAULT_EVENT_LOG_URL",
    "AuditReport",
    "BlockAllocator",
    "BlockTable",
    "EpochInfo",
    "Event",
    "EventKind",
    "EventLog",
    "EventLogError",
    "EventStream",
    "EventStreamLagged",
    "FreeReason",
    "KVCacheExhausted",
    "LogNotFoundError",
    "PoolState",
    "SecondWriterError",
    "Violation",
    "audit",
    "audit_all",
    "read_events",
    "replay",
]
