"""Benchmark crash -> log open (recovery) on crashed epochs of growing length, and the full audit.

    .venv/bin/python bench/recovery.py [--num-events 200000 1000000 10000000] [--real-events 200000]
        [--url-dir DIR] [--scan-max-events 200000]

For each ``--num-events`` N:

1. Writes a crashed epoch of N allocator events and its request journal
   through ``EventLog`` (no model, no engine). Its last ``--real-events``
   events are a live random workload on the pure allocator with prefix caching
   (requests sharing a few prompts: ALLOCATE_FOR, SHARE, REGISTER, FREE_ALL,
   RELEASE, EVICT), one batch per scheduler step, journaling what an engine
   would: an ADMIT per admission (prompt ids, sampling), an OUTPUT of 16 tokens
   per running request per step, a FINISH per ending; a SNAPSHOT every
   ``--events-per-snapshot`` events. Before them (N above ``--real-events``),
   one recorded period of the same workload, whose requests all end, is
   written again and again without SNAPSHOTs: rows recovery must not read,
   stored as the log stores them (step rows, index rows, journal checkpoints
   every 8,192 records), generated at the writer's speed rather than the
   allocator's. The epoch is then abandoned as SIGKILL leaves it (no
   POOL_CLOSE, the lock gone).
2. Times crash -> log open: ``EventLog.open(prepare_journal=RecoveryPlanner(...))``,
   what the server runs before SERVING: the allocator audit of the tail since
   the newest verified SNAPSHOT, the unfinished requests from the newest
   verified journal checkpoint and the rows after it, their histories, the new
   epoch's commit. Target: <= 2 s whatever N. "events read" and "records read"
   are the two tails (they depend on where the crash falls between checkpoints).
3. Times the unfinished-request scan recovery made before journal checkpoints
   (every journal record of the epoch decoded), for N <= ``--scan-max-events``.
4. Times the full audit of the crashed epoch from genesis (``log audit``'s
   allocator work, in this process) where the whole epoch is the live workload.

Prints a table and the ratio of the longest epoch's crash -> open to the shortest's.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from nanoserve.allocator import (
    BlockAllocator,
    BlockEvent,
    BlockKey,
    EventKind,
    FreeReason,
    KVCacheExhausted,
    extend_block_keys,
)
from nanoserve.allocator.block_table import BlockTable
from nanoserve.allocator.log import EventLog, audit
from nanoserve.allocator.log.batch import Batch, seal_event_rows
from nanoserve.allocator.log.key_refs import KeyIds
from nanoserve.allocator.log.reader import connect
from nanoserve.allocator.log.schema import pool_epochs
from nanoserve.allocator.log.snapshot_codec import snapshot_data
from nanoserve.allocator.log.store import Row, create_log_engine, insert_rows, insert_through_driver
from nanoserve.engine.journal.journal_chain import journal_genesis, step_hash
from nanoserve.engine.journal.live_requests import CheckpointRow, LiveCheckpoints, LiveRequests
from nanoserve.engine.journal.records import JournalKind
from nanoserve.engine.journal.recovery import RecoveryPlanner
from nanoserve.engine.journal.schema import journal_checkpoints, journal_requests, journal_steps
from nanoserve.engine.journal.step_codec import encode_step
from nanoserve.engine.journal.store import (
    CHECKPOINT_COLUMNS,
    INDEX_COLUMNS,
    STEP_COLUMNS,
    JournalRecord,
    read_journal,
)
from nanoserve.migrations import upgrade

NUM_BLOCKS = 1024
BLOCK_SIZE = 16
POOL_ID = "bench-recovery"
Encoded = tuple[bytes, list[tuple[str, str]]]  # a step row's body, its records' (kind, request id)
SAMPLING = {"seed": 7, "temperature": 0.8, "top_p": 0.95, "max_tokens": 256}


def admit(owner: str, tokens: list[int]) -> JournalRecord:
    data = {
        "prompt_token_ids": tokens,
        "prompt": None,
        "sampling": SAMPLING,
        "max_tokens": 256,
        "arrival_wall_ns": time.time_ns(),
        "deadline_wall_ns": None,
        "recovered_from": None,
        "num_prior_tokens": 0,
    }
    return JournalRecord(JournalKind.ADMIT, owner, data)


def finish(owner: str, start: int, reason: str) -> JournalRecord:
    data = {"start": start, "token_ids": [], "text": "", "finish_reason": reason, "stop_reason": None}
    data.update(abort_cause=None, queue_s=0.01, ttft_s=0.05, total_s=1.5, num_preemptions=0)
    return JournalRecord(JournalKind.FINISH, owner, data)


class Workload:
    """A random serving workload on the pure allocator with prefix caching, one scheduler step at a time:
    each ``step()`` returns the step's allocator events and the journal records an engine would write."""

    def __init__(self, seed: int, id_prefix: str) -> None:
        self.rng = random.Random(seed)
        self.pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        self.prompts = [[self.rng.randrange(32_000) for _ in range(self.rng.randrange(40, 400))] for _ in range(16)]
        self.prompt_keys: list[list[BlockKey]] = [extend_block_keys([], p, BLOCK_SIZE) for p in self.prompts]
        self.id_prefix = id_prefix
        self.running: dict[str, BlockTable] = {}
        self.num_outputs: dict[str, int] = {}  # owner -> output tokens journaled
        self.serial = 0

    def step(self) -> tuple[list[BlockEvent], list[JournalRecord]]:
        rng, journal = self.rng, []
        for _ in range(rng.randrange(1, 4)):  # admissions: a shared prompt plus a private suffix
            which = rng.randrange(len(self.prompts))
            owner = f"{self.id_prefix}{self.serial}"
            self.serial += 1
            tokens = self.prompts[which] + [rng.randrange(32_000) for _ in range(rng.randrange(1, 64))]
            keys = extend_block_keys(list(self.prompt_keys[which]), tokens, BLOCK_SIZE)
            table = BlockTable(self.pool, owner)
            try:
                hits, _ = self.pool.count_prefix_hits(owner, keys[: (len(tokens) - 1) // BLOCK_SIZE])
                table.append_tokens(len(tokens) - table.share_prefix(keys[:hits]))
                table.register(keys, len(tokens))
            except KVCacheExhausted:
                table.release(FreeReason.ABORTED)
                continue
            self.running[owner] = table
            self.num_outputs[owner] = 0
            journal.append(admit(owner, tokens))
        for owner in list(self.running):  # decode: some requests grow (16 tokens a step), some end
            table = self.running[owner]
            if rng.random() < 0.3:
                journal.append(self.end(owner, FreeReason.FINISHED, "stop"))
            elif table.can_append(BLOCK_SIZE):
                table.append_tokens(BLOCK_SIZE)
                delta = [rng.randrange(32_000) for _ in range(BLOCK_SIZE)]
                data = {"start": self.num_outputs[owner], "token_ids": delta, "text": " tok" * BLOCK_SIZE}
                journal.append(JournalRecord(JournalKind.OUTPUT, owner, data))
                self.num_outputs[owner] += BLOCK_SIZE
        if len(self.running) > 48:  # keep the pool from filling: end the oldest
            journal.append(self.end(next(iter(self.running)), FreeReason.PREEMPTED, "abort"))
        return self.pool.take_events(), journal

    def end(self, owner: str, reason: FreeReason, finish_reason: str) -> JournalRecord:
        self.running.pop(owner).release(reason)
        return finish(owner, self.num_outputs.pop(owner), finish_reason)

    def end_all(self) -> tuple[list[BlockEvent], list[JournalRecord]]:
        journal = [self.end(owner, FreeReason.FINISHED, "stop") for owner in list(self.running)]
        return self.pool.take_events(), journal


class EpochFiller:
    """Stores an open epoch's next rows as its writer would (the same record codec, hash chains, journal
    step rows, index rows and journal checkpoints), in large transactions and without a writer thread.

    Starts where ``EventLog.open`` left the epoch: its POOL_INIT stored, no journal record yet."""

    def __init__(self, url: str, epoch: int, events_per_snapshot: int) -> None:
        self.engine = create_log_engine(url)
        self.epoch = epoch
        self.events_per_snapshot = events_per_snapshot
        with self.engine.connect() as conn:
            self.seq, self.head_hash = conn.execute(
                sa.select(pool_epochs.c.durable_seq, pool_epochs.c.head_hash).where(
                    pool_epochs.c.pool_id == POOL_ID, pool_epochs.c.epoch == epoch
                )
            ).one()
        self.snapshot_seq = self.seq
        self.journal_seq = 0
        self.journal_hash = journal_genesis(POOL_ID, epoch)
        self.checkpoints = LiveCheckpoints()
        self.event_rows: list[Row] = []
        self.key_ids = KeyIds()  # packed rows name their keys by id, as the writer stores them
        self.step_rows: list[tuple[object, ...]] = []
        self.index_rows: list[tuple[object, ...]] = []
        self.checkpoint_rows: list[CheckpointRow] = []

    def append(self, step: int, events: list[BlockEvent], journal: Encoded, pool: BlockAllocator | None = None) -> None:
        """One step: its events (with a SNAPSHOT of ``pool`` when one is due) and its journal."""
        data = None
        if pool is not None and self.seq + len(events) - self.snapshot_seq >= self.events_per_snapshot:
            data = snapshot_data(pool.snapshot())
        kind = None if data is None else EventKind.SNAPSHOT
        batch = Batch(self.seq + 1, step, time.time_ns(), time.monotonic_ns(), events, kind, data)
        sealed = seal_event_rows([batch], POOL_ID, self.epoch, self.seq + 1, self.head_hash)
        self.event_rows += sealed.rows
        self.seq, self.head_hash = sealed.last_seq, sealed.head_hash
        if data is not None:
            self.snapshot_seq = self.seq
        body, records = journal
        if records:
            first_seq, last_seq = self.journal_seq + 1, self.journal_seq + len(records)
            digest = step_hash(self.journal_hash, first_seq, last_seq, step, batch.wall_time_ns, body)
            self.step_rows.append((POOL_ID, self.epoch, first_seq, last_seq, step, batch.wall_time_ns, body, digest))
            self.index_rows += [
                (POOL_ID, self.epoch, seq, request_id)
                for seq, (kind_name, request_id) in enumerate(records, first_seq)
                if kind_name in ("admit", "finish")
            ]
            checkpoint = self.checkpoints.follow(POOL_ID, self.epoch, first_seq, records, digest)
            if checkpoint is not None:
                self.checkpoint_rows.append(checkpoint)
            self.journal_seq, self.journal_hash = last_seq, digest
        if len(self.event_rows) >= 200_000:
            self.commit()

    def commit(self) -> None:
        """Store the rows appended so far in one transaction, the epoch row's head moved with them."""
        with self.engine.begin() as conn:
            insert_rows(conn, self.event_rows, self.key_ids)
            insert_through_driver(conn, journal_steps, STEP_COLUMNS, self.step_rows)
            insert_through_driver(conn, journal_requests, INDEX_COLUMNS, self.index_rows)
            insert_through_driver(conn, journal_checkpoints, CHECKPOINT_COLUMNS, self.checkpoint_rows)
            conn.execute(
                sa.update(pool_epochs)
                .where(pool_epochs.c.pool_id == POOL_ID, pool_epochs.c.epoch == self.epoch)
                .values(durable_seq=self.seq, head_hash=self.head_hash)
            )
        self.key_ids.commit()
        self.event_rows, self.step_rows, self.index_rows, self.checkpoint_rows = [], [], [], []


def encoded(journal: list[JournalRecord]) -> Encoded:
    """A step's journal as its step row's body and its records' (kind, request id)."""
    body = encode_step([(record.kind.value, record.request_id, record.data) for record in journal])
    return body, [(record.kind.value, record.request_id) for record in journal]


def filler_period(num_events: int, seed: int) -> list[tuple[list[BlockEvent], Encoded]]:
    """The steps of a workload of about ``num_events`` events that ends every request it admits, with
    their journals encoded."""
    workload = Workload(seed, "fill-")
    steps = []
    num_written = 0
    while num_written < num_events:
        events, journal = workload.step()
        steps.append((events, encoded(journal)))
        num_written += len(events)
    events, journal = workload.end_all()
    steps.append((events, encoded(journal)))
    return steps


def write_crashed_epoch(url: str, num_events: int, args: argparse.Namespace) -> tuple[int, int]:
    """Write one epoch of at least ``num_events`` events with its journal and abandon it as SIGKILL
    would; returns its last seq and last journal seq. The last ``--real-events`` events are a live
    workload with its SNAPSHOTs; before them, one recorded period (its requests all ended) is stored
    again and again, with no SNAPSHOT: rows recovery never reads, stored as the log stores them."""
    log = EventLog.open(url, pool_id=POOL_ID, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    epoch = log.epoch
    log._writer.abandon()  # what SIGKILL leaves: no POOL_CLOSE, the lock gone with the process
    log._release()
    filler = EpochFiller(url, epoch, args.events_per_snapshot)
    step = 0
    num_filler = num_events - args.real_events
    if num_filler > 0:
        period = filler_period(min(num_filler, args.real_events), args.seed + 1)
        while filler.seq < num_filler:
            for events, journal in period:
                step += 1
                filler.append(step, events, journal)
    workload = Workload(args.seed, "req-")
    while filler.seq < num_events:
        step += 1
        events, records = workload.step()
        filler.append(step, events, encoded(records), workload.pool)
    filler.commit()
    filler.engine.dispose()
    return filler.seq, filler.journal_seq


def scan_unfinished(url: str) -> int:
    """What recovery did before journal checkpoints: every journal record of the crashed epoch decoded."""
    live = LiveRequests()
    with connect(url) as conn:
        for entry in read_journal(conn, POOL_ID, 1):
            live.apply(entry.journal_seq, entry.kind, entry.request_id)
    return len(live.ids())


def measure(url: str, num_events: int, args: argparse.Namespace) -> dict[str, object]:
    upgrade(url)
    began = time.perf_counter()
    last_seq, last_journal_seq = write_crashed_epoch(url, num_events, args)
    row: dict[str, object] = {"events": last_seq, "records": last_journal_seq, "write_s": time.perf_counter() - began}
    planner = RecoveryPlanner(retention_s=3600.0)
    began = time.perf_counter()
    log = EventLog.open(url, pool_id=POOL_ID, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, prepare_journal=planner)
    row["open_s"] = time.perf_counter() - began
    log.close(30)
    assert planner.audit_from_seq is not None
    assert planner.journal_from_seq is not None
    row["event_tail"] = last_seq - planner.audit_from_seq + 1
    row["journal_tail"] = last_journal_seq - planner.journal_from_seq
    row["recovered"] = len(planner.recovered)
    if num_events <= args.scan_max_events:
        began = time.perf_counter()
        assert scan_unfinished(url) == len(planner.recovered) + len(planner.ended)
        row["scan_s"] = time.perf_counter() - began
    if num_events <= args.real_events:  # the whole epoch a live workload: it audits clean
        began = time.perf_counter()
        report = audit(url, POOL_ID, 1)
        audit_s = time.perf_counter() - began
        assert report.clean, report.render()
        row["audit_rate"] = report.num_events / audit_s
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-events", type=int, nargs="+", default=[200_000, 1_000_000, 10_000_000])
    parser.add_argument("--events-per-snapshot", type=int, default=10_000)
    parser.add_argument("--url-dir", type=Path, default=None, help="where the SQLite logs go (default: a temp dir)")
    parser.add_argument("--real-events", type=int, default=200_000, help="the live workload's events at the end")
    parser.add_argument("--scan-max-events", type=int, default=200_000, help="no full journal scan above this")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = []
    print(
        f"{'events':>11} {'journal records':>15} {'written in':>10} {'crash->open':>11} {'events read':>11} "
        f"{'records read':>12} {'recovered':>9} {'full journal scan':>17} {'full audit':>13}"
    )
    with tempfile.TemporaryDirectory(dir=args.url_dir) as tmp:
        for num_events in sorted(args.num_events):
            url = f"sqlite:///{Path(tmp) / f'log-{num_events}.db'}"
            row = measure(url, num_events, args)
            rows.append(row)
            scan = f"{row['scan_s']:.2f} s" if "scan_s" in row else "-"
            rate = f"{row['audit_rate']:,.0f}/s" if "audit_rate" in row else "-"
            print(
                f"{row['events']:>11,} {row['records']:>15,} {row['write_s']:>8.0f} s {row['open_s']:>9.3f} s "
                f"{row['event_tail']:>11,} {row['journal_tail']:>12,} {row['recovered']:>9} {scan:>17} {rate:>13}",
                flush=True,
            )
            Path(url.removeprefix("sqlite:///")).unlink()
    shortest, longest = rows[0], rows[-1]
    verdict = "meets" if max(float(str(row["open_s"])) for row in rows) <= 2.0 else "MISSES"
    print(
        f"crash -> open, longest / shortest epoch ({longest['events']:,} / {shortest['events']:,} events): "
        f"{float(str(longest['open_s'])) / float(str(shortest['open_s'])):.2f}x; {verdict} the 2 s target"
    )


if __name__ == "__main__":
    main()
