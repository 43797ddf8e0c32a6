"""Speculative decoding's blocks in ``log show`` and the pictures: draft slots and their rollback are their own kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog
from nanoserve.migrations import upgrade
from nanoserve.service.cli.main import main
from nanoserve.service.pictures.block_map import ENDING_COLOURS, _ending_colours, interval_title
from nanoserve.service.pictures.pool_timeline import read_timeline
from nanoserve.service.pictures.timeline_view import TimelineView, event_xs


@pytest.fixture
def url(tmp_path: Path) -> str:
    """Step 1: seq 2 A's prompt [0, 1]; step 2: seq 3 A's drafts take [2, 3], seq 4 gives back [3]
    (rejected_draft); step 3: seq 5 A finishes [0, 1, 2]; seq 6 POOL_CLOSE."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    with EventLog.open(url, pool_id="p", num_blocks=6, block_size=4) as log:
        pool = BlockAllocator(6, 4)
        pool.allocate_for(8, "A")
        log.append_batch(1, pool.take_events())
        pool.allocate_for(5, "A", FreeReason.DRAFT)
        pool.free_all([3], FreeReason.REJECTED_DRAFT)
        log.append_batch(2, pool.take_events())
        pool.free_all([0, 1, 2], FreeReason.FINISHED)
        log.append_batch(3, pool.take_events())
    return url


def test_log_show_prints_the_draft_allocation_and_its_rollback(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "show", "--url", url, "--owner", "A"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    kinds = ("allocate_for", "free_all")
    assert [(row[0], *row[next(i for i, word in enumerate(row) if word in kinds) :]) for row in rows] == [
        ("2", "allocate_for", "0,1", "A"),
        ("3", "allocate_for", "2,3", "A", "draft"),
        ("4", "free_all", "3", "A", "rejected_draft"),
        ("5", "free_all", "0,1,2", "A", "finished"),
    ]


def test_the_timeline_marks_draft_intervals_and_the_block_map_colours_their_rollback(url: str) -> None:
    timeline = read_timeline(url)
    spans = [(i.block_id, i.start_seq, i.end_seq, i.end_reason, i.draft) for i in timeline.intervals()]
    assert spans == [
        (0, 2, 5, "finished", False),
        (1, 2, 5, "finished", False),
        (2, 3, 5, "finished", True),  # a draft slot the accepted drafts kept
        (3, 3, 4, "rejected_draft", True),
    ]
    assert interval_title(timeline, 3, None) == (
        "A held block 3 (taken for draft tokens) from seq 3 to 4 (steps 2 to 2), freed: rejected_draft"
    )
    view = TimelineView(timeline, event_xs(timeline, "seq"), 0, len(timeline.seqs) - 1)
    palette, bar_palette_index, handles = _ending_colours(view)
    assert [palette[k] for k in bar_palette_index] == [
        ENDING_COLOURS["finished"],
        ENDING_COLOURS["finished"],
        ENDING_COLOURS["finished"],
        ENDING_COLOURS["rejected_draft"],
    ]
    assert [handle.get_label() for handle in handles] == ["then freed: finished", "then freed: rejected draft tokens"]
    assert np.unique(bar_palette_index).size == 2
