"""``PoolTimeline``: one epoch's blocks over time, as held intervals and occupancy, from its events.

A block is *held* from the event that allocates it to the event that frees it;
each holding is one ``BlockInterval`` (block, owner, start and end). The
timeline does not interpret event kinds itself: it folds each block event into
a ``PoolState`` with the allocator's ``transition.apply`` (as the live pool and
replay do) and observes every holder change (its ``observe`` hook), so the owner
of every block after every event is the one ``replay(until_seq=seq)`` gives, by
construction (a test checks it). One pass over the events, O(1) per block
touched, columns of plain ints: a million events fit.

It is what the pictures of the pool (``nanoserve log plot``, ``log state
--svg``) are computed from; the drawing itself lives in ``pool_plot``. (The
audit's "seq range to plot" is ``nanoserve.allocator.log.plot_range``.)
"""

from __future__ import annotations

import gc
import json
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from nanoserve.allocator import PoolState
from nanoserve.allocator.events import BlockEvent, EventKind, FreeReason
from nanoserve.allocator.log.reader import EpochInfo, connect, read_events, resolve_epoch
from nanoserve.allocator.log.record_codec import BLOCK_KINDS, block_event_of
from nanoserve.allocator.log.segment import epoch_cut
from nanoserve.allocator.log.snapshot_codec import decode_snapshot
from nanoserve.allocator.log.stored_event import Event
from nanoserve.allocator.transition import Observe, apply, ignore

__all__ = ["NO_STEP", "NUM_EVENTS_PER_PAGE", "OPEN", "BlockInterval", "PoolTimeline", "read_timeline"]

# events read per query: bounded memory, and few live objects for the garbage collector to walk
NUM_EVENTS_PER_PAGE = 50_000
_INIT = EventKind.POOL_INIT.value
_SNAPSHOT = EventKind.SNAPSHOT.value
_CLOSE = EventKind.POOL_CLOSE.value
_DRAFT = FreeReason.DRAFT.value
NO_STEP = -1  # step_column of an event outside a scheduler step (steps are >= 0)
OPEN = -1  # interval_ends of an interval still held
# how the last holding of an owner that holds no block ended, in the order readers list them (None: another reason)
ENDINGS_WITHOUT_BLOCKS = ("preempted", "finished", "aborted", None)


