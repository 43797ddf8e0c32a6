"""A new SQLite log is made of 8 KiB pages; one created before keeps its 4 KiB pages and still serves.

The journal's step rows with logprobs are 1.5-2.7 KB: a 4 KiB page holds one, and a third
of the file stayed empty (``bench.log_bytes``: 173 B per generated token with logprobs=20 in
journal_steps at 4 KiB, 131 at 8 KiB).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog, audit, read_events
from nanoserve.allocator.log.store import SQLITE_PAGE_SIZE
from nanoserve.migrations import upgrade


def _page_size(path: Path) -> int:
    with sqlite3.connect(path) as connection:
        return int(connection.execute("PRAGMA page_size").fetchone()[0])


def _write_and_audit(url: str) -> None:
    log = EventLog.open(url, pool_id="pages", num_blocks=4, block_size=16)
    pool = BlockAllocator(4, 16)
    pool.allocate_for(40, "A")
    log.append_batch(1, pool.take_events(), pool.snapshot)
    pool.free_all([0, 1, 2], FreeReason.FINISHED)
    log.append_batch(2, pool.take_events(), pool.snapshot)
    log.close(final_state=pool.snapshot())
    assert [(e.seq, e.kind, e.block_ids) for e in read_events(url, "pages")] == [
        (1, "pool_init", ()),
        (2, "allocate_for", (0, 1, 2)),
        (3, "free_all", (0, 1, 2)),
        (4, "pool_close", ()),
    ]
    assert audit(url, "pages").clean


def test_a_log_created_by_the_migrations_has_8_kib_pages(tmp_path: Path) -> None:
    database = tmp_path / "log.db"
    upgrade(f"sqlite:///{database}")
    assert SQLITE_PAGE_SIZE == 8192
    assert _page_size(database) == 8192
    _write_and_audit(f"sqlite:///{database}")
    assert _page_size(database) == 8192


@pytest.mark.parametrize("old_page_size", [4096, 16384])
def test_a_log_created_with_other_pages_keeps_them_and_serves(tmp_path: Path, old_page_size: int) -> None:
    database = tmp_path / "old.db"
    with sqlite3.connect(database) as connection:  # an older nanoserve's file: the page size fixed by a table
        connection.execute(f"PRAGMA page_size={old_page_size}")
        connection.execute("CREATE TABLE made_before (x INTEGER)")
    upgrade(f"sqlite:///{database}")
    _write_and_audit(f"sqlite:///{database}")
    assert _page_size(database) == old_page_size
