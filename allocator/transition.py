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

To add an event kind: add it to ``EventKind``, write its transition
``(state, event, report) -> None`` and enter it in ``TRANSITIONS``; replay
applies it from then on (the fast replay loop hands kinds it does not inline
to the checked path). New fields of ``PoolState`` are written only by
transitions, and a SNAPSHOT record stores them through
``record_codec.snapshot_data`` / ``decode_snapshot``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from nanoserve.allocator.events import BlockEvent, EventKind
from nanoserve.allocator.pool_state import PoolState

# report(rule, message, block_id, owner): what to do with a broken rule
Report = Callable[[str, str, "int | None", "str | None"], None]
Transition = Callable[[PoolState, BlockEvent, Report], None]


def refuse(rule: str, message: str, block_id: int | None, owner: str | None) -> NoReturn:
    """The allocator's ``report``: it checks its input first, so a broken rule here is a bug."""
    raise AssertionError(f"allocator broke rule {rule} (block {block_id}, owner {owner!r}): {message}")


def apply(state: PoolState, event: BlockEvent, report: Report = refuse) -> None:
    """Change ``state`` as ``event`` says, reporting each rule it breaks.

    ``state`` must keep the ``PoolState`` invariant (free stack and owner map
    partition the pool; replay loads no snapshot that breaks it). An event of
    a kind without a transition changes nothing and is reported as
    ``unknown_kind``.
    """
    transition = TRANSITIONS.get(event.kind)
    if transition is None:
        report("unknown_kind", f"event kind {event.kind.value!r} changes no block", None, event.owner)
        return
    transition(state, event, report)


def take(state: PoolState, event: BlockEvent, report: Report) -> None:
    """ALLOCATE, ALLOCATE_FOR: each block leaves the free stack and gets the event's owner.

    A held block or one outside the pool is reported and skipped. The
    allocator takes blocks from the top of the stack, so that is looked at
    first; a block elsewhere on the stack (a replayed log that differs from
    the allocator's order) is taken from where it is.
    """
    free, owners, owner, num_blocks = state.free_block_ids, state.owners, event.owner, state.num_blocks
    for block_id in event.block_ids:
        holder = owners.get(block_id)
        if holder is not None:
            report("allocate_of_allocated", f"block is held by {holder!r}", block_id, owner)
        elif not 0 <= block_id < num_blocks:
            report("foreign_block", f"block is not in the pool of {num_blocks}", block_id, owner)
        else:
            if free and free[-1] == block_id:
                free.pop()
            else:
                assert block_id in free, f"block {block_id} is neither free nor allocated: {state} broke its invariant"
                free.remove(block_id)
            owners[block_id] = owner


def release(state: PoolState, event: BlockEvent, report: Report) -> None:
    """FREE, FREE_ALL: each block is pushed onto the free stack, in the event's order.

    A block that is not allocated is reported and skipped; a block held by
    another owner than the event's is reported and freed all the same.
    """
    free, owners, owner, num_blocks = state.free_block_ids, state.owners, event.owner, state.num_blocks
    for block_id in event.block_ids:
        holder = owners.pop(block_id, None)
        if holder == owner:
            free.append(block_id)
        elif holder is None:
            rule = "free_of_free_block" if 0 <= block_id < num_blocks else "foreign_block"
            report(rule, "block is not allocated", block_id, owner)
        else:
            report("owner_mismatch", f"block is held by {holder!r}", block_id, owner)
            free.append(block_id)


# event kind -> its transition; the kinds not here (POOL_INIT, SNAPSHOT, POOL_CLOSE) belong to the log
TRANSITIONS: dict[EventKind, Transition] = {
    EventKind.ALLOCATE: take,
    EventKind.ALLOCATE_FOR: take,
    EventKind.FREE: release,
    EventKind.FREE_ALL: release,
}
