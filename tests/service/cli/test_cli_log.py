"""``nanoserve log`` and ``nanoserve db`` through ``main([...])``: output and exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from nanoserve.allocator import BlockAllocator, BlockTable, FreeReason
from nanoserve.allocator.log import EventLog, read_events
from nanoserve.migrations import upgrade
from nanoserve.service.cli.main import main


def persist(pool: BlockAllocator, log: EventLog) -> None:
    """The pool's pending events as one batch of the log, as the engine appends a step's."""
    log.append_batch(None, pool.take_events(), pool.snapshot)


@pytest.fixture
def log_url(tmp_path: Path) -> str:
    """A closed epoch: A [0, 1] finished, B [2] still held (a leak)."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    with EventLog.open(url, pool_id="p", num_blocks=4, block_size=16) as log:
        pool = BlockAllocator(4, 16)
        pool.allocate_for(20, "A")  # seq 2
        persist(pool, log)
        pool.allocate("B")  # seq 3
        persist(pool, log)
        pool.free_all([0, 1], FreeReason.FINISHED)  # seq 4
        persist(pool, log)
    return url


def test_db_upgrade_creates_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    assert main(["db", "upgrade", url]) == 0
    engine = sa.create_engine(url)
    assert "allocator_events" in sa.inspect(engine).get_table_names()
    engine.dispose()
    assert capsys.readouterr().out == f"{url}: schema at head\n"


def test_db_upgrade_of_unreachable_database_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", "postgresql+psycopg://nobody@127.0.0.1:1/none"]) == 2
    assert "nanoserve db upgrade:" in capsys.readouterr().err


@pytest.mark.parametrize("action", [["upgrade"], ["downgrade", "--revision", "0009"]])
def test_db_on_a_sqlite_file_in_a_missing_folder_names_the_folder_as_serve_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: list[str]
) -> None:
    # SQLite's own words were "(sqlite3.OperationalError) unable to open database file (Background on ...)"
    url = f"sqlite:///{tmp_path / 'nowhere' / 'x.db'}"
    assert main(["db", action[0], url, *action[1:]]) == 2
    assert capsys.readouterr().err == (
        f"nanoserve db {action[0]}: event log store {url} is unavailable: "
        f"folder {str(tmp_path / 'nowhere')!r} does not exist\n"
    )


def test_db_upgrade_of_a_refused_connection_is_one_line_without_sqlalchemys_link(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["db", "upgrade", "postgresql+psycopg://nobody:secret@127.0.0.1:1/none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "nanoserve db upgrade: event log store postgresql+psycopg://nobody:***@127.0.0.1:1/none is unavailable: "
        "OperationalError: connection failed"
    )
    assert (err.count("\n"), "sqlalche.me" in err, "secret" in err) == (1, False, False)


def test_db_downgrade_takes_the_schema_back_keeping_the_events(
    log_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a new user found the docs' `alembic downgrade 0008` failing without -c and -x url=
    events = read_events(log_url)
    assert main(["db", "downgrade", log_url, "--revision", "0008"]) == 0
    assert capsys.readouterr().out == f"{log_url}: schema at 0008\n"
    engine = sa.create_engine(log_url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one() == "0008"
        assert "allocator_keys" not in sa.inspect(conn).get_table_names()
    engine.dispose()
    assert read_events(log_url) == events
    assert main(["db", "upgrade", log_url]) == 0
    assert read_events(log_url) == events


def test_db_downgrade_to_an_unknown_revision_exits_2(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "downgrade", log_url, "--revision", "0042"]) == 2
    assert "nanoserve db downgrade:" in capsys.readouterr().err


def test_audit_with_leak_exits_1_and_names_block_and_owner(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "audit", "--url", log_url]) == 1
    out = capsys.readouterr().out
    assert "seq 5 block 2 owner 'B': leaked_block" in out


def test_audit_of_clean_log_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'clean.db'}"
    upgrade(url)
    with EventLog.open(url, num_blocks=4, block_size=16) as log:
        pool = BlockAllocator(4, 16)
        pool.free(pool.allocate("A"))
        persist(pool, log)
    assert main(["log", "audit", "--url", url]) == 0
    assert "clean" in capsys.readouterr().out


