"""``PoolState``: the block pool as it stood at one sequence number.

Built by ``BlockAllocator.state()`` from the live pool and by
``nanoserve.allocator.replay`` from the log, so the two can be compared with
``==``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PoolState:
    """Free stack and owner map of a pool of ``num_blocks`` blocks.

    free_block_ids: the free stack from bottom to top (the next block handed
        out is the last one).
    owners: block_id -> owner (request id) of every allocated block.
    last_seq: sequence number of the last event applied; None for a pool
        without a log.
    """

    num_blocks: int
    block_size: int
    free_block_ids: tuple[int, ...]
    owners: dict[int, str] = field(default_factory=dict)
    last_seq: int | None = None

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
