"""Two servers opening a fresh log at the same instant (issue 9, fault 8).

Each does what a starting server does: migrate the log (``upgrade``), then open an epoch. The
migrations serialize (an advisory lock on PostgreSQL, the write lock taken first on SQLite), so
neither sees a half-made schema; two servers of one pool race for its first epoch, and the loser
either takes the next epoch or gets a ``SecondWriterError`` saying what to do. Never a raw
``OperationalError`` (``table pool_epochs already exists``, ``database is locked``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

NUM_ROUNDS = 2  # one with a pool each, one with both workers on one pool

# Waits at a file barrier before each round, then migrates and opens; prints one JSON line per round.
WORKER = """
import json, sys, time
from pathlib import Path
from nanoserve.allocator.log import EventLog, SecondWriterError
from nanoserve.migrations import upgrade

folder, name, pool_ids, urls = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4:]
for k, (url, pool_id) in enumerate(zip(urls, pool_ids)):
    (folder / f"ready-{k}-{name}").touch()
    while not (folder / f"go-{k}").exists():
        time.sleep(0.0002)
    try:
        upgrade(url)
        EventLog.open(url, pool_id=pool_id, num_blocks=4, block_size=16).close()
        result = "ok"
    except SecondWriterError as exc:
        result = "SecondWriterError: " + str(exc)
    except Exception as exc:
        result = type(exc).__name__ + ": " + str(exc).splitlines()[0]
    print(json.dumps(result), flush=True)
"""


def race(folder: Path, urls: list[str], pool_ids: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Two workers open each URL at the same instant, worker i with pool ``pool_ids[round][i]``;
    their results, round by round."""
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                str(folder),
                str(index),
                ",".join(pools[index] for pools in pool_ids),
                *urls,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]
    try:
        for k in range(len(urls)):
            deadline = time.monotonic() + 120
            while len(list(folder.glob(f"ready-{k}-*"))) < len(workers):
                assert time.monotonic() < deadline, "workers did not reach the barrier"
                time.sleep(0.001)
            (folder / f"go-{k}").touch()
        outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    columns = [[json.loads(line) for line in output.splitlines()] for output in outputs]
    return list(zip(*columns, strict=True))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def fresh_urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    """NUM_ROUNDS URLs of logs nobody has opened yet: new SQLite files, or new PostgreSQL databases."""
    if request.param == "sqlite":
        yield [f"sqlite:///{tmp_path / f'fresh-{k}.db'}" for k in range(NUM_ROUNDS)]
        return
    admin = sa.create_engine(request.getfixturevalue("pg_url"), isolation_level="AUTOCOMMIT")
    names = [f"race_{uuid.uuid4().hex[:12]}" for _ in range(NUM_ROUNDS)]
    base = admin.url
    try:
        with admin.connect() as conn:
            for name in names:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield [base.set(database=name).render_as_string(hide_password=False) for name in names]
    finally:
        with admin.connect() as conn:
            for name in names:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_servers_opening_a_fresh_log_at_once_migrate_it_once_and_each_start_or_are_told_what_to_do(
    fresh_urls: list[str], tmp_path: Path
) -> None:
    half = NUM_ROUNDS // 2
    rounds = race(tmp_path, fresh_urls, [("pool-a", "pool-b")] * half + [("default", "default")] * half)
    assert rounds[:half] == [("ok", "ok")] * half  # two pools: both start
    refusal = (
        "SecondWriterError: pool 'default' epoch 1 already has a writer: another server opened it at the same "
        "moment and is writing pool 'default' to this log. Give each server its own pool (--pool-id), or stop "
        "the other server, then start this one again"
    )
    # the pool's lock (one live writer per pool id) refuses the second while the first holds the pool
    held = "SecondWriterError: pool 'default' is being written by another live server ("
    for results in rounds[half:]:  # one pool: the second takes epoch 2, or is told what to do
        first, second = sorted(results, key=lambda r: r != "ok")[::-1]
        assert second == "ok", results
        assert first == "ok" or first == refusal or first.startswith(held), results
