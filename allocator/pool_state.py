"""``PoolState``: the block pool's free stack and owner map, and the ``Violation`` of a rule.

One type for the pool wherever it lives: ``BlockAllocator`` keeps one and
changes it only through ``transition.apply``; replay builds one from the log
through the same function; ``BlockAllocator.state()`` and ``replay`` hand out
copies, so a live pool and a replayed one compare with ``==``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Violation:
    """One broken rule found in a log: where (seq, block, owner) and what.

    plot_range: the seqs (first, last) whose picture shows what led to it
    (``nanoserve log plot --from first --to last``), set by ``audit``; None elsewhere.
    """

    seq: int
    rule: str
    message: str
    block_id: int | None = None
    owner: str | None = None
    plot_range: tuple[int, int] | None = field(default=None, compare=False)

    def __str__(self) -> str:
        where = f"seq {self.seq}"
        if self.block_id is not None:
            where += f" block {self.block_id}"
        if self.owner is not None:
            where += f" owner {self.owner!r}"
        return f"{where}: {self.rule}: {self.message}"


@dataclass(slots=True)
class PoolState:
    """Free stack, owner map and prefix-cache index of a pool of ``num_blocks`` blocks.

    Invariant (kept by ``transition.apply`` on a pool that starts whole):
    every block id in ``range(num_blocks)`` is in exactly one of the free
    stack, the cached-free list and the owner map (free + cached-free + held
    == num_blocks); a block's reference count is ``1 + len(sharers[block])``
    while held and 0 while free; only registered blocks are cached-free, and
    only registered or forked ones shared; ``key_blocks`` is the inverse of ``block_keys``.

    free_block_ids: the free stack of never-cached blocks from bottom to top
        (the next block handed out is the last one).
    owners: block_id -> owner (request id) of every held block: the holder
        that took it from the pool, or, once that one let go, the longest-standing
        remaining holder.
    sharers: block_id -> the block's other holders, in the order they took
        their references (prefix caching; absent for a block with one holder).
    cached_free: free blocks that keep their KV and their key, least recently
        used first (the next one evicted is the first).
    block_keys: block_id -> (key, parent key or None) of every registered block.
    key_blocks: key -> block_id, the index a prefix lookup reads.
    copy_on_write: partly filled blocks a FORK shared that more than one owner
        still holds: a holder writes into one only after copying it (COPY); an
        ALLOCATE by a holder of one means it filled the block in place (the
        audit's ``append_to_shared``). A block leaves the set when one holder is left.
    last_seq: sequence number of the last logged event applied; None for a
        pool that was not rebuilt from a log.
    pool_id, epoch: the log a replayed state came from.
    violations: broken rules met while rebuilding this state from a log.

    ``==`` compares the pool itself (shape, free stack, holders, cache index), not where it
    came from (last_seq, pool_id, epoch) nor the violations on the way.
    """

    num_blocks: int
    block_size: int
    free_block_ids: list[int]
    owners: dict[int, str] = field(default_factory=dict)
    sharers: dict[int, list[str]] = field(default_factory=dict)
    cached_free: list[int] = field(default_factory=list)
    block_keys: dict[int, tuple[str, str | None]] = field(default_factory=dict)
    key_blocks: dict[str, int] = field(default_factory=dict)
    copy_on_write: set[int] = field(default_factory=set)
    last_seq: int | None = field(default=None, compare=False)
    pool_id: str | None = field(default=None, compare=False)
    epoch: int | None = field(default=None, compare=False)
    violations: list[Violation] = field(default_factory=list, compare=False)

    @classmethod
    def fresh(cls, num_blocks: int, block_size: int) -> PoolState:
        """Every block free, stacked so that a fresh pool hands out 0, 1, 2, ..."""
        return cls(num_blocks, block_size, list(range(num_blocks - 1, -1, -1)))

    def copy(self) -> PoolState:
        """A copy whose stack, owner map and violations can change without touching this one."""
        return PoolState(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_block_ids=list(self.free_block_ids),
            owners=dict(self.owners),
            sharers={block_id: list(holders) for block_id, holders in self.sharers.items()},
            cached_free=list(self.cached_free),
            block_keys=dict(self.block_keys),
            key_blocks=dict(self.key_blocks),
            copy_on_write=set(self.copy_on_write),
            last_seq=self.last_seq,
            pool_id=self.pool_id,
            epoch=self.epoch,
            violations=list(self.violations),
        )

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: the free stack's and the cached-free ones."""
        return len(self.free_block_ids) + len(self.cached_free)

    @property
    def num_allocated(self) -> int:
        return len(self.owners)

    @property
    def num_cached_free(self) -> int:
        return len(self.cached_free)

    def ref_count(self, block_id: int) -> int:
        """Holders of ``block_id``: 0 when free (cached or not)."""
        if block_id not in self.owners:
            return 0
        return 1 + len(self.sharers.get(block_id, ()))

    def holders(self, block_id: int) -> list[str]:
        """Every owner holding ``block_id``, the first holder first; [] when free."""
        owner = self.owners.get(block_id)
        return [] if owner is None else [owner, *self.sharers.get(block_id, ())]

    def shared_blocks(self) -> dict[int, list[str]]:
        """block_id -> its holders, for the blocks held by more than one owner, in block order."""
        return {block_id: self.holders(block_id) for block_id in sorted(self.sharers)}

    def blocks_by_owner(self) -> dict[str, list[int]]:
        """owner -> the block ids it holds (shared ones included) in ascending order."""
        grouped: dict[str, list[int]] = {}
        for block_id in sorted(self.owners):
            grouped.setdefault(self.owners[block_id], []).append(block_id)
            for sharer in self.sharers.get(block_id, ()):
                grouped.setdefault(sharer, []).append(block_id)
        return grouped
