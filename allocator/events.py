"""Event kinds and the stored event record of the allocator's log.

Kinds are stored as short strings so that a later migration can add new ones
(for example reference-counted sharing for prefix caching) without touching
the existing rows.
"""

from __future__ import annotations

import enum


class EventKind(str, enum.Enum):
    """What one log record says happened."""

    POOL_INIT = "pool_init"  # an epoch opens: num_blocks, block_size, model, config
    ALLOCATE = "allocate"  # one block taken by owner
    ALLOCATE_FOR = "allocate_for"  # ceil(num_tokens / block_size) blocks taken at once
    FREE = "free"  # one block returned
    FREE_ALL = "free_all"  # several blocks of one owner returned at once
    SNAPSHOT = "snapshot"  # the full pool state, so replay can start here
    POOL_CLOSE = "pool_close"  # the epoch ended cleanly
