"""``nanoserve log requests`` and ``log show --owner`` across a crash; Resume's status codes."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from nanoserve.allocator import BlockEvent, EventKind
from nanoserve.allocator.log import EventLog
from nanoserve.engine.errors import JournalDisabledError, RequestNotFoundError
from nanoserve.engine.journal.records import JournalKind
from nanoserve.engine.journal.recovery import RecoveryPlanner
from nanoserve.engine.journal.store import JournalRecord
from nanoserve.migrations import upgrade
from nanoserve.service.cli.main import main
from nanoserve.service.grpc.interceptors import status_for


def _admit(request_id: str) -> JournalRecord:
    data = {
        "prompt_token_ids": [1, 2, 3],
        "prompt": "hi",
        "sampling": {"seed": 42},
        "max_tokens": 8,
        "arrival_wall_ns": time.time_ns(),
        "deadline_wall_ns": None,
        "recovered_from": None,
        "num_prior_tokens": 0,
    }
    return JournalRecord(JournalKind.ADMIT, request_id, data)


def _out(request_id: str, start: int, token_ids: list[int], finish: str | None = None) -> JournalRecord:
    data: dict[str, object] = {"start": start, "token_ids": token_ids, "text": "t"}
    if finish is None:
        return JournalRecord(JournalKind.OUTPUT, request_id, data)
    data.update(finish_reason=finish, abort_cause="cancelled" if finish == "abort" else None)
    return JournalRecord(JournalKind.FINISH, request_id, data)


@pytest.fixture
def crashed_log(tmp_path: Path) -> str:
    """Epoch 1: 'a' runs (block 3, two tokens), 'b' finishes, 'c' is cancelled; SIGKILL. Epoch 2 recovers 'a',
    which finishes there."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    log = EventLog.open(url, pool_id="p", num_blocks=8, block_size=4)
    log.append_batch(1, [BlockEvent(EventKind.ALLOCATE, (3,), "a")], journal=[_admit("a"), _admit("b"), _admit("c")])
    log.append_batch(2, [], journal=[_out("a", 0, [5, 6]), _out("b", 0, [7], "length"), _out("c", 0, [], "abort")])
    assert log.flush(10)
    log._writer.abandon()  # SIGKILL
    log._release()
    log = EventLog.open(url, pool_id="p", num_blocks=8, block_size=4, prepare_journal=RecoveryPlanner(3600.0))
    log.append_batch(1, [BlockEvent(EventKind.ALLOCATE, (0,), "a")], journal=[_out("a", 2, [9])])
    log.append_batch(2, [BlockEvent(EventKind.FREE, (0,), "a")], journal=[_out("a", 3, [], "length")])
    log.close(10)
    return url


