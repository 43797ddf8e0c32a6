"""``PoolTimeline``: one epoch's blocks over time, as held intervals and occupancy, from its events.

A block is *held* from the event that allocates it to the event that frees it;
each holding is one ``BlockInterval`` (block, owner, start and end). The
timeline applies events the way replay does (an allocate takes free blocks, a
free returns held ones whoever holds them, an allocate of a held block or a free
of a free block changes nothing), so the owner of every block after every event
is the one ``replay(until_seq=seq)`` gives (a test proves it). One pass over the
events, O(1) per block touched, columns of plain ints: a million events fit.

It is what the pictures of the pool (``nanoserve log plot``, ``log state
--svg``) and the audit's "seq range to plot" are computed from; the drawing
itself lives in ``nanoserve.service.pool_plot``.
"""

from __future__ import annotations

import bisect
import gc
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat

from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log.event import Event
from nanoserve.allocator.log.log_reader import read_events

__all__ = ["NO_STEP", "NUM_EVENTS_PER_PAGE", "OPEN", "BlockInterval", "PoolTimeline", "plot_range", "read_timeline"]

# events read per query: bounded memory, and few live objects for the garbage collector to walk
NUM_EVENTS_PER_PAGE = 50_000
_INIT = EventKind.POOL_INIT.value
NO_STEP = -1  # step_column of an event outside a scheduler step (steps are >= 0)
OPEN = -1  # interval_ends of an interval still held
# a violation without a block is plotted with this many events before it
PLOT_CONTEXT_EVENTS = 100


@dataclass(frozen=True, slots=True)
class BlockInterval:
    """One block held by one owner: from the event that allocated it to the one that freed it.

    end_seq / end_step / end_wall_ns: the freeing event; None while the block is
        still held after the last event read (a leak at POOL_CLOSE, or held at a crash).
    end_reason: the free's reason (``finished``, ``aborted``, ``preempted``), None
        when the free named none or the block is still held.
    """

    block_id: int
    owner: str
    start_seq: int
    end_seq: int | None
    start_step: int | None
    end_step: int | None
    start_wall_ns: int
    end_wall_ns: int | None
    end_reason: str | None


