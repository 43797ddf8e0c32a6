"""The pool at one seq, drawn the way the paged-attention literature draws it (``nanoserve log state --svg``).

::

    blocks (by id)           free stack        block tables (logical order)
    ┌──┬──┬──┬──┬──┬──┐      ┌──┐ next out     ■ r0 (3 blocks): 0 → 1 → 2
    │ 0│ 1│ 2│ 3│ 4│ 5│      │ 9│              ■ r1 (2 blocks): 3 → 6
    ├──┼──┼──┼──┼──┼──┤      │ 7│
    │ 6│ 7│ 8│ 9│10│11│      │ 8│
    └──┴──┴──┴──┴──┴──┘      └──┘

Each block is a cell coloured by its owner (white when free) carrying its id;
in an SVG each cell is the element ``block-N`` whose tooltip names the owner,
the seq (and step) since which it holds the block and the block's place in its
table, or the block's place in the free stack. The free stack is listed next
out first (``free-P``, P = 0 the next block handed out), and each owner's block
table in logical order, the order it was given the blocks (``table-K``).
Owners and free stack come from ``replay`` (the ``PoolState``); since-seqs and
logical order from the ``PoolTimeline`` up to the same seq.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from nanoserve.allocator import PoolState
from nanoserve.allocator.log import Event
from nanoserve.service.pictures.figure_file import Picture
from nanoserve.service.pictures.owner_colours import FREE_COLOUR, OwnerColours
from nanoserve.service.pictures.pool_timeline import BlockInterval, PoolTimeline

MAX_FREE_SHOWN = 48  # free stack entries drawn (next out first); the rest are counted
MAX_TABLES_SHOWN = 30  # block tables listed; the rest are counted
MAX_NAMES_SHOWN = 8  # requests named per line of "not holding blocks"; the rest are counted
GRID_WIDTH_IN = 8.0  # inches of the block grid, at most
MAX_CELL_IN = 0.62  # a block's cell, at most (a small pool is not blown up to fill the grid's width)
TEXT_WIDTH_IN = 5.0  # the block tables and the requests without blocks
LINE_PT = 13.0  # one line of the block tables
EDGE_COLOUR = "#9a9a9a"
# how a request's last holding ended -> how the list of requests without blocks names it, in its order
WITHOUT_BLOCKS = {
    "preempted": "preempted, waiting to be recomputed",
    "finished": "finished",
    "aborted": "aborted",
    None: "freed, no reason given",
}


def draw_pool_grid(state: PoolState, timeline: PoolTimeline, event: Event | None = None) -> Picture:
    """The picture of ``state`` (from ``replay``), with ``timeline`` read up to the same seq.

    event: the event at that seq, named in the heading; the blocks it touched are outlined.
    Raises ValueError when the two disagree on the seq they stand at.
    """
    if timeline.last_seq != state.last_seq:
        raise ValueError(f"the timeline stands at seq {timeline.last_seq}, the pool at seq {state.last_seq}")
    tables = _tables(state, timeline)
    tables = dict(sorted(tables.items(), key=lambda item: _place(timeline, item[0])))
    colours = OwnerColours(
        {owner: len(blocks) for owner, blocks in tables.items()},
        {owner: _place(timeline, owner) for owner in tables},
    )
    # the owners with a colour of their own first: the list is the picture's legend
    tables = {owner: tables[owner] for owner in [*colours.colours, *(o for o in tables if o not in colours.colours)]}
    num_columns = min(state.num_blocks, max(4, math.ceil(math.sqrt(state.num_blocks * 2))))
    num_rows = math.ceil(state.num_blocks / num_columns)
    cell_in = min(MAX_CELL_IN, GRID_WIDTH_IN / num_columns)
    grid_in = cell_in * num_columns
    height_in = max(3.6, num_rows * cell_in + 1.4)
    figure = Figure(figsize=(grid_in + 1.0 + TEXT_WIDTH_IN, height_in), layout="constrained")
    grid_ax, stack_ax, tables_ax = figure.subplots(1, 3, width_ratios=(grid_in, 0.8, TEXT_WIDTH_IN))
    titles: dict[str, str] = {}
    touched = set(event.block_ids) if event is not None else set()
    _draw_grid(grid_ax, state, tables, colours, num_columns, num_rows, cell_in, titles, touched)
    _draw_free_stack(stack_ax, state, titles, height_in)
    without = timeline.without_blocks(set(tables))
    _draw_tables(tables_ax, tables, without, colours, titles, height_in)
    step = timeline.step(timeline.num_events - 1)
    at = f"seq {state.last_seq:,}" + ("" if step is None else f" (step {step:,})")
    summary = (
        f"{state.num_allocated:,} allocated, {state.num_free:,} free of {state.num_blocks:,} blocks "
        f"of {state.block_size} tokens; {_holders(tables)}"
    )
    if "preempted" in without:
        num_waiting = len(without["preempted"])
        summary += f", {num_waiting:,} preempted {'waits' if num_waiting == 1 else 'wait'} to be recomputed"
    heading = f"pool {state.pool_id!r} · epoch {state.epoch} · the pool after {at}"
    if event is not None:
        heading += f": {describe(event)}"
    figure.suptitle(f"{heading}\n{summary}", fontsize="medium")
    return Picture(figure, titles, summary)


def describe(event: Event) -> str:
    """The event in words: ``llm-7 preempted: blocks 16, 21, 12 freed for recompute (outlined)``."""
    if not event.block_ids:
        return _NO_BLOCK_KINDS.get(event.kind, f"a {event.kind} record")
    plural = "s" if len(event.block_ids) > 1 else ""
    blocks = f"block{plural} " + ", ".join(map(str, event.block_ids))
    if event.kind in ("allocate", "allocate_for"):
        return f"{event.owner} given {blocks} (outlined)"
    if event.reason == "preempted":
        return f"{event.owner} preempted: {blocks} freed for recompute (outlined)"
    if event.reason in ("finished", "aborted"):
        return f"{event.owner} {event.reason}: {blocks} freed (outlined)"
    return f"{blocks} of {event.owner} freed (outlined)"


_NO_BLOCK_KINDS = {
    "pool_init": "POOL_INIT, the pool opened",
    "snapshot": "a SNAPSHOT record (no block changed)",
    "pool_close": "POOL_CLOSE",
}


def _place(timeline: PoolTimeline, owner: str) -> int:
    """The owner's place in the epoch (order of first allocation); past the others when the timeline lacks it."""
    try:
        return timeline.owner_id(owner)
    except KeyError:
        return len(timeline.owners)


