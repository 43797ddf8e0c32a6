"""The block pool's one transition function: ``apply(state, event, report)``.

Every change to a pool goes through here. ``BlockAllocator`` decides which
blocks an event takes or returns (and refuses bad input) and then applies the
event; replay applies each stored block event to the pool it rebuilds. So the
live pool and the replayed pool change by the same code, and they agree by
construction rather than by care (the event-sourcing pattern: state is the
fold of ``apply`` over the events).

A rule an event breaks (taking a held block, returning a free one, ...) is
passed to ``report(rule, message, block_id, owner)``, and the event applies as
far as the rules allow: the allocator's ``report`` raises, since it checked
first and a break is a bug; replay's collects ``Violation``s and goes on.

Whoever derives a view from the events (the pictures' ``PoolTimeline``, the
audit's ``HoldingStarts``) passes an ``observe(block_id, old_holder,
new_holder)`` hook instead of re-reading what each kind means: the transition
calls it each time a block's holder (``PoolState.owners``) changes, so the
view follows the pool by the same code.

To add an event kind: add it to ``EventKind``, write its transition
``(state, event, report, observe) -> None`` (calling ``observe`` on every
holder change) and enter it in ``TRANSITIONS``; replay, audit and the
timeline apply it from then on (the fast replay loop hands kinds it does not
inline to the checked path). New fields of ``PoolState`` are written only by
transitions, and a SNAPSHOT record stores them through
``snapshot_codec.snapshot_data`` / ``decode_snapshot``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from nanoserve.allocator.events import BlockEvent, EventKind
from nanoserve.allocator.pool_state import PoolState

# report(rule, message, block_id, owner): what to do with a broken rule
Report = Callable[[str, str, "int | None", "str | None"], None]
# observe(block_id, old_holder, new_holder): the block's holder (``PoolState.owners``) changed; None is free
Observe = Callable[[int, "str | None", "str | None"], None]
Transition = Callable[[PoolState, BlockEvent, Report, "Observe | None"], None]


def refuse(rule: str, message: str, block_id: int | None, owner: str | None) -> NoReturn:
    """The allocator's ``report``: it checks its input first, so a broken rule here is a bug."""
    raise AssertionError(f"allocator broke rule {rule} (block {block_id}, owner {owner!r}): {message}")


def ignore(rule: str, message: str, block_id: int | None, owner: str | None) -> None:
    """A ``report`` for views that follow the pool and leave its rules to the audit."""


def apply(state: PoolState, event: BlockEvent, report: Report = refuse, observe: Observe | None = None) -> None:
    """Change ``state`` as ``event`` says, reporting each rule it breaks.

    ``state`` must keep the ``PoolState`` invariant (free stack and owner map
    partition the pool; replay loads no snapshot that breaks it). An event of
    a kind without a transition changes nothing and is reported as
    ``unknown_kind``. ``observe``, when given, is called once per holder
    change, in the order the changes are made: ``(block_id, None, owner)`` when
    a block is taken (allocated, or shared off the cached-free list),
    ``(block_id, holder, None)`` when its last holder lets go of it, and
    ``(block_id, holder, next_holder)`` when its first holder releases a
    shared block. A sharer joining or leaving a held block is no holder change.
    """
    transition = TRANSITIONS.get(event.kind)
    if transition is None:
        report("unknown_kind", f"event kind {event.kind.value!r} changes no block", None, event.owner)
        return
    transition(state, event, report, observe)


def take(state: PoolState, event: BlockEvent, report: Report, observe: Observe | None = None) -> None:
    """ALLOCATE, ALLOCATE_FOR: each block leaves the free stack and gets the event's owner.

    A held block or one outside the pool is reported and skipped. The
    allocator takes blocks from the top of the stack, so that is looked at
    first; a block elsewhere on the stack (a replayed log that differs from
    the allocator's order) is taken from where it is.
    """
    if state.copy_on_write:
        _check_no_shared_write(state, event.owner, report)
    _take_blocks(state, event.block_ids, event.owner, report, observe)