def test_audit_of_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "audit", "--url", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["epochs", "show", "audit", "requests"])
def test_a_log_command_without_a_log_file_says_where_the_url_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NANOSERVE_EVENT_LOG_URL", raising=False)
    assert main(["log", command]) == 2
    assert capsys.readouterr().err == (
        f"nanoserve log {command}: no event log at 'sqlite:///nanoserve-log.db': "
        "file 'nanoserve-log.db' does not exist\n"
        "hint: no --url and no $NANOSERVE_EVENT_LOG_URL, so the URL was the default sqlite:///nanoserve-log.db "
        f"(nanoserve-log.db in this folder, {tmp_path}); the log is where `nanoserve serve --event-log-url` put it: "
        "pass that URL as --url, or run this in the folder serve ran in (its default, sqlite:///nanoserve-log.db, "
        "is relative to it)\n"
    )


def test_a_log_url_from_the_environment_that_names_no_file_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'gone.db'}"
    monkeypatch.setenv("NANOSERVE_EVENT_LOG_URL", url)
    assert main(["log", "epochs"]) == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[1]
        .startswith("hint: the URL came from $NANOSERVE_EVENT_LOG_URL (no --url given); ")
    )


def test_audit_of_unknown_epoch_exits_2(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "audit", "--url", log_url, "--epoch", "9"]) == 2
    assert "pool 'p' has no epoch 9; epochs: [1]" in capsys.readouterr().err


