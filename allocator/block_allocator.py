"""The paged KV cache's block pool: a free stack and an owner map.

The pool hands out fixed-size KV blocks (``block_size`` token slots each) to
requests, following the paged-attention scheme of Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention" (SOSP 2023).
It is pure integer bookkeeping: block ids in, block ids out.

When an ``EventLog`` is attached, every state change (allocate, allocate_for,
free, free_all) is recorded as one event, so the pool can be rebuilt and audited
from the log (see ``nanoserve.allocator.log.replay``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

from nanoserve.allocator.events import EventKind
from nanoserve.allocator.pool_state import PoolState

if TYPE_CHECKING:
    from nanoserve.allocator.log.event_log import EventLog

_ALLOCATE = EventKind.ALLOCATE.value
_ALLOCATE_FOR = EventKind.ALLOCATE_FOR.value
_FREE = EventKind.FREE.value
_FREE_ALL = EventKind.FREE_ALL.value


class FreeReason(str, enum.Enum):
    """Why blocks went back to the pool; recorded on free events."""

    FINISHED = "finished"
    ABORTED = "aborted"
    PREEMPTED = "preempted"


class KVCacheExhausted(RuntimeError):
    """The pool has fewer free blocks than a request needs.

    ``requested`` and ``available`` are block counts. Nothing was reserved. The
    scheduler catches this by name (to preempt or to wait); it never leaves the
    engine.
    """

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"KV cache exhausted: requested {requested} blocks, {available} free")
        self.requested = requested
        self.available = available

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return (type(self), (self.requested, self.available))


def _check_reason(reason: FreeReason | None) -> str | None:
    if reason is None:
        return None
    if not isinstance(reason, FreeReason):
        raise ValueError(f"reason must be a FreeReason or None, got {reason!r}")
    return reason.value


def _check_owner(owner: str) -> None:
    if type(owner) is not str or not owner:
        raise ValueError(f"owner must be a non-empty str (the request id), got {owner!r}")


class BlockAllocator:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` token slots.

    Invariant: every block id in ``range(num_blocks)`` is either on the free
    stack or in the owner map, never both. The free stack is a plain list used
    last-in-first-out: a block freed a moment ago is handed out first, which
    keeps the working set of blocks small and makes the order exact and easy to
    check (a fresh pool hands out 0, 1, 2, ...).

    Errors: ``KVCacheExhausted`` when too few blocks are free (nothing is
    reserved); ``ValueError`` naming the block on a double free or a block id
    that is not in the pool, and on a bad owner, token count or reason.
    """

    def __init__(self, num_blocks: int, block_size: int, event_log: EventLog | None = None) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        # free stack, top at the end: a fresh pool pops 0 first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # block_id -> owner (request id) of every allocated block
        self._owners: dict[int, str] = {}
        self._step: int | None = None
        self._log = event_log
        if event_log is not None:
            event_log.attach(self)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._owners)

    @property
    def event_log(self) -> EventLog | None:
        return self._log

    def can_allocate(self, num_blocks: int) -> bool:
        """True when ``num_blocks`` blocks are free right now."""
        return num_blocks <= len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self._block_size)

    def owner_of(self, block_id: int) -> str | None:
        """The owner holding ``block_id``, or None when it is free."""
        return self._owners.get(block_id)

    def allocate(self, owner: str) -> int:
        """Reserve one block for ``owner``; returns its id. Raises KVCacheExhausted."""
        _check_owner(owner)
        if not self._free:
            raise KVCacheExhausted(1, 0)
        block_id = self._free.pop()
        self._owners[block_id] = owner
        if self._log is not None:
            self._log.record(_ALLOCATE, (block_id,), owner, None)
        return block_id

    def allocate_for(self, num_tokens: int, owner: str) -> list[int]:
        """Reserve ceil(num_tokens / block_size) blocks for ``owner``, all or none.

        Returns the block ids in the order they were taken. Raises
        KVCacheExhausted (reserving nothing) when the pool cannot cover all of
        them, ValueError when ``num_tokens < 1``.
        """
        _check_owner(owner)
        if type(num_tokens) is not int or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        num_needed = -(-num_tokens // self._block_size)
        free = self._free
        if num_needed > len(free):
            raise KVCacheExhausted(num_needed, len(free))
        block_ids = free[-1 : -num_needed - 1 : -1]
        del free[-num_needed:]
        owners = self._owners
        for block_id in block_ids:
            owners[block_id] = owner
        if self._log is not None:
            self._log.record(_ALLOCATE_FOR, tuple(block_ids), owner, None)
        return block_ids

    def free(self, block_id: int, reason: FreeReason | None = None) -> None:
        """Return ``block_id`` to the pool. ValueError on a double free or a foreign block."""
        reason_value = _check_reason(reason)
        owner = self._owners.pop(block_id, None)
        if owner is None:
            raise self._bad_free(block_id)
        self._free.append(block_id)
        if self._log is not None:
            self._log.record(_FREE, (block_id,), owner, reason_value)

    def free_all(self, block_ids: Iterable[int], reason: FreeReason | None = None) -> None:
        """Return every block in ``block_ids`` to the pool, all or none.

        Blocks are pushed in the order given, so the last one is reused first.
        Every block is checked before any is freed: a double free, a foreign
        block or a block listed twice raises ValueError and frees nothing.
        One event is recorded per run of consecutive blocks of one owner (one
        event in the usual case of a sequence releasing its own blocks), all in
        one batch, so replay pushes them in the same order. An empty list is a
        no-op.
        """
        reason_value = _check_reason(reason)
        block_ids = list(block_ids)
        owners = self._owners
        runs: list[tuple[str, list[int]]] = []  # (owner, consecutive blocks of that owner) in order
        for block_id in block_ids:
            owner = owners.get(block_id)
            if owner is None:
                raise self._bad_free(block_id)
            if runs and runs[-1][0] == owner:
                runs[-1][1].append(block_id)
            else:
                runs.append((owner, [block_id]))
        if len(set(block_ids)) != len(block_ids):
            twice = next(b for b in block_ids if block_ids.count(b) > 1)
            raise ValueError(f"block {twice} is listed twice in free_all (it would be freed twice)")
        for block_id in block_ids:
            del owners[block_id]
        self._free.extend(block_ids)
        if self._log is not None:
            num_runs = len(runs)
            for index, (owner, run) in enumerate(runs, 1):
                # one batch for the whole call: seal only after the last run's event
                self._log.record(_FREE_ALL, tuple(run), owner, reason_value, index == num_runs)

    def begin_step(self, step: int) -> None:
        """Stamp the events that follow with scheduler step ``step``.

        Without an event log this only tracks the step. ValueError when a step
        is still open or ``step`` is negative.
        """
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if self._step is not None:
            raise ValueError(f"step {self._step} is still open; call end_step() before begin_step({step})")
        self._step = step
        if self._log is not None:
            self._log.begin_step(step)

    def end_step(self) -> None:
        """Seal the open step's events into one batch for the log writer.

        A no-op when no step is open or there is no event log.
        """
        if self._step is None:
            return
        self._step = None
        if self._log is not None:
            self._log.end_step()

    def state(self, last_seq: int | None = None) -> PoolState:
        """A copy of the pool as it stands: free stack and owner map."""
        log = self._log
        return PoolState(
            num_blocks=self._num_blocks,
            block_size=self._block_size,
            free_block_ids=tuple(self._free),
            owners=dict(self._owners),
            last_seq=log.last_seq if last_seq is None and log is not None else last_seq,
            pool_id=None if log is None else log.pool_id,
            epoch=None if log is None else log.epoch,
        )

    def snapshot_data(self) -> dict[str, object]:
        """Copies of the free stack and owner map, for a SNAPSHOT record."""
        return {"free_block_ids": list(self._free), "owners": dict(self._owners)}

    def _bad_free(self, block_id: object) -> ValueError:
        if type(block_id) is int and 0 <= block_id < self._num_blocks:
            return ValueError(f"block {block_id} is already free (double free)")
        return ValueError(f"block {block_id!r} does not belong to this pool (block ids are 0..{self._num_blocks - 1})")
