"""Soak: a busy pool that never restarts, with retention set; the open epoch's live log stays flat.

A synthetic engine (no model): one epoch runs ``--rounds`` rounds of
``--steps`` scheduler steps, requests taking blocks and finishing (one logged
batch a step, a SNAPSHOT checkpoint every ``--snapshot-every`` events), each
step journaling what the engine journals (an ADMIT per new request, an OUTPUT
of one token per running request, a FINISH per ending) beside its events. After each round the server's archiver
(``LogArchiver.run_once`` with ``--retention-bytes``) cuts the open epoch at its
newest checkpoint once its live events outgrow the bound, moving the older rows
into a segment file, with the journal rows before the oldest running request's
ADMIT. Printed after each round: the live SQLite file's size with its WAL (its
freed pages are reused), the live event and journal step rows, the epoch's last seq, the
segments so far and the pass's seconds. At the end the live epoch is audited
from its cut and every segment file alone (hash chain and rules), each checked
against the segment manifest (sha256, head hash): together they verify the
epoch's whole chain.

    .venv/bin/python -m bench.log_segment_soak                 # 40 rounds of 500 steps
    .venv/bin/python -m bench.log_segment_soak --rounds 10 --steps 200
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
from nanoserve.allocator.log import EventLog, audit, audit_all
from nanoserve.allocator.log.archive import RetentionPolicy, file_sha256
from nanoserve.allocator.log.reader import connect, stored_hash
from nanoserve.allocator.log.segment_archive import segment_manifest
from nanoserve.engine.journal.records import JournalKind
from nanoserve.engine.journal.store import JournalRecord, audit_journal
from nanoserve.migrations import upgrade
from nanoserve.service.log_retention import LogArchiver

POOL_ID = "soak"
NUM_BLOCKS = 512
BLOCK_SIZE = 16
MAX_RUNNING = 24


class Driver:
    """The open epoch and its pool: requests come, take blocks, finish."""

    def __init__(self, url: str, snapshot_every: int, rng: random.Random) -> None:
        self.log = EventLog.open(
            url, pool_id=POOL_ID, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_events_per_snapshot=snapshot_every
        )
        self.pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        self.rng = rng
        self.running: dict[str, list[int]] = {}  # request id -> its blocks
        self.tokens: dict[str, int] = {}  # request id -> tokens journaled
        self.step = 0
        self.next_id = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            journal: list[JournalRecord] = []
            while len(self.running) < MAX_RUNNING and self.pool.num_free > 8:
                owner = f"req-{self.next_id}"
                self.next_id += 1
                self.running[owner] = self.pool.allocate_for(self.rng.randint(16, 100), owner)
                self.tokens[owner] = 0
                journal.append(JournalRecord(JournalKind.ADMIT, owner, {"prompt_token_ids": [1, 2, 3]}))
            for owner in list(self.running):
                start = self.tokens[owner]
                token = {"start": start, "token_ids": [self.rng.randint(0, 49151)], "text": "x"}
                journal.append(JournalRecord(JournalKind.OUTPUT, owner, token))
                self.tokens[owner] = start + 1
                if self.rng.random() < 0.08:
                    self.pool.free_all(self.running.pop(owner), FreeReason.FINISHED)
                    ending = {"start": start + 1, "token_ids": [], "text": "", "finish_reason": "length"}
                    journal.append(JournalRecord(JournalKind.FINISH, owner, ending))
                    del self.tokens[owner]
            self.log.append_batch(self.step, self.pool.take_events(), self.pool.snapshot, journal=journal)
        self.log.flush()

    def close(self) -> None:
        for owner in list(self.running):
            self.pool.free_all(self.running.pop(owner), FreeReason.FINISHED)
        self.log.append_batch(self.step + 1, self.pool.take_events(), self.pool.snapshot)
        self.log.close(final_state=self.pool.snapshot())


def live_rows(url: str) -> tuple[int, int]:
    """(event rows, journal step rows) in the live log."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            events = conn.execute(sa.text("SELECT count(*) FROM allocator_events")).scalar_one()
            journal = conn.execute(sa.text("SELECT count(*) FROM journal_steps")).scalar_one()
            return int(events), int(journal)
    finally:
        engine.dispose()


def check_segments(url: str) -> int:
    """Audits every segment file alone and against the manifest; the number that fail."""
    bad = 0
    for entry in segment_manifest(url, POOL_ID):
        path = Path(entry.path)
        [report] = audit_all(f"sqlite:///{path}", POOL_ID)
        with connect(f"sqlite:///{path}") as conn:
            head = stored_hash(conn, POOL_ID, entry.epoch, entry.last_seq)
            journal_clean = not audit_journal(conn, POOL_ID)
        ok = report.clean and journal_clean and file_sha256(path) == entry.sha256 and head == entry.head_hash
        ok = ok and report.from_seq == entry.first_seq and report.last_seq == entry.last_seq + 1
        bad += not ok
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=500, help="scheduler steps per round")
    parser.add_argument("--snapshot-every", type=int, default=2_000, help="events between checkpoints")
    parser.add_argument(
        "--retention-bytes", type=int, default=400_000, help="event bytes the open epoch keeps before a cut"
    )
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # the table only
    work = Path(args.dir or tempfile.mkdtemp(prefix="nanoserve-segment-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    db = work / "live.db"
    url = f"sqlite:///{db}"
    upgrade(url)
    archiver = LogArchiver(url, POOL_ID, work / "archive", RetentionPolicy(retention_bytes=args.retention_bytes))
    driver = Driver(url, args.snapshot_every, random.Random(7))
    print(f"live log {db}, segments in {archiver.dest_dir}, retention {args.retention_bytes} bytes of the open epoch")
    print(f"{'round':>5} {'live+wal B':>12} {'events':>8} {'journal':>8} {'last seq':>9} {'segments':>8} {'pass s':>7}")
    started = time.monotonic()
    sizes: list[int] = []
    for number in range(1, args.rounds + 1):
        driver.run(args.steps)
        pass_started = time.monotonic()
        archiver.run_once()
        pass_s = time.monotonic() - pass_started
        sizes.append(sum(path.stat().st_size for path in (db, db.with_name(db.name + "-wal")) if path.exists()))
        (events, journal), last_seq, num_segments = live_rows(url), driver.log.durable_seq, len(archiver.segments)
        print(f"{number:>5} {sizes[-1]:>12} {events:>8} {journal:>8} {last_seq:>9} {num_segments:>8} {pass_s:>7.2f}")
    driver.close()
    half = sizes[len(sizes) // 2 :]
    print(
        f"live file: max {max(sizes)} B; second half min {min(half)} max {max(half)} B "
        f"(flat: max/min {max(half) / min(half):.2f})"
    )
    report = audit(url, POOL_ID)
    with connect(url) as conn:
        live_journal_clean = not audit_journal(conn, POOL_ID)
    bad = check_segments(url)
    archived_bytes = sum(entry.num_bytes for entry in archiver.segments)
    print(
        f"the epoch's {report.last_seq} events: {report.last_seq - report.from_seq + 1} live, the rest in "
        f"{len(archiver.segments)} segment files of {archived_bytes} B together"
    )
    clean = report.clean and live_journal_clean
    print(
        f"live epoch: {'clean' if clean else 'VIOLATIONS'} (events and journal), closed, audited from seq "
        f"{report.from_seq} to {report.last_seq}; segments: {len(archiver.segments)} audited, "
        f"{len(archiver.segments) - bad} clean (events and journal) and matching the manifest; "
        f"{time.monotonic() - started:.1f} s"
    )
    return 0 if bad == 0 and clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