def _take_blocks(
    state: PoolState, block_ids: tuple[int, ...], owner: str, report: Report, observe: Observe | None
) -> None:
    free, owners, num_blocks = state.free_block_ids, state.owners, state.num_blocks
    for block_id in block_ids:
        holder = owners.get(block_id)
        if holder is not None:
            report("allocate_of_allocated", f"block is held by {holder!r}", block_id, owner)
        elif not 0 <= block_id < num_blocks:
            report("foreign_block", f"block is not in the pool of {num_blocks}", block_id, owner)
        else:
            if free and free[-1] == block_id:
                free.pop()
            elif block_id in state.block_keys:
                key = state.block_keys[block_id][0]
                report("stale_key", f"block is handed out while still cached under key {key[:16]}", block_id, owner)
                state.cached_free.remove(block_id)
                _drop_key(state, block_id)
            else:
                assert block_id in free, f"block {block_id} is neither free nor allocated: {state} broke its invariant"
                free.remove(block_id)
            owners[block_id] = owner
            if observe is not None:
                observe(block_id, None, owner)


def _check_no_shared_write(state: PoolState, owner: str, report: Report) -> None:
    """An owner takes a new block while it holds a forked partial block others hold too: it filled
    that block in place, writing over the other holders' next slots (it had to COPY it first)."""
    for block_id in sorted(state.copy_on_write):
        if owner in state.holders(block_id):
            others = [holder for holder in state.holders(block_id) if holder != owner]
            report("append_to_shared", f"block written while {others!r} hold it too (no COPY first)", block_id, owner)


def release(state: PoolState, event: BlockEvent, report: Report, observe: Observe | None = None) -> None:
    """FREE, FREE_ALL: each block is pushed onto the free stack, in the event's order.

    A block that is not allocated is reported and skipped; a block held by
    another owner than the event's is reported and freed all the same.
    """
    free, owners, owner, num_blocks = state.free_block_ids, state.owners, event.owner, state.num_blocks
    for block_id in event.block_ids:
        if block_id in state.sharers or block_id in state.block_keys:  # a prefix-cache block freed as a plain one
            _free_cached(state, block_id, owner, report, observe)
            continue
        holder = owners.pop(block_id, None)
        if holder is None:
            rule = "free_of_free_block" if 0 <= block_id < num_blocks else "foreign_block"
            report(rule, "block is not allocated", block_id, owner)
            continue
        if holder != owner:
            report("owner_mismatch", f"block is held by {holder!r}", block_id, owner)
        free.append(block_id)
        if observe is not None:
            observe(block_id, holder, None)


def _free_cached(state: PoolState, block_id: int, owner: str, report: Report, observe: Observe | None) -> None:
    """FREE of a shared or registered block: reported, then applied as far as it can be."""
    holders = state.holders(block_id)
    if owner not in holders:
        report(
            "owner_mismatch", f"block is held by {holders!r}" if holders else "block is not allocated", block_id, owner
        )
        return
    if len(holders) > 1:
        report("ref_count_mismatch", f"block freed to the pool while {holders!r} hold it", block_id, owner)
        _drop_reference(state, block_id, owner, observe)
        return
    key = state.block_keys[block_id][0]
    report("stale_key", f"block freed as never-cached while indexed under key {key[:16]}", block_id, owner)
    del state.owners[block_id]
    _drop_key(state, block_id)
    state.free_block_ids.append(block_id)
    if observe is not None:
        observe(block_id, owner, None)


def _drop_key(state: PoolState, block_id: int) -> None:
    key, _ = state.block_keys.pop(block_id)
    if state.key_blocks.get(key) == block_id:
        del state.key_blocks[key]


def _drop_reference(state: PoolState, block_id: int, owner: str, observe: Observe | None) -> None:
    """``owner`` (a holder) lets go of ``block_id``; the last holder leaves it cached-free (or free, unkeyed)."""
    others = state.sharers.get(block_id)
    if state.owners[block_id] == owner:
        successor = others.pop(0) if others else None
        if successor is not None:
            state.owners[block_id] = successor
        else:
            del state.owners[block_id]
            if block_id in state.block_keys:
                state.cached_free.append(block_id)
            else:
                state.free_block_ids.append(block_id)
        if observe is not None:
            observe(block_id, owner, successor)
    else:
        assert others is not None, f"{owner!r} does not hold block {block_id}"
        others.remove(owner)
    if others is not None and not others:
        del state.sharers[block_id]
    if block_id in state.copy_on_write and block_id not in state.sharers:
        state.copy_on_write.discard(block_id)  # one holder left: it writes in place


