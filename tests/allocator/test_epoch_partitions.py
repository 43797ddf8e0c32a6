"""PostgreSQL: the tables keyed by (pool_id, epoch) are partitioned per epoch (migration 0010).

Each test gets a database of its own on the server of ``pg_url`` (the migration is
run down and up, and the catalog is counted): they skip without PostgreSQL.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from structlog.testing import capture_logs

from nanoserve.allocator.log import audit_all, epoch_partitions
from nanoserve.allocator.log.archive import archive_epoch
from nanoserve.allocator.log.schema import default_partition_name, epoch_partition_name
from nanoserve.migrations import alembic_config, upgrade

from .test_audit import write_log
from .test_stored_keys import query

pytestmark = pytest.mark.postgres

EPOCH_TABLES = (
    "allocator_events",
    "allocator_keys",
    "journal_checkpoints",
    "journal_requests",
    "journal_steps",
    "request_journal",
)
ODD_POOL_ID = "o'k\\ %s :x é;--"  # a quote, a backslash, a driver placeholder, a bind-parameter colon


@pytest.fixture
def url(pg_url: str) -> Iterator[str]:
    """A database of its own, migrated to the newest schema, dropped after the test."""
    name = f"nanoserve_partitions_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except sa.exc.SQLAlchemyError as exc:  # pragma: no cover - a role without CREATEDB
        admin.dispose()
        pytest.skip(f"cannot create a database: {exc}")
    own = sa.engine.make_url(pg_url).set(database=name).render_as_string(hide_password=False)
    upgrade(own)
    yield own
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def _partitions(url: str) -> dict[str, set[str]]:
    """partitioned table -> the names of its partitions (pg_inherits)."""
    rows = query(
        url,
        "SELECT p.relname, c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relkind = 'p'",
    )
    found: dict[str, set[str]] = {}
    for parent, child in rows:
        found.setdefault(parent, set()).add(child)
    return found


def _expected(epochs: list[tuple[str, int]]) -> dict[str, set[str]]:
    return {
        table: {default_partition_name(table)} | {epoch_partition_name(table, p, e) for p, e in epochs}
        for table in EPOCH_TABLES
    }


def _all_rows(url: str) -> dict[str, list[tuple]]:
    return {table: query(url, f"SELECT * FROM {table} ORDER BY 1, 2, 3") for table in ("pool_epochs", *EPOCH_TABLES)}


def _add_journal_rows(url: str, pool_id: str, epoch: int) -> None:
    """An ADMIT record of request 'A' and its index row: companion rows that move with their epoch."""
    query(
        url,
        "INSERT INTO request_journal (pool_id, epoch, journal_seq, request_id, kind, step, wall_ns, record) "
        "VALUES (:p, :e, 1, 'A', 'admit', NULL, 5, :r)",
        p=pool_id,
        e=epoch,
        r=f'{{"epoch": {epoch}}}',
    )
    query(url, "INSERT INTO journal_requests VALUES (:p, :e, 1, 'A')", p=pool_id, e=epoch)


def _relkinds(url: str) -> set[tuple[str, str]]:
    rows = query(url, "SELECT relname, relkind FROM pg_class WHERE relname = ANY(:names)", names=list(EPOCH_TABLES))
    return {(name, str(kind)) for name, kind in rows}


def test_downgrade_and_upgrade_keep_every_row_of_two_pools(url: str) -> None:
    for pool_id, epoch in (("pool-a", 1), ("pool-a", 2), ("pool-b", 1)):
        write_log(url, pool_id)
        _add_journal_rows(url, pool_id, epoch)
    before = _all_rows(url)
    assert len(before["allocator_events"]) > 3
    assert len(before["request_journal"]) == 3

    command.downgrade(alembic_config(url), "0009")
    assert _relkinds(url) == {(table, "r") for table in EPOCH_TABLES}  # plain tables
    assert _partitions(url) == {}
    assert _all_rows(url) == before

    upgrade(url)
    assert _relkinds(url) == {(table, "p") for table in EPOCH_TABLES}
    assert _partitions(url) == _expected([("pool-a", 1), ("pool-a", 2), ("pool-b", 1)])
    assert _all_rows(url) == before
    for table in EPOCH_TABLES:  # every row is in its epoch's partition
        assert query(url, f"SELECT count(*) FROM ONLY {default_partition_name(table)}") == [(0,)]
    partition = epoch_partition_name("allocator_events", "pool-a", 2)
    assert query(url, f"SELECT count(*) FROM {partition}") == [(len(before["allocator_events"]) // 3,)]
    reports = audit_all(url)
    assert [(r.pool_id, r.epoch, r.num_events, r.clean) for r in reports] == [
        ("pool-a", 1, 12, True),
        ("pool-a", 2, 12, True),
        ("pool-b", 1, 12, True),
    ]


@pytest.mark.usefixtures("one_row_per_event")  # 12 rows an epoch
def test_a_new_epoch_gets_its_partitions(url: str) -> None:
    assert _partitions(url) == _expected([])  # a fresh log: DEFAULT only
    write_log(url, "pool-a")
    write_log(url, "pool-a")
    assert _partitions(url) == _expected([("pool-a", 1), ("pool-a", 2)])
    partition = epoch_partition_name("allocator_events", "pool-a", 2)
    assert query(url, f"SELECT count(*) FROM {partition}") == [(12,)]
    assert query(url, "SELECT count(*) FROM ONLY allocator_events_default") == [(0,)]


@pytest.mark.usefixtures("one_row_per_event")  # 12 rows an epoch
def test_archiving_an_epoch_drops_its_partitions(url: str, tmp_path: Path) -> None:
    for epoch in (1, 2):
        write_log(url, "pool-a")
        _add_journal_rows(url, "pool-a", epoch)
    engine = sa.create_engine(url)
    try:
        entry = archive_epoch(engine, "pool-a", 1, tmp_path, upgrade)
    finally:
        engine.dispose()
    assert _partitions(url) == _expected([("pool-a", 2)])
    assert query(url, "SELECT count(*) FROM pg_class WHERE relname LIKE '%\\_e1'") == [(0,)]
    assert query(url, "SELECT epoch, count(*) FROM allocator_events GROUP BY epoch") == [(2, 12)]
    assert query(url, "SELECT epoch FROM pool_epochs") == [(2,)]
    [report] = audit_all(f"sqlite:///{entry.path}")
    assert (report.epoch, report.num_events, report.clean) == (1, 12, True)
    archived = query(f"sqlite:///{entry.path}", "SELECT pool_id, epoch, request_id FROM journal_requests")
    assert archived == [("pool-a", 1, "A")]


def test_a_pool_id_with_odd_characters_gets_quoted_bounds(url: str, tmp_path: Path) -> None:
    write_log(url, ODD_POOL_ID)
    write_log(url, ODD_POOL_ID)
    name = epoch_partition_name("allocator_events", ODD_POOL_ID, 1)
    assert len(name.encode()) <= 63
    assert name.isascii()
    [(bound,)] = query(url, "SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE relname = :n", n=name)
    assert bound == "FOR VALUES FROM ('o''k\\ %s :x é;--', 1) TO ('o''k\\ %s :x é;--', 2)"
    assert query(url, f"SELECT DISTINCT pool_id FROM {name}") == [(ODD_POOL_ID,)]
    engine = sa.create_engine(url)
    try:
        entry = archive_epoch(engine, ODD_POOL_ID, 1, tmp_path, upgrade)
    finally:
        engine.dispose()
    assert _partitions(url) == _expected([(ODD_POOL_ID, 2)])
    assert [report.clean for report in audit_all(f"sqlite:///{entry.path}")] == [True]
    assert [report.clean for report in audit_all(url)] == [True]


@pytest.mark.usefixtures("one_row_per_event")  # 12 rows an epoch
def test_an_epoch_without_partitions_writes_to_default_and_is_archived_from_there(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(epoch_partitions, "LOCK_ATTEMPTS", 1)
    monkeypatch.setattr(epoch_partitions, "_warned", False)
    reader = sa.create_engine(url)
    with reader.connect() as conn, capture_logs() as logs:
        # a reader's transaction holds allocator_events: the open cannot lock it and makes no partitions
        conn.exec_driver_sql("SELECT count(*) FROM allocator_events")
        write_log(url, "pool-a")
    reader.dispose()
    assert [entry["event"] for entry in logs if entry["log_level"] == "warning"] == [
        "event_log_epoch_partitions_not_made"
    ]
    assert _partitions(url) == _expected([])
    assert query(url, "SELECT count(*) FROM ONLY allocator_events_default") == [(12,)]
    write_log(url, "pool-a")  # epoch 2 gets its partitions
    assert _partitions(url) == _expected([("pool-a", 2)])

    engine = sa.create_engine(url)
    try:
        entry = archive_epoch(engine, "pool-a", 1, tmp_path, upgrade)
    finally:
        engine.dispose()
    assert query(url, "SELECT count(*) FROM ONLY allocator_events_default") == [(0,)]
    assert _partitions(url) == _expected([("pool-a", 2)])
    [report] = audit_all(f"sqlite:///{entry.path}")
    assert (report.epoch, report.num_events, report.clean) == (1, 12, True)
    assert [(r.epoch, r.clean) for r in audit_all(url)] == [(2, True)]


@pytest.mark.usefixtures("one_row_per_event")  # 12 rows an epoch
def test_pools_opening_at_once_each_get_their_partitions(url: str) -> None:
    pools = [f"pool-{n}" for n in range(4)]
    errors: list[BaseException] = []

    def run(pool_id: str) -> None:
        try:
            for _ in range(3):
                write_log(url, pool_id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(pool_id,)) for pool_id in pools]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert _partitions(url) == _expected([(p, e) for p in pools for e in (1, 2, 3)])
    assert query(url, "SELECT count(*) FROM ONLY allocator_events_default") == [(0,)]
    assert query(url, "SELECT count(*) FROM allocator_events") == [(4 * 3 * 12,)]


def test_stored_keys_move_into_their_epochs_partition_and_leave_with_it(url: str, tmp_path: Path) -> None:
    from .test_stored_keys import cached_log, records

    cached_log(url, "pool-a")  # epoch 1: packed rows naming prefix-cache keys by id (migration 0009)
    cached_log(url, "pool-a")  # epoch 2
    keys = query(url, "SELECT epoch, count(*) FROM allocator_keys GROUP BY epoch ORDER BY epoch")
    assert [epoch for epoch, _ in keys] == [1, 2]
    records_before = records(url, "pool-a")
    command.downgrade(alembic_config(url), "0009")
    upgrade(url)
    for epoch, num_rows in keys:
        partition = epoch_partition_name("allocator_keys", "pool-a", epoch)
        assert query(url, f"SELECT count(*) FROM {partition}") == [(num_rows,)]
    assert query(url, "SELECT count(*) FROM ONLY allocator_keys_default") == [(0,)]
    assert records(url, "pool-a") == records_before
    assert [r.clean for r in audit_all(url)] == [True, True]

    engine = sa.create_engine(url)
    try:
        entry = archive_epoch(engine, "pool-a", 1, tmp_path, upgrade)
    finally:
        engine.dispose()
    assert epoch_partition_name("allocator_keys", "pool-a", 1) not in _partitions(url)["allocator_keys"]
    assert query(url, "SELECT epoch FROM allocator_keys GROUP BY epoch") == [(2,)]
    [report] = audit_all(f"sqlite:///{entry.path}")
    assert report.clean


def _block_key_indexes(url: str) -> dict[str, str]:
    """table or partition of allocator_events -> the definition of its index on block_key."""
    rows = query(
        url,
        "SELECT tablename, indexdef FROM pg_indexes "
        "WHERE tablename LIKE 'allocator_events%' AND indexdef LIKE '%block_key%'",
    )
    return {str(table): str(definition) for table, definition in rows}


@pytest.mark.usefixtures("one_row_per_event")  # prefix-cache rows that carry their first key
def test_the_block_key_index_is_partial_on_every_partition_and_a_query_for_a_key_uses_it(url: str) -> None:
    from .test_stored_keys import cached_log

    cached_log(url, "pool-a")  # epoch 1, made after the upgrade: its partition gets the index from the table's
    [(key,)] = query(url, "SELECT block_key FROM allocator_events WHERE epoch = 1 AND seq = 6")  # A's release
    indexes = _block_key_indexes(url)
    partition = epoch_partition_name("allocator_events", "pool-a", 1)
    assert set(indexes) == {"allocator_events", "allocator_events_default", partition}
    assert all(definition.endswith("(block_key) WHERE (block_key IS NOT NULL)") for definition in indexes.values())
    assert indexes["allocator_events"].startswith("CREATE INDEX ix_allocator_events_block_key ON ONLY")
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SET enable_seqscan = off")
            plan = conn.execute(
                sa.text("EXPLAIN SELECT seq FROM allocator_events WHERE block_key = :k"), {"k": key}
            ).scalars()
            assert any("Index" in line and "block_key" in line for line in plan)
            found = conn.execute(
                sa.text("SELECT seq, kind FROM allocator_events WHERE block_key = :k ORDER BY seq"), {"k": key}
            )
            assert [tuple(row) for row in found] == [(6, "release"), (9, "evict")]
    finally:
        engine.dispose()

    command.downgrade(alembic_config(url), "0010")
    indexes = _block_key_indexes(url)
    assert set(indexes) == {"allocator_events", "allocator_events_default", partition}
    assert not any("WHERE" in definition for definition in indexes.values())
    command.downgrade(alembic_config(url), "0009")  # 0010 rebuilds the plain table with the full index
    assert set(_block_key_indexes(url)) == {"allocator_events"}
    upgrade(url)
    indexes = _block_key_indexes(url)
    assert set(indexes) == {"allocator_events", "allocator_events_default", partition}
    assert all(definition.endswith("WHERE (block_key IS NOT NULL)") for definition in indexes.values())
    assert [r.clean for r in audit_all(url)] == [True]
