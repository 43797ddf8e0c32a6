"""The marks on a block map: how holdings ended (preempted, aborted), blocks held at the end, broken rules.

Each mark names its request. A preemption or an abort is one mark per block
at the bar's end, grouped per freeing event and request: in an SVG the
element ``preempted-K`` / ``aborted-K`` with the tooltip ``llm-6 preempted at
seq 49 (step 48): blocks 3, 9, 10 freed for recompute``, and on the picture
the request's name written on its bar, left of the marks. A block still held
after the last event (a leak at POOL_CLOSE, or held at the last durable event
of an open or damaged log) is a ◀ in the right margin, past the edge line and
clear of every bar (``leak-B`` or ``held-B``), its request named on its bar
too. The marks are white or black with an outline of the other, so they stay
visible on a bar of any colour, and they grow with the rows.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.lines import Line2D

from nanoserve.allocator import Violation
from nanoserve.service.pictures.plot_frame import PlotFrame
from nanoserve.service.pictures.timeline_view import TimelineView

MAX_TITLED_MARKS = 500  # mark groups drawn one SVG element each (with a tooltip); more: one element for all
MAX_NAMED_MARKS = 80  # mark groups whose request is also written on the picture
MIN_NAMED_ROW_PT = 7.0  # rows lower than this (points) are too low to write a name on
NAME_FONT_PT = 7.0
NAME_PT_PER_CHARACTER = 3.8  # about, at NAME_FONT_PT (DejaVu Sans: digits 4.5, l 2.0, - 2.5)
LEAK_COLOUR = "#e7298a"
VIOLATION_COLOUR = "#ff7f00"
# free reason -> (marker, face, edge, what happened to the request, what happened to its blocks)
END_MARKS = {
    "preempted": ("X", "#ffffff", "#000000", "preempted", "freed for recompute"),
    "aborted": ("D", "#000000", "#ffffff", "aborted", "freed"),
}


@dataclass(frozen=True)
class MapScale:
    """The block map's scale in points (1/72 inch): a block's row high, one unit of x wide."""

    row_pt: float
    x_pt: float

    @property
    def mark_pt(self) -> float:
        return mark_size_pt(self.row_pt)


def mark_size_pt(row_pt: float) -> float:
    """The marks' size (points) on rows ``row_pt`` points high: most of a row, within 4..9."""
    return float(min(9.0, max(4.0, row_pt * 0.85)))


def draw_end_marks(
    ax: Any, view: TimelineView, titles: dict[str, str], scale: MapScale, x: str
) -> tuple[list[Any], dict[int, list[str]]]:
    """Preempted and aborted ends; returns (legend handles, owner id -> what happened to it, for the legend)."""
    timeline = view.timeline
    handles: list[Any] = []
    facts: dict[int, list[str]] = {}
    for reason, (marker, face, edge, words, freed) in END_MARKS.items():
        groups = view.end_groups(reason)
        if not groups:
            continue
        style = {"marker": marker, "s": scale.mark_pt**2, "facecolor": face, "edgecolor": edge, "linewidths": 0.9}
        if len(groups) > MAX_TITLED_MARKS:
            bars = np.concatenate([bars for _, _, bars in groups])
            ax.scatter(view.x1[bars], view.block[bars], zorder=3, **style)
        for k, (event, owner_id, bars) in enumerate(groups if len(groups) <= MAX_TITLED_MARKS else ()):
            mark = ax.scatter(view.x1[bars], view.block[bars], zorder=3, **style)
            mark.set_gid(f"{reason}-{k}")
            blocks = ", ".join(str(b) for b in sorted(view.block[bars].tolist()))
            step = timeline.step(event)
            at = f"seq {timeline.seqs[event]:,}" + ("" if step is None else f" (step {step:,})")
            titles[f"{reason}-{k}"] = (
                f"{timeline.owners[owner_id]} {words} at {at}: block{'s' * (len(bars) > 1)} {blocks} {freed}"
            )
        if len(groups) <= MAX_NAMED_MARKS and scale.row_pt >= MIN_NAMED_ROW_PT:
            for _, owner_id, bars in groups:
                _name(ax, timeline.owners[owner_id], view, bars, view.x1, scale)
        said = _ends_said(view, groups, words, x)
        for owner_id, text in said.items():
            facts.setdefault(owner_id, []).append(text)
        label = f"{words} (its blocks {freed}): {len(groups):,} time{'s' * (len(groups) != 1)}"
        label += f", {len(said):,} request{'s' * (len(said) != 1)}"
        num_marks = sum(len(bars) for _, _, bars in groups)  # one mark per block (a new user counted 4 for "2 times")
        label += f", {num_marks:,} block mark{'s' * (num_marks != 1)}"
        handles.append(_handle(marker, face, edge, label))
    return handles, facts


def _ends_said(view: TimelineView, groups: list[tuple[int, int, np.ndarray]], words: str, x: str) -> dict[int, str]:
    """owner id -> ``preempted at seq 31``, ``preempted ×3 at steps 9, 30, …``: where to look for its marks."""
    events: dict[int, list[int]] = {}  # owner id -> its ending events
    for event, owner_id, _ in groups:
        events.setdefault(owner_id, []).append(event)
    said = {}
    for owner_id, ends in events.items():
        if x == "time":
            places = [f"{view.xs[event]:,.2f}" for event in ends]
            unit, after = "", " s"
        elif x == "step" and all(view.timeline.step(event) is not None for event in ends):
            places = [f"{view.timeline.step(event):,}" for event in ends]
            unit, after = "step", ""
        else:
            places = [f"{view.timeline.seqs[event]:,}" for event in ends]
            unit, after = "seq", ""
        shown = ", ".join(places[:3]) + (", …" if len(places) > 3 else "")
        unit += "s " if unit and len(places) > 1 else " " if unit else ""
        count = f" ×{len(places)}" if len(places) > 1 else ""
        said[owner_id] = f"{words}{count} at {unit}{shown}{after}"
    return said


