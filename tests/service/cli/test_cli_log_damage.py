"""``nanoserve log`` on damaged logs: the audit names the first bad seq and exits 1, ``show`` and
``state`` print what they can and name the damage; never a traceback (issue 9, fault 6).

Each damage is made on a real SQLite file the way it happens: a flipped high bit in a record,
a page whose b-tree header is overwritten, a hash stored as TEXT, a SNAPSHOT whose JSON has
another shape (chained again, so the shape is the only damage).
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog
from nanoserve.allocator.log.hash_chain import genesis_hash
from nanoserve.migrations import upgrade
from nanoserve.service.cli.main import main

from ...faults import Tmpfs, damage_page

NUM_REQUESTS = 150  # 300 block events over a few dozen pages, three snapshots
POOL = "p"

# every test damages one event's row by its seq (packed rows: tests/allocator/test_packed_rows.py)
pytestmark = pytest.mark.usefixtures("one_row_per_event")


def build_log(folder: Path) -> tuple[str, Path]:
    """A closed epoch: request i allocates one block (one step) and frees it (the next step)."""
    path = folder / "log.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    with EventLog.open(url, pool_id=POOL, num_blocks=8, block_size=16, num_events_per_snapshot=100) as log:
        pool = BlockAllocator(8, 16)
        for i in range(NUM_REQUESTS):
            block_id = pool.allocate(f"request-{i:04d}")
            log.append_batch(2 * i, pool.take_events(), pool.snapshot)
            pool.free(block_id, FreeReason.FINISHED)
            log.append_batch(2 * i + 1, pool.take_events(), pool.snapshot)
        final = pool.snapshot()
        log.close(final_state=final)
    return url, path


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[str, Path]:
    return build_log(tmp_path)


def kinds(path: Path) -> dict[int, str]:
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT seq, kind FROM allocator_events ORDER BY seq").fetchall())


def rechain(path: Path, from_seq: int) -> None:
    """Store the hashes the records from ``from_seq`` on chain to, and the epoch's head hash."""
    db = sqlite3.connect(path)
    previous = (
        genesis_hash(POOL, 1)
        if from_seq == 1
        else db.execute("SELECT hash FROM allocator_events WHERE seq = ?", (from_seq - 1,)).fetchone()[0]
    )
    rows = db.execute("SELECT seq, record FROM allocator_events WHERE seq >= ? ORDER BY seq", (from_seq,)).fetchall()
    for seq, record in rows:
        previous = hashlib.sha256(previous + record.encode()).digest()
        db.execute("UPDATE allocator_events SET hash = ? WHERE seq = ?", (previous, seq))
    db.execute("UPDATE pool_epochs SET head_hash = ?", (previous,))
    db.commit()
    db.close()


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def shown_seqs(out: str) -> list[int]:
    return [int(line.split()[0]) for line in out.splitlines()[2:] if line[:1].isdigit()]


# -- a record with a flipped high bit: not valid UTF-8 -------------------------------------------


def flip_high_bit(path: Path, seq: int) -> None:
    with sqlite3.connect(path) as db:
        (record,) = db.execute("SELECT CAST(record AS BLOB) FROM allocator_events WHERE seq = ?", (seq,)).fetchone()
        damaged = bytearray(record)
        damaged[-1] |= 0x80  # the owner's last digit: 0x3N becomes 0xBN, a lone continuation byte
        db.execute("UPDATE allocator_events SET record = CAST(? AS TEXT) WHERE seq = ?", (bytes(damaged), seq))