def test_log_requests_lists_each_request_with_its_state(crashed_log: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "requests", "--url", crashed_log]) == 0
    rows = [line.split("  ") for line in capsys.readouterr().out.splitlines()[2:]]
    cells = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    assert cells == [
        ["1", "a", "admitted", "3", "2", "recovered in epoch 2"],
        ["1", "b", "admitted", "3", "1", "finished (length)"],
        ["1", "c", "admitted", "3", "0", "aborted (cancelled)"],
        ["2", "a", "recovered from epoch 1", "3", "3", "finished (length)"],
    ]
    assert main(["log", "requests", "--url", crashed_log, "--epoch", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_log_show_owner_follows_a_request_across_epochs(crashed_log: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "show", "--url", crashed_log, "--owner", "a"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["epoch", "seq", "batch"]
    assert [(line.split()[0], line.split()[1], line.split()[6]) for line in lines[2:5]] == [
        ("1", "2", "allocate"),
        ("2", "2", "allocate"),
        ("2", "3", "free"),
    ]
    assert lines[5:] == [
        "journal: epoch 1 step 1 admit: admitted, 3 prompt tokens, seed 42",
        "journal: epoch 1 step 2 output: tokens 0..2",
        "journal: epoch 2 admit: recovered from epoch 1 with 2 tokens, 3 prompt tokens, seed 42",
        "journal: epoch 2 step 1 output: tokens 2..3",
        "journal: epoch 2 step 2 finish: no new tokens, ended: length",
    ]


def test_resume_errors_map_to_their_status_codes() -> None:
    assert status_for(JournalDisabledError("no journal")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(RequestNotFoundError("request_id: no request 'x'")) == grpc.StatusCode.NOT_FOUND


def test_log_epochs_names_the_epoch_that_recovered_a_crash(
    crashed_log: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["log", "epochs", "--url", crashed_log]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows[0].endswith("crashed; recovered by epoch 2")
    assert "closed at seq" in rows[1]


def test_an_abort_recovery_explained_is_shown_with_its_reason() -> None:
    from nanoserve.service.cli.commands.log_requests import _ending

    finish = {"finish_reason": "abort", "abort_cause": "not_recovered", "abort_detail": "needs 16 KV blocks"}
    assert _ending(finish) == "aborted (not_recovered: needs 16 KV blocks)"
    assert _ending({"finish_reason": "abort", "abort_cause": "shutdown"}) == "aborted (shutdown)"


def test_an_archived_crashed_epoch_reads_back_crashed_and_recovered_in_every_reader(
    crashed_log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a new user's archive of a crashed epoch read back "open (running, or crashed)" in `log epochs`,
    # "running, or cut by a crash" in `log requests`, and "epochs 2..4 opened the pool after it" in `log audit`
    assert main(["log", "archive", "--url", crashed_log, "--dest", str(tmp_path / "arch")]) == 0
    archive = tmp_path / "arch" / "p-epoch-00000001.db"
    capsys.readouterr()
    assert main(["log", "epochs", "--url", f"sqlite:///{archive}"]) == 0
    [row] = capsys.readouterr().out.splitlines()[2:]
    assert row.endswith("crashed; recovered by epoch 2")
    assert main(["log", "requests", "--url", f"sqlite:///{archive}"]) == 0
    states = [line.split("  ")[-1].strip() for line in capsys.readouterr().out.splitlines()[2:]]
    assert states == ["cut by a crash; epoch 2 took the epoch over", "finished (length)", "aborted (cancelled)"]
    for live in ([], ["--url", crashed_log]):  # the file alone, and checked against its live log
        main(["log", "audit", "--archive", str(archive), *live])
        [head] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pool")]
        assert "crashed; recovered by epoch 2" in head, head
    assert main(["log", "epochs", "--url", crashed_log]) == 0
    archived_row = capsys.readouterr().out.splitlines()[2]
    assert f"crashed; recovered by epoch 2; archived to {archive}" in archived_row


def test_audit_of_one_pool_reads_no_other_pools_journal_and_finds_the_recovery_by_one_row(
    crashed_log: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`log audit --pool replica-0` exited 2 ('damaged journal step body') because naming the crashed epochs'
    recoveries decoded every pool's whole journal, and another pool of the log had a damaged step row."""
    import sqlalchemy as sa

    from nanoserve.engine.journal.schema import journal_steps

    with EventLog.open(crashed_log, pool_id="other", num_blocks=4, block_size=4) as other:
        other.append_batch(1, [], journal=[_admit("x")])
    engine = sa.create_engine(crashed_log)
    with engine.begin() as conn:  # its body says version 3, zlib-packed, and is not zlib
        conn.execute(
            journal_steps.update().where(journal_steps.c.pool_id == "other").values(body=b"\x03\x01not zlib at all")
        )
    engine.dispose()
    assert main(["log", "audit", "--url", crashed_log, "--pool", "p"]) == 0
    out = capsys.readouterr().out
    assert "pool 'p' epoch 1: " in out
    assert "crashed; recovered by epoch 2" in out
    assert main(["log", "epochs", "--url", crashed_log]) == 0
    assert "crashed; recovered by epoch 2" in capsys.readouterr().out
