"""The stored form of a SNAPSHOT record's tail, both ways: the pool as JSON.

Part of the record codec (``record_codec.py`` holds the record's fields and the
block events' details): records are encoded and decoded only in these two modules.
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.allocator.pool_state import PoolState


def snapshot_data(state: PoolState) -> dict[str, Any]:
    """The data of a SNAPSHOT record: the free stack (bottom to top), the owner map and,
    once prefix caching used the pool, the cached-free list, the sharers and the key index, and
    the forked partial blocks (``copy_on_write``) while there are any.

    Refers to ``state``'s stack and map (no copy): pass a state nothing changes
    any more, such as ``BlockAllocator.snapshot()``.
    """
    data: dict[str, Any] = {"free_block_ids": state.free_block_ids, "owners": state.owners}
    if state.block_keys or state.cached_free or state.sharers:
        data["cached_free"] = state.cached_free
        data["sharers"] = state.sharers
        data["block_keys"] = state.block_keys  # block_id -> [key, parent or null]; key_blocks is its inverse
    if state.copy_on_write:
        data["copy_on_write"] = sorted(state.copy_on_write)
    return data


def decode_snapshot(tail: str, num_blocks: int, block_size: int) -> PoolState:
    """The pool a SNAPSHOT record's tail holds.

    ValueError, naming what is wrong, when the tail is not JSON of the shape
    ``snapshot_data`` writes: an object with ``free_block_ids`` (a list of
    integers) and ``owners`` (an object mapping block ids to owner strings).
    """
    try:
        data = json.loads(tail)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or not {"free_block_ids", "owners"} <= set(data):
        shape = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"expected an object with free_block_ids and owners, got {shape}")
    free_block_ids, owners = data["free_block_ids"], data["owners"]
    if not isinstance(free_block_ids, list) or not all(type(block_id) is int for block_id in free_block_ids):
        raise ValueError("free_block_ids is not a list of integers")
    if not isinstance(owners, dict) or not all(type(owner) is str for owner in owners.values()):
        raise ValueError("owners is not an object of owner strings")
    try:
        owner_map = {int(block_id): owner for block_id, owner in owners.items()}
    except ValueError:
        raise ValueError("owners has a key that is not a block id") from None
    state = PoolState(num_blocks, block_size, free_block_ids, owner_map)
    _decode_cache(data, state)
    return state


def check_whole(pool: PoolState) -> None:
    """Checks the ``PoolState`` invariant on a decoded snapshot, the rules a replay may start from:
    every block of the pool free, cached-free or owned by a named owner, exactly once; cached-free
    and shared blocks registered and held; copy-on-write blocks shared. ValueError naming the rule
    it breaks."""
    if sorted([*pool.free_block_ids, *pool.cached_free, *pool.owners]) != list(range(pool.num_blocks)) or not all(
        type(owner) is str and owner for owner in pool.owners.values()
    ):
        raise ValueError("the snapshot does not hold every block of the pool exactly once")
    if not set(pool.cached_free) <= set(pool.block_keys) or not set(pool.sharers) <= set(pool.owners):
        raise ValueError("the snapshot's cached-free or shared blocks are not registered and held")
    if not pool.copy_on_write <= set(pool.sharers):
        raise ValueError("the snapshot's copy-on-write blocks are not shared")


def _decode_cache(data: dict[str, Any], state: PoolState) -> None:
    """The prefix-cache part of a snapshot (absent in snapshots written before it), into ``state``."""
    cached_free = data.get("cached_free", [])
    sharers = data.get("sharers", {})
    block_keys = data.get("block_keys", {})
    if not isinstance(cached_free, list) or not all(type(block_id) is int for block_id in cached_free):
        raise ValueError("cached_free is not a list of integers")
    if not isinstance(sharers, dict) or not all(
        isinstance(holders, list) and all(type(owner) is str for owner in holders) for holders in sharers.values()
    ):
        raise ValueError("sharers is not an object of owner lists")
    if not isinstance(block_keys, dict) or not all(
        isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is str and type(entry[1]) in (str, type(None))
        for entry in block_keys.values()
    ):
        raise ValueError("block_keys is not an object of [key, parent] pairs")
    try:
        state.sharers = {int(block_id): list(holders) for block_id, holders in sharers.items()}
        state.block_keys = {int(block_id): (entry[0], entry[1]) for block_id, entry in block_keys.items()}
    except ValueError:
        raise ValueError("sharers or block_keys has a key that is not a block id") from None
    state.cached_free = list(cached_free)
    copy_on_write = data.get("copy_on_write", [])
    if not isinstance(copy_on_write, list) or not all(type(block_id) is int for block_id in copy_on_write):
        raise ValueError("copy_on_write is not a list of integers")
    state.copy_on_write = set(copy_on_write)
    state.key_blocks = {key: block_id for block_id, (key, _) in state.block_keys.items()}
