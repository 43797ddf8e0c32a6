"""Event kinds and the stored event record of the allocator's log.

Kinds are stored as short strings so that a later migration can add new ones
(for example reference-counted sharing for prefix caching) without touching
the existing rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class EventKind(str, enum.Enum):
    """What one log record says happened."""

    POOL_INIT = "pool_init"  # an epoch opens: num_blocks, block_size, model, config
    ALLOCATE = "allocate"  # one block taken by owner
    ALLOCATE_FOR = "allocate_for"  # ceil(num_tokens / block_size) blocks taken at once
    FREE = "free"  # one block returned
    FREE_ALL = "free_all"  # several blocks of one owner returned at once
    SNAPSHOT = "snapshot"  # the full pool state, so replay can start here
    POOL_CLOSE = "pool_close"  # the epoch ended cleanly


@dataclass(frozen=True, slots=True)
class Event:
    """One committed log record, as stored.

    block_ids: the blocks the event touched, in the allocator's order.
    data: the POOL_INIT settings, the SNAPSHOT state or the POOL_CLOSE summary
        (decoded JSON), None for the other kinds.
    wall_time_ns / monotonic_ns: ``time.time_ns()`` / ``time.monotonic_ns()``
        when the allocator made the change.
    """

    pool_id: str
    epoch: int
    seq: int
    batch_seq: int
    kind: str
    block_ids: tuple[int, ...]
    owner: str | None
    step: int | None
    reason: str | None
    wall_time_ns: int
    monotonic_ns: int
    data: Any
    hash: bytes


def encode_block_ids(block_ids: tuple[int, ...] | list[int]) -> str:
    """Block ids as stored: ``"3,4"``."""
    return ",".join(map(str, block_ids))


def decode_block_ids(text: str) -> tuple[int, ...]:
    """Inverse of ``encode_block_ids``; ValueError on a malformed list."""
    return tuple(map(int, text.split(","))) if text else ()
