"""What a picture of an epoch shows, as numpy arrays: x of each event, the bars in view, cells, extremes.

No drawing here (``pool_plot`` draws): the choices of what to aggregate and how
are made, and tested, on arrays. ``event_xs`` puts every event on the chosen
time axis; ``TimelineView`` holds the held intervals that fall in a range of
events and finds who held each block at the middle of each time cell;
``cell_extremes`` gives the lowest and highest value of a series per cell.
"""

from __future__ import annotations

import bisect

import numpy as np

from nanoserve.service.pictures.owner_colours import PALETTE, OwnerColours
from nanoserve.service.pictures.pool_timeline import NO_STEP, OPEN, PoolTimeline

AXES = ("seq", "step", "time")


def event_xs(timeline: PoolTimeline, x: str) -> np.ndarray:
    """The x of each event, float64 [num_events], on the axis ``x`` (one of AXES).

    ``step``: events without a step take the one before (the first ones the
    first step); the events of one step are spread evenly over [step, step + 1).
    ``time``: seconds of wall time since the first event. The events of one
    scheduler step all carry the time the step ended, so those sharing one
    time are spread evenly over the time since the previous one (at most the
    median such gap, so an idle pause before a step does not stretch it): the
    last lands on its own time, and a pool drained and refilled within one
    step shows as a dip, not as a line of no width.
    Raises ValueError for an unknown axis, or ``step`` on events that carry no step.
    """
    if x == "seq":
        return np.array(timeline.seqs, dtype=np.float64)
    if x == "time":
        wall_ns = np.array(timeline.wall_ns, dtype=np.int64)
        return _spread_over_gaps((wall_ns - wall_ns[0]) / 1e9)
    if x != "step":
        raise ValueError(f"the x axis must be one of {', '.join(AXES)}, got {x!r}")
    raw = np.array(timeline.step_column, dtype=np.int64)
    known = np.flatnonzero(raw != NO_STEP)
    if not len(known):
        raise ValueError("the events carry no scheduler step: use --x seq or --x time")
    # the last event with a step at or before each event (the first one for those before it)
    source = np.maximum.accumulate(np.where(raw != NO_STEP, np.arange(len(raw)), known[0]))
    steps = raw[source].astype(np.float64)
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])  # first event of each run of one step
    run = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(steps)]))
    lengths = np.diff(np.r_[starts, len(steps)])
    spread: np.ndarray = steps + (np.arange(len(steps)) - starts[run]) / lengths[run]
    return spread


def _spread_over_gaps(seconds: np.ndarray) -> np.ndarray:
    """``seconds`` [n] with each run of equal values spread evenly over the gap before it (capped at the median gap).

    Run r of n_r events at time t_r, gap g_r = t_r - t_(r-1) (0 for the first
    run, or when the clock went back), width w_r = min(g_r, median of the
    positive gaps): its k-th event (k = 1..n_r) lands at t_r - w_r + k w_r / n_r.
    """
    starts = np.flatnonzero(np.r_[True, seconds[1:] != seconds[:-1]])  # first event of each run of one time
    lengths = np.diff(np.r_[starts, len(seconds)])
    times = seconds[starts]
    gaps = np.maximum(np.diff(times, prepend=times[0]), 0.0)
    positive = gaps[gaps > 0]
    widths = np.minimum(gaps, float(np.median(positive)) if len(positive) else 0.0)
    run = np.repeat(np.arange(len(starts)), lengths)
    place = np.arange(len(seconds)) - starts[run] + 1  # 1..n_r within its run
    spread: np.ndarray = times[run] - widths[run] + place * widths[run] / lengths[run]
    return spread


