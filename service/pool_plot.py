"""The picture of an epoch: a block map over time above the pool's occupancy (``nanoserve log plot``).

::

    block id ▲  ▇▇▇▇▇ r0 ▇▇▇▇▇▇|        ▇▇▇▇ r3 ▇▇▇▇▇▇▇▇▇▇▇▇▇  ┆   one bar per held interval,
             │  ▇▇ r1 ▇▇▇▇▇▇▇▇X   ▇▇▇▇▇ r1 ▇▇▇▇▇▇▇▇▇▇▇▇▇▇▇▇▇▇  ┆   coloured by owner; X preempted,
             │        ▇▇▇▇ r2 ▇▇▇▇▇▇▇▇▇▇▇▇▇|                     ┆   ◆ aborted, ┆ POOL_CLOSE or crash
             └──────────────────────────────────────────────────────▶ seq | step | time
    blocks   ▲  ░░░░░░░░░░░ free ░░░░░░░░░░░░░░░░░░░░░░░░░░░░░░░░      allocated and free blocks,
             │  ████████ allocated ███████████████████████████████      running requests (right axis)
             └──────────────────────────────────────────────────────▶

Drawn from a ``PoolTimeline``. Up to ``MAX_BARS`` intervals in view each is
one bar (in an SVG, an element with id ``interval-J`` and a tooltip naming
owner, block, seqs, steps and how it ended). Past that the block map is an
image of ``NUM_CELLS`` time cells per block, each cell the holder of the block
at the cell's middle, with the preemptions and aborts counted per cell in a
strip below it; past ``MAX_OCCUPANCY_POINTS`` events the occupancy is drawn per
cell as its lowest..highest value. A million events draw in the time of a
thousand-cell image, and the figure's heading says what it aggregated. The
arrays behind it are ``timeline_view``'s.
"""

from __future__ import annotations

import bisect
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.colors import ListedColormap, to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from nanoserve.allocator import Violation
from nanoserve.allocator.log.pool_timeline import PoolTimeline
from nanoserve.service.figure_file import Picture
from nanoserve.service.owner_colours import FREE_COLOUR, OTHER_COLOUR, OwnerColours
from nanoserve.service.timeline_view import TimelineView, cell_extremes, event_xs

MAX_BARS = 10_000  # held intervals in view drawn one bar each; more: an image of cells
MAX_OCCUPANCY_POINTS = 20_000  # events in view drawn one by one; more: min..max per cell
NUM_CELLS = 1_200  # time cells of the image and of the binned occupancy (about one per pixel)
MAX_TITLED_MARKS = 500  # leaks marked one SVG element each (with a tooltip); more: one element for all

ALLOCATED_COLOUR = "#3b6ea5"
FREE_FILL_COLOUR = "#e4e4e4"
RUNNING_COLOUR = "#d95f02"
PREEMPTED_COLOUR = "#d62728"
ABORTED_COLOUR = "#000000"
LEAK_COLOUR = "#e7298a"
VIOLATION_COLOUR = "#ff7f00"
CRASH_COLOUR = "#d62728"
CLOSE_COLOUR = "#555555"
DAMAGE_COLOUR = "#000000"

_AXIS_LABELS = {
    "seq": "event seq",
    "step": "scheduler step (the events of one step are spread evenly across it)",
    "time": "wall time since the epoch's first event (s)",
}
# free reasons with a mark on the block map: reason -> (marker, colour, legend label)
_END_MARKS = {
    "preempted": ("X", PREEMPTED_COLOUR, "preempted (blocks freed for recompute)"),
    "aborted": ("D", ABORTED_COLOUR, "aborted"),
}


