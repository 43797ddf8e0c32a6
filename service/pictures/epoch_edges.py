"""Where a picture of the pool stops: POOL_CLOSE, the last durable event of an open epoch, a damaged log, the window.

Each edge is a vertical line through every panel, in a style of its own
(POOL_CLOSE solid grey, the last durable event dashed black, the damage
dash-dot black over a hatched margin), named above the block map and in the
legend, where it also says what a bar reaching it means: held there. The
events a picture leaves out (before ``--from``, after ``--to``, past the
damage) are a hatched margin, named inside it.
In an SVG each line is the element ``close-marker-K``, ``crash-marker-K`` or
``damage-marker-K`` (K: the panel), with a tooltip.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from nanoserve.allocator.log.epoch_status import OPEN_STATUS
from nanoserve.service.pictures.plot_frame import PlotFrame
from nanoserve.service.pictures.pool_timeline import PoolTimeline
from nanoserve.service.pictures.timeline_view import TimelineView

EdgeStyle = tuple[str, Literal["-", "--", "-."], float]  # colour, line style, width
CLOSE_STYLE: EdgeStyle = ("#6b6b6b", "-", 1.4)
CRASH_STYLE: EdgeStyle = ("#000000", "--", 1.6)
DAMAGE_STYLE: EdgeStyle = ("#000000", "-.", 1.6)
HIDDEN_FACE = (1.0, 1.0, 1.0, 0.6)  # the hatched margin: it veils the bars cut by the window
HIDDEN_HATCH_COLOUR = "#9a9a9a"


def held_then(timeline: PoolTimeline) -> str:
    """``21 blocks of 3 requests`` still held after the timeline's last event, or ``no block``."""
    owners = timeline.owners_now()
    if not owners:
        return "no block"
    num_requests = len(set(owners.values()))
    return f"{len(owners):,} block{'s' * (len(owners) != 1)} of {num_requests:,} request{'s' * (num_requests != 1)}"


def draw_edges(
    axes: Sequence[Any],
    view: TimelineView,
    frame: PlotFrame,
    damaged_seq: int | None,
    titles: dict[str, str],
    last_sample_x: float | None = None,
    open_status: str = OPEN_STATUS,
) -> list[Any]:
    """The edge lines and hatched margins on ``axes`` (the block map first); returns the legend handles.

    open_status: how an epoch without POOL_CLOSE is named at its last durable event (``epoch_status``).

    last_sample_x: where the block map last sampled the pool (the middle of
    its last cell, when aggregated): blocks freed after it are said to be.
    """
    timeline = view.timeline
    handles: list[Any] = []
    last_seq = timeline.seqs[-1]
    at_end = view.last == timeline.num_events - 1
    if damaged_seq is not None and at_end:
        label = (
            f"log damaged: first bad record at seq {damaged_seq:,}; it and all after it are not drawn. "
            f"Bars reaching this line were held at seq {last_seq:,} ({held_then(timeline)})"
        )
        handles.append(_edge(axes, frame.x_hi, DAMAGE_STYLE, "damage-marker", "damaged", label, titles))
    elif timeline.closed_seq is None and at_end:
        label = (
            f"last durable event, seq {last_seq:,}: the epoch is {open_status}. "
            f"Bars reaching this line were held then ({held_then(timeline)})"
        )
        handles.append(_edge(axes, frame.x_hi, CRASH_STYLE, "crash-marker", "last durable event", label, titles))
    if timeline.closed_seq is not None:
        x = view.x_of_seq(timeline.closed_seq)
        if x is not None:
            held = held_then(timeline)
            label = f"POOL_CLOSE, seq {timeline.closed_seq:,}: " + (
                "no block held then (clean)" if held == "no block" else f"{held} still held: leaked"
            )
            label += _freed_after_sample(view, last_sample_x)
            handles.append(_edge(axes, x, CLOSE_STYLE, "close-marker", "POOL_CLOSE", label, titles))
    handles.extend(_draw_hidden(axes, view, frame, damaged_seq))
    return handles


def _freed_after_sample(view: TimelineView, sample_x: float | None) -> str:
    """`` (1,339 blocks, held at seq 999,588 where the map last samples the pool, were freed after it)``, or ``""``."""
    if sample_x is None:
        return ""
    timeline = view.timeline
    sampled = int(np.searchsorted(view.xs, sample_x, side="right")) - 1  # the last event at or before it
    num_freed = timeline.num_allocated[sampled] - timeline.num_allocated[-1]
    if num_freed <= 0:
        return ""
    return (
        f". The map's last cell shows the pool at seq {timeline.seqs[sampled]:,}; "
        f"{num_freed:,} blocks held then were freed after it"
    )


def _edge(
    axes: Sequence[Any],
    x: float,
    style: EdgeStyle,
    gid: str,
    name: str,
    title: str,
    titles: dict[str, str],
) -> Line2D:
    colour, line_style, width = style
    for k, ax in enumerate(axes):
        line = ax.axvline(x, color=colour, linestyle=line_style, linewidth=width, zorder=5)
        line.set_gid(f"{gid}-{k}")
        titles[f"{gid}-{k}"] = title
    top = blended_transform_factory(axes[0].transData, axes[0].transAxes)
    axes[0].text(x, 1.01, name, transform=top, ha="center", va="bottom", fontsize="small", color=colour)
    return Line2D([], [], color=colour, linestyle=line_style, linewidth=width, label=_wrap(title))


def _draw_hidden(axes: Sequence[Any], view: TimelineView, frame: PlotFrame, damaged_seq: int | None) -> list[Any]:
    """Hatch the margins standing for events not drawn, and name them; returns the legend handle (if any)."""
    seqs = view.timeline.seqs
    first_seq, last_seq = seqs[view.first], seqs[view.last]
    spans = []  # (from x, to x, x of its name, its name)
    if frame.hidden_before:
        spans.append((frame.left, frame.x_lo, (frame.left + frame.x_lo) / 2, f"seqs before {first_seq:,}: not drawn"))
    if frame.hidden_after:
        if damaged_seq is not None and view.last == view.timeline.num_events - 1:
            name = f"seqs from {damaged_seq:,}: damaged, not drawn"
        else:
            name = f"seqs after {last_seq:,}: not drawn"
        spans.append((frame.x_hi, frame.right, frame.hidden_after_name_x, name))
    for lo, hi, name_x, name in spans:
        for ax in axes:
            ax.axvspan(lo, hi, facecolor=HIDDEN_FACE, edgecolor=HIDDEN_HATCH_COLOUR, hatch="///", linewidth=0, zorder=4)
        axes[0].text(
            name_x,
            0.5,
            name,
            transform=blended_transform_factory(axes[0].transData, axes[0].transAxes),
            rotation=90,
            ha="center",
            va="center",
            fontsize="small",
            zorder=6,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5},
        )
    if not spans:
        return []
    label = "events not drawn"
    if frame.hidden_before or (frame.hidden_after and damaged_seq is None):
        label += (
            f" (outside seqs {first_seq:,}–{last_seq:,}): a bar running into this margin was taken before "
            f"seq {first_seq:,} or is held past seq {last_seq:,}"
        )
    return [Patch(facecolor="white", edgecolor=HIDDEN_HATCH_COLOUR, hatch="///", label=_wrap(label))]


def _wrap(text: str, width: int = 46) -> str:
    """Legend text in lines of about ``width`` characters, broken between words."""
    return "\n".join(textwrap.wrap(text, width))
