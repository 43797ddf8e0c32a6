"""The prefix-cache kinds (REGISTER, SHARE, RELEASE, EVICT) as replay's fast loop applies them.

Each function applies one record's event exactly as its transition
(``transition.register``, ``share``, ``release_reference``, ``evict``) would,
when the event breaks no rule, and returns True; otherwise it changes nothing
and returns False, and the fast loop hands the record to the checked path,
which names what is wrong. So every rule is checked for all of the event's
blocks before the first one changes (an event naming a block twice, or a key
twice, is the checked path's too).

``cached`` mirrors ``PoolState.cached_free`` while the fast loop runs: a dict
(block_id -> None) in LRU order, oldest first, so a block leaves it in O(1)
where ``list.remove`` walked the list (a third of the audit's time). The fast
loop writes it back to the pool before anything else reads the pool.
Guarded by tests/allocator/test_replay_paths.py with the rest of the fast loop.
"""

from __future__ import annotations

from typing import Any

from nanoserve.allocator.log.record_codec import entries_are, fast_register_entries
from nanoserve.allocator.pool_state import PoolState

__all__ = ["evict", "register", "release_reference", "share"]


def register(pool: PoolState, cached: dict[int, None], block_ids: list[int], owner: str, detail: str) -> bool:
    """REGISTER: each block, held by ``owner`` and not yet registered, enters the key index."""
    decoded = fast_register_entries(detail, len(block_ids))
    if decoded is None:
        return False
    keys, parents = decoded
    owners, sharers, block_keys, key_blocks = pool.owners, pool.sharers, pool.block_keys, pool.key_blocks
    if len(set(block_ids)) != len(block_ids) or len(set(keys)) != len(keys):
        return False
    for block_id, key in zip(block_ids, keys, strict=True):
        holder = owners.get(block_id)
        if holder is None or (holder != owner and owner not in sharers.get(block_id, ())):
            return False
        if block_id in block_keys or key in key_blocks:
            return False
    for block_id, key, parent in zip(block_ids, keys, parents, strict=True):
        block_keys[block_id] = (key, parent)
        key_blocks[key] = block_id
    return True


def share(pool: PoolState, cached: dict[int, None], block_ids: list[int], owner: str, detail: str) -> bool:
    """SHARE: ``owner`` takes a reference on each block cached under its key, the count as recorded."""
    if len(set(block_ids)) != len(block_ids):
        return False
    owners, sharers, block_keys = pool.owners, pool.sharers, pool.block_keys
    keys: list[str] = []
    counts: list[int] = []
    for block_id in block_ids:
        known = block_keys.get(block_id)
        if known is None:
            return False
        holder = owners.get(block_id)
        if holder is None:
            if block_id not in cached:
                return False
            counts.append(1 + len(sharers.get(block_id, ())))
        else:
            others = sharers.get(block_id, ())
            if holder == owner or owner in others:
                return False
            counts.append(2 + len(others))
        keys.append(known[0])
    if not entries_are(detail, keys, counts):  # the record names these keys and these counts after the event
        return False
    for block_id in block_ids:
        if block_id in owners:
            sharers.setdefault(block_id, []).append(owner)
        else:
            del cached[block_id]
            owners[block_id] = owner
    return True


def release_reference(pool: PoolState, cached: dict[int, None], block_ids: list[int], owner: str, detail: str) -> bool:
    """RELEASE: ``owner`` drops its reference on each block it holds under the key; the last one leaves
    it cached-free (at the LRU list's end, in the event's order)."""
    if len(set(block_ids)) != len(block_ids):
        return False
    owners, sharers, block_keys = pool.owners, pool.sharers, pool.block_keys
    keys: list[str] = []
    counts: list[int] = []
    for block_id in block_ids:
        holder = owners.get(block_id)
        num_others = len(sharers.get(block_id, ()))
        known = block_keys.get(block_id)
        if holder is None or (holder != owner and owner not in sharers.get(block_id, ())) or known is None:
            return False
        keys.append(known[0])
        counts.append(num_others)  # the holders left
    if not entries_are(detail, keys, counts):
        return False
    for block_id in block_ids:
        remaining = sharers.get(block_id)
        if owners[block_id] == owner:
            if remaining:
                owners[block_id] = remaining.pop(0)
            else:
                del owners[block_id]
                cached[block_id] = None  # registered (its key was checked): cached-free
        else:
            assert remaining is not None, f"{owner!r} does not hold block {block_id}"
            remaining.remove(owner)
        if remaining is not None and not remaining:
            del sharers[block_id]
    return True


def evict(pool: PoolState, cached: dict[int, None], block_ids: list[int], owner: str, detail: str) -> bool:
    """EVICT: each cached-free block loses its key and goes onto the free stack, in order."""
    if len(set(block_ids)) != len(block_ids):
        return False
    owners, block_keys, key_blocks, free = pool.owners, pool.block_keys, pool.key_blocks, pool.free_block_ids
    keys: list[str] = []
    for block_id in block_ids:
        known = block_keys.get(block_id)
        if block_id in owners or known is None or block_id not in cached:
            return False
        keys.append(known[0])
    if not entries_are(detail, keys):
        return False
    for block_id, key in zip(block_ids, keys, strict=True):
        del cached[block_id]
        del block_keys[block_id]
        if key_blocks.get(key) == block_id:
            del key_blocks[key]
        free.append(block_id)
    return True


def plain_blocks(block_ids: list[int], block_keys: dict[int, tuple[str, str | None]], sharers: dict[int, Any]) -> bool:
    """Whether none of ``block_ids`` is registered or shared (``transition.release`` then frees each as plain)."""
    return not any(block_id in block_keys or block_id in sharers for block_id in block_ids)
