"""The panels under a block map: the pool's occupancy, the running requests, and (aggregated) the ends per cell.

Occupancy: allocated blocks (filled) and free ones (grey above them), on the
pool's scale of 0..num_blocks (of as many blocks as the map above draws). Running requests (those holding at least one
block) have a panel and a y axis of their own, so their line is never read as
the edge of the allocated area. Past ``MAX_OCCUPANCY_POINTS`` events both are
drawn per cell as the lowest..highest value in it. The end counts are one row
per free reason, each cell shaded from white to the reason's colour by the
preemptions (or aborts) in it, with a colour scale beside the row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.colors import LinearSegmentedColormap, to_rgb
from matplotlib.lines import Line2D

from nanoserve.service.pictures.timeline_view import TimelineView, cell_extremes

MAX_OCCUPANCY_POINTS = 20_000  # events in view drawn one by one; more: min..max per cell
ALLOCATED_COLOUR = "#3b6ea5"
ALLOCATED_EDGE_COLOUR = "#16324f"
FREE_FILL_COLOUR = "#e4e4e4"
RUNNING_COLOUR = "#d95f02"
# free reason -> (colour of its row of counts, what one count is)
END_COUNT_ROWS = {"preempted": ("#d62728", "preemptions"), "aborted": ("#2b2b2b", "aborts")}


def draw_occupancy(ax: Any, running_ax: Any, view: TimelineView, num_cells: int, x: str, num_rows: int) -> str:
    """Allocated and free blocks on ``ax``, running requests on ``running_ax``; returns how they were drawn.

    num_rows: the blocks the map above draws (``pool_plot.rows_drawn``); the y axis spans as many (no more
    blocks can be held in view than the highest id held plus one), or the whole pool where cached-free
    blocks held before a window would rise above them.
    """
    timeline = view.timeline
    span = slice(view.first, view.last + 1)
    # each value holds from its event's x to the next one's; the last one up to the view's x_stop
    xs = np.append(view.xs[span], view.x_stop)
    allocated = np.asarray(timeline.num_allocated[span], dtype=np.float64)
    running = np.asarray(timeline.num_holding[span], dtype=np.float64)
    allocated, running = np.append(allocated, allocated[-1]), np.append(running, running[-1])
    if len(xs) <= MAX_OCCUPANCY_POINTS:
        ax.fill_between(xs, allocated, step="post", color=ALLOCATED_COLOUR, linewidth=0, label="allocated")
        ax.fill_between(xs, allocated, timeline.num_blocks, step="post", color=FREE_FILL_COLOUR, label="free")
        # the area's edge, drawn as a line: a dip too brief for the area's width (within one step, on a time axis)
        # still shows as a stroke down to its lowest
        ax.plot(xs, allocated, drawstyle="steps-post", color=ALLOCATED_EDGE_COLOUR, linewidth=1.0)
        dip = deepest_brief_dip(xs, allocated)
        if dip is not None:
            at = {"seq": f"seq {timeline.seqs[view.first + dip]:,}", "step": f"step {int(xs[dip]):,}"}.get(
                x, f"{xs[dip]:,.3f} s"
            )
            ax.plot(
                [],
                [],
                color=ALLOCATED_EDGE_COLOUR,
                label="a stroke down: a dip too brief to show\n"
                f"as area (deepest: to {allocated[dip]:,.0f} blocks at {at})",
            )
        _draw_cache(ax, xs, allocated, timeline, span)
        running_ax.plot(xs, running, drawstyle="steps-post", color=RUNNING_COLOUR, linewidth=1.2)
        note = "event by event"
    else:
        edges, low, high = cell_extremes(allocated[:-1], num_cells)
        # the last cell is drawn up to x_stop, like every other up to the next cell's start
        cell_xs, low, high = np.append(xs[edges], xs[-1]), np.append(low, low[-1]), np.append(high, high[-1])
        ax.fill_between(cell_xs, low, step="post", color=ALLOCATED_COLOUR, linewidth=0, label="allocated")
        ax.fill_between(
            cell_xs,
            low,
            high,
            step="post",
            color=ALLOCATED_COLOUR,
            alpha=0.45,
            linewidth=0,
            label="allocated at some event of the cell",
        )
        ax.fill_between(cell_xs, high, timeline.num_blocks, step="post", color=FREE_FILL_COLOUR, label="free")
        _, running_low, running_high = cell_extremes(running[:-1], num_cells)
        running_low, running_high = np.append(running_low, running_low[-1]), np.append(running_high, running_high[-1])
        running_ax.fill_between(
            cell_xs, running_low, running_high, step="post", color=RUNNING_COLOUR, alpha=0.35, linewidth=0
        )
        running_ax.plot(cell_xs, running_high, drawstyle="steps-post", color=RUNNING_COLOUR, linewidth=0.8)
        note = f"as lowest..highest per cell of {num_cells:,} (about {(len(xs) - 1) / num_cells:,.0f} events each)"
    # a windowed view's cached-free blocks may have been held before the window, above the map's rows
    cached_peak = float(np.max(np.add(timeline.num_allocated[span], timeline.num_cached_free[span])))
    top = num_rows if cached_peak <= num_rows else timeline.num_blocks
    ax.set_ylim(0, top)
    ax.set_ylabel("blocks" if top == timeline.num_blocks else f"blocks\n(of {timeline.num_blocks:,})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    running_ax.set_ylim(0, max(1.0, float(running.max()) * 1.15))
    running_ax.set_ylabel("running\nrequests", color=RUNNING_COLOUR)
    running_ax.tick_params(axis="y", colors=RUNNING_COLOUR)
    running_ax.yaxis.get_major_locator().set_params(integer=True)
    running_ax.legend(
        handles=[Line2D([], [], color=RUNNING_COLOUR, label="running requests\n(holding at least one block)")],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
    )
    return note


def _draw_cache(ax: Any, xs: np.ndarray, allocated: np.ndarray, timeline: Any, span: slice) -> None:
    """Prefix caching, where the epoch used it: cached-free blocks as a hatched band above the
    allocated ones (free, but still holding a prefix's KV), shared blocks as a dashed line."""
    cached = np.asarray(timeline.num_cached_free[span], dtype=np.float64)
    shared = np.asarray(timeline.num_shared[span], dtype=np.float64)
    if not cached.any() and not shared.any():
        return
    cached, shared = np.append(cached, cached[-1]), np.append(shared, shared[-1])
    ax.fill_between(
        xs,
        allocated,
        allocated + cached,
        step="post",
        facecolor="none",
        edgecolor=ALLOCATED_EDGE_COLOUR,
        hatch="////",
        linewidth=0,
        label="free, still cached (prefix)",
    )
    ax.plot(
        xs,
        shared,
        drawstyle="steps-post",
        color=ALLOCATED_EDGE_COLOUR,
        linestyle="--",
        linewidth=1.0,
        label="shared by several requests",
    )


def deepest_brief_dip(xs: np.ndarray, allocated: np.ndarray) -> int | None:
    """The index of the lowest value shown for under about a pixel (1/800 of the range) below both neighbours.

    Such a dip (a pool drained and refilled within one step, on a time axis)
    has no visible area; None when there is none.
    """
    if len(xs) < 3:
        return None
    widths = np.diff(xs)[1:]  # [n - 2]: how long the value after event i (1..n-2) is shown
    middle = allocated[1:-1]
    brief = widths < (xs[-1] - xs[0]) / 800
    dips = np.flatnonzero(brief & (middle < allocated[:-2]) & (middle < allocated[2:]))
    if not len(dips):
        return None
    return int(dips[np.argmin(middle[dips])]) + 1


def draw_end_counts(ax: Any, view: TimelineView, num_cells: int) -> None:
    """One row per reason of END_COUNT_ROWS: its count per cell, shaded white..colour, with a colour scale."""
    rows, labels, scales = [], [], []
    for reason, (colour, what) in END_COUNT_ROWS.items():
        events = view.ending_events(reason)
        counts, _ = np.histogram(view.xs[events], bins=num_cells, range=view.x_range)
        most = max(1, int(counts.max()))
        share = counts / most  # [num_cells] in 0..1
        rows.append(1.0 - (1.0 - np.asarray(to_rgb(colour)))[None, :] * share[:, None])  # [num_cells, 3]
        labels.append(f"{what}: {len(events):,}")
        scales.append((colour, most, what))
    x_lo, x_hi = view.x_range
    ax.imshow(np.stack(rows), aspect="auto", interpolation="nearest", extent=(x_lo, x_hi, len(rows) - 0.5, -0.5))
    ax.set_yticks(range(len(rows)), labels, fontsize="x-small")
    for row, (colour, most, what) in enumerate(scales):  # a colour scale beside each row: 0 .. most per cell
        top = row / len(rows)
        scale = ax.inset_axes((1.025, 1.0 - top - 0.8 / len(rows), 0.1, 0.6 / len(rows)))
        ramp = LinearSegmentedColormap.from_list(what, ["#ffffff", colour])
        scale.imshow(np.linspace(0, 1, 64)[None, :], aspect="auto", cmap=ramp)
        scale.set_xticks([])
        scale.set_yticks([])
        middle = 1.0 - top - 0.5 / len(rows)
        ax.text(1.02, middle, "0", transform=ax.transAxes, ha="right", va="center", fontsize="x-small")
        ax.text(1.13, middle, f"{most:,} per cell", transform=ax.transAxes, ha="left", va="center", fontsize="x-small")
