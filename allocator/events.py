"""What the block allocator says happened: ``BlockEvent``, its ``EventKind`` and ``FreeReason``.

The allocator emits one ``BlockEvent`` per change to the pool and keeps it
pending until its caller takes it (``BlockAllocator.take_events``); the same
events, applied by ``nanoserve.allocator.transition.apply``, rebuild the pool.
Kinds are short strings so that the stored log gains new ones without
touching the existing rows: prefix caching added REGISTER, SHARE, RELEASE,
EVICT and CACHE_RESET (migration 0002), parallel sampling FORK and COPY.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class EventKind(str, enum.Enum):
    """What one event says happened.

    The block kinds are emitted by the allocator; POOL_INIT, SNAPSHOT and
    POOL_CLOSE are written by the event log around them.
    """

    POOL_INIT = "pool_init"  # an epoch opens: num_blocks, block_size, model, config
    ALLOCATE = "allocate"  # one block taken by owner
    ALLOCATE_FOR = "allocate_for"  # ceil(num_tokens / block_size) blocks taken at once
    FREE = "free"  # one block returned
    FREE_ALL = "free_all"  # several blocks of one owner returned at once
    REGISTER = "register"  # full blocks whose KV a forward pass wrote, indexed under their keys
    SHARE = "share"  # a reference taken on cached blocks (held by others, or cached-free)
    RELEASE = "release"  # owner drops its reference on cached blocks; at count 0 they stay cached-free
    EVICT = "evict"  # cached-free blocks lose their keys and go back on the free stack, for owner
    CACHE_RESET = "cache_reset"  # every cached-free block loses its key (the Allocation service's reset)
    FORK = "fork"  # a child takes a reference on each of its parent's blocks (parallel sampling)
    COPY = "copy"  # a holder copies a forked partial block before writing into it (copy on write)
    SNAPSHOT = "snapshot"  # the full pool state, so replay can start here
    POOL_CLOSE = "pool_close"  # the epoch ended cleanly


class FreeReason(str, enum.Enum):
    """Why blocks moved: carried by free events (why they went back to the pool), and by one
    allocation, DRAFT (an ALLOCATE_FOR whose blocks are slots of draft tokens, which the step's
    verify pass either keeps for accepted drafts or gives back as REJECTED_DRAFT). Stored as
    the record's reason text, so a log written before DRAFT existed reads as before."""

    FINISHED = "finished"
    ABORTED = "aborted"
    PREEMPTED = "preempted"
    REJECTED_DRAFT = "rejected_draft"  # speculative decoding: blocks only the rejected draft tokens needed
    DRAFT = "draft"  # speculative decoding, on ALLOCATE_FOR only: slots taken for draft tokens


class BlockEvent(NamedTuple):
    """One change to the pool, as the allocator made it. Immutable.

    kind: a block kind (ALLOCATE, ALLOCATE_FOR, FREE, FREE_ALL).
    block_ids: the blocks touched, in the allocator's order: the order they
        were taken off the free stack, or pushed back onto it.
    owner: the request id that took the blocks, or held them until now.
    reason: why blocks were freed (FREE, FREE_ALL, RELEASE); DRAFT on an
        ALLOCATE_FOR of draft tokens' slots; None on other allocations and
        unexplained frees.
    keys: the prefix-cache kinds only: each block's key (hex sha256), in
        ``block_ids`` order; empty for the other kinds.
    parent_keys: REGISTER only: each block's parent key (None for the first
        block of a sequence).
    ref_counts: SHARE and RELEASE only: each block's reference count after
        the event; replay checks them against the holders it rebuilt.
    token_ids: REGISTER only: each block's ``block_size`` token ids (what a
        gateway's prefix index of the replica needs); empty in records written
        before they were logged.
    parent: FORK and COPY only: the owner whose blocks were forked (FORK: the
        one the child shares with; COPY: the one the copied block came from).
    partial: FORK only: the last block is partly filled, so a holder must copy
        it (COPY) before writing into it while others hold it.

    FORK: ``block_ids`` are the parent's blocks in logical order, ``owner`` the
    child, ``ref_counts`` each block's count after. COPY: ``block_ids`` is
    ``(source, destination)``: the destination leaves the free stack for
    ``owner``, who drops its reference on the source (``ref_counts`` is the
    source's count after); the engine copies the K/V rows on the cache.
    Forking follows the vLLM paper (Kwon et al., SOSP 2023), section 4.4.

    An event carries no sequence number, step or time: the event log stamps
    those when the engine hands it a step's events (``EventLog.append_batch``).
    A NamedTuple rather than a frozen dataclass: the allocator makes one per
    call, and it is built in half the time.
    """

    kind: EventKind
    block_ids: tuple[int, ...]
    owner: str
    reason: FreeReason | None = None
    keys: tuple[str, ...] = ()
    parent_keys: tuple[str | None, ...] = ()
    ref_counts: tuple[int, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    parent: str | None = None
    partial: bool = False
