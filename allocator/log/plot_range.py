"""The seq range to plot for a violation: ``plot_range``, from the holdings that ``HoldingStarts`` follows.

The audit gives each violation the seqs whose picture shows what led to it
(``Violation.plot_range``): from where the block's last holding before the
violation began (the request that held it, or freed it before a double free).
``HoldingStarts`` learns those starts by folding the epoch's events through
``transition.apply`` with an ``observe`` hook, as the live pool, replay and the
pictures' timeline do, so it knows what each event kind means from there alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log.record_codec import block_event_of
from nanoserve.allocator.log.stored_event import Event
from nanoserve.allocator.pool_state import PoolState
from nanoserve.allocator.transition import apply, ignore

# a violation without a block (or without a known holding) is plotted with this many events before it
PLOT_CONTEXT_EVENTS = 100
_INIT = EventKind.POOL_INIT.value


class HoldingStarts:
    """block_id -> the seqs at which its holdings began, from an epoch's events read from its genesis.

    A holding begins each time a block gets a holder (``PoolState.owners``):
    taken off the free stack or the cached-free list, or handed to the next
    holder of a shared block. Seqs are appended in the order applied, so each
    block's list is ascending. The pool is built at POOL_INIT (``num_blocks``,
    ``block_size`` of its data); block events before it change nothing, and
    broken rules are left to the audit's replay (``ignore``).
    """

    def __init__(self) -> None:
        self.pool: PoolState | None = None
        self.starts: dict[int, list[int]] = {}  # block_id -> start seqs of its holdings, ascending
        self._seq = 0  # the event being applied, for ``_observe``

    def apply(self, events: Iterable[Event]) -> None:
        """Apply events in seq order (a block record replay cannot apply changes nothing here either)."""
        for event in events:
            if self.pool is None:
                if event.kind == _INIT:
                    self.pool = PoolState.fresh(int(event.data["num_blocks"]), int(event.data["block_size"]))
                continue
            try:
                block_event = block_event_of(event)
            except ValueError:  # a reason that is no FreeReason: replay applies nothing of it either
                continue
            if block_event is not None:
                self._seq = event.seq
                apply(self.pool, block_event, ignore, self._observe)

    def _observe(self, block_id: int, old_holder: str | None, new_holder: str | None) -> None:
        if new_holder is not None:
            self.starts.setdefault(block_id, []).append(self._seq)

    def holding_start(self, seq: int, block_id: int | None) -> int | None:
        """The seq at which the last holding of ``block_id`` that began before ``seq`` began; None if none."""
        if block_id is None:
            return None
        starts = self.starts.get(block_id, [])
        position = bisect.bisect_left(starts, seq)
        return starts[position - 1] if position else None


def plot_range(seq: int, holding_start_seq: int | None, last_seq: int) -> tuple[int, int]:
    """The seqs (first, last) to plot to see what led to a violation at ``seq``.

    From ``holding_start_seq`` (where the block's last holding before ``seq``
    began: the request that held it, or freed it before a double free) when
    known, else from ``PLOT_CONTEXT_EVENTS`` before ``seq``; up to ``seq`` and a
    margin of a twentieth of the range (at least one event), within ``1..last_seq``.
    """
    last_seq = max(last_seq, 1)
    first = max(1, seq - PLOT_CONTEXT_EVENTS) if holding_start_seq is None else holding_start_seq
    first = min(first, last_seq)
    last = min(max(seq, first), last_seq)
    return first, min(last_seq, last + max(1, (last - first) // 20))
