"""The picture of an epoch: a block map over time above the pool's occupancy (``nanoserve log plot``).

::

                       POOL_CLOSE
    block id ▲  ▇▇▇▇▇ r0 ▇▇▇▇▇▇|        ▇▇▇▇ r3 ▇▇▇▇▇▇▇▇▇▇▇▇▇│◀   one bar per held interval,
             │  ▇▇▇▇▇▇▇▇ r1 ✖   ▇▇▇▇▇ r1 ▇▇▇▇▇▇▇▇▇▇▇▇▇▇▇▇▇▇▇│     coloured by owner; ✖ preempted,
             │        ▇▇▇▇ r2 ▇▇▇▇▇▇▇▇▇▇▇▇▇|                   │     ◆ aborted, ◀ held at the end
             └──────────────────────────────────────────────────────▶ seq | step | time
    blocks   ▲  ░░░░░░░░░░░ free ░░░░░░░░░░░░░░░░░░░░░░░░░░░░░░░░      allocated and free blocks
             │  ████████ allocated ███████████████████████████████
    running  ▲  ──────┐______┌────────────────────────────────────      running requests, own panel
             └──────────────────────────────────────────────────────▶

Drawn from a ``PoolTimeline``: the block map by ``block_map`` (bars up to
``MAX_BARS`` intervals in view, else an image of ``NUM_CELLS`` cells per block,
with a strip of preemptions and aborts per cell), its marks by
``block_marks``, the panels below by ``occupancy_panel``, the edges (POOL_CLOSE,
the last durable event, the damage, the window) by ``epoch_edges``, on the
x extent of a ``PlotFrame``. The heading says what the epoch is, what part of
it is drawn on which axis, and what was aggregated. The arrays behind it are
``timeline_view``'s.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from nanoserve.allocator import Violation
from nanoserve.allocator.log.epoch_status import OPEN_STATUS
from nanoserve.service.pictures.block_map import draw_bars, draw_cells
from nanoserve.service.pictures.block_marks import MapScale, draw_end_marks, draw_held_marks, draw_violations
from nanoserve.service.pictures.epoch_edges import draw_edges, held_then
from nanoserve.service.pictures.figure_file import Picture
from nanoserve.service.pictures.occupancy_panel import draw_end_counts, draw_occupancy
from nanoserve.service.pictures.owner_colours import FREE_COLOUR, OwnerColours
from nanoserve.service.pictures.plot_frame import PlotFrame
from nanoserve.service.pictures.pool_timeline import PoolTimeline
from nanoserve.service.pictures.timeline_view import TimelineView, event_xs

MAX_BARS = 10_000  # held intervals in view drawn one bar each; more: an image of cells
NUM_CELLS = 1_200  # time cells of the image and of the binned occupancy (about one per pixel)
MIN_ROWS_CUT = 64  # a pool of up to this many blocks is drawn whole; a larger one from block 0 up to its highest held
MIN_ROWS_DRAWN = 16  # ... but at least this many
FIGURE_SIZE_IN = (14.0, 9.5)
PANELS_HEIGHT_IN = 6.8  # the panels together, about: the figure less its heading and x axis
BLOCK_MAP_WIDTH_IN = 9.0  # about: the figure less the y axis and the legends

_AXIS_LABELS = {
    "seq": "event seq",
    "step": "scheduler step (the events of one step are spread evenly across it)",
    "time": "wall time since the epoch's first event (s; the events of one step, which share its end time, "
    "are spread over the time since the step before)",
}


def plot_timeline(
    timeline: PoolTimeline,
    *,
    from_seq: int = 1,
    to_seq: int | None = None,
    x: str = "seq",
    violations: Sequence[Violation] = (),
    damaged_seq: int | None = None,
    open_status: str = OPEN_STATUS,
) -> Picture:
    """Draw the events ``from_seq..to_seq`` of ``timeline`` (see the module docstring).

    violations: the audit's, marked where they carry a block. damaged_seq: the
    first seq of a damaged log (the timeline stops before it), marked at the
    right edge. open_status: how an epoch without POOL_CLOSE is named in the
    heading and at its last durable event (``epoch_status.open_status``: crashed
    once a later epoch of the pool opened). Raises ValueError when no event lies
    in the range.
    """
    first = bisect.bisect_left(timeline.seqs, from_seq)
    last = bisect.bisect_right(timeline.seqs, to_seq if to_seq is not None else timeline.seqs[-1]) - 1
    if first > last:
        raise ValueError(
            f"no events in seqs {from_seq}..{to_seq}: the epoch holds seqs {timeline.seqs[0]}..{timeline.seqs[-1]}"
        )
    view = TimelineView(timeline, event_xs(timeline, x), first, last)
    frame = PlotFrame.of(view, x, damaged_seq is not None)
    colours = view.owner_colours()
    aggregated = view.num_bars > MAX_BARS
    strip = aggregated and any(len(view.ending_events(reason)) for reason in ("preempted", "aborted"))
    ratios = (3.0, 0.3, 1.0, 0.45) if strip else (3.0, 1.0, 0.45)
    figure = Figure(figsize=FIGURE_SIZE_IN, layout="constrained")
    axes = figure.subplots(len(ratios), 1, sharex=True, height_ratios=ratios)
    block_ax, occupancy_ax, running_ax = axes[0], axes[-2], axes[-1]
    num_rows = rows_drawn(view, violations)
    scale = MapScale(
        row_pt=PANELS_HEIGHT_IN * 72 * ratios[0] / sum(ratios) / max(1, num_rows),
        x_pt=BLOCK_MAP_WIDTH_IN * 72 / (frame.right - frame.left),
    )
    titles: dict[str, str] = {}
    facts: dict[int, list[str]] = {}
    if aggregated:
        cell_handles = draw_cells(block_ax, view, colours, NUM_CELLS)
        blocks_note = (
            f"{view.num_bars:,} held intervals drawn as {timeline.num_blocks:,} blocks × {NUM_CELLS:,} cells "
            f"(a cell: who held the block at its middle; one cell spans {_cell_span(view, x)})"
        )
        mark_handles: list[Any] = []  # too many preemptions and aborts to mark: counted per cell below
        if strip:
            draw_end_counts(axes[1], view, NUM_CELLS)
    else:
        draft_handles = draw_bars(block_ax, view, colours, frame, titles, damaged_seq)
        cell_handles = []
        blocks_note = f"{view.num_bars:,} held intervals, one bar each"
        mark_handles, facts = draw_end_marks(block_ax, view, titles, scale, x)
        mark_handles += draft_handles
    if num_rows < timeline.num_blocks:
        blocks_note += f" (blocks {num_rows:,}–{timeline.num_blocks - 1:,} not drawn: free throughout)"
    held_handles, held_facts = draw_held_marks(block_ax, view, frame, titles, scale, damaged_seq)
    for owner_id, more in held_facts.items():
        facts.setdefault(owner_id, []).extend(more)
    mark_handles += held_handles + draw_violations(block_ax, view, violations, titles, scale)
    occupancy_note = draw_occupancy(occupancy_ax, running_ax, view, NUM_CELLS, x, num_rows)
    last_sample_x = float(view.cell_middles(NUM_CELLS)[-1]) if aggregated else None
    edge_handles = draw_edges(axes, view, frame, damaged_seq, titles, last_sample_x, open_status)
    _label(block_ax, running_ax, view, frame, x, num_rows)
    owner_handles = cell_handles or _owner_handles(timeline, colours, facts)
    legend_title = "requests" + (" (by blocks held)" if colours.num_others else "")
    if cell_handles:
        legend_title = (
            f"{len(set(view.owner.tolist())):,} requests: a cell's colour says\nhow the holding it shows ended"
        )
    block_ax.legend(
        handles=owner_handles + mark_handles + edge_handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
        title=legend_title,
        title_fontsize="small",
    )
    num_events = last - first + 1
    parts = [f"{num_events:,} events: {blocks_note}", f"occupancy {occupancy_note}"]
    if timeline.unknown_kinds:
        parts.append("not drawn: " + ", ".join(f"{n:,} {kind}" for kind, n in sorted(timeline.unknown_kinds.items())))
    summary = "; ".join(parts)
    heading = [
        _status_line(timeline, damaged_seq, open_status),
        _window_line(timeline, view, x, damaged_seq is not None),
    ]
    heading += parts if aggregated else [summary]  # aggregated: a line per part, too long for one
    figure.suptitle("\n".join(heading), fontsize="medium")
    return Picture(figure, titles, summary)


def _owner_handles(timeline: PoolTimeline, colours: OwnerColours, facts: dict[int, list[str]]) -> list[Any]:
    """A swatch per coloured request, named with what happened to it in view (``req-9 · preempted, aborted``)."""
    handles: list[Any] = []
    for label, colour in colours.legend():
        owner_id = timeline.owner_id(label) if label in colours.colours else None
        said = facts.get(owner_id, []) if owner_id is not None else []
        handles.append(Patch(facecolor=colour, label=" · ".join([label, *said])))
    return handles


def _cell_span(view: TimelineView, x: str) -> str:
    x_lo, x_hi = view.x_range
    events = f"about {(view.last - view.first + 1) / NUM_CELLS:,.0f} events"
    if x == "seq":
        return events
    span = (x_hi - x_lo) / NUM_CELLS
    unit = ("step" if span == 1 else "steps") if x == "step" else "s"
    return f"{span:,.3g} {unit}, {events}"


def rows_drawn(view: TimelineView, violations: Sequence[Violation]) -> int:
    """How many blocks the map draws, from block 0: up to the highest one held in view or named by a
    violation, at least MIN_ROWS_DRAWN (the rest of a large pool, free throughout, would squeeze the bars
    into a line); all of them when that leaves out less than a tenth of the pool."""
    marked = [violation.block_id for violation in violations if violation.block_id is not None]
    highest = max([int(view.block.max()) if len(view.block) else -1, *marked])
    num_blocks = view.timeline.num_blocks
    if num_blocks <= MIN_ROWS_CUT or highest < 0 or highest + 1 >= num_blocks * 0.9:
        return num_blocks
    return max(MIN_ROWS_DRAWN, highest + 1)


def _label(block_ax: Any, bottom_ax: Any, view: TimelineView, frame: PlotFrame, x: str, num_rows: int) -> None:
    block_ax.set_xlim(frame.left, frame.right)
    block_ax.set_ylim(-0.5, num_rows - 0.5)
    block_ax.set_ylabel("block id")
    block_ax.set_facecolor(FREE_COLOUR)
    bottom_ax.set_xlabel(_AXIS_LABELS[x])
    if x != "time":
        bottom_ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.10g}"))


def _status_line(timeline: PoolTimeline, damaged_seq: int | None, open_status: str) -> str:
    """``pool 'p' · epoch 1 · 24 blocks of 4 tokens · closed at seq 107, no block held then``."""
    pool = f"pool {timeline.pool_id!r} · epoch {timeline.epoch} · "
    pool += f"{timeline.num_blocks:,} blocks of {timeline.block_size} tokens"
    if timeline.seqs and timeline.seqs[0] > 1:  # the epoch's older part is in segment files
        pool += f" · seqs 1–{timeline.seqs[0] - 1:,} archived: drawn from the checkpoint at {timeline.seqs[0]:,}"
    held = held_then(timeline)
    if damaged_seq is not None:
        status = f"log damaged from seq {damaged_seq:,}: drawn up to seq {timeline.seqs[-1]:,} ({held} held then)"
    elif timeline.closed_seq is not None:
        status = f"closed at seq {timeline.closed_seq:,}, " + (
            "no block held then" if held == "no block" else f"{held} still held then: leaked"
        )
    else:
        status = f"{open_status}: last durable seq {timeline.seqs[-1]:,}, {held} held then"
    return f"{pool} · {status}"


def _window_line(timeline: PoolTimeline, view: TimelineView, x: str, damaged: bool) -> str:
    """What is drawn on which axis: ``drawn: seqs 40–60 of 1–107 (--from/--to) = steps 39–59 · x axis: step``."""
    first_seq, last_seq = timeline.seqs[view.first], timeline.seqs[view.last]
    text = f"drawn: seqs {first_seq:,}–{last_seq:,}"
    if view.first > 0 or view.last < timeline.num_events - 1:
        text += f" of {timeline.seqs[0]:,}–{timeline.seqs[-1]:,} (the window chosen with --from/--to)"
    elif damaged:
        text += " (all before the damage)"
    elif timeline.seqs[0] > 1:
        text += " (all the live log holds)"
    else:
        text += " (the whole epoch)"
    steps = [step for step in timeline.step_column[view.first : view.last + 1] if step >= 0]
    if steps and x != "seq":
        text += f" = steps {min(steps):,}–{max(steps):,}"
    if x == "time":
        x_lo, x_hi = view.x_range
        text += f" = {x_lo:,.3f}–{x_hi:,.3f} s"
    return f"{text} · x axis: {_AXIS_LABELS[x].split(' (')[0]}"
