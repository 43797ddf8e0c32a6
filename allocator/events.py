"""Event kinds and the stored event record of the allocator's log.

Kinds are stored as short strings so that a later migration can add new ones
(for example reference-counted sharing for prefix caching) without touching
the existing rows.
"""

from __future__ import annotations

import enum
import json
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


def decode_block_ids(text: str) -> tuple[int, ...]:
    """Stored block ids (``"3,4"``) as a tuple; ValueError on a malformed list."""
    return tuple(map(int, text.split(","))) if text else ()


# kinds whose record tail is JSON data rather than an owner
DATA_KINDS = frozenset((EventKind.POOL_INIT.value, EventKind.SNAPSHOT.value, EventKind.POOL_CLOSE.value))


def parse_event(pool_id: str, epoch: int, seq: int, record: str, hash_: bytes) -> Event:
    """An ``Event`` from its stored record (see ``event_chain``). ValueError when malformed."""
    fields = record.split("|", 8)
    if len(fields) != 9:
        raise ValueError(f"seq {seq}: record has {len(fields)} fields, expected 9")
    _, batch_seq, kind, block_ids, step, reason, wall_ns, mono_ns, tail = fields
    is_data = kind in DATA_KINDS
    return Event(
        pool_id=pool_id,
        epoch=epoch,
        seq=seq,
        batch_seq=int(batch_seq),
        kind=kind,
        block_ids=decode_block_ids(block_ids),
        owner=None if is_data else tail,
        step=int(step) if step else None,
        reason=reason or None,
        wall_time_ns=int(wall_ns),
        monotonic_ns=int(mono_ns),
        data=json.loads(tail) if is_data else None,
        hash=bytes(hash_),
    )
