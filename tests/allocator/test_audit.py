"""Audit: clean logs, leaks at close, crashed epochs, and tampering named by its first bad seq."""

from __future__ import annotations

import importlib
import subprocess

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog, LogNotFoundError, audit, audit_all, replay

replay_module = importlib.import_module("nanoserve.allocator.log.replay")  # the module, not the function


def write_log(url: str, pool_id: str, close: bool = True) -> EventLog:
    """Seq 1 POOL_INIT, 2..9 eight single-event batches, 10..11 one step, 12 POOL_CLOSE."""
    log = EventLog.open(url, pool_id=pool_id, num_blocks=8, block_size=4)
    pool = BlockAllocator(8, 4)

    def persist(step: int | None = None) -> None:
        log.append_batch(step, pool.take_events(), pool.snapshot)

    for owner in ("A", "B", "C", "D"):
        pool.allocate_for(8, owner)  # seqs 2..5: A [0, 1], B [2, 3], C [4, 5], D [6, 7]
        persist()
    pool.free_all([0, 1], FreeReason.FINISHED)  # 6
    persist()
    pool.free_all([2, 3], FreeReason.ABORTED)  # 7
    persist()
    pool.allocate("E")  # 8 -> block 3
    persist()
    pool.free(3)  # 9
    persist()
    pool.free_all([4, 5])  # 10
    pool.free_all([6, 7])  # 11
    persist(step=1)
    if close:
        log.close(final_state=pool.snapshot())
    else:
        log.flush()
    return log


def execute(url: str, sql: str, **params: object) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(sql), params)
    finally:
        engine.dispose()


