"""Secrets at rest: the log's files are 0600 whatever the umask, and no record holds a store password."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from nanoserve.allocator.log import EventLog
from nanoserve.allocator.log.errors import redact_urls
from nanoserve.allocator.log.pool_lock import lock_file_path
from nanoserve.migrations import upgrade

PASSWORD = "s3cret-at-rest"


@pytest.fixture
def open_umask() -> Iterator[None]:
    previous = os.umask(0o022)  # the usual umask: SQLite alone would create 0644
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.usefixtures("open_umask")
def test_the_database_its_wal_and_the_lock_file_are_created_0600(tmp_path: Path) -> None:
    database = tmp_path / "log.db"
    upgrade(f"sqlite:///{database}")
    log = EventLog.open(f"sqlite:///{database}", pool_id="rest", num_blocks=4, block_size=16)
    try:
        files = {
            "db": database,
            "wal": Path(f"{database}-wal"),
            "shm": Path(f"{database}-shm"),
            "lock": Path(lock_file_path(str(database), "rest")),
        }
        assert {name: oct(_mode(path)) for name, path in files.items() if path.exists()} == dict.fromkeys(
            files, "0o600"
        )
    finally:
        log.close()


@pytest.mark.usefixtures("open_umask")
def test_a_log_opened_without_migrating_first_is_0600_too(tmp_path: Path) -> None:
    database = tmp_path / "fresh.db"
    with pytest.raises(ValueError, match="schema"):  # no schema yet: refused, but the file SQLite made is private
        EventLog.open(f"sqlite:///{database}", pool_id="rest", num_blocks=4, block_size=16)
    assert oct(_mode(database)) == "0o600"


def test_an_existing_file_keeps_its_mode(tmp_path: Path) -> None:
    database = tmp_path / "shared.db"
    database.touch()
    database.chmod(0o640)
    upgrade(f"sqlite:///{database}")
    assert oct(_mode(database)) == "0o640"


def test_redact_urls_hides_passwords_at_any_depth() -> None:
    config = {"event_log": {"url": f"postgresql+psycopg://app:{PASSWORD}@db:5432/log"}, "n": 3, "l": ["a://b"]}
    assert redact_urls(config) == {
        "event_log": {"url": "postgresql+psycopg://app:***@db:5432/log"},
        "n": 3,
        "l": ["a://b"],
    }


def _with_password(url: str) -> str:
    parsed = sa.engine.make_url(url)
    return parsed.set(password=PASSWORD).render_as_string(hide_password=False)


def _all_text(url: str) -> str:
    """Every row of every table in the log, as text."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            tables = sa.inspect(conn).get_table_names()
            return "\n".join(repr(row) for table in tables for row in conn.execute(sa.text(f'SELECT * FROM "{table}"')))
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_no_row_of_a_postgres_log_holds_the_url_password(pg_url: str) -> None:
    url = _with_password(pg_url)  # trust auth: the password is sent to no one, but it is in the URL
    upgrade(pg_url)
    config = {"event_log": {"event_log_url": url, "pool_id": "secret-pool"}}
    log = EventLog.open(url, pool_id="secret-pool", num_blocks=4, block_size=16, config=config)
    log.close()
    stored = _all_text(pg_url)
    assert "secret-pool" in stored
    assert "***" in stored
    assert PASSWORD not in stored
    assert PASSWORD.encode().hex() not in stored  # nor hidden in a hex-encoded record


def test_no_row_of_a_sqlite_log_holds_a_configured_password(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    config = {"mirror_url": f"postgresql+psycopg://app:{PASSWORD}@db/log"}
    EventLog.open(url, pool_id="p", num_blocks=4, block_size=16, config=config).close()
    assert PASSWORD.encode() not in (tmp_path / "log.db").read_bytes()
    assert PASSWORD not in _all_text(url)