class PoolTimeline:
    """Held intervals and occupancy of one epoch, built by ``apply`` from its events in seq order.

    Columns are ``array('q')``s, one machine integer per entry: a million
    events hold no million Python objects for the garbage collector to walk
    (with lists of ints its passes doubled the time to read an epoch).

    Per event applied (index i, seq order): ``seqs[i]``, ``wall_ns[i]``,
    ``step_column[i]`` (``NO_STEP`` outside a scheduler step; ``step(i)`` and
    ``steps`` give None there), and after it ``num_allocated[i]`` blocks held
    and ``num_holding[i]`` owners holding at least one block (the requests
    running: a waiting or preempted request holds none).

    Per interval (index j, in the order they began; block order within one
    event): ``interval_block_ids[j]``, ``interval_owner_ids[j]`` (an index into
    ``owners``, the owners in order of first allocation), ``interval_starts[j]``
    and ``interval_ends[j]`` (event indexes; ``OPEN`` while held) and
    ``interval_reason_codes[j]`` (an index into ``reasons``; 0 is None).
    ``interval(j)`` gives one as a ``BlockInterval``.

    Prefix caching: an interval belongs to a block's first holder (replay's
    ``PoolState.owners``); the other holders of a shared block are in
    ``sharers`` and draw no bar of their own. When the first holder releases
    a shared block, its interval ends and the next holder's begins. After
    each event, ``num_cached_free[i]`` blocks are free but still cached and
    ``num_shared[i]`` blocks are held by more than one owner.

    Invariant: ``held[b]`` is the index of the open interval on block b, or
    None when b is free; ``num_allocated[-1]`` counts the non-None entries.
    Kinds this timeline does not know are counted in ``unknown_kinds`` and
    change nothing.
    """

    def __init__(self) -> None:
        self.pool_id: str | None = None
        self.epoch: int | None = None
        self.num_blocks = 0
        self.block_size = 0
        self.closed_seq: int | None = None
        self.seqs = array("q")
        self.step_column = array("q")
        self.wall_ns = array("q")
        self.num_allocated = array("q")
        self.num_holding = array("q")
        self.num_cached_free = array("q")
        self.num_shared = array("q")
        self.sharers: dict[int, list[str]] = {}  # block_id -> its holders beside the interval's owner
        self.cached_free: set[int] = set()  # free blocks that keep their key
        self.owners: list[str] = []
        self.reasons: list[str | None] = [None]  # free reasons met, by code
        self.interval_block_ids = array("q")
        self.interval_owner_ids = array("q")
        self.interval_starts = array("q")
        self.interval_ends = array("q")
        self.interval_reason_codes = array("q")
        self.held: list[int | None] = []  # block_id -> index of its open interval
        self.unknown_kinds: dict[str, int] = {}  # kind -> events of it, not drawn
        self._owner_ids: dict[str, int] = {}  # owner -> index into owners
        self._reason_codes: dict[str | None, int] = {None: 0}  # reason -> index into reasons
        self._num_held_by: dict[int, int] = {}  # owner index -> blocks it holds now (> 0)
        self._num_allocated_now = 0
        self._starts_by_block: dict[int, list[int]] | None = None  # block_id -> start seqs of its holdings
        self._handlers = {
            EventKind.POOL_INIT.value: self._init,
            EventKind.ALLOCATE.value: self._allocate,
            EventKind.ALLOCATE_FOR.value: self._allocate,
            EventKind.FREE.value: self._free,
            EventKind.FREE_ALL.value: self._free,
            EventKind.SNAPSHOT.value: _no_change,
            EventKind.POOL_CLOSE.value: self._close,
            EventKind.REGISTER.value: _no_change,
            EventKind.SHARE.value: self._share,
            EventKind.RELEASE.value: self._release,
            EventKind.EVICT.value: self._evict,
            EventKind.CACHE_RESET.value: self._evict,
        }

    @property
    def num_events(self) -> int:
        return len(self.seqs)

    @property
    def num_intervals(self) -> int:
        return len(self.interval_block_ids)

    @property
    def last_seq(self) -> int | None:
        return self.seqs[-1] if self.seqs else None

    def step(self, i: int) -> int | None:
        """The scheduler step of event i, None outside a step."""
        step = self.step_column[i]
        return None if step == NO_STEP else step

    @property
    def steps(self) -> list[int | None]:
        """The step of every event (a new list)."""
        return [None if step == NO_STEP else step for step in self.step_column]

    def apply(self, events: Iterable[Event]) -> None:
        """Apply events in seq order. ValueError when the first event of the epoch is not POOL_INIT."""
        self._starts_by_block = None
        seqs, steps, wall_ns = self.seqs, self.step_column, self.wall_ns
        num_allocated, num_holding, held_by = self.num_allocated, self.num_holding, self._num_held_by
        handlers = self._handlers
        for event in events:
            if not seqs and event.kind != _INIT:
                raise ValueError(f"seq {event.seq}: the epoch starts with {event.kind!r}, not pool_init")
            seqs.append(event.seq)
            steps.append(NO_STEP if event.step is None else event.step)
            wall_ns.append(event.wall_time_ns)
            handler = handlers.get(event.kind)
            if handler is None:
                self.unknown_kinds[event.kind] = self.unknown_kinds.get(event.kind, 0) + 1
            else:
                handler(event)
            num_allocated.append(self._num_allocated_now)
            num_holding.append(len(held_by))
            self.num_cached_free.append(len(self.cached_free))
            self.num_shared.append(len(self.sharers))

    def _init(self, event: Event) -> None:
        if self.seqs[0] != event.seq:
            return  # a misplaced POOL_INIT changes nothing (replay names it)
        self.pool_id, self.epoch = event.pool_id, event.epoch
        self.num_blocks = int(event.data["num_blocks"])
        self.block_size = int(event.data["block_size"])
        self.held = [None] * self.num_blocks

    def _share(self, event: Event) -> None:
        """A reference on cached blocks: a cached-free block begins an interval, a held one gains a sharer."""
        owner = event.owner or ""
        for block_id in event.block_ids:
            if not 0 <= block_id < self.num_blocks:
                continue
            if self.held[block_id] is None:
                self.cached_free.discard(block_id)
                self._allocate_blocks(owner, (block_id,))
            else:
                self.sharers.setdefault(block_id, []).append(owner)

    def _release(self, event: Event) -> None:
        """A holder lets go of cached blocks: a sharer leaves; the interval's owner ends its interval,
        and the next holder's begins (or the block becomes cached-free)."""
        owner = event.owner or ""
        for block_id in event.block_ids:
            interval = self.held[block_id] if 0 <= block_id < self.num_blocks else None
            if interval is None:
                continue
            others = self.sharers.get(block_id, [])
            if self.owners[self.interval_owner_ids[interval]] != owner:
                if owner in others:
                    others.remove(owner)
                    if not others:
                        del self.sharers[block_id]
                continue
            self._free_blocks((block_id,), event.reason)
            if others:
                self._allocate_blocks(others.pop(0), (block_id,))
                if not others:
                    del self.sharers[block_id]
            else:
                self.cached_free.add(block_id)

    def _evict(self, event: Event) -> None:
        self.cached_free.difference_update(event.block_ids)

    def _allocate(self, event: Event) -> None:
        self.cached_free.difference_update(event.block_ids)  # replay reports a cached block taken without EVICT
        self._allocate_blocks(event.owner or "", event.block_ids)

    def _allocate_blocks(self, owner: str, block_ids: Iterable[int]) -> None:
        owner_id = self._owner_ids.get(owner)
        if owner_id is None:
            owner_id = self._owner_ids[owner] = len(self.owners)
            self.owners.append(owner)
        index = len(self.seqs) - 1
        held, num_blocks = self.held, self.num_blocks
        taken = 0
        for block_id in block_ids:
            if not 0 <= block_id < num_blocks or held[block_id] is not None:
                continue  # foreign block, or allocate of an allocated block: replay keeps the holder
            held[block_id] = len(self.interval_block_ids)
            self.interval_block_ids.append(block_id)
            taken += 1
        if taken:
            self.interval_owner_ids.extend(repeat(owner_id, taken))
            self.interval_starts.extend(repeat(index, taken))
            self.interval_ends.extend(repeat(OPEN, taken))
            self.interval_reason_codes.extend(repeat(0, taken))
            self._num_held_by[owner_id] = self._num_held_by.get(owner_id, 0) + taken
            self._num_allocated_now += taken

    def _free(self, event: Event) -> None:
        self._free_blocks(event.block_ids, event.reason)

    def _free_blocks(self, block_ids: Iterable[int], reason: str | None) -> None:
        index = len(self.seqs) - 1
        held, num_blocks, held_by = self.held, self.num_blocks, self._num_held_by
        ends, reason_codes, interval_owner_ids = self.interval_ends, self.interval_reason_codes, self.interval_owner_ids
        code = self._reason_codes.get(reason)
        if code is None:
            code = self._reason_codes[reason] = len(self.reasons)
            self.reasons.append(reason)
        for block_id in block_ids:
            interval = held[block_id] if 0 <= block_id < num_blocks else None
            if interval is None:
                continue  # free of a free block: nothing changes
            held[block_id] = None
            ends[interval] = index
            reason_codes[interval] = code
            holder = interval_owner_ids[interval]  # the holder, even when another owner freed it
            left = held_by[holder] - 1
            if left:
                held_by[holder] = left
            else:
                del held_by[holder]
            self._num_allocated_now -= 1

    def _close(self, event: Event) -> None:
        if self.closed_seq is None:
            self.closed_seq = event.seq

    def owner_id(self, owner: str) -> int:
        """The index of ``owner`` in ``owners``; KeyError when it never held a block here."""
        return self._owner_ids[owner]

    def interval(self, j: int) -> BlockInterval:
        """Interval ``j`` (in the order they began) as a ``BlockInterval``."""
        start, end = self.interval_starts[j], self.interval_ends[j]
        held = end == OPEN
        return BlockInterval(
            block_id=self.interval_block_ids[j],
            owner=self.owners[self.interval_owner_ids[j]],
            start_seq=self.seqs[start],
            end_seq=None if held else self.seqs[end],
            start_step=self.step(start),
            end_step=None if held else self.step(end),
            start_wall_ns=self.wall_ns[start],
            end_wall_ns=None if held else self.wall_ns[end],
            end_reason=self.reasons[self.interval_reason_codes[j]],
        )

    def intervals(self) -> list[BlockInterval]:
        """Every held interval, in the order they began."""
        return [self.interval(j) for j in range(self.num_intervals)]

    def owners_now(self) -> dict[int, str]:
        """block_id -> owner of every block held after the last event (replay's ``PoolState.owners``)."""
        return {
            block_id: self.owners[self.interval_owner_ids[j]] for block_id, j in enumerate(self.held) if j is not None
        }

    def block_tables(self) -> dict[str, list[BlockInterval]]:
        """owner -> the intervals it holds after the last event, in the order it took them.

        That is its block table in logical order: a request's table grows by
        appending the blocks it is given (``BlockTable.append_tokens``).
        """
        tables: dict[str, list[BlockInterval]] = {}
        for j in sorted(j for j in self.held if j is not None):
            interval = self.interval(j)
            tables.setdefault(interval.owner, []).append(interval)
        return tables

    def holding_start(self, seq: int, block_id: int | None) -> int | None:
        """The seq at which the last holding of ``block_id`` that began before ``seq`` began; None if none."""
        if block_id is None:
            return None
        if self._starts_by_block is None:  # one pass for all the questions about this timeline
            self._starts_by_block = {}
            for block, start in zip(self.interval_block_ids, self.interval_starts, strict=True):
                self._starts_by_block.setdefault(block, []).append(self.seqs[start])
        starts = self._starts_by_block.get(block_id, [])
        position = bisect.bisect_left(starts, seq)  # the holdings of one block begin in seq order
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