def edit_record(url: str, pool_id: str, seq: int, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` once in the stored record of ``seq`` (its hash is left alone)."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            where = "WHERE pool_id = :p AND epoch = 1 AND seq = :s"
            record = conn.execute(
                sa.text(f"SELECT record FROM allocator_events {where}"), {"p": pool_id, "s": seq}
            ).scalar_one()
            assert old in record
            conn.execute(
                sa.text(f"UPDATE allocator_events SET record = :r {where}"),
                {"r": record.replace(old, new, 1), "p": pool_id, "s": seq},
            )
    finally:
        engine.dispose()


def test_clean_log_audits_clean(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    report = audit(log_url, pool_id)
    assert (report.clean, report.closed, report.num_events, report.last_seq, report.leaked) == (True, True, 12, 12, {})


def test_leaked_blocks_at_close_are_named_with_owners(log_url: str, pool_id: str) -> None:
    with EventLog.open(log_url, pool_id=pool_id, num_blocks=4, block_size=4) as log:
        pool = BlockAllocator(4, 4)
        pool.allocate_for(8, "A")
        pool.allocate("B")
        pool.free(0)
        log.append_batch(1, pool.take_events())
    report = audit(log_url, pool_id)
    assert report.leaked == {1: "A", 2: "B"}
    assert [(v.seq, v.rule, v.block_id, v.owner) for v in report.violations] == [
        (5, "leaked_block", 1, "A"),
        (5, "leaked_block", 2, "B"),
    ]


def test_crashed_epoch_reports_the_pool_at_the_last_durable_event(log_url: str, pool_id: str) -> None:
    log = EventLog.open(log_url, pool_id=pool_id, num_blocks=4, block_size=4)
    pool = BlockAllocator(4, 4)
    pool.allocate_for(8, "A")
    log.append_batch(1, pool.take_events())
    pool.allocate("B")
    log.append_batch(2, pool.take_events())
    log.flush()
    log._writer.stop()  # the process dies: no POOL_CLOSE
    report = audit(log_url, pool_id)
    assert (report.crashed, report.clean, report.last_seq) == (True, True, 3)
    assert report.state.blocks_by_owner() == {"A": [0, 1], "B": [2]}
    assert (
        report.render().splitlines()[0] == f"pool {pool_id!r} epoch 1: 3 events, last seq 3, open (running, or crashed)"
    )


def test_audit_all_covers_every_epoch(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    write_log(log_url, pool_id, close=False)._writer.stop()
    reports = audit_all(log_url, pool_id)
    assert [(r.epoch, r.closed, r.clean) for r in reports] == [(1, True, True), (2, False, True)]


def test_unknown_pool_is_refused(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    with pytest.raises(LogNotFoundError, match="the log holds no pool 'nope'"):
        audit(log_url, "nope")


def test_missing_sqlite_file_is_refused(tmp_path: object) -> None:
    with pytest.raises(LogNotFoundError, match="does not exist"):
        replay(f"sqlite:///{tmp_path}/none.db")


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_flipped_byte_in_payload_is_named(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    edit_record(log_url, pool_id, 7, "|aborted|", "|abortec|")
    report = audit(log_url, pool_id)
    assert report.first_bad_seq == 7
    assert report.violations[0].rule == "hash_mismatch"


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_flipped_block_id_is_named(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    edit_record(log_url, pool_id, 6, "|0,1|", "|4,1|")
    assert audit(log_url, pool_id).first_bad_seq == 6


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_edited_filter_column_is_named(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    execute(log_url, "UPDATE allocator_events SET owner = 'X' WHERE pool_id = :p AND seq = 3", p=pool_id)
    report = audit(log_url, pool_id)
    assert [(v.seq, v.rule) for v in report.violations] == [(3, "column_mismatch")]


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_deleted_row_is_named(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    execute(log_url, "DELETE FROM allocator_events WHERE pool_id = :p AND seq = 5", p=pool_id)
    report = audit(log_url, pool_id)
    assert report.first_bad_seq == 5
    assert report.violations[0].rule == "missing_events"


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_swapped_rows_are_named(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    execute(log_url, "UPDATE allocator_events SET seq = -1 WHERE pool_id = :p AND seq = 4", p=pool_id)
    execute(log_url, "UPDATE allocator_events SET seq = 4 WHERE pool_id = :p AND seq = 8", p=pool_id)
    execute(log_url, "UPDATE allocator_events SET seq = 8 WHERE pool_id = :p AND seq = -1", p=pool_id)
    assert audit(log_url, pool_id).first_bad_seq == 4


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_cut_tail_is_named(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    execute(log_url, "DELETE FROM allocator_events WHERE pool_id = :p AND seq >= 9", p=pool_id)
    report = audit(log_url, pool_id)
    assert report.first_bad_seq == 9
    assert report.violations[0].rule == "missing_events"


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_cut_tail_inside_a_batch_is_a_torn_batch(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id, close=False)._writer.stop()
    execute(log_url, "DELETE FROM allocator_events WHERE pool_id = :p AND seq = 11", p=pool_id)
    report = audit(log_url, pool_id)
    assert (report.first_bad_seq, report.violations[0].rule) == (11, "torn_batch")


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_state_violations_carry_block_and_owner(log_url: str, pool_id: str) -> None:
    write_log(log_url, pool_id)
    # a forged owner on a free: the chain breaks there, and the state check names blocks and owners
    edit_record(log_url, pool_id, 10, "|C", "|Z")
    execute(log_url, "UPDATE allocator_events SET owner = 'Z' WHERE pool_id = :p AND seq = 10", p=pool_id)
    rules = [(v.seq, v.rule, v.block_id, v.owner) for v in audit(log_url, pool_id).violations]
    assert rules[:3] == [
        (10, "hash_mismatch", None, "Z"),
        (10, "owner_mismatch", 4, "Z"),
        (10, "owner_mismatch", 5, "Z"),
    ]


def test_large_epoch_is_verified_in_a_second_process(
    log_url: str, pool_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not log_url.startswith("sqlite"):
        pytest.skip("the second process reads SQLite files only")
    from nanoserve.allocator.log import hash_chain_verifier as chain_verifier

    verdicts = []
    collect = chain_verifier.result
    monkeypatch.setattr(replay_module, "NUM_EVENTS_FOR_VERIFIER", 1)
    monkeypatch.setattr(replay_module, "_has_idle_core", lambda: True)
    monkeypatch.setattr(chain_verifier, "result", lambda proc: verdicts.append(collect(proc)) or verdicts[-1])
    write_log(log_url, pool_id)
    report = audit(log_url, pool_id, fold=False)  # the Python replay's way (an intact epoch is folded in C)
    assert (report.clean, report.num_events, verdicts) == (
        True,
        12,
        [chain_verifier.ChainResult(True, 12, report_head(log_url, pool_id))],
    )


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_large_epoch_with_a_flipped_byte_is_named_like_a_small_one(
    log_url: str, pool_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_log(log_url, pool_id)
    edit_record(log_url, pool_id, 7, "|aborted|", "|abortec|")
    small = audit(log_url, pool_id)
    monkeypatch.setattr(replay_module, "NUM_EVENTS_FOR_VERIFIER", 1)
    monkeypatch.setattr(replay_module, "_has_idle_core", lambda: True)
    large = audit(log_url, pool_id)
    assert large.violations == small.violations
    assert (large.first_bad_seq, large.violations[0].rule) == (7, "hash_mismatch")


def report_head(url: str, pool_id: str) -> bytes:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            where = "WHERE pool_id = :p AND epoch = 1 AND seq = 12"
            return bytes(
                conn.execute(sa.text(f"SELECT hash FROM allocator_events {where}"), {"p": pool_id}).scalar_one()
            )
    finally:
        engine.dispose()


def test_large_epoch_is_audited_in_one_process_when_the_verifier_fails(
    log_url: str, pool_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanoserve.allocator.log import hash_chain_verifier as chain_verifier

    monkeypatch.setattr(replay_module, "NUM_EVENTS_FOR_VERIFIER", 1)
    monkeypatch.setattr(replay_module, "_has_idle_core", lambda: True)

    def failed(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.communicate()
        return None

    monkeypatch.setattr(chain_verifier, "result", failed)
    write_log(log_url, pool_id)
    report = audit(log_url, pool_id)
    assert (report.clean, report.num_events, report.state.free_block_ids) == (True, 12, [0, 1, 2, 3, 4, 5, 6, 7])


def test_a_snapshot_that_loses_a_block_is_not_replayed_from(log_url: str, pool_id: str) -> None:
    with EventLog.open(log_url, pool_id=pool_id, num_blocks=4, block_size=4, num_events_per_snapshot=2) as log:
        pool = BlockAllocator(4, 4)
        for step, owner in enumerate("AB"):
            pool.allocate(owner)  # seq 2, 3; SNAPSHOT seq 4
            log.append_batch(step, pool.take_events(), pool.snapshot)
        pool.free(1)  # seq 5
        log.append_batch(2, pool.take_events(), pool.snapshot)
    edit_record(log_url, pool_id, 4, '"free_block_ids":[3,2]', '"free_block_ids":[3]')
    from_snapshot = replay(log_url, pool_id, until_seq=5)
    from_genesis = replay(log_url, pool_id, until_seq=5, from_snapshot=False)
    assert from_snapshot == from_genesis
    assert (from_snapshot.free_block_ids, from_snapshot.owners) == ([3, 2, 1], {0: "A"})
    assert [(v.seq, v.rule) for v in from_snapshot.violations] == [(4, "hash_mismatch"), (4, "snapshot_mismatch")]
