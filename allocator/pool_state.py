"""``PoolState``: the block pool as it stood at one sequence number.

Built by ``BlockAllocator.state()`` from the live pool and by
``nanoserve.allocator.replay`` from the log, so the two can be compared with
``==``.
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


@dataclass
class PoolState:
    """Free stack and owner map of a pool of ``num_blocks`` blocks.

    free_block_ids: the free stack from bottom to top (the next block handed
        out is the last one).
    owners: block_id -> owner (request id) of every allocated block.
    last_seq: sequence number of the last event applied; None for a pool
        without a log.
    pool_id, epoch, violations: where a replayed state came from and what was
        wrong on the way (not part of ``==``).
    """

    num_blocks: int
    block_size: int
    free_block_ids: tuple[int, ...]
    owners: dict[int, str] = field(default_factory=dict)
    last_seq: int | None = None
    pool_id: str | None = field(default=None, compare=False)
    epoch: int | None = field(default=None, compare=False)
    # broken rules met while rebuilding this state from a log (replay only)
    violations: list[Violation] = field(default_factory=list, compare=False)

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