def draw_held_marks(
    ax: Any, view: TimelineView, frame: PlotFrame, titles: dict[str, str], scale: MapScale, damaged_seq: int | None
) -> tuple[list[Any], dict[int, list[str]]]:
    """◀ in the right margin for each block still held after the last event; (legend handles, owner id -> facts)."""
    holders = view.held_at_end()
    if not holders:
        return [], {}
    timeline = view.timeline
    closed = timeline.closed_seq is not None and damaged_seq is None
    last_seq = timeline.seqs[-1]
    if closed:
        face, gid, where, verb = LEAK_COLOUR, "leak", f"at POOL_CLOSE (seq {timeline.closed_seq})", "leaked"
    elif damaged_seq is not None:
        face, gid, where, verb = "#ffffff", "held", f"at seq {last_seq}, before the damage", "held at the end"
    else:
        face, gid, where, verb = "#ffffff", "held", f"at the last durable event (seq {last_seq})", "held at the end"
    size = scale.mark_pt
    style = {"marker": "<", "s": size**2, "facecolor": face, "edgecolor": "#000000", "linewidths": 0.9, "zorder": 6}
    num_blocks = sum(len(bars) for _, bars in holders)
    facts: dict[int, list[str]] = {}
    for owner_id, bars in holders:
        owner = timeline.owners[owner_id]
        blocks = view.block[bars]
        if num_blocks <= MAX_TITLED_MARKS:
            for block in blocks.tolist():
                mark = ax.scatter([frame.held_mark_x], [block], clip_on=False, **style)
                mark.set_gid(f"{gid}-{block}")
                suffix = ": leaked" if closed else ""
                titles[f"{gid}-{block}"] = f"block {block} still held by {owner} {where}{suffix}"
        if len(holders) <= MAX_NAMED_MARKS and scale.row_pt >= MIN_NAMED_ROW_PT:
            _name(ax, owner, view, bars, np.full(view.num_bars, frame.x_hi), scale)
        facts[owner_id] = [f"{verb}: {len(bars)} block{'s' * (len(bars) != 1)}"]
    if num_blocks > MAX_TITLED_MARKS:
        blocks = np.concatenate([view.block[bars] for _, bars in holders])
        ax.scatter(np.full(len(blocks), frame.held_mark_x), blocks, clip_on=False, **style)
    names = ", ".join(timeline.owners[owner_id] for owner_id, _ in holders[:4]) + (", …" if len(holders) > 4 else "")
    label = (
        f"{'leaked' if closed else 'held'}: {num_blocks:,} block{'s' * (num_blocks != 1)} still held {where} by {names}"
    )
    return [_handle("<", face, "#000000", _wrap(label))], facts


def draw_violations(
    ax: Any, view: TimelineView, violations: Sequence[Violation], titles: dict[str, str], scale: MapScale
) -> list[Any]:
    """★ where the audit found a rule broken on a block (a leak is marked by ``draw_held_marks``)."""
    points = [(view.x_of_seq(v.seq), v) for v in violations if v.block_id is not None and v.rule != "leaked_block"]
    points = [(x, v) for x, v in points if x is not None]
    size = scale.mark_pt * 1.6
    for k, (x, violation) in enumerate(points):
        marker = ax.scatter(
            [x],
            [violation.block_id],
            marker="*",
            s=size**2,
            facecolor=VIOLATION_COLOUR,
            edgecolor="#000000",
            linewidths=0.7,
            zorder=4,
        )
        marker.set_gid(f"violation-{k}")
        titles[f"violation-{k}"] = str(violation)
    if not points:
        return []
    return [_handle("*", VIOLATION_COLOUR, "#000000", f"audit violation: {len(points):,}", size=11)]


def _name(ax: Any, owner: str, view: TimelineView, bars: np.ndarray, ends: np.ndarray, scale: MapScale) -> None:
    """The request's name written on the widest of its ``bars``, ending just left of its mark at ``ends[bar]``.

    Left out when even that bar is too short for the name: written over a
    neighbour's bar it would name the wrong one (the legend and tooltips still do).
    """
    widths = (ends[bars] - view.x0[bars]) * scale.x_pt  # [len(bars)] points
    widest = int(np.argmax(widths))
    if widths[widest] < NAME_PT_PER_CHARACTER * len(owner) + _name_offset_pt(scale):
        return
    bar = bars[widest]
    ax.annotate(
        owner,
        (float(ends[bar]), float(view.block[bar])),
        xytext=(-_name_offset_pt(scale), 0),
        textcoords="offset points",
        ha="right",
        va="center",
        fontsize=NAME_FONT_PT,
        zorder=3,
        bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
    )


def _name_offset_pt(scale: MapScale) -> float:
    """How far left of its mark's centre a name ends: clear of the mark."""
    return scale.mark_pt * 0.6 + 1.5


def _handle(marker: str, face: str, edge: str, label: str, size: float = 8) -> Line2D:
    return Line2D(
        [],
        [],
        marker=marker,
        markerfacecolor=face,
        markeredgecolor=edge,
        linestyle="none",
        markersize=size,
        label=label,
    )


def _wrap(text: str, width: int = 46) -> str:
    return "\n".join(textwrap.wrap(text, width))
