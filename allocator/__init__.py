"""The paged KV cache's block allocator: pure bookkeeping that emits its events.

``BlockAllocator`` hands out fixed-size KV blocks and records every change as
a ``BlockEvent`` pending until its caller takes it; ``BlockTable`` maps one
sequence's token positions onto the blocks; ``apply`` is the one transition
function that both the live pool and replay change a ``PoolState`` with.

No torch, nothing from the engine, and nothing of the event log: the log,
its replay and audit live in ``nanoserve.allocator.log``, which builds on this
package (never the reverse), so importing the allocator pulls in neither
SQLAlchemy nor structlog.
"""

from nanoserve.allocator.arithmetic import cdiv
from nanoserve.allocator.block_allocator import BlockAllocator
from nanoserve.allocator.block_key import BlockKey, extend_block_keys, hash_block
from nanoserve.allocator.block_table import BlockTable
from nanoserve.allocator.errors import KVCacheExhausted
from nanoserve.allocator.events import BlockEvent, EventKind, FreeReason
from nanoserve.allocator.pool_state import PoolState, Violation
from nanoserve.allocator.transition import TRANSITIONS, apply

__all__ = [
    "BlockAllocator",
    "BlockTable",
    "BlockEvent",
    "BlockKey",
    "EventKind",
    "FreeReason",
    "KVCacheExhausted",
    "PoolState",
    "TRANSITIONS",
    "Violation",
    "apply",
    "cdiv",
    "extend_block_keys",
    "hash_block",
]
