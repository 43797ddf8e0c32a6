"""Benchmark the allocator's event log: caller cost, writer throughput, replay + audit.

    .venv/bin/python bench/allocator_log.py [--num-events 1000000] [--pg-url URL] [--skip-pg]

1. Added cost per allocator call on the caller's thread, logging off vs on
   (SQLite, background writer): thread CPU time and wall time per call.
2. Events per second sustained by the writer, SQLite vs PostgreSQL: events
   from a producer running as fast as it can, until all are durable.
3. Replay + audit of a log of ``--num-events`` events on SQLite (full replay,
   replay from the newest snapshot, audit).

The workload is the same everywhere: scheduler steps of 1..8 calls mixing
allocate_for (1..64 tokens) and free_all of a whole request, on a 1024-block pool.
Targets: < 5 us added per call on the caller's thread; replay + audit of 1M < 3 s.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from nanoserve.allocator import BlockAllocator, EventLog, FreeReason, audit, replay

NUM_BLOCKS = 1024
BLOCK_SIZE = 16
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def drive(pool: BlockAllocator, num_calls: int, seed: int = 0) -> None:
    """``num_calls`` allocator calls in scheduler steps of 1..8 calls."""
    rng = random.Random(seed)
    held: list[list[int]] = []
    step = calls = 0
    while calls < num_calls:
        pool.begin_step(step)
        for _ in range(rng.randint(1, 8)):
            if held and (rng.random() < 0.45 or not pool.can_allocate(4)):
                pool.free_all(held.pop(rng.randrange(len(held))), FreeReason.FINISHED)
            else:
                held.append(pool.allocate_for(rng.randint(1, 64), f"req-{calls}"))
            calls += 1
        pool.end_step()
        step += 1
    pool.begin_step(step)
    for block_ids in held:
        pool.free_all(block_ids, FreeReason.FINISHED)
    pool.end_step()


def timed(work: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of ``work()``."""
    wall, cpu = time.perf_counter(), time.thread_time()
    work()
    return time.perf_counter() - wall, time.thread_time() - cpu


def timed_process(work: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, the process's CPU seconds, all threads) of ``work()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def caller_cost(folder: Path, num_calls: int) -> list[tuple[str, float, float]]:
    rows = []
    for name in ("logging off", "logging on (SQLite)"):
        best = (float("inf"), float("inf"))
        for attempt in range(3):
            log = None
            if name != "logging off":
                log = EventLog.open(
                    f"sqlite:///{folder / f'cost{attempt}.db'}", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE
                )
            pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, event_log=log)
            wall, cpu = timed(lambda: drive(pool, num_calls))
            if log is not None:
                log.close()
            best = min(best, (wall, cpu), key=lambda pair: pair[1])
        rows.append((name, best[0] / num_calls * 1e6, best[1] / num_calls * 1e6))
    return rows


def writer_rate(url: str, num_calls: int) -> tuple[float, int]:
    """Events per second from the first submit until every event is durable."""
    log = EventLog.open(url, pool_id=f"bench-{os.getpid()}-{time.time_ns()}", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, event_log=log)
    first_seq = log.last_seq
    start = time.perf_counter()
    drive(pool, num_calls)
    log.flush()
    elapsed = time.perf_counter() - start
    num_events = log.last_seq - first_seq
    log.close()
    return num_events / elapsed, num_events


def replay_audit(url: str) -> list[tuple[str, float, float, str]]:
    rows = []
    wall, cpu = timed_process(lambda: replay(url, from_snapshot=False))
    rows.append(("replay, full", wall, cpu, ""))
    wall, cpu = timed_process(lambda: replay(url))
    rows.append(("replay, from newest snapshot", wall, cpu, ""))
    reports = []
    wall, cpu = timed_process(lambda: reports.append(audit(url)))
    report = reports[0]
    rows.append(("audit (full replay + checks)", wall, cpu, f"{report.num_events} events, clean={report.clean}"))
    return rows


def pg_reachable(url: str) -> bool:
    import sqlalchemy as sa

    try:
        engine = sa.create_engine(url)
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
        engine.dispose()
        return True
    except Exception:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-events", type=int, default=1_000_000, help="size of the replayed log")
    parser.add_argument("--num-calls", type=int, default=200_000, help="allocator calls for cost and throughput")
    parser.add_argument("--pg-url", default=os.environ.get("NANOSERVE_TEST_PG_URL", DEFAULT_PG_URL))
    parser.add_argument("--skip-pg", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="nanoserve-bench-"))
    try:
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; python {sys.version.split()[0]}\n")

        cost = caller_cost(folder, args.num_calls)
        off_cpu = cost[0][2]
        print(f"1. per allocator call, {args.num_calls} calls (best of 3 by thread CPU)")
        print(f"{'mode':<24}{'wall us/call':>14}{'caller CPU us/call':>20}{'added CPU us':>14}")
        for name, wall_us, cpu_us in cost:
            print(f"{name:<24}{wall_us:>14.2f}{cpu_us:>20.2f}{cpu_us - off_cpu:>14.2f}")
        print(f"ratio on/off (caller CPU): {cost[1][2] / off_cpu:.2f}x\n")

        print(f"2. writer throughput, {args.num_calls} allocator calls")
        targets = [("SQLite (WAL, synchronous=FULL)", f"sqlite:///{folder / 'rate.db'}")]
        if not args.skip_pg and pg_reachable(args.pg_url):
            targets.append(("PostgreSQL (psycopg 3)", args.pg_url))
        rates = []
        print(f"{'database':<32}{'events':>10}{'events/s':>12}")
        for name, url in targets:
            rate, num_events = writer_rate(url, args.num_calls)
            rates.append(rate)
            print(f"{name:<32}{num_events:>10}{rate:>12.0f}")
        if len(rates) == 2:
            print(f"ratio SQLite/PostgreSQL: {rates[0] / rates[1]:.2f}x")
        print()

        url = f"sqlite:///{folder / 'big.db'}"
        log = EventLog.open(url, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, event_log=log)
        write_s, _ = timed(lambda: drive(pool, args.num_events))
        log.close()
        print(f"3. replay + audit of a {log.last_seq}-event SQLite log (written in {write_s:.1f} s)")
        print(f"{'operation':<32}{'wall s':>8}{'CPU s':>8}{'wall us/event':>15}  note")
        for name, wall_s, cpu_s, note in replay_audit(url):
            print(f"{name:<32}{wall_s:>8.2f}{cpu_s:>8.2f}{wall_s / log.last_seq * 1e6:>15.2f}  {note}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