@pytest.mark.usefixtures("one_row_per_event")  # damages one event's row
def test_audit_of_tampered_log_names_first_bad_seq(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    engine = sa.create_engine(log_url)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM allocator_events WHERE seq = 3"))
    engine.dispose()
    assert main(["log", "audit", "--url", log_url, "--pool", "p", "--epoch", "1"]) == 1
    assert "first bad seq 3" in capsys.readouterr().out


def test_show_filters_by_owner(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "show", "--url", log_url, "--owner", "A"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["seq", "batch", "step", "time", "(UTC)", "kind", "blocks", "owner", "reason"]
    assert [line.split()[0] for line in lines[2:]] == ["2", "4"]
    assert lines[3].split()[-3:] == ["0,1", "A", "finished"]


def test_show_filters_by_block_and_range(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "show", "--url", log_url, "--block", "1", "--from", "3", "--to", "5"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["4"]


def test_state_at_seq_lists_holders(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "state", "--url", log_url, "--at", "3"]) == 0
    out = capsys.readouterr().out
    assert "at seq 3: 1 free, 3 allocated of 4 blocks of 16 tokens" in out
    assert "free blocks: 3" in out
    owners = {line.split()[0]: line.split()[2] for line in out.splitlines() if line.startswith(("A ", "B "))}
    assert owners == {"A": "0,1", "B": "2"}


def test_state_lists_the_preempted_requests_waiting_without_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``log state --svg`` listed preempted requests that hold no block; the text left them out, so a pool
    short of blocks looked as if nothing waited for it."""
    url = f"sqlite:///{tmp_path / 'preempted.db'}"
    upgrade(url)
    with EventLog.open(url, pool_id="p", num_blocks=4, block_size=16) as log:
        pool = BlockAllocator(4, 16)
        pool.allocate_for(20, "A")  # seq 2: [0, 1]
        pool.allocate("B")  # seq 3: [2]
        persist(pool, log)
        pool.free_all([0, 1], FreeReason.PREEMPTED)  # seq 4
        pool.allocate("C")  # seq 5: [1]
        persist(pool, log)
        pool.free_all([2], FreeReason.FINISHED)  # seq 6
        persist(pool, log)
    assert main(["log", "state", "--url", url, "--at", "3"]) == 0
    assert "preempted" not in capsys.readouterr().out
    assert main(["log", "state", "--url", url, "--at", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "preempted, waiting to be recomputed (1, holding no block): A (since seq 4)" in out
    assert not any(line.startswith("B") for line in out)  # finished: not waiting


def test_epochs_lists_each_epoch_with_status(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    log = EventLog.open(log_url, pool_id="p", num_blocks=4, block_size=16)
    log._writer.stop()  # crashed: never closed
    assert main(["log", "epochs", "--url", log_url]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    assert [line.split()[:4] for line in lines] == [["p", "1", "4", "16"], ["p", "2", "4", "16"]]
    assert lines[0].endswith("5            closed at seq 5")
    assert lines[1].endswith("1            open (running, or crashed)")


def test_url_defaults_to_environment(
    log_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NANOSERVE_EVENT_LOG_URL", log_url)
    assert main(["log", "show", "--kind", "allocate"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["3"]


def test_audit_of_an_open_epoch_says_running_or_crashed(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    log = EventLog.open(log_url, pool_id="p", num_blocks=4, block_size=16)
    log._writer.stop()  # never closed
    assert main(["log", "audit", "--url", log_url, "--epoch", "2"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[0] == "pool 'p' epoch 2: 1 events, last seq 1, open (running, or crashed)"
    )


def test_an_open_epoch_that_a_later_one_followed_is_crashed_in_audit_and_epochs(
    log_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    crashed = EventLog.open(log_url, pool_id="p", num_blocks=4, block_size=16)
    crashed._writer.stop()  # epoch 2 never closed: its server died, and with it its lock
    crashed._pool_lock.release()
    EventLog.open(log_url, pool_id="p", num_blocks=4, block_size=16)._writer.stop()  # nor epoch 3, the newest
    assert main(["log", "audit", "--url", log_url]) == 1  # the fixture's epoch 1 leaks a block
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pool ")]
    assert heads == [
        "pool 'p' epoch 1: 5 events, last seq 5, closed",
        "pool 'p' epoch 2: 1 events, last seq 1, crashed; epoch 3 opened the pool after it",
        "pool 'p' epoch 3: 1 events, last seq 1, open (running, or crashed)",
    ]
    assert main(["log", "epochs", "--url", log_url]) == 0
    statuses = [line.rsplit("  ", 1)[1].strip() for line in capsys.readouterr().out.splitlines()[2:]]
    assert statuses == ["closed at seq 5", "crashed; epoch 3 opened the pool after it", "open (running, or crashed)"]


def test_state_prints_free_blocks_as_sorted_ranges(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'ranges.db'}"
    upgrade(url)
    with EventLog.open(url, pool_id="p", num_blocks=10, block_size=16) as log:
        pool = BlockAllocator(10, 16)
        taken = [pool.allocate(f"r{i}") for i in range(10)]  # seq 2..11
        for block_id in (5, 0, 9, 1, 2, 7):  # seq 12..17
            pool.free(taken[block_id])
        pool.free_all([taken[i] for i in (3, 4, 6, 8)], FreeReason.FINISHED)
        persist(pool, log)
    assert main(["log", "state", "--url", url, "--at", "17"]) == 0
    assert "free blocks: 0-2, 5, 7, 9" in capsys.readouterr().out.splitlines()


def test_state_full_prints_the_free_stack_in_lifo_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'lifo.db'}"
    upgrade(url)
    with EventLog.open(url, pool_id="p", num_blocks=10, block_size=16) as log:
        pool = BlockAllocator(10, 16)
        taken = [pool.allocate(f"r{i}") for i in range(10)]
        for block_id in (5, 0, 9, 1, 2, 7):
            pool.free(taken[block_id])
        pool.free_all([taken[i] for i in (3, 4, 6, 8)], FreeReason.FINISHED)
        persist(pool, log)
    assert main(["log", "state", "--url", url, "--at", "17", "--full"]) == 0
    assert "free stack (next out first): 7,2,1,9,0,5" in capsys.readouterr().out.splitlines()


def test_state_past_the_end_says_where_the_epoch_ends(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "state", "--url", log_url, "--at", "99999"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "note: epoch 1 ends at seq 5; showing the pool there, not at --at 99999\n"
    assert "epoch 1 at seq 5:" in captured.out


def test_show_rejects_an_unknown_kind_naming_the_kinds(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["log", "show", "--url", log_url, "--kind", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err
    assert "'allocate_for'" in err
    assert "'pool_close'" in err


def _empty_log(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    assert main(["db", "upgrade", url]) == 0
    return url


def test_epochs_of_an_empty_log_says_so_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _empty_log(tmp_path)
    capsys.readouterr()
    assert main(["log", "epochs", "--url", url]) == 0
    assert capsys.readouterr().out == "no epochs in the log\n"


def test_audit_of_an_empty_log_has_nothing_to_audit_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _empty_log(tmp_path)
    capsys.readouterr()
    assert main(["log", "audit", "--url", url]) == 0
    assert capsys.readouterr().out == "nothing to audit: the log holds no epochs\n"


def test_epochs_of_an_unknown_pool_exits_2(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "epochs", "--url", log_url, "--pool", "nope"]) == 2
    assert "the log holds no pool 'nope'" in capsys.readouterr().err


def forked_log(tmp_path: Path) -> str:
    """Request r (blocks 0, 1; block 1 half full) forked into r#0 and r#1 (seqs 4, 5), which copy block 1 into
    3 and 4 (seqs 6, 7); "other" holds block 2 (seq 3); everything released at the end."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    with EventLog.open(url, pool_id="p", num_blocks=8, block_size=4) as log:
        pool = BlockAllocator(8, 4)
        parent = BlockTable(pool, "r")
        parent.append_tokens(6)
        other = BlockTable(pool, "other")
        other.append_tokens(1)
        children = [parent.fork("r#0"), parent.fork("r#1")]
        for child in children:
            child.append_tokens(1)
        persist(pool, log)
        for table in (*children, parent, other):
            table.release(FreeReason.FINISHED)
        persist(pool, log)
    return url


def test_state_at_a_fork_names_the_shared_blocks_and_the_one_to_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = forked_log(tmp_path)
    capsys.readouterr()
    assert main(["log", "state", "--url", url, "--at", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shared = lines[lines.index(next(line for line in lines if line.startswith("shared block"))) + 2 :]
    assert [line.split() for line in shared] == [
        ["0", "3", "r,r#0,r#1", "(forked)"],
        ["1", "3", "r,r#0,r#1", "(forked)", "copy", "on", "write"],
    ]


def test_show_owner_lists_the_samples_forked_from_it_with_their_forks_and_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = forked_log(tmp_path)
    capsys.readouterr()
    assert main(["log", "show", "--url", url, "--owner", "r", "--epoch", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    events = [line.split()[:1] + line.split()[4:7] for line in lines[2:]]  # no step: seq, batch, date, time, kind, ...
    assert events[:5] == [
        ["2", "allocate_for", "0,1", "r"],
        ["4", "fork", "0,1", "r#0"],
        ["5", "fork", "0,1", "r#1"],
        ["6", "copy", "1,3", "r#0"],
        ["7", "copy", "1,4", "r#1"],
    ]
    assert "other" not in "\n".join(lines)
    assert any("<-r partial =2,2" in line for line in lines)


@pytest.mark.parametrize("command", [("log", "show"), ("log", "state", "--at", "3"), ("log", "epochs")])
def test_output_whose_reader_went_away_stops_quietly_with_141(log_url: str, command: tuple[str, ...]) -> None:
    # `nanoserve log show | head -1`: once head exits, every write meets a closed pipe; here the reader
    # is gone before the first one
    import subprocess
    import sys

    nanoserve = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.service.cli.main", *command, "--url", log_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert nanoserve.stdout is not None
    nanoserve.stdout.close()
    _, stderr = nanoserve.communicate(timeout=60)
    assert stderr.decode() == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    assert nanoserve.returncode == 141


TENANT_HINT = (
    "hint: a tenant's request is owned as <tenant>/<request_id> where tenants are configured ('default/nosuch' "
    "with --auth-token), and sample i of a parallel request as <owner>#i; `nanoserve log requests` lists the "
    "request ids\n"
)


def test_show_owner_that_has_no_event_says_so_and_nothing_of_tenants_where_the_log_has_none(
    log_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a new user got an empty table and exit 0, silently; then a tenant hint on a server without auth
    assert main(["log", "show", "--url", log_url, "--owner", "nosuch"]) == 0  # as `log requests` finding none
    out, err = capsys.readouterr()
    assert out == "no event of owner 'nosuch' in pool 'p' epoch 1\n"
    assert err == ""
    assert main(["log", "show", "--url", log_url, "--owner", "nosuch", "--epoch", "1", "--kind", "free"]) == 0
    assert capsys.readouterr().out == "no event of owner 'nosuch' of kind free in pool 'p' epoch 1\n"


def test_show_without_owner_that_finds_nothing_names_its_filters(
    log_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["log", "show", "--url", log_url, "--block", "3", "--from", "2"]) == 0
    assert capsys.readouterr() == ("no event touching block 3 in seqs 2.. in pool 'p' epoch 1\n", "")


def test_show_owner_of_a_client_id_names_the_tenants_owners_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a server with tenants the log's owner of a client's id ``x`` is ``<tenant>/x``."""
    url = f"sqlite:///{tmp_path / 'tenants.db'}"
    upgrade(url)
    with EventLog.open(url, pool_id="p", num_blocks=4, block_size=16) as log:
        pool = BlockAllocator(4, 16)
        pool.allocate("team-a/x")
        pool.allocate("team-b/x#0")  # a sample of team-b's x
        pool.allocate("team-a/xx")
        persist(pool, log)
    assert main(["log", "show", "--url", url, "--owner", "x"]) == 0
    out, err = capsys.readouterr()
    assert out == "no event of owner 'x' in pool 'p' epoch 1\n"
    assert err == "hint: a tenant's request is owned as <tenant>/<request_id>: found 'team-a/x', 'team-b/x'\n"
    assert main(["log", "show", "--url", url, "--owner", "nosuch"]) == 0  # tenants' owners, none of this id
    assert capsys.readouterr().err == TENANT_HINT


def test_a_long_block_list_is_shown_as_runs_cut_with_its_count() -> None:
    from nanoserve.service.cli.commands.log_format import short_blocks

    assert short_blocks([5, 0, 1]) == "5,0,1"  # short: as stored
    assert short_blocks(list(range(3, 60))) == "3-59"  # 57 blocks were 190 characters
    evens = list(range(0, 200, 2))
    assert short_blocks(evens) == "0,2,4,6,8,10,12,14,16... (100 blocks)"
    assert short_blocks(evens, max_chars=1000) == ",".join(map(str, evens))


def test_a_register_of_many_keys_shows_two_and_the_count_unless_full() -> None:
    from nanoserve.service.cli.commands.log_format import cache_detail

    keys = [f"{i:064x}" for i in range(57)]
    parents = [None, *keys[:-1]]
    assert cache_detail(keys, parents, [], max_keys=2) == (
        "000000000000 000000000000<-000000000000 ... (57 keys, --full)"
    )
    assert len(cache_detail(keys, parents, [])) == 12 + 56 * 26 + 56  # every key, as before: --full
    assert cache_detail(keys[:2], parents[:2], [], max_keys=2) == "000000000000 000000000000<-000000000000"


def test_show_owner_prints_a_run_of_journal_outputs_as_one_line_unless_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a 600-token request printed 600 journal lines, one per engine step
    from nanoserve.allocator import BlockEvent, EventKind
    from tests.service.cli.test_journal_cli import _admit, _out

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    with EventLog.open(url, pool_id="p", num_blocks=8, block_size=4) as log:
        log.append_batch(1, [BlockEvent(EventKind.ALLOCATE, (3,), "a")], journal=[_admit("a")])
        for step in range(2, 7):  # tokens 0..5, one a step
            log.append_batch(step, [], journal=[_out("a", step - 2, [step])])
        log.append_batch(7, [], journal=[_out("a", 6, [], "length")])
        log.append_batch(8, [], journal=[_out("a", 9, [4])])  # not following on (tokens 6..9 missing): its own line
    assert main(["log", "show", "--url", url, "--owner", "a"]) == 0
    journal = [line for line in capsys.readouterr().out.splitlines() if line.startswith("journal:")]
    assert journal == [
        "journal: epoch 1 step 1 admit: admitted, 3 prompt tokens, seed 42",
        "journal: epoch 1 steps 2..6 output: tokens 0..5",
        "journal: epoch 1 step 7 finish: no new tokens, ended: length",
        "journal: epoch 1 step 8 output: tokens 9..10",
    ]
    assert main(["log", "show", "--url", url, "--owner", "a", "--full"]) == 0
    journal = [line for line in capsys.readouterr().out.splitlines() if line.startswith("journal:")]
    assert journal[1:3] == [
        "journal: epoch 1 step 2 output: tokens 0..1",
        "journal: epoch 1 step 3 output: tokens 1..2",
    ]
    assert len(journal) == 8