def plot_timeline(
    timeline: PoolTimeline,
    *,
    from_seq: int = 1,
    to_seq: int | None = None,
    x: str = "seq",
    violations: Sequence[Violation] = (),
    damaged_seq: int | None = None,
) -> Picture:
    """Draw the events ``from_seq..to_seq`` of ``timeline`` (see the module docstring).

    violations: the audit's, marked where they carry a block. damaged_seq: the
    first seq of a damaged log (the timeline stops before it), marked at the
    right edge. Raises ValueError when no event lies in the range.
    """
    first = bisect.bisect_left(timeline.seqs, from_seq)
    last = bisect.bisect_right(timeline.seqs, to_seq if to_seq is not None else timeline.seqs[-1]) - 1
    if first > last:
        raise ValueError(
            f"no events in seqs {from_seq}..{to_seq}: the epoch holds seqs {timeline.seqs[0]}..{timeline.seqs[-1]}"
        )
    xs = event_xs(timeline, x)
    view = TimelineView(timeline, xs, first, last)
    colours = view.owner_colours()
    figure = Figure(figsize=(14, 8.5), layout="constrained")
    aggregated = view.num_bars > MAX_BARS
    ends = {reason: view.ending_events(reason) for reason in _END_MARKS}
    strip = aggregated and any(len(events) for events in ends.values())
    if strip:  # a row of counts per cell for the preemptions and aborts, too many to mark block by block
        block_ax, ends_ax, occupancy_ax = figure.subplots(3, 1, sharex=True, height_ratios=(3, 0.28, 1))
        _draw_end_counts(ends_ax, view, ends)
    else:
        block_ax, occupancy_ax = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    titles: dict[str, str] = {}
    if not aggregated:
        _draw_bars(block_ax, view, colours, titles, damaged_seq)
        blocks_note = f"{view.num_bars:,} held intervals, one bar each"
    else:
        cell_span = _draw_cells(block_ax, view, colours, x)
        blocks_note = (
            f"{view.num_bars:,} held intervals drawn as {timeline.num_blocks:,} blocks × {NUM_CELLS:,} cells "
            f"(a cell: who held the block at its middle; one cell spans {cell_span})"
        )
    marks = _draw_marks(block_ax, view, violations, titles, per_block=not aggregated)
    occupancy_note = _draw_occupancy(occupancy_ax, view)
    axes = (block_ax, ends_ax, occupancy_ax) if strip else (block_ax, occupancy_ax)
    edges = _draw_edges(axes, view, damaged_seq, titles)
    _label(figure, block_ax, occupancy_ax, view, x)
    block_ax.legend(
        handles=[Patch(facecolor=colour, label=label) for label, colour in colours.legend()] + marks + edges,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
        title="requests (by blocks held)" if colours.num_others else "requests",
    )
    num_events = last - first + 1
    summary = f"{num_events:,} events: {blocks_note}; occupancy {occupancy_note}"
    if timeline.unknown_kinds:
        summary += "; not drawn: " + ", ".join(f"{n:,} {kind}" for kind, n in sorted(timeline.unknown_kinds.items()))
    figure.suptitle(
        _heading(timeline, view, damaged_seq) + "\n" + "\n".join(textwrap.wrap(summary, 150)), fontsize="medium"
    )
    return Picture(figure, titles, summary)


def _draw_bars(
    ax: Any, view: TimelineView, colours: OwnerColours, titles: dict[str, str], damaged_seq: int | None
) -> None:
    timeline = view.timeline
    for k, j in enumerate(view.index):
        owner = timeline.owners[view.owner[k]]
        bar = Rectangle(
            (view.x0[k], view.block[k] - 0.42),
            view.x1[k] - view.x0[k],
            0.84,
            facecolor=colours[owner],
            edgecolor="white",
            linewidth=0.3,
        )
        bar.set_gid(f"interval-{j}")
        ax.add_patch(bar)
        titles[f"interval-{j}"] = _interval_title(timeline, int(j), damaged_seq)


def _interval_title(timeline: PoolTimeline, j: int, damaged_seq: int | None) -> str:
    """``r3 held block 7 from seq 120 to 245 (steps 10 to 22), freed: preempted``."""
    interval = timeline.interval(j)
    held = f"{interval.owner} held block {interval.block_id} from seq {interval.start_seq}"
    if interval.end_seq is None:
        steps = "" if interval.start_step is None else f" (step {interval.start_step})"
        if damaged_seq is not None:
            where = f"seq {timeline.last_seq}, before the damage"
        elif timeline.closed_seq is not None:
            where = "POOL_CLOSE: leaked"
        else:
            where = "the last durable event"
        return f"{held}{steps}, still held at {where}"
    steps = ""
    if interval.start_step is not None and interval.end_step is not None:
        steps = f" (steps {interval.start_step} to {interval.end_step})"
    return f"{held} to {interval.end_seq}{steps}, freed: {interval.end_reason or 'no reason given'}"


def _draw_cells(ax: Any, view: TimelineView, colours: OwnerColours, x: str) -> str:
    """The block map as an image [num_blocks, NUM_CELLS]; returns what one cell spans."""
    timeline = view.timeline
    x_lo, x_hi = view.x_range
    # colour index of each owner: 0 free, 1 the others, then the owners with a colour of their own
    palette = [FREE_COLOUR, OTHER_COLOUR, *colours.colours.values()]
    owner_colour = np.ones(len(timeline.owners), dtype=np.int64)
    for k, owner in enumerate(colours.colours, start=2):
        owner_colour[timeline.owner_id(owner)] = k
    holders = view.cell_holders(NUM_CELLS)
    image = np.zeros(holders.shape, dtype=np.int64)
    held = holders >= 0
    image[held] = owner_colour[view.owner[holders[held]]]
    ax.imshow(
        image,
        cmap=ListedColormap([to_rgb(colour) for colour in palette]),
        vmin=-0.5,
        vmax=len(palette) - 0.5,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        extent=(x_lo, x_hi, -0.5, timeline.num_blocks - 0.5),
    )
    events = f"about {(view.last - view.first + 1) / NUM_CELLS:,.0f} events"
    if x == "seq":
        return events
    unit = "steps" if x == "step" else "s"
    return f"{(x_hi - x_lo) / NUM_CELLS:,.3g} {unit}, {events}"