@dataclass(frozen=True, slots=True)
class BlockInterval:
    """One block held by one owner: from the event that allocated it to the one that freed it.

    end_seq / end_step / end_wall_ns: the freeing event; None while the block is
        still held after the last event read (a leak at POOL_CLOSE, or held at a crash).
    end_reason: the free's reason (``finished``, ``aborted``, ``preempted``,
        ``rejected_draft``), None when the free named none or the block is still held.
    draft: the allocation that began it was speculative (reason ``draft``: slots
        taken for draft tokens, kept by accepted drafts or given back as ``rejected_draft``).
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
    draft: bool = False


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
    ``interval_reason_codes[j]`` (an index into ``reasons``; 0 is None) and
    ``interval_drafts[j]`` (1 when a speculative allocation, reason ``draft``, began it).
    ``interval(j)`` gives one as a ``BlockInterval``.

    Prefix caching: an interval belongs to a block's first holder (replay's
    ``PoolState.owners``); the other holders of a shared block are in
    ``sharers`` and draw no bar of their own. When the first holder releases
    a shared block, its interval ends and the next holder's begins. After
    each event, ``num_cached_free[i]`` blocks are free but still cached and
    ``num_shared[i]`` blocks are held by more than one owner.

    Invariant: ``held[b]`` is the index of the open interval on block b, or
    None when b is free, and its owner is ``pool.owners[b]`` (intervals open
    and close only in ``_observer``'s hook, which ``transition.apply`` calls on each
    holder change); ``num_allocated[-1]`` counts the non-None entries. Kinds
    ``transition.apply`` does not know, other than the log's own (POOL_INIT,
    SNAPSHOT, POOL_CLOSE), are counted in ``unknown_kinds`` and change nothing.
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
        self.pool: PoolState | None = None  # the pool after the last event, from POOL_INIT on
        self.owners: list[str] = []
        self.reasons: list[str | None] = [None]  # free reasons met, by code
        self.interval_block_ids = array("q")
        self.interval_owner_ids = array("q")
        self.interval_starts = array("q")
        self.interval_ends = array("q")
        self.interval_reason_codes = array("q")
        self.interval_drafts = array("b")
        self.held: list[int | None] = []  # block_id -> index of its open interval
        self.unknown_kinds: dict[str, int] = {}  # kind -> events of it, not drawn
        self._owner_ids: dict[str, int] = {}  # owner -> index into owners
        self._reason_codes: dict[str | None, int] = {None: 0}  # reason -> index into reasons
        self._num_held_by: dict[int, int] = {}  # owner index -> blocks it holds now (> 0)
        self._index = 0  # the index of the event being applied, for the observer
        self._reason_code = 0  # the reason code of the event being applied, for the observer
        self._checkpoint: EpochInfo | None = None  # set when the epoch's stored part starts at a cut
        self._draft = 0  # 1 while a speculative allocation (reason "draft") is applied, for the observer

    @property
    def sharers(self) -> dict[int, list[str]]:
        """block_id -> its holders beside the interval's owner, after the last event (a copy)."""
        if self.pool is None:
            return {}
        return {block_id: list(holders) for block_id, holders in self.pool.sharers.items()}

    @property
    def cached_free(self) -> set[int]:
        """The free blocks that keep their key, after the last event (a copy)."""
        return set() if self.pool is None else set(self.pool.cached_free)

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
        """Apply events in seq order: each block event through ``transition.apply`` (its broken rules are
        the audit's to name; here they change what ``apply`` lets them change).

        ValueError when the first event of the epoch is not POOL_INIT.
        """
        seqs, steps, wall_ns = self.seqs, self.step_column, self.wall_ns
        num_allocated, num_holding, held_by = self.num_allocated, self.num_holding, self._num_held_by
        num_cached_free, num_shared = self.num_cached_free, self.num_shared
        observe = self._observer()
        for event in events:
            if not seqs and event.kind != _INIT:
                if event.kind != _SNAPSHOT or self._checkpoint is None:
                    raise ValueError(f"seq {event.seq}: the epoch starts with {event.kind!r}, not pool_init")
                seqs.append(event.seq)
                steps.append(NO_STEP if event.step is None else event.step)
                wall_ns.append(event.wall_time_ns)
                self._start_at_checkpoint(event, self._checkpoint, observe)
                num_allocated.append(len(self.pool.owners) if self.pool is not None else 0)
                num_cached_free.append(len(self.pool.cached_free) if self.pool is not None else 0)
                num_shared.append(len(self.pool.sharers) if self.pool is not None else 0)
                num_holding.append(len(held_by))
                continue
            seqs.append(event.seq)
            steps.append(NO_STEP if event.step is None else event.step)
            wall_ns.append(event.wall_time_ns)
            pool = self.pool
            block_event = _block_event(event)
            if block_event is not None:
                if pool is not None:
                    self._index = len(seqs) - 1
                    self._reason_code = self._reason_code_of(event.reason)
                    self._draft = int(event.reason == _DRAFT)
                    apply(pool, block_event, ignore, observe)
            elif event.kind in BLOCK_KINDS:
                pass  # a block record replay cannot apply (it names it): nothing changes
            elif event.kind == _INIT:
                self._init(event)
                pool = self.pool
            elif event.kind == _CLOSE:
                if self.closed_seq is None:
                    self.closed_seq = event.seq
            elif event.kind != _SNAPSHOT:
                self.unknown_kinds[event.kind] = self.unknown_kinds.get(event.kind, 0) + 1
            if pool is None:
                num_allocated.append(0)
                num_cached_free.append(0)
                num_shared.append(0)
            else:
                num_allocated.append(len(pool.owners))
                num_cached_free.append(len(pool.cached_free))
                num_shared.append(len(pool.sharers))
            num_holding.append(len(held_by))

    def start_at_checkpoint(self, info: EpochInfo) -> None:
        """The epoch's seqs before a cut are archived (``segment``): its first stored event is the
        checkpoint SNAPSHOT ``apply`` then starts from, the pool of ``info``'s shape as it holds.
        Every block held there opens an interval at that SNAPSHOT, in block id order (a request's
        block table order before the cut is not in the live log)."""
        self._checkpoint = info

    def _start_at_checkpoint(self, event: Event, info: EpochInfo, observe: Observe) -> None:
        """ValueError when the SNAPSHOT's data is not a pool of ``info``'s shape."""
        self.pool_id, self.epoch = info.pool_id, info.epoch
        self.num_blocks, self.block_size = info.num_blocks, info.block_size
        self.held.extend([None] * self.num_blocks)
        pool = decode_snapshot(json.dumps(event.data), info.num_blocks, info.block_size)
        self._index, self._reason_code, self._draft = 0, 0, 0
        for block_id in sorted(pool.owners):
            observe(block_id, None, pool.owners[block_id])
        self.pool = pool

    def _init(self, event: Event) -> None:
        if self.seqs[0] != event.seq:
            return  # a misplaced POOL_INIT changes nothing (replay names it)
        self.pool_id, self.epoch = event.pool_id, event.epoch
        self.num_blocks = int(event.data["num_blocks"])
        self.block_size = int(event.data["block_size"])
        self.held.extend([None] * self.num_blocks)  # extended, not replaced: the observer holds it
        self.pool = PoolState.fresh(self.num_blocks, self.block_size)

    def _reason_code_of(self, reason: str | None) -> int:
        code = self._reason_codes.get(reason)
        if code is None:
            code = self._reason_codes[reason] = len(self.reasons)
            self.reasons.append(reason)
        return code

    def _observer(self) -> Observe:
        """``transition.apply``'s hook for this timeline: the holder of a block changed at event ``_index``.

        The old holder's interval ends with the event's reason; the new holder's begins.
        A closure over the columns (they are never replaced): it runs once per block
        touched, the timeline's inner loop.
        """
        held, held_by, owner_ids, owners = self.held, self._num_held_by, self._owner_ids, self.owners
        ends, reason_codes, interval_owner_ids = self.interval_ends, self.interval_reason_codes, self.interval_owner_ids
        block_ids, starts, drafts = self.interval_block_ids, self.interval_starts, self.interval_drafts

        def observe(block_id: int, old_holder: str | None, new_holder: str | None) -> None:
            if old_holder is not None:
                interval = held[block_id]
                assert interval is not None, f"block {block_id} had holder {old_holder!r} but no open interval"
                held[block_id] = None
                ends[interval] = self._index
                reason_codes[interval] = self._reason_code
                holder = interval_owner_ids[interval]
                left = held_by[holder] - 1
                if left:
                    held_by[holder] = left
                else:
                    del held_by[holder]
            if new_holder is not None:
                owner_id = owner_ids.get(new_holder)
                if owner_id is None:
                    owner_id = owner_ids[new_holder] = len(owners)
                    owners.append(new_holder)
                held[block_id] = len(block_ids)
                block_ids.append(block_id)
                interval_owner_ids.append(owner_id)
                starts.append(self._index)
                ends.append(OPEN)
                reason_codes.append(0)
                drafts.append(self._draft)
                held_by[owner_id] = held_by.get(owner_id, 0) + 1

        return observe

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
            draft=bool(self.interval_drafts[j]),
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

    def without_blocks(self, holding: set[str]) -> dict[str | None, list[tuple[str, int]]]:
        """How the last holding ended -> [(owner, seq of that free)], of the owners that held blocks and
        hold none after the last event (``holding``: the owners that do).

        Keys are ENDINGS_WITHOUT_BLOCKS, in that order (another reason counts as None); owners in order
        of that seq, latest first. A request the log never saw holding a block is not known to it.
        """
        owner_ids = np.array(self.interval_owner_ids, dtype=np.int64)
        ends = np.array(self.interval_ends, dtype=np.int64)
        order = np.lexsort((ends, owner_ids))  # by owner, then by end: an owner's last-ending holding is its last
        is_last = np.r_[owner_ids[order][1:] != owner_ids[order][:-1], True]
        found: dict[str | None, list[tuple[str, int]]] = {}
        for j in order[is_last].tolist():
            owner = self.owners[owner_ids[j]]
            if owner in holding or ends[j] == OPEN:
                continue
            reason = self.reasons[self.interval_reason_codes[j]]
            key = reason if reason in ENDINGS_WITHOUT_BLOCKS else None
            found.setdefault(key, []).append((owner, self.seqs[ends[j]]))
        return {
            reason: sorted(found[reason], key=lambda item: -item[1])
            for reason in ENDINGS_WITHOUT_BLOCKS
            if reason in found
        }


def _block_event(event: Event) -> BlockEvent | None:
    """The ``BlockEvent`` to apply for ``event``; None for the log's kinds, unknown ones and bad reasons."""
    try:
        return block_event_of(event)
    except ValueError:
        return None


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
    """The timeline of ``(pool_id, epoch)`` from its first stored event to ``until_seq`` (default: the last
    stored): seq 1, or the checkpoint at the epoch's cut when its older part is archived (``segment``).

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
    with connect(url) as conn:
        info = resolve_epoch(conn, pool_id, epoch)
        cut = epoch_cut(conn, info.pool_id, info.epoch)
    pool_id, epoch = info.pool_id, info.epoch
    from_seq = 1
    if cut is not None:  # seqs before it are archived: the live part starts at its checkpoint
        timeline.start_at_checkpoint(info)
        from_seq = cut.first_seq
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