def _tables(state: PoolState, timeline: PoolTimeline) -> dict[str, list[tuple[int, BlockInterval | None]]]:
    """owner -> (block_id, its holding or None when the timeline disagrees) in logical order."""
    held = timeline.block_tables()
    tables: dict[str, list[tuple[int, BlockInterval | None]]] = {}
    for owner, intervals in held.items():
        tables[owner] = [(i.block_id, i) for i in intervals if state.owners.get(i.block_id) == owner]
    for block_id, owner in sorted(state.owners.items()):  # held by replay's account but not the timeline's
        if all(block_id != b for b, _ in tables.get(owner, [])):
            tables.setdefault(owner, []).append((block_id, None))
    return {owner: blocks for owner, blocks in tables.items() if blocks}


def _draw_grid(
    ax: Any,
    state: PoolState,
    tables: dict[str, list[tuple[int, BlockInterval | None]]],
    colours: OwnerColours,
    num_columns: int,
    num_rows: int,
    cell_in: float,
    titles: dict[str, str],
    touched: set[int],
) -> None:
    place: dict[int, tuple[str, int, BlockInterval | None]] = {}  # block_id -> owner, position in table, holding
    for owner, blocks in tables.items():
        for position, (block_id, interval) in enumerate(blocks):
            place[block_id] = (owner, position, interval)
    free_position = {block_id: k for k, block_id in enumerate(reversed(state.free_block_ids))}
    font_size = max(2.5, min(9.0, cell_in * 72 * 0.32))
    for block_id in range(state.num_blocks):
        row, column = divmod(block_id, num_columns)
        holder = state.owners.get(block_id)
        cell = Rectangle(
            (column, row),
            1,
            1,
            facecolor=FREE_COLOUR if holder is None else colours[holder],
            edgecolor="black" if block_id in touched else EDGE_COLOUR,
            linewidth=2.5 if block_id in touched else 0.5,
            zorder=2 if block_id in touched else 1,
        )
        cell.set_gid(f"block-{block_id}")
        ax.add_patch(cell)
        fill = FREE_COLOUR if holder is None else colours[holder]
        ink = "white" if _is_dark(fill) else "black"
        ax.text(column + 0.5, row + 0.5, str(block_id), ha="center", va="center", fontsize=font_size, color=ink)
        if holder is None and block_id in free_position:
            titles[f"block-{block_id}"] = (
                f"block {block_id}: free, #{free_position[block_id] + 1} out of the free stack"
            )
        elif holder is None:  # prefix caching: free, but its KV and key kept until evicted
            titles[f"block-{block_id}"] = (
                f"block {block_id}: free but cached, #{state.cached_free.index(block_id) + 1} to be evicted"
            )
        else:
            _, position, interval = place[block_id]
            since = "" if interval is None else f" since seq {interval.start_seq}"
            if interval is not None and interval.start_step is not None:
                since += f" (step {interval.start_step})"
            shared = state.sharers.get(block_id)
            also = f", shared with {', '.join(shared)}" if shared else ""
            titles[f"block-{block_id}"] = (
                f"block {block_id}: held by {holder}{since}, logical block {position} of its table{also}"
            )
    ax.set_xlim(-0.05, num_columns + 0.05)
    ax.set_ylim(num_rows + 0.05, -0.05)  # block 0 top left, ids run along the rows
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("blocks by id (colour: owner, white: free)", fontsize="small")