def _no_change(event: Event) -> None:
    pass


@contextmanager
def _collector_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_timeline(
    url: str,
    pool_id: str | None = None,
    epoch: int | None = None,
    until_seq: int | None = None,
    *,
    num_events_per_page: int = NUM_EVENTS_PER_PAGE,
) -> PoolTimeline:
    """The timeline of ``(pool_id, epoch)`` from its first event to ``until_seq`` (default: the last stored).

    ``pool_id`` None means the log's only pool, ``epoch`` None its newest
    epoch (as ``read_events``). Reads ``num_events_per_page`` events per query.
    Raises LogNotFoundError (a ValueError) for an unknown log, pool or epoch,
    ValueError for a malformed record or an epoch that does not start with POOL_INIT.
    Does not check the hash chain: ``audit`` does.

    The garbage collector is paused meanwhile: reading makes no reference
    cycles, and its full passes over the timeline's owner table (one string per
    request) cost a third of the time on a million events.
    """
    timeline = PoolTimeline()
    from_seq = 1
    with _collector_paused():
        while until_seq is None or from_seq <= until_seq:
            last = from_seq + num_events_per_page - 1
            if until_seq is not None:
                last = min(last, until_seq)
            page = read_events(url, pool_id, epoch, from_seq, last)
            if not page:
                break
            timeline.apply(page)
            pool_id, epoch = page[-1].pool_id, page[-1].epoch  # the epoch meant, even if a newer one opens meanwhile
            from_seq = last + 1
    return timeline
