"""The text of ``nanoserve log``'s output: event rows, the prefix-cache listing, block ranges, aligned tables.

Pure formatting of replayed or stored values; nothing here reads a log.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from nanoserve.allocator import PoolState

# a cell of `log show` longer than this is shortened unless --full: a table pads each column to its
# longest cell, so one long row (a 57-block ALLOCATE, a REGISTER of 57 keys) made every row wrap
MAX_BLOCKS_CHARS = 24
MAX_KEYS_SHOWN = 4


def event_cells(item: Any, full: bool = True) -> list[str]:
    """An event's row of ``log show``: seq, batch, step, time, kind, blocks, owner, reason, keys. Not
    ``full``: blocks as sorted runs (``3-59``) cut to MAX_BLOCKS_CHARS with their count, and at most
    MAX_KEYS_SHOWN keys followed by their count."""
    detail = (
        fork_detail(item.parent, item.partial, item.ref_counts)
        if item.parent is not None
        else cache_detail(item.keys, item.parent_keys, item.ref_counts, None if full else MAX_KEYS_SHOWN)
    )
    return [
        str(item.seq),
        str(item.batch_seq),
        "" if item.step is None else str(item.step),
        utc(item.wall_time_ns),
        item.kind,
        ",".join(map(str, item.block_ids)) if full else short_blocks(item.block_ids),
        item.owner or "",
        item.reason or "",
        detail,
    ]


def short_blocks(block_ids: Sequence[int], max_chars: int = MAX_BLOCKS_CHARS) -> str:
    """Block ids as ``log show`` lists them (``5,0,1``), or, when that is longer than ``max_chars``, as
    sorted runs (``0-56``), cut to ``max_chars`` with the count (``0-3,5,7,9... (40 blocks)``)."""
    listed = ",".join(map(str, block_ids))
    if len(listed) <= max_chars:
        return listed
    runs = block_ranges(block_ids).replace(", ", ",")
    if len(runs) <= max_chars:
        return runs
    cut = runs[:max_chars].rsplit(",", 1)[0]
    return f"{cut}... ({len(block_ids)} blocks)"


def print_cache(state: PoolState, full: bool) -> None:
    """The prefix cache of a replayed pool: cached-free blocks, shared blocks (registered, or forked by parallel
    sampling, those partly filled copied on write) and who shares them, keys."""
    print(
        f"prefix cache: {len(state.block_keys)} blocks registered, {state.num_cached_free} of them free "
        f"(evicted first: {','.join(map(str, state.cached_free)) or 'none'})"
    )
    shared = state.shared_blocks()
    if shared:
        rows = [
            [
                str(b),
                str(len(h)),
                ",".join(h),
                state.block_keys[b][0][:KEY_CHARS] if b in state.block_keys else "(forked)",
                "copy on write" if b in state.copy_on_write else "",
            ]
            for b, h in shared.items()
        ]
        print(table(["shared block", "count", "held by", "key", "copy"], rows))
    if full:
        rows = [
            [str(block_id), str(state.ref_count(block_id)), key, parent or ""]
            for block_id, (key, parent) in sorted(state.block_keys.items())
        ]
        print(table(["block", "count", "key", "parent key"], rows))


# hex characters of a key shown where a whole key (64) would not fit
KEY_CHARS = 12


def fork_detail(parent: str, partial: bool, ref_counts: Sequence[int]) -> str:
    """A FORK or COPY event's detail: ``<-parent``, ``partial`` when a fork's last block is partly filled,
    and the counts after it (``=2,2,2``)."""
    counts = ",".join(map(str, ref_counts))
    return f"<-{parent}" + (" partial" if partial else "") + (f" ={counts}" if counts else "")


def cache_detail(
    keys: Sequence[str], parent_keys: Sequence[str | None], ref_counts: Sequence[int], max_keys: int | None = None
) -> str:
    """A prefix-cache event's keys, shortened: ``key=count`` (SHARE, RELEASE), ``key<-parent`` (REGISTER;
    a sequence's first block has no parent); with ``max_keys``, the first that many and then how many
    there are (``... (57 keys, --full)``)."""
    if parent_keys:
        shown = [
            f"{k[:KEY_CHARS]}<-{p[:KEY_CHARS]}" if p else k[:KEY_CHARS] for k, p in zip(keys, parent_keys, strict=False)
        ]
    elif ref_counts:
        shown = [f"{k[:KEY_CHARS]}={c}" for k, c in zip(keys, ref_counts, strict=False)]
    else:
        shown = [k[:KEY_CHARS] for k in keys]
    if max_keys is not None and len(shown) > max_keys:
        return " ".join(shown[:max_keys]) + f" ... ({len(shown)} keys, --full)"
    return " ".join(shown)


def block_ranges(block_ids: Iterable[int]) -> str:
    """Block ids sorted and compressed into runs: [5, 0, 1, 2, 7] -> "0-2, 5, 7"."""
    runs: list[list[int]] = []
    for block_id in sorted(block_ids):
        if runs and block_id == runs[-1][1] + 1:
            runs[-1][1] = block_id
        else:
            runs.append([block_id, block_id])
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def utc(wall_time_ns: int) -> str:
    return datetime.fromtimestamp(wall_time_ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