def _draw_free_stack(ax: Any, state: PoolState, titles: dict[str, str], height_in: float) -> None:
    stack = list(reversed(state.free_block_ids))  # next out first
    shown = stack[:MAX_FREE_SHOWN]
    font_size = max(4.0, min(9.0, (height_in - 1.2) / (len(shown) + 1.5) * 72 * 0.45))
    for position, block_id in enumerate(shown):
        cell = Rectangle((0, position), 1, 1, facecolor=FREE_COLOUR, edgecolor=EDGE_COLOUR, linewidth=0.5)
        cell.set_gid(f"free-{position}")
        ax.add_patch(cell)
        ax.text(0.5, position + 0.5, str(block_id), ha="center", va="center", fontsize=font_size)
        titles[f"free-{position}"] = f"free stack #{position + 1} (#1 is handed out next): block {block_id}"
    if len(stack) > len(shown):
        ax.text(0.5, len(shown) + 0.6, f"… {len(stack) - len(shown):,} more", ha="center", va="top", fontsize="small")
    ax.set_xlim(-0.2, 1.2)
    ax.set_ylim(max(len(shown), 1) + 1.5, 0)
    ax.axis("off")
    ax.set_title(f"free stack ({len(stack):,})\nnext out first", fontsize="small")


def _draw_tables(
    ax: Any,
    tables: dict[str, list[tuple[int, BlockInterval | None]]],
    without: dict[str | None, list[tuple[str, int]]],
    colours: OwnerColours,
    titles: dict[str, str],
    height_in: float,
) -> None:
    """Each holder's block table, then the requests that hold no block now, by how their last holding ended."""
    lines: list[tuple[int | None, str | None, str]] = []  # (table number on its first line, swatch colour, text)
    for table, (owner, blocks) in enumerate(list(tables.items())[:MAX_TABLES_SHOWN]):
        text = f"{owner} ({len(blocks)} block{'s' if len(blocks) != 1 else ''}): " + " → ".join(
            str(block_id) for block_id, _ in blocks
        )
        for k, line in enumerate(textwrap.wrap(text, 72, subsequent_indent="    ", break_on_hyphens=False)):
            lines.append((table if k == 0 else None, colours[owner] if k == 0 else None, line))
    if len(tables) > MAX_TABLES_SHOWN:
        lines.append((None, None, f"… {len(tables) - MAX_TABLES_SHOWN:,} more requests"))
    if not tables:
        lines.append((None, None, "no request holds a block"))
    heading = None  # the line that heads the requests without blocks
    if without:
        lines.append((None, None, ""))
        heading = len(lines)
        lines.append((None, None, "holding no block now (the log knows a request once it held one):"))
        for reason, freed in without.items():
            names = [f"{owner} (since seq {seq:,})" if reason == "preempted" else owner for owner, seq in freed]
            text = f"{WITHOUT_BLOCKS[reason]} ({len(freed):,}): " + ", ".join(names[:MAX_NAMES_SHOWN])
            text += f", … {len(names) - MAX_NAMES_SHOWN:,} more" if len(names) > MAX_NAMES_SHOWN else ""
            lines.extend(
                (None, None, line) for line in textwrap.wrap(text, 72, subsequent_indent="    ", break_on_hyphens=False)
            )
    owners = list(tables)
    for k, (first_of, colour, line) in enumerate(lines):
        weight = "bold" if k == heading else None
        label = ax.text(0.55, k + 0.5, line, va="center", fontsize="small", family="monospace", weight=weight)
        if colour is not None:
            swatch = Rectangle((0, k + 0.15), 0.35, 0.7, facecolor=colour, edgecolor=EDGE_COLOUR, linewidth=0.5)
            ax.add_patch(swatch)
        if first_of is not None:
            label.set_gid(f"table-{first_of}")
            titles[f"table-{first_of}"] = f"{owners[first_of]}'s block table, logical block 0 first"
    ax.set_xlim(0, 19)
    ax.set_ylim(max(len(lines) + 1, (height_in - 1.0) * 72 / LINE_PT), 0)
    ax.axis("off")
    ax.set_title("block tables, logical order (the order the blocks were given)", fontsize="small")


def _is_dark(colour: str) -> bool:
    """Whether black text would be hard to read on ``colour`` (relative luminance below 0.4)."""
    red, green, blue = to_rgb(colour)
    return 0.2126 * red + 0.7152 * green + 0.0722 * blue < 0.4


def _holders(tables: dict[str, Any]) -> str:
    """Who holds blocks, in words: a parallel request's samples (``ID#k`` beside the owner ``ID``, the
    engine's names for them) are counted as its samples, not as requests of their own."""
    samples = [
        owner for owner in tables if (base := owner.rpartition("#"))[1] and base[2].isdigit() and base[0] in tables
    ]
    num_requests = len(tables) - len(samples)
    words = f"{num_requests:,} {'request holds' if num_requests == 1 else 'requests hold'} blocks"
    return words + (f", with {len(samples):,} parallel samples" if samples else "")