def _draw_marks(
    ax: Any, view: TimelineView, violations: Sequence[Violation], titles: dict[str, str], per_block: bool
) -> list[Any]:
    """Preempted and aborted ends (``per_block``), leaks at POOL_CLOSE, audit violations; returns legend handles."""
    handles = []
    for reason, (marker, colour, label) in _END_MARKS.items():
        bars = view.ended_with(reason)
        if len(bars) and per_block:
            ax.scatter(view.x1[bars], view.block[bars], marker=marker, s=18, color=colour, zorder=3, linewidths=0)
            handles.append(_mark_handle(marker, colour, f"{label}: {len(bars):,} blocks"))
    closed_seq = view.timeline.closed_seq
    closed_x = view.x_of_seq(closed_seq) if closed_seq is not None else None
    if closed_x is not None and view.open.any():
        blocks = view.block[view.open]
        if len(blocks) <= MAX_TITLED_MARKS:  # one element per leak, each with its tooltip
            for block, owner_id in zip(blocks, view.owner[view.open], strict=True):
                leak = ax.scatter([closed_x], [block], marker=">", s=30, color=LEAK_COLOUR, zorder=3)
                leak.set_gid(f"leak-{block}")
                owner = view.timeline.owners[owner_id]
                titles[f"leak-{block}"] = (
                    f"block {block} still held by {owner} at POOL_CLOSE (seq {closed_seq}): leaked"
                )
        else:
            ax.scatter(np.full(len(blocks), closed_x), blocks, marker=">", s=30, color=LEAK_COLOUR, zorder=3)
        handles.append(_mark_handle(">", LEAK_COLOUR, f"leaked: {len(blocks):,} blocks held at POOL_CLOSE"))
    # the other broken rules (a leak is marked above)
    points = [(view.x_of_seq(v.seq), v) for v in violations if v.block_id is not None and v.rule != "leaked_block"]
    points = [(x, v) for x, v in points if x is not None]
    for k, (x, violation) in enumerate(points):
        marker = ax.scatter([x], [violation.block_id], marker="*", s=90, color=VIOLATION_COLOUR, zorder=4)
        marker.set_gid(f"violation-{k}")
        titles[f"violation-{k}"] = str(violation)
    if points:
        handles.append(_mark_handle("*", VIOLATION_COLOUR, f"audit violation: {len(points):,}", size=10))
    return handles


def _draw_end_counts(ax: Any, view: TimelineView, ends: dict[str, np.ndarray]) -> None:
    """One row per free reason of _END_MARKS: the requests freed so in each cell, shaded from white to its colour."""
    rows, labels = [], []
    for reason, (_, colour, _) in _END_MARKS.items():
        counts, _ = np.histogram(view.xs[ends[reason]], bins=NUM_CELLS, range=view.x_range)
        share = counts / max(1, int(counts.max()))  # [NUM_CELLS] in 0..1
        rows.append(1.0 - (1.0 - np.asarray(to_rgb(colour)))[None, :] * share[:, None])  # [NUM_CELLS, 3]
        labels.append(f"{reason}: {len(ends[reason]):,} requests, ≤ {int(counts.max()):,} per cell")
    x_lo, x_hi = view.x_range
    ax.imshow(np.stack(rows), aspect="auto", interpolation="nearest", extent=(x_lo, x_hi, len(rows) - 0.5, -0.5))
    ax.set_yticks(range(len(rows)), labels, fontsize="x-small")


def _mark_handle(marker: str, colour: str, label: str, size: float = 6) -> Line2D:
    return Line2D([], [], marker=marker, color=colour, linestyle="none", markersize=size, label=label)


