"""The block_key index holds only the rows that have a key (migration 0011), and a query for a key uses it."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command

from nanoserve.allocator.block_allocator import BlockAllocator
from nanoserve.allocator.log import EventLog
from nanoserve.migrations import alembic_config, upgrade

from ..allocator.test_stored_keys import BLOCK_SIZE, query, write_cached

INDEX = "ix_allocator_events_block_key"


def _write_two_epochs(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Epoch 1 one row per event (as before 0008: its prefix-cache rows carry their first key), epoch 2 packed."""
    from nanoserve.allocator.log import packed_rows

    with monkeypatch.context() as patch:
        patch.setattr(packed_rows, "MIN_EVENTS_PER_PACKED_ROW", 1 << 30)
        patch.setattr(packed_rows, "MIN_KEYED_EVENTS_PER_PACKED_ROW", 1 << 30)
        _write_epoch(url)
    _write_epoch(url)


def _write_epoch(url: str) -> None:
    log = EventLog.open(url, pool_id="p", num_blocks=8, block_size=BLOCK_SIZE)
    pool = BlockAllocator(8, BLOCK_SIZE)
    write_cached(log, pool)
    log.close(final_state=pool.snapshot())


def _index_entries(url: str) -> int:
    """The entries of the block_key index, as SQLite's ANALYZE counts them."""
    query(url, "ANALYZE")
    [(stat,)] = query(url, "SELECT stat FROM sqlite_stat1 WHERE idx = :i", i=INDEX)
    return int(str(stat).split()[0])


def _index_sql(url: str) -> str:
    [(sql,)] = query(url, "SELECT sql FROM sqlite_master WHERE name = :i", i=INDEX)
    return str(sql)


def test_the_index_holds_only_the_rows_with_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    _write_two_epochs(url, monkeypatch)
    [(num_rows, num_keyed)] = query(url, "SELECT count(*), count(block_key) FROM allocator_events")
    assert (num_rows, num_keyed) == (18, 5)  # epoch 1: 12 rows, 5 of them name keys; epoch 2: 6 rows, none
    assert _index_sql(url).endswith("(block_key) WHERE block_key IS NOT NULL")
    assert _index_entries(url) == num_keyed


def test_a_query_for_a_key_uses_the_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    _write_two_epochs(url, monkeypatch)
    [(key,)] = query(url, "SELECT block_key FROM allocator_events WHERE epoch = 1 AND seq = 6")  # A's release
    sql = "SELECT epoch, seq, kind FROM allocator_events WHERE block_key = :k ORDER BY epoch, seq"
    plan = " ".join(str(row[-1]) for row in query(url, f"EXPLAIN QUERY PLAN {sql}", k=key))
    assert f"USING INDEX {INDEX} (block_key=?)" in plan
    assert query(url, sql, k=key) == [(1, 6, "release"), (1, 9, "evict")]


def test_downgrading_0011_makes_the_full_index_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    _write_two_epochs(url, monkeypatch)
    rows = query(url, "SELECT * FROM allocator_events ORDER BY epoch, seq")
    command.downgrade(alembic_config(url), "0010")
    assert "WHERE" not in _index_sql(url)
    assert _index_entries(url) == 18
    upgrade(url)
    assert _index_entries(url) == 5
    assert query(url, "SELECT * FROM allocator_events ORDER BY epoch, seq") == rows
