"""The paged KV cache's block pool: a free stack and an owner map that emit their events.

The pool hands out fixed-size KV blocks (``block_size`` token slots each) to
requests, following the paged-attention scheme of Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention" (SOSP 2023).
It is pure integer bookkeeping: block ids in, block ids out.

Every change is a ``BlockEvent``, applied to the pool by ``transition.apply``
and kept pending until the caller takes it with ``take_events()`` (the engine
does once per scheduler step and hands the events to the event log). The pool
never holds the log: it emits, the caller persists.
"""

from __future__ import annotations

from collections.abc import Iterable

from nanoserve.allocator.arithmetic import cdiv
from nanoserve.allocator.events import BlockEvent, EventKind, FreeReason
from nanoserve.allocator.pool_state import PoolState
from nanoserve.allocator.transition import apply

_ALLOCATE = EventKind.ALLOCATE
_ALLOCATE_FOR = EventKind.ALLOCATE_FOR
_FREE = EventKind.FREE
_FREE_ALL = EventKind.FREE_ALL


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


def _check_reason(reason: FreeReason | None) -> None:
    if reason is not None and not isinstance(reason, FreeReason):
        raise ValueError(f"reason must be a FreeReason or None, got {reason!r}")


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

    Events: each call that changes the pool appends its events to a pending
    list, in the order of the changes; ``take_events()`` drains it. Applying
    the taken events to ``PoolState.fresh(num_blocks, block_size)`` with
    ``transition.apply`` gives ``state()``.

    Errors: ``KVCacheExhausted`` when too few blocks are free (nothing is
    reserved); ``ValueError`` naming the block on a double free or a block id
    that is not in the pool, and on a bad owner, token count or reason. A call
    that raises changes nothing and emits nothing.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self._state = PoolState.fresh(num_blocks, block_size)
        self._free = self._state.free_block_ids  # the state's free stack, top at the end
        self._owners = self._state.owners  # block_id -> owner (request id) of every allocated block
        self._pending: list[BlockEvent] = []  # emitted, not yet taken; in order

    @property
    def num_blocks(self) -> int:
        return self._state.num_blocks

    @property
    def block_size(self) -> int:
        return self._state.block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._owners)

    @property
    def num_pending_events(self) -> int:
        """Events emitted and not yet taken."""
        return len(self._pending)

    def can_allocate(self, num_blocks: int) -> bool:
        """True when ``num_blocks`` blocks are free right now."""
        return num_blocks <= len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return cdiv(num_tokens, self._state.block_size)

    def owner_of(self, block_id: int) -> str | None:
        """The owner holding ``block_id``, or None when it is free."""
        return self._owners.get(block_id)

    def allocate(self, owner: str) -> int:
        """Reserve one block for ``owner``; returns its id. Emits ALLOCATE. Raises KVCacheExhausted."""
        _check_owner(owner)
        if not self._free:
            raise KVCacheExhausted(1, 0)
        block_id = self._free[-1]
        self._emit(BlockEvent(_ALLOCATE, (block_id,), owner))
        return block_id

    def allocate_for(self, num_tokens: int, owner: str) -> list[int]:
        """Reserve ceil(num_tokens / block_size) blocks for ``owner``, all or none.

        Returns the block ids in the order they were taken (the top of the free
        stack first). Emits one ALLOCATE_FOR. Raises KVCacheExhausted
        (reserving nothing) when the pool cannot cover all of them, ValueError
        when ``num_tokens < 1``.
        """
        _check_owner(owner)
        if type(num_tokens) is not int or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        num_needed = cdiv(num_tokens, self._state.block_size)
        free = self._free
        if num_needed > len(free):
            raise KVCacheExhausted(num_needed, len(free))
        block_ids = free[-1 : -num_needed - 1 : -1]
        self._emit(BlockEvent(_ALLOCATE_FOR, tuple(block_ids), owner))
        return block_ids

    def free(self, block_id: int, reason: FreeReason | None = None) -> None:
        """Return ``block_id`` to the pool. Emits FREE. ValueError on a double free or a foreign block."""
        _check_reason(reason)
        owner = self._owners.get(block_id)
        if owner is None:
            raise self._bad_free(block_id)
        self._emit(BlockEvent(_FREE, (block_id,), owner, reason))

    def free_all(self, block_ids: Iterable[int], reason: FreeReason | None = None) -> None:
        """Return every block in ``block_ids`` to the pool, all or none.

        Blocks are pushed in the order given, so the last one is reused first.
        Every block is checked before any is freed: a double free, a foreign
        block or a block listed twice raises ValueError and frees nothing.
        Emits one FREE_ALL per run of consecutive blocks of one owner (one in
        the usual case of a sequence releasing its own blocks). An empty list
        is a no-op.
        """
        _check_reason(reason)
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
        for owner, run in runs:
            self._emit(BlockEvent(_FREE_ALL, tuple(run), owner, reason))

    def take_events(self) -> list[BlockEvent]:
        """The events emitted since the last call, in order; the pending list is left empty."""
        events, self._pending = self._pending, []
        return events

    def state(self) -> PoolState:
        """A copy of the pool as it stands: free stack and owner map."""
        return self._state.copy()

    def snapshot(self) -> PoolState:
        """A copy of the pool for a SNAPSHOT record: the state after exactly the events taken so far.

        Every event must have been taken (an event still pending would make the
        snapshot run ahead of the log it goes into).
        """
        assert not self._pending, f"{len(self._pending)} events are still pending: take them before a snapshot"
        return self._state.copy()

    def _emit(self, event: BlockEvent) -> None:
        apply(self._state, event)
        self._pending.append(event)

    def _bad_free(self, block_id: object) -> ValueError:
        num_blocks = self._state.num_blocks
        if type(block_id) is int and 0 <= block_id < num_blocks:
            return ValueError(f"block {block_id} is already free (double free)")
        return ValueError(f"block {block_id!r} does not belong to this pool (block ids are 0..{num_blocks - 1})")