def _check_count(state: PoolState, event: BlockEvent, index: int, report: Report) -> None:
    if index < len(event.ref_counts):
        block_id, count = event.block_ids[index], event.ref_counts[index]
        held = state.ref_count(block_id)
        if held != count:
            report("ref_count_mismatch", f"event says {count} holders, {held} hold it", block_id, event.owner)


def register(state: PoolState, event: BlockEvent, report: Report, observe: Observe | None = None) -> None:
    """REGISTER: each held block enters the key index under its key and parent key.

    A block not held by the event's owner, a block registered already, or a
    key that indexes another block is reported and left as it was.
    """
    owner = event.owner
    for index, block_id in enumerate(event.block_ids):
        key = event.keys[index] if index < len(event.keys) else ""
        parent = event.parent_keys[index] if index < len(event.parent_keys) else None
        if owner not in state.holders(block_id):
            report("register_of_unheld", "block registered by an owner that does not hold it", block_id, owner)
        elif block_id in state.block_keys:
            known = state.block_keys[block_id][0]
            report("double_register", f"block already registered under key {known[:16]}", block_id, owner)
        elif key in state.key_blocks:
            other = state.key_blocks[key]
            report("double_register", f"key {key[:16]} already indexes block {other}", block_id, owner)
        else:
            state.block_keys[block_id] = (key, parent)
            state.key_blocks[key] = block_id


def share(state: PoolState, event: BlockEvent, report: Report, observe: Observe | None = None) -> None:
    """SHARE: the owner takes a reference on each cached block (held by others, or cached-free).

    A block that is not indexed under the event's key (evicted, reused,
    never registered) is reported and not taken; so is one the owner holds already.
    """
    owner = event.owner
    for index, block_id in enumerate(event.block_ids):
        key = event.keys[index] if index < len(event.keys) else ""
        known = state.block_keys.get(block_id)
        if known is None or known[0] != key:
            report("ref_on_evicted", f"reference taken on a block not cached under key {key[:16]}", block_id, owner)
            continue
        holders = state.holders(block_id)
        if owner in holders:
            report("ref_count_mismatch", "owner takes a second reference on a block it holds", block_id, owner)
        elif holders:
            state.sharers.setdefault(block_id, []).append(owner)
        else:
            state.cached_free.remove(block_id)
            state.owners[block_id] = owner
            if observe is not None:
                observe(block_id, None, owner)
        _check_count(state, event, index, report)


def release_reference(state: PoolState, event: BlockEvent, report: Report, observe: Observe | None = None) -> None:
    """RELEASE: the owner drops its reference on each cached block; at count 0 it is cached-free.

    Cached-free blocks join the end of the LRU list in the event's order (the
    allocator lists a sequence's tail first, so its tail is evicted first).
    """
    owner = event.owner
    for index, block_id in enumerate(event.block_ids):
        holders = state.holders(block_id)
        if owner not in holders:
            if holders:
                report("owner_mismatch", f"block is held by {holders!r}", block_id, owner)
            else:
                rule = "free_of_free_block" if 0 <= block_id < state.num_blocks else "foreign_block"
                report(rule, "block is not allocated", block_id, owner)
            continue
        key = event.keys[index] if index < len(event.keys) else ""
        known = state.block_keys.get(block_id)
        if (known[0] if known is not None else "") != key:  # a forked block never registered: key ""
            report("stale_key", f"block released under key {key[:16]} it is not indexed under", block_id, owner)
        _drop_reference(state, block_id, owner, observe)
        _check_count(state, event, index, report)