def _draw_occupancy(ax: Any, view: TimelineView) -> str:
    """Allocated and free blocks, running requests on a right axis; returns how they were drawn."""
    timeline = view.timeline
    span = slice(view.first, view.last + 1)
    xs = view.xs[span]
    allocated = np.asarray(timeline.num_allocated[span], dtype=np.float64)
    running = np.asarray(timeline.num_holding[span], dtype=np.float64)
    running_ax = ax.twinx()
    if len(xs) <= MAX_OCCUPANCY_POINTS:
        ax.fill_between(xs, allocated, step="post", color=ALLOCATED_COLOUR, linewidth=0, label="allocated")
        ax.fill_between(xs, allocated, timeline.num_blocks, step="post", color=FREE_FILL_COLOUR, label="free")
        running_ax.plot(xs, running, drawstyle="steps-post", color=RUNNING_COLOUR, linewidth=1)
        note = "event by event"
    else:
        edges, low, high = cell_extremes(allocated, NUM_CELLS)
        cell_xs = xs[edges]
        ax.fill_between(cell_xs, low, step="post", color=ALLOCATED_COLOUR, linewidth=0, label="allocated")
        ax.fill_between(
            cell_xs, low, high, step="post", color=ALLOCATED_COLOUR, alpha=0.45, linewidth=0, label="allocated (range)"
        )
        ax.fill_between(cell_xs, high, timeline.num_blocks, step="post", color=FREE_FILL_COLOUR, label="free")
        running_ax.plot(cell_xs, cell_extremes(running, NUM_CELLS)[2], drawstyle="steps-post", color=RUNNING_COLOUR)
        note = f"as lowest..highest per cell of {NUM_CELLS:,} (about {len(xs) / NUM_CELLS:,.0f} events each)"
    ax.set_ylim(0, timeline.num_blocks)
    ax.set_ylabel("blocks")
    running_ax.set_ylim(0, max(1.0, float(running.max()) * 1.1))
    running_ax.set_ylabel("running requests", color=RUNNING_COLOUR)
    running_ax.tick_params(axis="y", colors=RUNNING_COLOUR)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color=RUNNING_COLOUR, label="running requests (holding blocks)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize="small")
    return note


def _draw_edges(axes: Sequence[Any], view: TimelineView, damaged_seq: int | None, titles: dict[str, str]) -> list[Any]:
    """POOL_CLOSE, the crash point (an open epoch's last durable event) and where damage stops the picture."""
    timeline = view.timeline
    handles = []
    last_seq = timeline.seqs[-1]
    if damaged_seq is not None and view.last == timeline.num_events - 1:
        label = f"log damaged from seq {damaged_seq:,}: the picture stops at seq {last_seq:,}"
        _vline(axes, float(view.xs[view.last]), DAMAGE_COLOUR, "-.", "damage-marker", label, titles)
        handles.append(Line2D([], [], color=DAMAGE_COLOUR, linestyle="-.", label=label))
    elif timeline.closed_seq is None and view.last == timeline.num_events - 1:
        label = f"last durable event, seq {last_seq:,}: open epoch (running, or crashed); bars reaching it held then"
        _vline(axes, float(view.xs[view.last]), CRASH_COLOUR, "--", "crash-marker", label, titles)
        handles.append(Line2D([], [], color=CRASH_COLOUR, linestyle="--", label=label))
    if timeline.closed_seq is not None:
        x = view.x_of_seq(timeline.closed_seq)
        if x is not None:
            label = f"POOL_CLOSE, seq {timeline.closed_seq:,}"
            _vline(axes, x, CLOSE_COLOUR, ":", "close-marker", label, titles)
            handles.append(Line2D([], [], color=CLOSE_COLOUR, linestyle=":", label=label))
    return handles


def _vline(
    axes: Sequence[Any], x: float, colour: str, style: str, gid: str, title: str, titles: dict[str, str]
) -> None:
    for k, ax in enumerate(axes):
        line = ax.axvline(x, color=colour, linestyle=style, linewidth=1.5, zorder=5)
        line.set_gid(f"{gid}-{k}")
        titles[f"{gid}-{k}"] = title


def _label(figure: Figure, block_ax: Any, occupancy_ax: Any, view: TimelineView, x: str) -> None:
    x_lo, x_hi = float(view.xs[view.first]), float(view.xs[view.last])
    pad = max((x_hi - x_lo) * 0.01, 0.5 if x != "time" else 1e-3)
    block_ax.set_xlim(x_lo - pad, x_hi + pad)
    block_ax.set_ylim(-0.5, view.timeline.num_blocks - 0.5)
    block_ax.set_ylabel("block id")
    block_ax.set_facecolor(FREE_COLOUR)
    occupancy_ax.set_xlabel(_AXIS_LABELS[x])
    if x != "time":
        occupancy_ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.10g}"))


def _heading(timeline: PoolTimeline, view: TimelineView, damaged_seq: int | None) -> str:
    first, last = timeline.seqs[view.first], timeline.seqs[view.last]
    if damaged_seq is not None:
        status = f"log damaged from seq {damaged_seq:,}: drawn up to seq {timeline.seqs[-1]:,}"
    elif timeline.closed_seq is not None:
        status = f"closed at seq {timeline.closed_seq:,}"
    else:
        status = f"open (running, or crashed) after seq {timeline.seqs[-1]:,}"
    return (
        f"pool {timeline.pool_id!r} · epoch {timeline.epoch} · seqs {first:,}–{last:,} · "
        f"{timeline.num_blocks:,} blocks of {timeline.block_size} tokens · {status}"
    )
