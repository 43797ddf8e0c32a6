"""``BlockTable``: one sequence's map from logical token positions to KV slots.

Token position ``p`` of a sequence lives in logical block ``p // block_size`` at
offset ``p % block_size``; the table maps logical blocks to the physical block
ids the allocator handed out (PagedAttention, Kwon et al., SOSP 2023)::

    block_size = 4, block_ids = [7, 2]
    position:  0  1  2  3 | 4  5  6  7
    block:     7  7  7  7 | 2  2  2  2
    slot:     28 29 30 31 | 8  9 10 11     slot = block_id * block_size + offset
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nanoserve.allocator.arithmetic import cdiv
from nanoserve.allocator.block_allocator import BlockAllocator
from nanoserve.allocator.block_key import BlockKey
from nanoserve.allocator.errors import KVCacheExhausted
from nanoserve.allocator.events import FreeReason


class BlockTable:
    """The physical blocks holding one sequence's ``num_tokens`` tokens, in order.

    Invariant: ``len(block_ids) == ceil(num_tokens / block_size)``: the table
    holds exactly the blocks its tokens need, so the last block is the only one
    with free slots. With prefix caching, the first ``num_registered_blocks``
    blocks are registered (shared from the cache, or registered by this table
    after their KV was written), each chained to the one before.
    """

    def __init__(self, allocator: BlockAllocator, owner: str) -> None:
        self._allocator = allocator
        self._block_size = allocator.block_size
        self.owner = owner
        self._block_ids: list[int] = []  # logical block index -> physical block id
        self._num_tokens = 0
        self._num_registered = 0  # leading blocks that are in the key index, chained
        self._chain_broken = False  # a block's key indexed another block: later ones cannot be chained
        self.parent: str | None = None  # the owner this table was forked from (parallel sampling)
        self._copies: list[tuple[int, int]] = []  # (source, destination) blocks copied, K/V rows not yet

    def fork(self, child: str) -> BlockTable:
        """A table for ``child`` holding this table's blocks by reference (FORK; Kwon et al. 2023, 4.4).

        Full blocks stay shared for good; a partly filled last block is copied
        by whichever holder writes into it while another still holds it
        (``append_tokens``). ValueError on an empty table.
        """
        table = BlockTable(self._allocator, child)
        partial = self._num_tokens % self._block_size != 0
        self._allocator.fork(self.owner, child, self._block_ids, partial=partial)
        table._block_ids = list(self._block_ids)
        table._num_tokens = self._num_tokens
        table._num_registered = self._num_registered
        table._chain_broken = self._chain_broken
        table.parent = self.owner
        return table

    def take_copies(self) -> list[tuple[int, int]]:
        """(source, destination) of the blocks copied on write since the last call: the caller copies
        their K/V rows before the forward pass writes into the destinations."""
        copies, self._copies = self._copies, []
        return copies

    @property
    def num_registered_blocks(self) -> int:
        return self._num_registered

    def share_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Take the cached blocks of ``keys`` (a prompt's leading full blocks) into this empty table.

        Returns the tokens they hold (``block_size`` per hit); the table then
        holds exactly those tokens. The caller passes only keys of blocks that
        leave at least one prompt token to compute.
        """
        assert not self._block_ids, f"share_prefix on a table that holds {self._block_ids}"
        hits = self._allocator.share_prefix(self.owner, keys)
        self._block_ids.extend(hits)
        self._num_tokens = len(hits) * self._block_size
        self._num_registered = len(hits)
        return self._num_tokens

    def register(self, keys: Sequence[BlockKey], num_computed_tokens: int) -> None:
        """Register the full blocks whose KV is written (the first ``num_computed_tokens`` tokens).

        ``keys`` are the sequence's block keys (at least one per full computed
        block). Blocks registered already are skipped; once a key turns out
        to index another block (the same prefix computed twice at once), this
        table registers no more.
        """
        num_full = min(num_computed_tokens // self._block_size, len(keys), len(self._block_ids))
        if self._chain_broken or num_full <= self._num_registered:
            return
        start = self._num_registered
        parent = self._block_ids[start - 1] if start else None
        num_new = self._allocator.register(self.owner, parent, self._block_ids[start:num_full], keys[start:num_full])
        self._num_registered += num_new
        self._chain_broken = self._num_registered < num_full

    @property
    def block_ids(self) -> list[int]:
        """Physical block ids in logical order (a copy)."""
        return list(self._block_ids)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_blocks(self) -> int:
        return len(self._block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        """New blocks needed to append ``num_tokens`` more tokens (0 when they fit)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        total_blocks = cdiv(self._num_tokens + num_tokens, self._block_size)
        return max(0, total_blocks - len(self._block_ids))

    def can_append(self, num_tokens: int) -> bool:
        """True when the pool has the blocks to append ``num_tokens`` tokens now."""
        return self._allocator.can_allocate(self.blocks_needed(num_tokens))

    def append_tokens(self, num_tokens: int, reason: FreeReason | None = None) -> list[int]:
        """Make room for ``num_tokens`` more tokens; returns the new block ids.

        New blocks are reserved all at once through ``allocate_for`` (its event
        carrying ``reason``: ``FreeReason.DRAFT`` for draft tokens' slots): on
        KVCacheExhausted nothing changes. A partly filled last block that
        another owner holds too (forked) is first copied to a block of this
        table's own (COPY; ``take_copies`` names it). ValueError when ``num_tokens < 0``.
        """
        num_new = self.blocks_needed(num_tokens)
        new_block_ids: list[int] = []
        if num_tokens and self._must_copy_last():
            if not self._allocator.can_allocate(num_new + 1):
                raise KVCacheExhausted(num_new + 1, self._allocator.num_free)
            source = self._block_ids[-1]
            self._block_ids[-1] = self._allocator.copy_on_write(self.owner, self.parent or self.owner, source)
            self._copies.append((source, self._block_ids[-1]))
        if num_new:
            room = len(self._block_ids) * self._block_size - self._num_tokens
            new_block_ids = self._allocator.allocate_for(num_tokens - room, self.owner, reason)
            assert len(new_block_ids) == num_new, f"allocate_for gave {len(new_block_ids)} blocks, expected {num_new}"
            self._block_ids.extend(new_block_ids)
        self._num_tokens += num_tokens
        return new_block_ids

    def truncate(self, num_tokens: int, reason: FreeReason | None = None) -> list[int]:
        """Shrink the table to its first ``num_tokens`` tokens; returns the block ids it let go of.

        The blocks past ``ceil(num_tokens / block_size)`` are released (one
        FREE_ALL with ``reason`` for blocks only this table held and never
        registered), so the table again holds exactly the blocks its tokens
        need. Speculative decoding rolls back a verify pass's rejected draft
        slots with it. ValueError when ``num_tokens`` is outside [0, num_tokens].
        """
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"num_tokens must be in [0, {self._num_tokens}], got {num_tokens}")
        num_kept = cdiv(num_tokens, self._block_size)
        dropped = self._block_ids[num_kept:]
        if dropped:
            self._allocator.release(self.owner, dropped, reason)
            del self._block_ids[num_kept:]
            self._num_registered = min(self._num_registered, num_kept)
        self._num_tokens = num_tokens
        return dropped

    def _must_copy_last(self) -> bool:
        """The last block is partly filled and held by another owner too: writing it needs a copy."""
        return self._num_tokens % self._block_size != 0 and self._allocator.ref_count(self._block_ids[-1]) > 1

    def physical(self, position: int) -> tuple[int, int]:
        """(block_id, offset) of token ``position``. ValueError outside [0, num_tokens)."""
        if not 0 <= position < self._num_tokens:
            raise ValueError(f"position must be in [0, {self._num_tokens}), got {position}")
        index, offset = divmod(position, self._block_size)
        return self._block_ids[index], offset

    def slot_mapping(self, positions: Iterable[int]) -> list[int]:
        """Flat KV slot ids (block_id * block_size + offset) of ``positions``.

        ValueError naming the first position outside [0, num_tokens).
        """
        block_size = self._block_size
        block_ids = self._block_ids
        num_tokens = self._num_tokens
        slots = []
        for position in positions:
            if not 0 <= position < num_tokens:
                raise ValueError(f"position must be in [0, {num_tokens}), got {position}")
            slots.append(block_ids[position // block_size] * block_size + position % block_size)
        return slots

    def release(self, reason: FreeReason | None = None) -> None:
        """Release every block and empty the table (``BlockAllocator.release``: cached ones stay cached)."""
        if self._block_ids:
            self._allocator.release(self.owner, self._block_ids, reason)
        self._block_ids = []
        self._num_tokens = 0
        self._num_registered = 0
        self._chain_broken = False
        self._copies = []

    def __repr__(self) -> str:
        return f"BlockTable(owner={self.owner!r}, num_tokens={self._num_tokens}, block_ids={self._block_ids})"
