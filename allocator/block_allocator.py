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

from collections.abc import Iterable, Sequence

from nanoserve.allocator.arithmetic import cdiv
from nanoserve.allocator.block_key import BlockKey
from nanoserve.allocator.errors import KVCacheExhausted
from nanoserve.allocator.events import BlockEvent, EventKind, FreeReason
from nanoserve.allocator.pool_state import PoolState
from nanoserve.allocator.prefix_index import PrefixIndex
from nanoserve.allocator.transition import apply

_ALLOCATE = EventKind.ALLOCATE
_ALLOCATE_FOR = EventKind.ALLOCATE_FOR
_FREE = EventKind.FREE
_FREE_ALL = EventKind.FREE_ALL


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

    Prefix caching (vLLM's automatic prefix caching): ``register`` indexes
    full blocks under their ``BlockKey``; ``share_prefix`` looks a prompt's
    keys up and takes a reference on every hit in one call, so nothing can
    evict a block between the two; ``release`` drops an owner's references,
    and a registered block whose count reaches 0 keeps its KV and key on the
    cached-free list. New blocks come from the free stack of never-cached
    blocks first; only when it is short are cached-free blocks evicted, least
    recently used first (EVICT, then the allocation). With nothing registered
    the pool behaves exactly as the plain LIFO pool.

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
        self._index = PrefixIndex()  # what every registered block's KV was computed from
        self.num_forked_blocks = 0  # block references FORK events took, over the allocator's life
        self.num_copied_blocks = 0  # blocks COPY events copied on write, over the allocator's life

    @property
    def num_blocks(self) -> int:
        return self._state.num_blocks

    @property
    def block_size(self) -> int:
        return self._state.block_size

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: never-cached ones and cached-free ones."""
        return len(self._free) + len(self._state.cached_free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that keep their KV and key until the pool needs them."""
        return len(self._state.cached_free)

    @property
    def num_shared(self) -> int:
        """Blocks held by more than one owner."""
        return len(self._state.sharers)

    @property
    def num_cached(self) -> int:
        """Registered blocks, held or cached-free."""
        return len(self._state.block_keys)

    @property
    def num_allocated(self) -> int:
        return len(self._owners)

    @property
    def num_pending_events(self) -> int:
        """Events emitted and not yet taken."""
        return len(self._pending)

    def can_allocate(self, num_blocks: int) -> bool:
        """True when ``num_blocks`` blocks are free right now (cached-free ones count)."""
        return num_blocks <= len(self._free) + len(self._state.cached_free)

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
            if not self._state.cached_free:
                raise KVCacheExhausted(1, 0)
            self._evict(1, owner)
        block_id = self._free[-1]
        self._emit(BlockEvent(_ALLOCATE, (block_id,), owner))
        return block_id

    def allocate_for(self, num_tokens: int, owner: str, reason: FreeReason | None = None) -> list[int]:
        """Reserve ceil(num_tokens / block_size) blocks for ``owner``, all or none.

        Returns the block ids in the order they were taken (the top of the free
        stack first). Emits one ALLOCATE_FOR, carrying ``reason``: None, or
        ``FreeReason.DRAFT`` for slots of speculative draft tokens. Raises
        KVCacheExhausted (reserving nothing) when the pool cannot cover all of
        them, ValueError when ``num_tokens < 1`` or ``reason`` is another reason.
        """
        _check_owner(owner)
        if type(num_tokens) is not int or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        if reason is not None and reason is not FreeReason.DRAFT:
            raise ValueError(f"an allocation's reason must be None or FreeReason.DRAFT, got {reason!r}")
        num_needed = cdiv(num_tokens, self._state.block_size)
        free = self._free
        if num_needed > len(free):
            available = len(free) + len(self._state.cached_free)
            if num_needed > available:
                raise KVCacheExhausted(num_needed, available)
            self._evict(num_needed - len(free), owner)
        block_ids = free[-1 : -num_needed - 1 : -1]
        self._emit(BlockEvent(_ALLOCATE_FOR, tuple(block_ids), owner, reason))
        return block_ids

    def free(self, block_id: int, reason: FreeReason | None = None) -> None:
        """Return ``block_id`` to the pool. Emits FREE. ValueError on a double free, a foreign block, or a
        registered or shared block (those go back through ``release``)."""
        _check_reason(reason)
        owner = self._owners.get(block_id)
        if owner is None:
            raise self._bad_free(block_id)
        if block_id in self._state.block_keys or block_id in self._state.sharers:
            raise ValueError(f"block {block_id} is cached or shared: release it with release(owner, ...)")
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
            if block_id in self._state.block_keys or block_id in self._state.sharers:
                raise ValueError(f"block {block_id} is cached or shared: release it with release(owner, ...)")
            if runs and runs[-1][0] == owner:
                runs[-1][1].append(block_id)
            else:
                runs.append((owner, [block_id]))
        if len(set(block_ids)) != len(block_ids):
            twice = next(b for b in block_ids if block_ids.count(b) > 1)
            raise ValueError(f"block {twice} is listed twice in free_all (it would be freed twice)")
        for owner, run in runs:
            self._emit(BlockEvent(_FREE_ALL, tuple(run), owner, reason))

    def release(self, owner: str, block_ids: Sequence[int], reason: FreeReason | None = None) -> None:
        """``owner`` lets go of ``block_ids`` (its block table, in logical order), all or none.

        Blocks nobody else holds and that were never registered go back on the
        free stack in the order given (one FREE_ALL, as ``free_all``); the others
        (registered or shared) are released tail first (one RELEASE), so that a
        sequence's tail is evicted before its head. ValueError, freeing nothing,
        when ``owner`` does not hold a block or a block is listed twice.
        """
        _check_owner(owner)
        _check_reason(reason)
        state = self._state
        for block_id in block_ids:
            if owner not in state.holders(block_id):
                if block_id in self._owners:
                    raise ValueError(f"block {block_id} is not held by {owner!r} (holders {state.holders(block_id)})")
                raise self._bad_free(block_id)
        if len(set(block_ids)) != len(block_ids):
            twice = next(b for b in block_ids if block_ids.count(b) > 1)
            raise ValueError(f"block {twice} is listed twice in release (it would be released twice)")
        keys, sharers = state.block_keys, state.sharers
        plain = tuple(b for b in block_ids if b not in keys and b not in sharers)
        cached = tuple(b for b in reversed(block_ids) if b in keys or b in sharers)
        if plain:
            self._emit(BlockEvent(_FREE_ALL, plain, owner, reason))
        if cached:
            self._emit(
                BlockEvent(
                    EventKind.RELEASE,
                    cached,
                    owner,
                    reason,
                    keys=tuple(keys[b][0] if b in keys else "" for b in cached),  # "": forked, never registered
                    ref_counts=tuple(state.ref_count(b) - 1 for b in cached),
                )
            )

    def ref_count(self, block_id: int) -> int:
        """Holders of ``block_id``: 0 when free."""
        return self._state.ref_count(block_id)

    def fork(self, parent: str, child: str, block_ids: Sequence[int], *, partial: bool) -> None:
        """``child`` takes a reference on each of ``block_ids``, which ``parent`` holds (parallel sampling).

        block_ids: the parent's block table, in logical order. partial: its
        last block is partly filled; from now on a holder copies it
        (``copy_on_write``) before writing into it while another holds it.
        Emits one FORK (the counts after it). ValueError, changing nothing, when
        the parent does not hold a block, the child holds one already, a block
        is listed twice, or the list is empty. (Kwon et al., SOSP 2023, 4.4.)
        """
        _check_owner(parent)
        _check_owner(child)
        state = self._state
        if child == parent:
            raise ValueError(f"a request cannot fork into itself ({child!r})")
        if not block_ids:
            raise ValueError("fork of an empty block table")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block_ids {list(block_ids)} lists a block twice")
        for block_id in block_ids:
            holders = state.holders(block_id)
            if parent not in holders:
                raise ValueError(f"block {block_id} is not held by {parent!r} (holders {holders})")
            if child in holders:
                raise ValueError(f"block {block_id} is held by {child!r} already")
        self._emit(
            BlockEvent(
                EventKind.FORK,
                tuple(block_ids),
                child,
                ref_counts=tuple(state.ref_count(b) + 1 for b in block_ids),
                parent=parent,
                partial=partial,
            )
        )
        self.num_forked_blocks += len(block_ids)

    def copy_on_write(self, owner: str, parent: str, block_id: int) -> int:
        """``owner`` trades its reference on the shared ``block_id`` for a new block of its own; returns it.

        The caller copies the block's K/V rows into the new block before
        writing. parent: the owner the block was forked from (it still holds
        it). Emits COPY ``(block_id, new)`` (after an EVICT when only
        cached-free blocks are left). KVCacheExhausted when no block is free;
        ValueError when ``owner`` or ``parent`` does not hold the block or
        nobody else does (a block held once is written in place).
        """
        _check_owner(owner)
        _check_owner(parent)
        holders = self._state.holders(block_id)
        if owner not in holders or parent not in holders:
            raise ValueError(f"block {block_id} is held by {holders}, not by both {owner!r} and {parent!r}")
        if len(holders) < 2:
            raise ValueError(f"block {block_id} is held by {owner!r} alone: write in place")
        if not self._free:
            if not self._state.cached_free:
                raise KVCacheExhausted(1, 0)
            self._evict(1, owner)
        destination = self._free[-1]
        self._emit(
            BlockEvent(EventKind.COPY, (block_id, destination), owner, ref_counts=(len(holders) - 1,), parent=parent)
        )
        self.num_copied_blocks += 1
        return destination

    def count_prefix_hits(self, owner: str, keys: Sequence[BlockKey]) -> tuple[int, int]:
        """(blocks of ``keys`` a ``share_prefix`` would hit now, how many of them are cached-free). Emits nothing."""
        hits = self._index.lookup(self._state, owner, keys)
        return len(hits), sum(1 for block_id in hits if block_id not in self._owners)

    def share_prefix(self, owner: str, keys: Sequence[BlockKey]) -> list[int]:
        """Look up ``keys`` (a prompt's full blocks, in order) and take a reference on each hit.

        Stops at the first block whose key is not indexed, or whose stored
        token ids, extra keys or parent differ from the key's (a hash
        collision, or a parent that was evicted and reused): such a block is a
        miss, never served. Lookup and references are one call, so no eviction
        comes between them. Returns the hit blocks in order; emits one SHARE
        when there is any.
        """
        _check_owner(owner)
        hits = self._index.lookup(self._state, owner, keys)
        if hits:
            state = self._state
            self._emit(
                BlockEvent(
                    EventKind.SHARE,
                    tuple(hits),
                    owner,
                    keys=tuple(state.block_keys[b][0] for b in hits),
                    ref_counts=tuple(state.ref_count(b) + 1 for b in hits),
                )
            )
        return hits

    def register(
        self, owner: str, parent_block_id: int | None, block_ids: Sequence[int], keys: Sequence[BlockKey]
    ) -> int:
        """Index full blocks that ``owner`` holds and a finished forward pass wrote, under ``keys``.

        ``block_ids[i]`` holds the tokens of ``keys[i]``; ``parent_block_id`` is
        the registered block before the first one (None for a sequence's first
        block). Registration stops at the first key that already indexes
        another block (the same content computed twice): later blocks could
        not be chained. Returns how many blocks were registered; emits one
        REGISTER when there is any. ValueError when ``owner`` does not hold a
        block, the parent is not registered, or a block is registered already.
        """
        _check_owner(owner)
        if len(block_ids) != len(keys):
            raise ValueError(f"{len(block_ids)} block_ids but {len(keys)} keys")
        state = self._state
        parent_serial = self._index.serial_of(parent_block_id)
        registered: list[int] = []
        for block_id, key in zip(block_ids, keys, strict=True):
            if owner not in state.holders(block_id):
                raise ValueError(f"block {block_id} is not held by {owner!r}")
            if block_id in state.block_keys:
                raise ValueError(f"block {block_id} is registered already")
            if key.key in state.key_blocks or any(key.key == done.key for done in keys[: len(registered)]):
                break
            parent_serial = self._index.add(block_id, parent_serial, key)
            registered.append(block_id)
        if registered:
            used = keys[: len(registered)]
            self._emit(
                BlockEvent(
                    EventKind.REGISTER,
                    tuple(registered),
                    owner,
                    keys=tuple(key.key for key in used),
                    parent_keys=tuple(key.parent for key in used),
                    token_ids=tuple(key.token_ids for key in used),
                )
            )
        return len(registered)

    def reset_prefix_cache(self, owner: str = "reset") -> bool:
        """Drop every cached-free block's key (they go on the free stack); emits CACHE_RESET.

        Refuses (returns False, changing nothing) while any block is held:
        a held block's key may be about to be shared. True when reset.
        """
        _check_owner(owner)
        if self._owners:
            return False
        state = self._state
        block_ids = tuple(state.cached_free)
        keys = tuple(state.block_keys[b][0] for b in block_ids)
        self._index.drop(block_ids)
        self._emit(BlockEvent(EventKind.CACHE_RESET, block_ids, owner, keys=keys))
        return True

    def _evict(self, num_blocks: int, owner: str) -> None:
        """Evict the ``num_blocks`` least recently used cached-free blocks for ``owner`` (one EVICT)."""
        state = self._state
        block_ids = tuple(state.cached_free[:num_blocks])
        keys = tuple(state.block_keys[b][0] for b in block_ids)
        self._index.drop(block_ids)
        self._emit(BlockEvent(EventKind.EVICT, block_ids, owner, keys=keys))

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
