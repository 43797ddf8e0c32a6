"""``Event``: one committed record of the event log, as stored and read back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Event:
    """One committed log record, as stored.

    kind: an ``EventKind`` value (a str: a log may hold kinds newer than this code).
    seq: its place in the epoch, 1, 2, 3, ... with no gap; batch_seq: the
        last seq of the batch it was committed in (a step's events are one batch).
    block_ids: the blocks the event touched, in the allocator's order.
    owner: the request id of a block event; None for POOL_INIT, SNAPSHOT, POOL_CLOSE.
    step: the engine's scheduler step of the batch; None outside any step.
    data: the POOL_INIT settings, the SNAPSHOT state or the POOL_CLOSE summary
        (decoded JSON), None for the other kinds.
    wall_time_ns / monotonic_ns: ``time.time_ns()`` / ``time.monotonic_ns()``
        when the event's batch was appended to the log; for block events the
        end of the scheduler step that made them (``EventLog.append_batch``).
    hash: sha256 of the previous record's hash and this record (the chain).
    keys, parent_keys, ref_counts: the prefix-cache kinds' block keys (hex),
        REGISTER's parent keys and SHARE/RELEASE's counts after the event
        (see ``BlockEvent``); empty for the other kinds.
    token_ids: REGISTER only: each block's token ids; empty for the other
        kinds and for REGISTER records written before they were logged.
    parent, partial: FORK and COPY only (see ``BlockEvent``).
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
    keys: tuple[str, ...] = ()
    parent_keys: tuple[str | None, ...] = ()
    ref_counts: tuple[int, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    parent: str | None = None
    partial: bool = False
