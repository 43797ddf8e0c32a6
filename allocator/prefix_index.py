"""``PrefixIndex``: what each registered block's KV was computed from, checked on every prefix lookup.

A block key is a hash (``block_key.hash_block``), so two different prefixes can meet at one
key. The pool never serves a block on its key alone: each registration keeps the block's
token ids and extra keys and the registration number of its parent block, and a lookup
follows the chain, stopping at the first block whose stored content or parent differs
from the key's. A collision, or a parent that was evicted and whose id was reused, is
then a miss, never another prefix's KV. None of this is logged: the log holds the keys,
and replay needs no content to check the pool's rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from nanoserve.allocator.block_key import BlockKey
from nanoserve.allocator.pool_state import PoolState


class CachedContent(NamedTuple):
    """What a registered block's KV was computed from.

    serial: this registration's number (unique over the index's life);
    parent_serial: the parent block's registration number, None for a first
    block. A child whose parent_serial matches proves its KV followed exactly
    the parent the lookup just verified, whatever the keys say.
    """

    serial: int
    parent_serial: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]


class PrefixIndex:
    """Registered block id -> ``CachedContent``; the allocator adds and drops entries as it emits
    REGISTER, EVICT and CACHE_RESET, so the index holds exactly the pool's registered blocks."""

    def __init__(self) -> None:
        self._contents: dict[int, CachedContent] = {}  # block_id -> content of every registered block
        self._num_registrations = 0

    def lookup(self, state: PoolState, owner: str, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks of ``state`` that serve ``keys`` (a prompt's full blocks, in order) to ``owner``:
        the longest run of keys indexed with the same content and parent chain, stopping before a
        block ``owner`` holds already."""
        hits: list[int] = []
        parent_serial: int | None = None
        for key in keys:
            block_id = state.key_blocks.get(key.key)
            if block_id is None:
                break
            content = self._contents[block_id]
            if (
                content.parent_serial != parent_serial
                or content.token_ids != key.token_ids
                or content.extra_keys != key.extra_keys
                or owner in state.holders(block_id)
            ):
                break
            hits.append(block_id)
            parent_serial = content.serial
        return hits

    def serial_of(self, block_id: int | None) -> int | None:
        """The registration number of ``block_id`` (None for None: a first block has no parent).
        ValueError when the block is not registered."""
        if block_id is None:
            return None
        content = self._contents.get(block_id)
        if content is None:
            raise ValueError(f"parent block {block_id} is not registered")
        return content.serial

    def add(self, block_id: int, parent_serial: int | None, key: BlockKey) -> int:
        """Records ``block_id``'s content under a new registration number, which it returns."""
        self._num_registrations += 1
        self._contents[block_id] = CachedContent(self._num_registrations, parent_serial, key.token_ids, key.extra_keys)
        return self._num_registrations

    def drop(self, block_ids: Iterable[int]) -> None:
        """Forgets evicted or reset blocks (each must be registered)."""
        for block_id in block_ids:
            del self._contents[block_id]
