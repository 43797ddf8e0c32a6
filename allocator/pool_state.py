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
    """Free stack and owner map of a pool of ``num_blocks`` blocks.

    Invariant (kept by ``transition.apply`` on a pool that starts whole):
    every block id in ``range(num_blocks)`` is on the free stack or in the
    owner map, never both, and no block is on the stack twice.

    free_block_ids: the free stack from bottom to top (the next block handed
        out is the last one).
    owners: block_id -> owner (request id) of every allocated block.
    last_seq: sequence number of the last logged event applied; None for a
        pool that was not rebuilt from a log.
    pool_id, epoch: the log a replayed state came from.
    violations: broken rules met while rebuilding this state from a log.

    ``==`` compares the pool itself (shape, free stack, owners), not where it
    came from (last_seq, pool_id, epoch) nor the violations on the way.
    """

    num_blocks: int
    block_size: int
    free_block_ids: list[int]
    owners: dict[int, str] = field(default_factory=dict)
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
            last_seq=self.last_seq,
            pool_id=self.pool_id,
            epoch=self.epoch,
            violations=list(self.violations),
        )

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_allocated(self) -> int:
        return len(self.owners)

    def blocks_by_owner(self) -> dict[str, list[int]]:
        """owner -> its block ids in ascending order."""
        grouped: dict[str, list[int]] = {}
        for block_id in sorted(self.owners):
            grouped.setdefault(self.owners[block_id], []).append(block_id)
        return grouped
