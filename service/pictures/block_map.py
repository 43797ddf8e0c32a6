"""The block map of a picture of the pool: one row per block, its held intervals as bars, or as an image of cells.

Bars (up to ``pool_plot.MAX_BARS``): one ``Rectangle`` per held interval, in
its owner's colour; in an SVG the element ``interval-J`` whose tooltip says
who held which block from which seq to which, in which steps, how it ended,
and whether the window cuts it. A bar the window cuts runs into the hatched
margin (``PlotFrame``): its end there is not an allocation or a free.

Cells (past that): an image [num_blocks, NUM_CELLS], each cell the holder of
its block at the cell's middle. With few enough requests for a colour each,
a cell takes its holder's colour; with more, a colour per request says
nothing, and a cell takes the colour of how its holding ended (finished,
preempted, aborted, still held at the end).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.colors import ListedColormap, to_rgb
from matplotlib.patches import Patch, Rectangle

from nanoserve.service.pictures.owner_colours import FREE_COLOUR, OTHER_COLOUR, OwnerColours
from nanoserve.service.pictures.plot_frame import PlotFrame
from nanoserve.service.pictures.pool_timeline import PoolTimeline
from nanoserve.service.pictures.timeline_view import TimelineView

BAR_HEIGHT = 0.84  # of a block's row
DRAFT_HATCH = "..."  # a bar begun by a speculative allocation (slots of draft tokens)
# how a holding ended -> colour of its cells, when cells are coloured by ending
ENDING_COLOURS = {
    "finished": "#9db7d5",
    "preempted": "#d62728",
    "aborted": "#2b2b2b",
    "rejected_draft": "#ff7f0e",  # speculative decoding: given back by the verify pass that rejected its drafts
    None: "#b5b5b5",  # freed with another reason, or none
    "held": "#e7298a",  # still held after the last event
}


def draw_bars(
    ax: Any,
    view: TimelineView,
    colours: OwnerColours,
    frame: PlotFrame,
    titles: dict[str, str],
    damaged_seq: int | None,
) -> list[Any]:
    """One bar per held interval in view; bars the window cuts run into its hatched margins.

    A bar begun by a speculative allocation (draft tokens' slots) is dotted; returns the
    legend handle saying so when there is one."""
    timeline = view.timeline
    window = f"seqs {timeline.seqs[view.first]:,}–{timeline.seqs[view.last]:,}"
    x0 = np.where(view.cut_before, frame.left, view.x0)
    x1 = np.where(view.cut_after, frame.right, view.x1)
    for k, j in enumerate(view.index):
        owner = timeline.owners[view.owner[k]]
        bar = Rectangle(
            (x0[k], view.block[k] - BAR_HEIGHT / 2),
            x1[k] - x0[k],
            BAR_HEIGHT,
            facecolor=colours[owner],
            edgecolor="white",
            linewidth=0.3,
            hatch=DRAFT_HATCH if timeline.interval_drafts[j] else None,
        )
        bar.set_gid(f"interval-{j}")
        ax.add_patch(bar)
        cut = _cut_note(bool(view.cut_before[k]), bool(view.cut_after[k]), window)
        titles[f"interval-{j}"] = interval_title(timeline, int(j), damaged_seq, cut)
    if not any(timeline.interval_drafts[j] for j in view.index):
        return []
    return [Patch(facecolor="white", edgecolor="#555555", hatch=DRAFT_HATCH, label="dotted: taken for draft tokens")]


def _cut_note(before: bool, after: bool, window: str) -> str:
    if before and after:
        return f", taken before this window ({window}) and held past it"
    if before:
        return f", taken before this window ({window})"
    if after:
        return f", held past this window ({window})"
    return ""


def interval_title(timeline: PoolTimeline, j: int, damaged_seq: int | None, cut: str = "") -> str:
    """``r3 held block 7 from seq 120 to 245 (steps 10 to 22), freed: preempted``; ``cut`` comes before the end."""
    interval = timeline.interval(j)
    taken = " (taken for draft tokens)" if interval.draft else ""
    held = f"{interval.owner} held block {interval.block_id}{taken} from seq {interval.start_seq}"
    if interval.end_seq is None:
        steps = "" if interval.start_step is None else f" (step {interval.start_step})"
        if damaged_seq is not None:
            where = f"seq {timeline.last_seq}, before the damage"
        elif timeline.closed_seq is not None:
            where = "POOL_CLOSE: leaked"
        else:
            where = "the last durable event"
        return f"{held}{steps}{cut}, still held at {where}"
    steps = ""
    if interval.start_step is not None and interval.end_step is not None:
        steps = f" (steps {interval.start_step} to {interval.end_step})"
    return f"{held} to {interval.end_seq}{steps}{cut}, freed: {interval.end_reason or 'no reason given'}"


def draw_cells(ax: Any, view: TimelineView, colours: OwnerColours, num_cells: int) -> list[Any]:
    """The block map as an image [num_blocks, num_cells]; returns the legend handles of its colours.

    Coloured by owner when every owner in view has a colour of its own, else by how each holding ended.
    """
    timeline = view.timeline
    holders = view.cell_holders(num_cells)
    held = holders >= 0
    if colours.num_others:
        palette, bar_colour, handles = _ending_colours(view)
    else:
        palette = [FREE_COLOUR, OTHER_COLOUR, *colours.colours.values()]
        owner_colour = np.ones(len(timeline.owners), dtype=np.int64)  # 0 free, 1 the others, then by owner
        for k, owner in enumerate(colours.colours, start=2):
            owner_colour[timeline.owner_id(owner)] = k
        bar_colour, handles = owner_colour[view.owner], []
    image = np.zeros(holders.shape, dtype=np.int64)
    image[held] = bar_colour[holders[held]]
    x_lo, x_hi = view.x_range
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
    return handles


def _ending_colours(view: TimelineView) -> tuple[list[str], np.ndarray, list[Any]]:
    """(palette, palette index of each bar, legend handles) for cells coloured by how their holding ended."""
    timeline = view.timeline
    endings: list[str | None] = list(ENDING_COLOURS)
    code = np.full(len(timeline.reasons), endings.index(None), dtype=np.int64)  # reason code -> ending
    for reason_code, reason in enumerate(timeline.reasons):
        if reason in ENDING_COLOURS and reason != "held":
            code[reason_code] = endings.index(reason)
    bar_ending = np.where(view.open, endings.index("held"), code[view.reason_code])
    palette = [FREE_COLOUR, *ENDING_COLOURS.values()]
    if timeline.closed_seq is not None:
        held = "still held at POOL_CLOSE: leaked"
    else:
        held = f"still held at seq {timeline.seqs[-1]:,}, the last event read"
    labels = {
        "finished": "then freed: finished",
        "preempted": "then freed: preempted",
        "aborted": "then freed: aborted",
        "rejected_draft": "then freed: rejected draft tokens",
        None: "then freed (other reason or none)",
        "held": held,
    }
    present = set(np.unique(bar_ending).tolist())
    handles: list[Any] = [
        Patch(facecolor=ENDING_COLOURS[ending], label=labels[ending])
        for k, ending in enumerate(endings)
        if k in present
    ]
    return palette, bar_ending + 1, handles
