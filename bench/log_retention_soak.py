"""Soak: a busy pool across many epochs with retention set; the live log stays flat, every archive audits clean.

A synthetic allocator driver (no model): each epoch opens the pool's log
(``EventLog.open``: POOL_INIT), runs ``--steps`` scheduler steps of requests
that take blocks and finish (one logged batch a step, plus one request-journal
row per running request a step, written beside it as the journal writes its
rows), and closes (POOL_CLOSE). After each epoch the server's archiver
(``LogArchiver.run_once``, with ``--retention-bytes``) moves what is due into
the archive folder. Printed after each epoch: the live SQLite file's size (its
freed pages are reused, so it stops growing once archival keeps up), the live
rows, the epochs kept and archived. At the end each archive is audited (hash
chain and rules, clean and closed) and its sha256 and head hash checked
against the live log's manifest.

    .venv/bin/python -m bench.log_retention_soak                # 30 epochs of 600 steps
    .venv/bin/python -m bench.log_retention_soak --epochs 10 --steps 200
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa
import structlog

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog, audit_all
from nanoserve.allocator.log.archive import RetentionPolicy, file_sha256, manifest
from nanoserve.allocator.log.reader import connect, list_epochs
from nanoserve.migrations import upgrade
from nanoserve.service.log_retention import LogArchiver

POOL_ID = "soak"
NUM_BLOCKS = 512
BLOCK_SIZE = 16
MAX_RUNNING = 24


def run_epoch(url: str, steps: int, rng: random.Random) -> int:
    """One epoch of ``steps`` steps; returns its number."""
    journal = sa.table(
        "request_journal",
        sa.column("pool_id"),
        sa.column("epoch"),
        sa.column("journal_seq"),
        sa.column("request_id"),
        sa.column("kind"),
        sa.column("step"),
        sa.column("wall_ns"),
        sa.column("record"),
    )
    journal_rows: list[dict[str, object]] = []
    log = EventLog.open(url, pool_id=POOL_ID, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    epoch = log.epoch
    pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    running: dict[str, list[int]] = {}
    next_id = 0
    for step in range(1, steps + 1):
        while len(running) < MAX_RUNNING and pool.num_free > 8:
            owner = f"req-{epoch}-{next_id}"
            next_id += 1
            running[owner] = pool.allocate_for(rng.randint(16, 100), owner)
        for owner in list(running):
            if rng.random() < 0.08:
                pool.free_all(running.pop(owner), FreeReason.FINISHED)
        log.append_batch(step, pool.take_events(), pool.snapshot)
        for owner in running:
            journal_rows.append(
                {
                    "pool_id": POOL_ID,
                    "epoch": epoch,
                    "journal_seq": len(journal_rows) + 1,
                    "request_id": owner,
                    "kind": "output",
                    "step": step,
                    "wall_ns": time.time_ns(),
                    "record": f'{{"token_ids":[{rng.randint(0, 49151)}],"finish":null}}',
                }
            )
    for owner in list(running):
        pool.free_all(running.pop(owner), FreeReason.FINISHED)
    log.append_batch(steps + 1, pool.take_events(), pool.snapshot)
    log.flush()
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(journal), journal_rows)
    finally:
        engine.dispose()
    log.close(final_state=pool.snapshot())
    return epoch


def live_rows(url: str) -> tuple[int, int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            events = conn.execute(sa.text("SELECT count(*) FROM allocator_events")).scalar_one()
            journal = conn.execute(sa.text("SELECT count(*) FROM request_journal")).scalar_one()
            return int(events), int(journal)
    finally:
        engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=600, help="scheduler steps per epoch")
    parser.add_argument(
        "--retention-bytes", type=int, default=1_500_000, help="bytes of finished epochs the live log keeps"
    )
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # the table only
    work = Path(args.dir or tempfile.mkdtemp(prefix="nanoserve-retention-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    db = work / "live.db"
    url = f"sqlite:///{db}"
    upgrade(url)
    archiver = LogArchiver(url, POOL_ID, work / "archive", RetentionPolicy(retention_bytes=args.retention_bytes))
    rng = random.Random(7)
    print(f"live log {db}, archives in {archiver.dest_dir}, retention {args.retention_bytes} bytes of finished epochs")
    print(f"{'epoch':>5} {'live file B':>12} {'events':>8} {'journal':>8} {'kept':>5} {'archived':>8} {'pass s':>7}")
    started = time.monotonic()
    sizes: list[int] = []
    for _ in range(args.epochs):
        epoch = run_epoch(url, args.steps, rng)
        pass_started = time.monotonic()
        archiver.run_once()
        pass_s = time.monotonic() - pass_started
        events, journal = live_rows(url)
        with connect(url) as conn:
            kept = len(list_epochs(conn, POOL_ID))
        sizes.append(db.stat().st_size)
        print(
            f"{epoch:>5} {sizes[-1]:>12} {events:>8} {journal:>8} {kept:>5} {len(archiver.archived):>8} {pass_s:>7.2f}"
        )
    half = sizes[len(sizes) // 2 :]
    print(
        f"live file: max {max(sizes)} B; second half min {min(half)} max {max(half)} B "
        f"(flat: max/min {max(half) / min(half):.2f})"
    )

    named = {entry.epoch: entry for entry in manifest(url, POOL_ID)}
    bad = 0
    for entry in archiver.archived:
        path = Path(entry.path)
        [report] = audit_all(f"sqlite:///{path}", POOL_ID)
        with connect(f"sqlite:///{path}") as conn:
            [info] = list_epochs(conn, POOL_ID)
        ok = (
            report.clean
            and report.closed
            and file_sha256(path) == named[entry.epoch].sha256
            and info.head_hash == named[entry.epoch].head_hash
        )
        bad += not ok
    print(
        f"archives: {len(archiver.archived)} audited, {len(archiver.archived) - bad} clean and matching the manifest; "
        f"{time.monotonic() - started:.1f} s"
    )
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
