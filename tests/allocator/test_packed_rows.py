"""Packed rows (migration 0008): a commit's run of block events is one row, and every reader sees its events."""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog, audit, packed_rows, read_events, replay
from nanoserve.allocator.log import hash_chain_verifier as chain_verifier
from nanoserve.allocator.log.hash_chain import genesis_hash
from nanoserve.allocator.log.reader import connect, event_rows, last_stored_seq, stored_hash


def write_log(url: str, pool_id: str) -> BlockAllocator:
    """Seq 1 POOL_INIT; 2..4 one step (A, B, C allocate); 5..7 the next (A, B, C end); 8 POOL_CLOSE.

    Each step is flushed before the next, so each is one commit: rows 1, 2..4, 5..7, 8.
    """
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4)
    pool = BlockAllocator(8, 4)
    for owner in ("A", "B", "C"):
        pool.allocate_for(8, owner)  # A [0, 1], B [2, 3], C [4, 5]
    log.append_batch(1, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    pool.free_all([0, 1], FreeReason.FINISHED)
    pool.free_all([2, 3], FreeReason.ABORTED)
    pool.free_all([4, 5], FreeReason.FINISHED)
    log.append_batch(2, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    log.close(final_state=pool.snapshot())
    return pool


def stored_rows(url: str, pool_id: str) -> list[tuple[int, str, str | None, int | None]]:
    """(seq, kind, owner, last_seq) of every stored row of epoch 1."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT seq, kind, owner, last_seq FROM allocator_events "
                    "WHERE pool_id = :p AND epoch = 1 ORDER BY seq"
                ),
                {"p": pool_id},
            )
            return [tuple(row) for row in rows]  # type: ignore[misc]
    finally:
        engine.dispose()


def packed_records(url: str, pool_id: str, seq: int) -> list[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            blob = conn.execute(
                sa.text("SELECT records FROM allocator_events WHERE pool_id = :p AND epoch = 1 AND seq = :s"),
                {"p": pool_id, "s": seq},
            ).scalar_one()
    finally:
        engine.dispose()
    return zlib.decompress(blob).decode().split("\n")


def set_records(url: str, pool_id: str, seq: int, blob: bytes) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE allocator_events SET records = :b WHERE pool_id = :p AND epoch = 1 AND seq = :s"),
                {"b": blob, "p": pool_id, "s": seq},
            )
    finally:
        engine.dispose()


def test_each_commits_block_events_are_one_packed_row(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    assert stored_rows(log_url, pool_id) == [
        (1, "pool_init", None, None),
        (2, "packed", None, 4),
        (5, "packed", None, 7),
        (8, "pool_close", None, None),
    ]
    assert [record.split("|")[0] for record in packed_records(log_url, pool_id, 2)] == ["2", "3", "4"]


def test_packed_rows_read_as_one_row_per_event_with_the_chain_hashes(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    with connect(log_url) as conn:
        rows = [row for chunk in event_rows(conn, pool_id, 1) for row in chunk]
        head = conn.execute(sa.text("SELECT head_hash FROM pool_epochs WHERE pool_id = :p"), {"p": pool_id}).scalar()
        assert last_stored_seq(conn, pool_id, 1, None) == 8
        assert last_stored_seq(conn, pool_id, 1, 3) == 3
        # the hash of an event inside a packed row, as one row per event stored it
        assert stored_hash(conn, pool_id, 1, 3) == rows[2][4]
        assert stored_hash(conn, pool_id, 1, 4) == rows[3][4]
    assert [(seq, kind, owner) for seq, kind, owner, _, _ in rows] == [
        (1, "pool_init", None),
        (2, "allocate_for", "A"),
        (3, "allocate_for", "B"),
        (4, "allocate_for", "C"),
        (5, "free_all", "A"),
        (6, "free_all", "B"),
        (7, "free_all", "C"),
        (8, "pool_close", None),
    ]
    previous = genesis_hash(pool_id, 1)
    for _, _, _, record, hash_ in rows:
        previous = hashlib.sha256(previous + record.encode()).digest()
        assert hash_ == previous
    assert previous == bytes(head)
    events = read_events(log_url, pool_id)
    assert [event.hash for event in events] == [row[4] for row in rows]
    assert [event.block_ids for event in events[1:7]] == [(0, 1), (2, 3), (4, 5), (0, 1), (2, 3), (4, 5)]
    assert [event.batch_seq for event in events] == [1, 4, 4, 4, 7, 7, 7, 8]


def test_packed_rows_come_in_chunks_of_at_most_the_chunk_size(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    with connect(log_url) as conn:
        chunks = list(event_rows(conn, pool_id, 1, num_rows_per_chunk=2))
    assert [[row[0] for row in chunk] for chunk in chunks] == [[1, 2], [3, 4], [5, 6], [7], [8]]


def test_a_range_or_filter_inside_a_packed_row_reads_exactly_its_events(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    assert [event.seq for event in read_events(log_url, pool_id, from_seq=3, until_seq=5)] == [3, 4, 5]
    assert [event.seq for event in read_events(log_url, pool_id, owner="B")] == [3, 6]
    assert [event.seq for event in read_events(log_url, pool_id, kind="free_all")] == [5, 6, 7]
    assert [event.seq for event in read_events(log_url, pool_id, from_seq=4, kind="allocate_for")] == [4]


def test_single_rows_and_packed_rows_in_one_epoch_audit_and_replay_alike(
    log_url: str, pool_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = EventLog.open(log_url, pool_id=pool_id, num_blocks=8, block_size=4)
    pool = BlockAllocator(8, 4)
    monkeypatch.setattr(packed_rows, "MIN_EVENTS_PER_PACKED_ROW", 100)  # as written before migration 0008
    pool.allocate_for(8, "A")
    pool.allocate_for(8, "B")
    log.append_batch(1, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    monkeypatch.setattr(packed_rows, "MIN_EVENTS_PER_PACKED_ROW", 2)
    pool.free_all([0, 1], FreeReason.FINISHED)
    pool.free_all([2, 3], FreeReason.FINISHED)
    log.append_batch(2, pool.take_events(), pool.snapshot)
    assert log.flush(10)
    log.close(final_state=pool.snapshot())
    assert [row[1] for row in stored_rows(log_url, pool_id)] == [
        "pool_init",
        "allocate_for",
        "allocate_for",
        "packed",
        "pool_close",
    ]
    report = audit(log_url, pool_id)
    assert (report.clean, report.closed, report.num_events, report.last_seq) == (True, True, 6, 6)
    assert replay(log_url, pool_id) == pool.state()
    assert replay(log_url, pool_id, until_seq=4).blocks_by_owner() == {"B": [2, 3]}
    assert replay(log_url, pool_id, until_seq=3).blocks_by_owner() == {"A": [0, 1], "B": [2, 3]}


def test_a_packed_row_that_does_not_inflate_is_named_by_audit_with_its_seqs(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    blob = zlib.compress("\n".join(packed_records(log_url, pool_id, 2)).encode())
    set_records(log_url, pool_id, 2, blob[:10] + bytes([blob[10] ^ 0xFF]) + blob[11:])
    report = audit(log_url, pool_id)
    assert [(v.seq, v.rule) for v in report.violations if v.rule == "bad_record"] == [(2, "bad_record")]
    (violation,) = [v for v in report.violations if v.rule == "bad_record"]
    assert violation.message.startswith("seqs 2..4 (one packed row): records ")
    # the events after it still read and chain on from its stored hash: 5..7 free blocks nobody holds now
    assert [(v.seq, v.block_id) for v in report.violations if v.seq > 2] == [
        (5, 0),
        (5, 1),
        (6, 2),
        (6, 3),
        (7, 4),
        (7, 5),
    ]
    assert {v.rule for v in report.violations if v.seq > 2} == {"free_of_free_block"}
    assert (report.num_events, report.last_seq) == (8, 8)
    assert [event.seq for event in read_events(log_url, pool_id, from_seq=5)] == [5, 6, 7, 8]


def test_a_packed_row_whose_records_were_rewritten_fails_its_hash_at_its_last_seq(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    records = packed_records(log_url, pool_id, 2)
    records[1] = records[1].replace("|2,3|", "|3,2|")  # seq 3 names its blocks in another order
    set_records(log_url, pool_id, 2, zlib.compress("\n".join(records).encode()))
    report = audit(log_url, pool_id)
    assert [(v.seq, v.rule) for v in report.violations] == [(4, "hash_mismatch")]


def test_the_verifier_process_reads_packed_rows_as_packed_rows_does() -> None:
    records = ["2|4|allocate|0||||5|6|A", "3|4|free|0|||5|6|A"]
    blob = zlib.compress("\n".join(records).encode())
    assert chain_verifier._packed_records(2, 3, blob) == [record.encode() for record in records]
    assert packed_rows.unpack_records(2, 3, blob) == records
    assert chain_verifier._packed_records(2, 4, blob) is None
    with pytest.raises(ValueError, match=r"2 records stored for seqs 2\.\.4"):
        packed_rows.unpack_records(2, 4, blob)


def test_a_record_holding_a_newline_stays_a_row_of_its_own() -> None:
    rows = [
        ("p", 1, 2, "allocate", "A", "2|3|allocate|0||||5|6|A", b"h2", None),
        ("p", 1, 3, "allocate", "B\nC", "3|3|allocate|1||||5|6|B\nC", b"h3", None),
    ]
    assert packed_rows.pack_rows(rows) == [(*rows[0], None, None), (*rows[1], None, None)]


def test_downgrading_below_0008_unpacks_every_row(tmp_path: Path) -> None:
    from alembic import command

    from nanoserve.migrations import alembic_config, upgrade

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    pool = write_log(url, "p")
    events = read_events(url, "p")
    command.downgrade(alembic_config(url), "0007")
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            seqs = conn.execute(sa.text("SELECT seq FROM allocator_events ORDER BY seq")).scalars().all()
    finally:
        engine.dispose()
    assert seqs == [1, 2, 3, 4, 5, 6, 7, 8]
    assert read_events(url, "p") == events
    upgrade(url)
    assert audit(url, "p").clean
    assert replay(url, "p") == pool.state()


def test_log_audit_show_and_state_name_a_damaged_packed_row_by_its_seqs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nanoserve.migrations import upgrade
    from nanoserve.service.cli.main import main

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    write_log(url, "p")
    blob = zlib.compress("\n".join(packed_records(url, "p", 2)).encode())
    set_records(url, "p", 2, blob[:-4] + bytes([blob[-4] ^ 0x01]) + blob[-3:])  # its checksum no longer holds

    assert main(["log", "audit", "--url", url]) == 1
    out = capsys.readouterr().out
    assert "first bad seq 2:" in out
    assert "seq 2: bad_record: seqs 2..4 (one packed row): records do not inflate" in out
    assert main(["log", "show", "--url", url]) == 1
    out = capsys.readouterr().out
    assert "damaged: seq 2: seqs 2..4 (one packed row): records do not inflate" in out
    assert [line.split()[0] for line in out.splitlines() if line[:1].isdigit()] == ["1", "2", "5", "6", "7", "8"]
    assert main(["log", "state", "--url", url, "--at", "6"]) == 1
    captured = capsys.readouterr()
    assert "violation: seq 2: bad_record: seqs 2..4 (one packed row)" in captured.out
    # the header's "at seq 6" is a pool without seqs 2..4: stderr says so (a new user took it for the whole pool)
    assert captured.err == (
        "note: the pool at seq 6 is what the records that could be read give, without the unreadable seqs 2..4 "
        "(the violations below)\n"
    )


def test_a_long_run_is_cut_into_packed_rows_of_the_largest_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_rows, "MAX_EVENTS_PER_PACKED_ROW", 2)
    rows = [
        ("p", 1, seq, "allocate", "A", f"{seq}|6|allocate|{seq}||||5|6|A", bytes([seq]), None) for seq in range(2, 7)
    ]
    stored = packed_rows.pack_rows(rows)
    assert [(row[2], row[3], row[8]) for row in stored] == [(2, "packed", 3), (4, "packed", 5), (6, "allocate", None)]
    assert [row[6] for row in stored] == [bytes([3]), bytes([5]), bytes([6])]  # each row's hash: its last event's