def evict(state: PoolState, event: BlockEvent, report: Report, observe: Observe | None = None) -> None:
    """EVICT, CACHE_RESET: each cached-free block loses its key and goes onto the free stack, in order.

    A held block, or one not cached under the event's key, is reported and left.
    """
    owner = event.owner
    for index, block_id in enumerate(event.block_ids):
        key = event.keys[index] if index < len(event.keys) else ""
        known = state.block_keys.get(block_id)
        if block_id in state.owners:
            report("stale_key", f"evicting a block held by {state.holders(block_id)!r}", block_id, owner)
        elif known is None or known[0] != key or block_id not in state.cached_free:
            report("stale_key", f"evicting a block not cached under key {key[:16]}", block_id, owner)
        else:
            state.cached_free.remove(block_id)
            _drop_key(state, block_id)
            state.free_block_ids.append(block_id)


def reset(state: PoolState, event: BlockEvent, report: Report, observe: Observe | None = None) -> None:
    """CACHE_RESET: ``evict`` of every cached-free block; any key left afterwards is reported."""
    evict(state, event, report, observe)
    for block_id in sorted(state.block_keys):
        report("stale_key", "block still indexed after the cache reset", block_id, event.owner)


def fork(state: PoolState, event: BlockEvent, report: Report, observe: Observe | None = None) -> None:
    """FORK: the child (the event's owner) takes a reference on each of its parent's blocks.

    A block the parent does not hold is reported (``fork_of_unheld``) and not
    taken; so is one the child holds already. With ``partial``, the last
    block enters ``copy_on_write``. No holder changes: the child is a sharer.
    """
    owner, parent = event.owner, event.parent or ""
    for index, block_id in enumerate(event.block_ids):
        holders = state.holders(block_id)
        if parent not in holders:
            report("fork_of_unheld", f"block forked from {parent!r}, held by {holders!r}", block_id, owner)
            continue
        if owner in holders:
            report("ref_count_mismatch", "child takes a second reference on a block it holds", block_id, owner)
        else:
            state.sharers.setdefault(block_id, []).append(owner)
            if event.partial and index == len(event.block_ids) - 1:
                state.copy_on_write.add(block_id)
        _check_count(state, event, index, report)


def copy(state: PoolState, event: BlockEvent, report: Report, observe: Observe | None = None) -> None:
    """COPY: ``(source, destination)``; the destination is taken off the free stack by the owner,
    who then drops its reference on the source.

    Rules: the source is held by the copier (``copy_of_unheld``) and by the
    copier's parent (``copy_source_not_parents``: a copy comes from the block
    the fork shared); a destination that is held is reported as by ``take``.
    """
    owner, parent = event.owner, event.parent or ""
    if len(event.block_ids) != 2:
        report("bad_record", f"copy names {len(event.block_ids)} blocks, not (source, destination)", None, owner)
        return
    source, destination = event.block_ids
    holders = state.holders(source)
    if parent not in holders:
        report("copy_source_not_parents", f"source is held by {holders!r}, not by {parent!r}", source, owner)
    _take_blocks(state, (destination,), owner, report, observe)
    if owner not in holders:
        report("copy_of_unheld", f"copier does not hold the source (held by {holders!r})", source, owner)
        return
    if len(holders) == 1:
        report("copy_of_unshared", "a block only the copier holds is written in place, not copied", source, owner)
    _drop_reference(state, source, owner, observe)
    _check_count(state, event, 0, report)


# event kind -> its transition; the kinds not here (POOL_INIT, SNAPSHOT, POOL_CLOSE) belong to the log
TRANSITIONS: dict[EventKind, Transition] = {
    EventKind.ALLOCATE: take,
    EventKind.ALLOCATE_FOR: take,
    EventKind.FREE: release,
    EventKind.FREE_ALL: release,
    EventKind.REGISTER: register,
    EventKind.SHARE: share,
    EventKind.RELEASE: release_reference,
    EventKind.EVICT: evict,
    EventKind.CACHE_RESET: reset,
    EventKind.FORK: fork,
    EventKind.COPY: copy,
}
# the parallel-sampling kinds: their records carry the parent (``record_codec``)
FAMILY_KINDS = frozenset((EventKind.FORK, EventKind.COPY))
# the prefix-cache kinds: their records carry keys (``record_codec``)
CACHE_KINDS = frozenset(
    (EventKind.REGISTER, EventKind.SHARE, EventKind.RELEASE, EventKind.EVICT, EventKind.CACHE_RESET)
)