class TimelineView:
    """The held intervals ("bars") and events of ``timeline`` in its event indexes first..last, as arrays.

    Per bar k (numpy arrays): ``index[k]`` the interval, ``block[k]``,
    ``owner[k]`` (owner id), ``start[k]``/``end[k]`` its events clipped to the
    view, ``x0[k]``/``x1[k]`` their x, ``open[k]`` whether it is still held after
    the timeline's last event, ``reason_code[k]`` how it ended (into
    ``timeline.reasons``), ``cut_before[k]`` / ``cut_after[k]`` whether the view
    cuts it: taken before the view's first event, or freed after its last one
    (a bar still held after the timeline's last event is cut only when the view
    ends before that event). A bar is in view when its block was held after at
    least one event of the view.

    Event i's state holds over [xs[i], xs[i + 1]); the state after the view's
    last event holds up to ``x_stop``, one event's width further (the gap to the
    next event, at most the median gap between events), so what the last event
    did is drawn with a width, not as a line.
    """

    def __init__(self, timeline: PoolTimeline, xs: np.ndarray, first: int, last: int) -> None:
        self.timeline, self.xs, self.first, self.last = timeline, xs, first, last
        num_events = timeline.num_events
        starts = np.array(timeline.interval_starts, dtype=np.int64)
        ends = np.array(timeline.interval_ends, dtype=np.int64)
        ends[ends == OPEN] = num_events
        # held after some event k of the view: start <= k < end
        self.index = np.flatnonzero((starts <= last) & (ends > first))  # interval j of each bar
        self.open = ends[self.index] == num_events  # still held after the timeline's last event
        self.start = np.maximum(starts[self.index], first)  # event indexes clipped to the view
        self.end = np.minimum(ends[self.index], last)
        self.block = np.array(timeline.interval_block_ids, dtype=np.int64)[self.index]
        self.owner = np.array(timeline.interval_owner_ids, dtype=np.int64)[self.index]
        self.reason_code = np.array(timeline.interval_reason_codes, dtype=np.int64)[self.index]
        positive = np.diff(xs)[np.diff(xs) > 0]
        width = float(np.median(positive)) if len(positive) else 1.0
        gap = float(xs[last + 1] - xs[last]) if last + 1 < len(xs) else 0.0
        self.x_stop = float(xs[last]) + (min(gap, width) if gap > 0 else width)
        # a bar freed by event e (<= last) ends at xs[e]; one held past the view's last event, at x_stop
        self.x0 = xs[self.start]
        self.x1 = np.where(ends[self.index] > last, self.x_stop, xs[self.end])
        self.cut_before = starts[self.index] < first
        self.cut_after = (ends[self.index] > last) & ~(self.open & (last == num_events - 1))

    @property
    def num_bars(self) -> int:
        return len(self.index)

    def owner_colours(self) -> OwnerColours:
        """Colours for the owners in view, weighed by events x blocks held in view."""
        owners = self.timeline.owners
        weights = np.bincount(self.owner, weights=self.end - self.start + 1, minlength=len(owners))
        present = np.flatnonzero(weights)
        heaviest = present
        if len(present) > len(PALETTE):  # only the heaviest can get a colour: rank those alone
            heaviest = np.sort(present[np.argpartition(-weights[present], len(PALETTE))[: len(PALETTE)]])
        return OwnerColours(
            {owners[i]: float(weights[i]) for i in heaviest}, {owners[i]: int(i) for i in heaviest}, len(present)
        )

    def ended_with(self, reason: str) -> np.ndarray:
        """Bars (positions in this view) freed inside the view with ``reason``."""
        if reason not in self.timeline.reasons:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero((self.reason_code == self.timeline.reasons.index(reason)) & ~self.open)

    def ending_events(self, reason: str) -> np.ndarray:
        """Event indexes in view that freed blocks with ``reason``: one per freeing event, in order."""
        return np.unique(self.end[self.ended_with(reason)])

    def end_groups(self, reason: str) -> list[tuple[int, int, np.ndarray]]:
        """(freeing event index, holder's owner id, its bars) per holder of the bars freed in view with ``reason``.

        In event order; a free that took blocks of two holders is two groups. The events of one holder in
        one scheduler step are one group, at its first event: with prefix caching a preemption or an abort
        is a FREE of the holder's uncached blocks and a RELEASE of its cached ones, one ending, not two.
        """
        bars = self.ended_with(reason)
        if not len(bars):
            return []
        keys = self.end[bars] * max(1, len(self.timeline.owners)) + self.owner[bars]
        order = np.argsort(keys, kind="stable")
        _, firsts = np.unique(keys[order], return_index=True)
        merged: dict[tuple[int, int], tuple[int, list[np.ndarray]]] = {}
        for group in np.split(bars[order], firsts[1:]):
            event, owner_id = int(self.end[group[0]]), int(self.owner[group[0]])
            step = self.timeline.step(event)
            key = (owner_id, -1 - event if step is None else step)
            _, parts = merged.setdefault(key, (event, []))
            parts.append(group)
        return [(event, owner_id, np.concatenate(parts)) for (owner_id, _), (event, parts) in merged.items()]

    def held_at_end(self) -> list[tuple[int, np.ndarray]]:
        """(owner id, its bars) per owner still holding blocks after the timeline's last event, in owner order.

        Empty when the view ends before that event.
        """
        bars = np.flatnonzero(self.open)
        if self.last != self.timeline.num_events - 1 or not len(bars):
            return []
        order = bars[np.argsort(self.owner[bars], kind="stable")]
        owners, firsts = np.unique(self.owner[order], return_index=True)
        return [(int(owner), group) for owner, group in zip(owners, np.split(order, firsts[1:]), strict=True)]

    def x_of_seq(self, seq: int) -> float | None:
        """x of the event ``seq`` when it is in view."""
        i = bisect.bisect_left(self.timeline.seqs, seq)
        if i < len(self.timeline.seqs) and self.timeline.seqs[i] == seq and self.first <= i <= self.last:
            return float(self.xs[i])
        return None

    @property
    def x_range(self) -> tuple[float, float]:
        """From the view's first event to where the state after its last event stops being drawn."""
        return float(self.xs[self.first]), self.x_stop

    def cell_middles(self, num_cells: int) -> np.ndarray:
        """The x of the middle of each of ``num_cells`` equal cells across the view, float64 [num_cells]."""
        x_lo, x_hi = self.x_range
        return x_lo + (np.arange(num_cells) + 0.5) * (x_hi - x_lo) / num_cells

    def cell_holders(self, num_cells: int) -> np.ndarray:
        """The bar holding each block at each cell's middle, -1 when free: int64 [num_blocks, num_cells].

        A bar holds its block over [x0, x1). The holdings of one block never
        overlap, so with the bars sorted by (block, x0) the one holding block b
        at x is the last bar starting at or before (b, x), if it has not ended:
        one ``searchsorted`` for all cells.
        """
        x_lo, x_hi = self.x_range
        middles = self.cell_middles(num_cells)
        stride = x_hi - x_lo + 1.0  # (block, x) -> block * stride + (x - x_lo), ordered as the pairs
        keys = self.block * stride + (self.x0 - x_lo)
        order = np.argsort(keys, kind="stable")
        num_blocks = self.timeline.num_blocks
        queries = (np.arange(num_blocks)[:, None] * stride + (middles - x_lo)[None, :]).ravel()
        found = np.searchsorted(keys[order], queries, side="right") - 1
        bars = order[np.maximum(found, 0)]
        cell_blocks = np.repeat(np.arange(num_blocks), num_cells)
        held = (found >= 0) & (self.block[bars] == cell_blocks) & (self.x1[bars] > np.tile(middles, num_blocks))
        return np.where(held, bars, -1).reshape(num_blocks, num_cells)


def cell_extremes(values: np.ndarray, num_cells: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``values`` [n] cut into ``num_cells`` runs of (nearly) equal length: (first index, lowest, highest) of each.

    All three are [num_cells] arrays (n >= num_cells).
    """
    starts = np.linspace(0, len(values), num_cells + 1).astype(np.int64)[:-1]
    return starts, np.minimum.reduceat(values, starts), np.maximum.reduceat(values, starts)
