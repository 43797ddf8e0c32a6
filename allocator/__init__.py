"""The paged KV cache's block allocator, event-sourced.

``BlockAllocator`` hands out fixed-size KV blocks; ``BlockTable`` maps one
sequence's token positions onto them. With an ``EventLog`` attached, every
change is an event in an append-only, hash-chained log that ``replay`` and
``audit`` rebuild and check. Pure bookkeeping: no torch, nothing from the engine.
"""

from nanoserve.allocator.block_allocator import BlockAllocator, FreeReason, KVCacheExhausted
from nanoserve.allocator.block_table import BlockTable
from nanoserve.allocator.events import EventKind
from nanoserve.allocator.pool_state import PoolState

__all__ = [
    "BlockAllocator",
    "BlockTable",
    "EventKind",
    "FreeReason",
    "KVCacheExhausted",
    "PoolState",
]
