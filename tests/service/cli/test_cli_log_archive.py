"""``nanoserve log archive`` and ``log audit --archive``; an archive file read like any log."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog
from nanoserve.allocator.log.archive import RetentionPolicy
from nanoserve.allocator.log.segment_archive import LiveSize, SegmentEntry, archive_due_segment
from nanoserve.migrations import upgrade
from nanoserve.service.cli.main import main


def _epoch(url: str) -> None:
    """One clean epoch: seq 1 POOL_INIT, 2 A takes [0, 1], 3 A frees them, 4 POOL_CLOSE."""
    with EventLog.open(url, pool_id="p", num_blocks=4, block_size=16) as log:
        pool = BlockAllocator(4, 16)
        pool.allocate_for(20, "A")
        log.append_batch(None, pool.take_events(), pool.snapshot)
        pool.free_all([0, 1], FreeReason.FINISHED)
        log.append_batch(None, pool.take_events(), pool.snapshot)


@pytest.fixture
def archived(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, Path]:
    """A live log of three epochs whose first two were archived by the CLI: (live url, epoch 1's file)."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    for _ in range(3):
        _epoch(url)
    dest = tmp_path / "archive"
    assert main(["log", "archive", "--url", url, "--dest", str(dest)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert out[0].startswith("archived pool p epoch 1 (seq 1..4, ")
    assert out[1].startswith("archived pool p epoch 2 (seq 1..4, ")
    path = dest / "p-epoch-00000001.db"
    assert out[0].split(" -> ")[1].startswith(f"{path.resolve()} sha256 ")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return url, path


def test_the_live_log_keeps_the_newest_epoch_only(
    archived: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = archived
    assert main(["log", "epochs", "--url", url]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    # the archived epochs are listed from the manifest, not skipped: epoch numbers run without a gap
    assert [line.split()[:2] for line in lines] == [["p", "1"], ["p", "2"], ["p", "3"]]
    second = path.parent / "p-epoch-00000002.db"
    assert lines[0].endswith(f"4            archived to {path.resolve()} (`log audit --archive` reads it)")
    assert lines[1].endswith(f"4            archived to {second.resolve()} (`log audit --archive` reads it)")
    assert lines[2].endswith("4            closed at seq 4")
    assert main(["log", "archive", "--url", url, "--dest", str(archived[1].parent)]) == 0
    assert capsys.readouterr().out == "nothing to archive\n"


def test_an_archive_audits_clean_and_matches_the_manifest(
    archived: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = archived
    assert main(["log", "audit", "--archive", str(path), "--url", url]) == 0
    out = capsys.readouterr().out
    assert f"{path}: sha256 " in out
    assert "and head hash match the manifest (pool p epoch 1)" in out


def test_an_archive_is_read_like_a_log(archived: tuple[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, path = archived
    file_url = f"sqlite:///{path}"
    assert main(["log", "show", "--url", file_url]) == 0
    shown = capsys.readouterr().out
    assert "pool_init" in shown
    assert "pool_close" in shown
    assert main(["log", "state", "--url", file_url, "--at", "2"]) == 0
    assert "A" in capsys.readouterr().out
    assert main(["log", "plot", "--url", file_url, "-o", str(path.parent / "p.svg")]) == 0
    assert (path.parent / "p.svg").stat().st_size > 0


def test_a_changed_archive_differs_from_the_manifest(
    archived: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = archived
    with path.open("ab") as f:
        f.write(b"\0")
    assert main(["log", "audit", "--archive", str(path), "--url", url]) == 1
    assert "differs from the manifest's" in capsys.readouterr().out


def test_archiving_one_epoch_needs_its_pool(archived: tuple[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    url, path = archived
    assert main(["log", "archive", "--url", url, "--dest", str(path.parent), "--epoch", "3"]) == 2
    assert capsys.readouterr().err == "nanoserve log archive: --epoch needs --pool\n"
    assert main(["log", "archive", "--url", url, "--dest", str(path.parent), "--pool", "p", "--epoch", "3"]) == 2
    assert "epoch 3 is the newest of pool 'p': it is never archived" in capsys.readouterr().err


def _cut_epoch(tmp_path: Path) -> tuple[str, EventLog, BlockAllocator, SegmentEntry]:
    """An open epoch of pool "p" (10 requests one block each: seqs 2..23, SNAPSHOTs at 12 and 23) cut at 23:
    (its log's URL, the open log, its pool, the segment of seqs 1..22)."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    log = EventLog.open(url, pool_id="p", num_blocks=4, block_size=16, num_events_per_snapshot=10)
    pool = BlockAllocator(4, 16)
    for step in range(10):  # seqs 2..23, SNAPSHOTs at 12 and 23: the cut at 23
        block = pool.allocate(f"r{step}")
        log.append_batch(step, pool.take_events(), pool.snapshot)
        pool.free(block)
        log.append_batch(step, pool.take_events(), pool.snapshot)
    log.flush()
    [segment] = archive_due_segment(
        url, tmp_path / "arch", RetentionPolicy(retention_bytes=1), upgrade, "p", LiveSize()
    )
    return url, log, pool, segment


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_log_audit_archive_checks_a_segment_file_and_names_a_planted_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, log, pool, segment = _cut_epoch(tmp_path)
    capsys.readouterr()

    assert main(["log", "audit", "--archive", segment.path, "--url", url]) == 0
    out = capsys.readouterr().out
    assert (
        f"sha256 {segment.sha256} and head hash match the manifest (seqs 1..{segment.last_seq} of pool p epoch 1)"
        in out
    )
    assert main(["log", "audit", "--url", url]) == 0
    assert f"seqs 1..{segment.last_seq} archived" in capsys.readouterr().out
    assert main(["log", "show", "--url", url, "--from", "5"]) == 0
    shown = capsys.readouterr()
    assert shown.out.splitlines()[2].split()[0] == str(segment.last_seq + 1)  # the first row kept
    assert shown.err == (
        f"seqs 1..{segment.last_seq} of epoch 1 are archived in segment files (`nanoserve log state --at SEQ` "
        f"names the one holding a seq): shown from seq {segment.last_seq + 1}\n"
    )

    archive = sa.create_engine(f"sqlite:///{segment.path}")
    try:
        with archive.begin() as conn:  # r3 'allocates' another block; the stored hash stays
            conn.execute(
                sa.text(
                    "UPDATE allocator_events SET record = replace(record, '|allocate|0|', '|allocate|1|') WHERE seq = 8"
                )
            )
    finally:
        archive.dispose()
    assert main(["log", "audit", "--archive", segment.path, "--url", url]) == 1
    out = capsys.readouterr().out
    assert f"differs from the manifest's {segment.sha256} (the file changed)" in out
    assert "seq 8 owner 'r3': hash_mismatch: stored hash does not match the record and the previous hash" in out
    log.close(final_state=pool.snapshot())


def test_a_segment_still_checks_after_its_epoch_was_archived_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """New-user report: once the epoch went into its own file, the live log's manifest lists the segment
    no more (its row moved with the epoch); the check follows it to the epoch's file, not to the epoch's
    own sha256 (which said "the file changed" of an unchanged segment)."""
    url, log, pool, segment = _cut_epoch(tmp_path)
    log.close(final_state=pool.snapshot())
    EventLog.open(url, pool_id="p", num_blocks=4, block_size=16).close()  # epoch 2: epoch 1 may go whole
    assert main(["log", "archive", "--url", url, "--dest", str(tmp_path / "whole"), "--pool", "p", "--epoch", "1"]) == 0
    whole = str(tmp_path / "whole" / "p-epoch-00000001.db")
    capsys.readouterr()

    assert main(["log", "audit", "--archive", segment.path, "--url", url]) == 0
    assert (
        f"sha256 {segment.sha256} and head hash match the manifest in {whole} (its epoch's file) "
        f"(seqs 1..{segment.last_seq} of pool p epoch 1)"
    ) in capsys.readouterr().out


def test_an_archived_epoch_asked_of_the_live_log_names_its_file(
    archived: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """audit, state and plot of an epoch archived whole exit 2 naming the file that holds it."""
    url, path = archived
    hint = (
        f"pool 'p' has no epoch 1; epochs: [3]; epoch 1 is archived in {path.resolve()}: "
        f"read it there (--url sqlite:///{path.resolve()})\n"
    )
    for action in (["audit"], ["state", "--at", "2"], ["plot", "-o", str(path.parent / "p.svg")]):
        assert main(["log", *action, "--url", url, "--epoch", "1"]) == 2
        assert capsys.readouterr().err == f"nanoserve log {action[0]}: {hint}"
    assert main(["log", "audit", "--url", url, "--epoch", "7"]) == 2  # never there: no file named
    assert capsys.readouterr().err == "nanoserve log audit: pool 'p' has no epoch 7; epochs: [3]\n"


def test_log_show_of_an_owner_not_in_the_live_log_says_archived_epochs_are_not_searched(
    archived: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = archived
    assert main(["log", "show", "--url", url, "--owner", "gone"]) == 0
    out, err = capsys.readouterr()
    second = path.parent / "p-epoch-00000002.db"
    assert out == "no event of owner 'gone' in pool 'p' epoch 3\n"  # the epochs read: the live log's
    assert err.splitlines() == [  # first, and no tenant hint: the log has no tenant's owner (no auth)
        "note: the archived epochs are not searched "
        f"(epoch 1 in {path.resolve()}, epoch 2 in {second.resolve()}): read one with --url sqlite:///FILE"
    ]
    assert main(["log", "show", "--url", url, "--owner", "A"]) == 0  # found in epoch 3: nothing said
    assert capsys.readouterr().err == ""


def test_log_audit_archive_checks_against_the_default_live_log_when_it_exists(
    archived: tuple[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --url (and NANOSERVE_EVENT_LOG_URL), the default log sqlite:///nanoserve-log.db is the live log."""
    _, path = archived
    monkeypatch.delenv("NANOSERVE_EVENT_LOG_URL", raising=False)
    monkeypatch.chdir(path.parent.parent)  # where log.db is: nothing named nanoserve-log.db yet
    assert main(["log", "audit", "--archive", str(path)]) == 0
    assert "(no live log given or found: not checked against a manifest)" in capsys.readouterr().out
    (path.parent.parent / "log.db").rename(path.parent.parent / "nanoserve-log.db")
    assert main(["log", "audit", "--archive", str(path)]) == 0
    out = capsys.readouterr().out
    assert "checked against the manifest of the live log sqlite:///nanoserve-log.db\n" in out
    assert "and head hash match the manifest (pool p epoch 1)" in out


def test_an_archived_crashed_epoch_audits_as_crashed_not_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Epoch 1 crashed (no POOL_CLOSE), epochs 2 and 3 followed, epoch 1 was archived: its file's audit said
    'open (running, or crashed)'; the live log says a later epoch opened the pool, so it is crashed."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    crashed = EventLog.open(url, pool_id="p", num_blocks=4, block_size=16)
    crashed._writer.stop()  # its server died, and with it its lock
    crashed._pool_lock.release()
    _epoch(url)
    _epoch(url)
    dest = tmp_path / "archive"
    assert main(["log", "archive", "--url", url, "--dest", str(dest), "--pool", "p", "--epoch", "1"]) == 0
    capsys.readouterr()
    path = dest / "p-epoch-00000001.db"
    assert main(["log", "audit", "--archive", str(path), "--url", url]) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pool ")]
    assert heads == ["pool 'p' epoch 1: 1 events, last seq 1, crashed; epochs 2..3 opened the pool after it"]
    assert main(["log", "epochs", "--url", url]) == 0
    statuses = [line.split("  ")[-1].strip() for line in capsys.readouterr().out.splitlines()[2:]]
    assert statuses[0].startswith("archived to ")