def test_invalid_utf8_record_is_named_by_audit_show_and_state(
    damaged: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = damaged
    flip_high_bit(path, 42)

    code, out, _ = run(["log", "audit", "--url", url], capsys)
    assert code == 1
    assert "first bad seq 42:" in out
    assert "seq 42 owner 'request-0020': bad_record: record b'42|42|allocate|" in out
    assert "is not valid UTF-8 (byte 0xb0 at offset" in out

    code, out, _ = run(["log", "show", "--url", url], capsys)
    assert code == 1
    assert shown_seqs(out) == sorted(kinds(path))  # every row is printed, the damaged one in its place
    assert [line.split()[:2] for line in out.splitlines() if " DAMAGED" in line] == [["42", "DAMAGED"]]
    assert "damaged: seq 42: the record is not valid UTF-8 text: b'42|42|allocate|" in out

    code, out, _ = run(["log", "state", "--url", url, "--at", "60"], capsys)
    assert code == 1
    assert "epoch 1 at seq 60:" in out
    assert out.count("violation: ") >= 1
    assert "violation: seq 42 owner 'request-0020': bad_record:" in out

    # the pictures: the damage is named, never a traceback
    code, _, err = run(["log", "state", "--url", url, "--at", "60", "--svg", str(path.parent / "s.svg")], capsys)
    assert code == 1
    assert "nanoserve log state: no picture: the log is damaged: seq 42: the record is not valid UTF-8 text" in err
    code, _, err = run(["log", "plot", "--url", url, "-o", str(path.parent / "p.svg")], capsys)
    assert code == 1


# -- a page the store cannot read -----------------------------------------------------------------


def first_unreadable_seq(path: Path) -> int:
    """The first seq whose row SQLite itself cannot read, probed row by row."""
    db = sqlite3.connect(path)
    try:
        seq = 1
        while True:
            try:
                row = db.execute(  # by the primary key: the index, then the one table page of the row
                    "SELECT record FROM allocator_events WHERE pool_id = ? AND epoch = 1 AND seq = ?", (POOL, seq)
                ).fetchone()
            except sqlite3.DatabaseError:
                return seq
            assert row is not None, f"every row up to seq {seq} is readable"
            seq += 1
    finally:
        db.close()


def test_damaged_page_is_named_by_audit_show_and_state(
    damaged: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = damaged
    num_rows = len(kinds(path))
    damage_page(path, b"request-0075")
    bad_seq = first_unreadable_seq(path)
    assert 103 <= bad_seq <= 153  # request 75 allocates at seq 153; its page starts at or before it

    code, out, _ = run(["log", "audit", "--url", url], capsys)
    assert code == 1
    assert f"first bad seq {bad_seq}:" in out
    assert f"seq {bad_seq}: unreadable: the store cannot read the rows from here on: DatabaseError: " in out
    assert "database disk image is malformed" in out

    code, out, _ = run(["log", "show", "--url", url], capsys)
    assert code == 1
    assert shown_seqs(out) == list(range(1, bad_seq + 1))  # every readable row, then the damaged one
    assert (
        f"damaged: seq {bad_seq}: this row and the rest could not be read: "
        "DatabaseError: database disk image is malformed"
    ) in out
    assert bad_seq < num_rows

    code, out, _ = run(["log", "state", "--url", url, "--at", str(num_rows)], capsys)
    assert code == 1
    assert f"epoch 1 at seq {bad_seq - 1}:" in out  # the pool as far as the log can be read
    assert f"violation: seq {bad_seq}: unreadable:" in out


# -- a column of the wrong type ---------------------------------------------------------------------


def test_hash_stored_as_text_is_named_by_audit_show_and_state(
    damaged: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = damaged
    with sqlite3.connect(path) as db:
        db.execute("UPDATE allocator_events SET hash = hex(hash) WHERE seq = 30")

    code, out, _ = run(["log", "audit", "--url", url], capsys)
    assert code == 1
    assert "1 violation(s), first bad seq 30:" in out  # the next record still chains to the true hash
    assert "seq 30 owner 'request-0014': hash_mismatch: stored hash is str, not bytes, and the record" in out

    code, out, _ = run(["log", "show", "--url", url, "--from", "28", "--to", "32"], capsys)
    assert code == 1
    assert shown_seqs(out) == [28, 29, 30, 31, 32]
    assert "damaged: seq 30: the hash column holds str '" in out

    code, out, _ = run(["log", "state", "--url", url, "--at", "40"], capsys)
    assert code == 1
    assert "violation: seq 30 owner 'request-0014': hash_mismatch:" in out


# -- a SNAPSHOT whose JSON parses but has another shape -------------------------------------------


@pytest.mark.parametrize("data", ['{"owners":{}}', "[1,2]", "7", '{"free_block_ids":["a"],"owners":{}}'])
def test_snapshot_of_the_wrong_shape_is_named_by_audit_show_and_state(
    tmp_path: Path, data: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = build_log(tmp_path)
    snapshot_seq = min(seq for seq, kind in kinds(path).items() if kind == "snapshot")
    with sqlite3.connect(path) as db:
        (record,) = db.execute("SELECT record FROM allocator_events WHERE seq = ?", (snapshot_seq,)).fetchone()
        head = record.rsplit("|", 1)[0]
        db.execute("UPDATE allocator_events SET record = ? WHERE seq = ?", (f"{head}|{data}", snapshot_seq))
    rechain(path, snapshot_seq)

    code, out, _ = run(["log", "audit", "--url", url], capsys)
    assert code == 1
    assert f"1 violation(s), first bad seq {snapshot_seq}:" in out
    assert f"seq {snapshot_seq}: bad_snapshot: snapshot data unreadable: " in out

    code, out, _ = run(["log", "show", "--url", url, "--kind", "snapshot"], capsys)
    assert code == 1
    assert shown_seqs(out)[0] == snapshot_seq
    assert f"damaged: seq {snapshot_seq}: snapshot data unreadable: " in out

    # replay cannot start from it: it starts at genesis and names it on the way
    code, out, _ = run(["log", "state", "--url", url, "--at", str(snapshot_seq + 4)], capsys)
    assert code == 1
    assert f"epoch 1 at seq {snapshot_seq + 4}:" in out
    assert f"violation: seq {snapshot_seq}: bad_snapshot:" in out


# -- state --at from a snapshot verifies the records before it --------------------------------------


def test_state_from_a_snapshot_verifies_the_chain_before_it(
    damaged: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = damaged
    snapshot_seq = min(seq for seq, kind in kinds(path).items() if kind == "snapshot")
    with sqlite3.connect(path) as db:  # the record of seq 10 edited, its hash left as it was
        db.execute(
            "UPDATE allocator_events SET record = replace(record, 'request-0004', 'request-0005') WHERE seq = 10"
        )

    code, out, err = run(["log", "state", "--url", url, "--at", str(snapshot_seq + 2)], capsys)
    assert code == 1
    assert "violation: seq 10 owner 'request-0004': hash_mismatch:" in out
    assert err == ""

    code, out, err = run(["log", "state", "--url", url, "--at", str(snapshot_seq + 2), "--trust-snapshot"], capsys)
    assert code == 0  # the records before the snapshot are trusted unread, as asked, and it says so
    assert "violation" not in out
    assert "--trust-snapshot: the records before the SNAPSHOT replay started from were not verified" in err


# -- a log on read-only media ---------------------------------------------------------------------


@pytest.mark.skipif(not Tmpfs.available(), reason="needs root and a tmpfs mount")
def test_log_on_read_only_media_is_read(capsys: pytest.CaptureFixture[str]) -> None:
    with Tmpfs(8 << 20) as media:
        url, _ = build_log(media.path)
        media.read_only()
        # no -wal, no -shm: closed cleanly (the writer's pool lock file stays, empty: PoolLock)
        assert sorted(p.name for p in media.path.iterdir() if not p.name.endswith(".lock")) == ["log.db"]
        assert run(["log", "epochs", "--url", url], capsys)[0] == 0
        code, out, _ = run(["log", "audit", "--url", url], capsys)
        assert (code, out.splitlines()[1]) == (0, "  clean")
        code, out, _ = run(["log", "show", "--url", url, "--owner", "request-0007"], capsys)
        assert (code, shown_seqs(out)) == (0, [16, 17])
        code, out, _ = run(["log", "state", "--url", url, "--at", "16"], capsys)
        assert code == 0
        assert "request-0007" in out
