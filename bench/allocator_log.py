"""Benchmark the allocator's event log: caller cost, writer throughput, replay + audit.

    .venv/bin/python bench/allocator_log.py [--num-events 1000000] [--pg-url URL] [--skip-pg]
        [--repeats 5] [--only-replay] [--replay-log sqlite:///PATH]

1. Added cost per allocator call on the caller's thread, logging off vs on
   (SQLite, background writer): thread CPU time and wall time per call.
2. Events per second sustained by the writer, SQLite vs PostgreSQL: events
   from a producer running as fast as it can, until all are durable.
3. Replay + audit of a log of ``--num-events`` events on SQLite: full replay,
   replay from the newest snapshot, the audit (replay and every check in one
   pass) by the Python replay in one process and with the hash chain verified
   in a second process (the peers), by the C fold of an intact epoch
   (``intact_fold``, what ``audit`` runs), and ``nanoserve log audit`` as the user runs it (a fresh
   process). Wall and CPU seconds (every process: the chain verifier and the
   CLI count), best and median of ``--repeats`` interleaved runs.

The workload is the same everywhere: scheduler steps of 1..8 calls mixing
allocate_for (1..64 tokens) and free_all of a whole request, on a 1024-block pool.
Targets: < 5 us added per call on the caller's thread; replay + audit of 1M < 3 s.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog, audit, replay
from nanoserve.migrations import upgrade

replay_module = importlib.import_module("nanoserve.allocator.log.replay")  # the module, not the function

NUM_BLOCKS = 1024
BLOCK_SIZE = 16
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def drive(pool: BlockAllocator, log: EventLog | None, num_calls: int, seed: int = 0) -> None:
    """``num_calls`` allocator calls in scheduler steps of 1..8 calls, each step persisted as the engine does."""
    rng = random.Random(seed)
    held: list[list[int]] = []
    step = calls = 0
    while calls < num_calls:
        for _ in range(rng.randint(1, 8)):
            if held and (rng.random() < 0.45 or not pool.can_allocate(4)):
                pool.free_all(held.pop(rng.randrange(len(held))), FreeReason.FINISHED)
            else:
                held.append(pool.allocate_for(rng.randint(1, 64), f"req-{calls}"))
            calls += 1
        persist(pool, log, step)
        step += 1
    for block_ids in held:
        pool.free_all(block_ids, FreeReason.FINISHED)
    persist(pool, log, step)


def persist(pool: BlockAllocator, log: EventLog | None, step: int) -> None:
    """The engine's end of a step: take the pool's events, append them as one batch (dropped without a log)."""
    events = pool.take_events()
    if log is not None:
        log.append_batch(step, events, pool.snapshot)


def open_log(url: str, **kwargs: object) -> EventLog:
    upgrade(url)
    return EventLog.open(url, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, **kwargs)  # type: ignore[arg-type]


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
                log = open_log(f"sqlite:///{folder / f'cost{attempt}.db'}")
            pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
            wall, cpu = timed(functools.partial(drive, pool, log, num_calls))
            if log is not None:
                log.close(final_state=pool.snapshot())
            best = min(best, (wall, cpu), key=lambda pair: pair[1])
        rows.append((name, best[0] / num_calls * 1e6, best[1] / num_calls * 1e6))
    return rows


def writer_rate(url: str, num_calls: int) -> tuple[float, int]:
    """Events per second from the first submit until every event is durable."""
    log = open_log(url, pool_id=f"bench-{os.getpid()}-{time.time_ns()}")
    pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    first_seq = log.last_seq
    start = time.perf_counter()
    drive(pool, log, num_calls)
    log.flush()
    elapsed = time.perf_counter() - start
    num_events = log.last_seq - first_seq
    log.close(final_state=pool.snapshot())
    return num_events / elapsed, num_events


def cpu_all_s() -> float:
    """CPU seconds of this process and of its waited-for children (the chain verifier, the CLI)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed_all(work: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every process involved) of ``work()``."""
    wall, cpu = time.perf_counter(), cpu_all_s()
    work()
    return time.perf_counter() - wall, cpu_all_s() - cpu


def audit_with(url: str, *, verifier: bool) -> object:
    """Audit by the Python replay with the hash chain verified in a second process (``verifier``) or in this
    one (an intact epoch is otherwise folded in C: "audit, C fold")."""
    saved = replay_module.NUM_EVENTS_FOR_VERIFIER, replay_module._has_idle_core
    replay_module.NUM_EVENTS_FOR_VERIFIER = 1 if verifier else sys.maxsize
    replay_module._has_idle_core = lambda: True
    try:
        return audit(url, fold=False)
    finally:
        replay_module.NUM_EVENTS_FOR_VERIFIER, replay_module._has_idle_core = saved


def cli_audit(url: str) -> None:
    """The user's path: ``nanoserve log audit --url URL`` in a fresh process (start-up and imports included)."""
    done = subprocess.run(
        [sys.executable, "-m", "nanoserve.service.cli.main", "log", "audit", "--url", url],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or "clean" not in done.stdout:
        raise RuntimeError(f"nanoserve log audit failed ({done.returncode}): {done.stdout}{done.stderr}")


def replay_audit(url: str, num_repeats: int) -> list[tuple[str, list[tuple[float, float]]]]:
    """(operation, [(wall s, CPU s of all processes)] per repeat), repeats interleaved so load hits all alike."""
    operations: list[tuple[str, Callable[[], object]]] = [
        ("replay, full (from genesis)", lambda: replay(url, from_snapshot=False)),
        ("replay, from newest snapshot", lambda: replay(url)),
        ("audit, one process", lambda: audit_with(url, verifier=False)),
        ("audit, chain verified in 2nd process", lambda: audit_with(url, verifier=True)),
        ("audit, C fold (intact_fold)", lambda: audit(url)),
        ("replay+audit: nanoserve log audit", lambda: cli_audit(url)),
    ]
    report = audit(url)
    if not report.clean or report.num_events != report.last_seq:
        raise RuntimeError(f"the benchmark log does not audit clean: {report.render()}")
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in operations}
    for _ in range(num_repeats):
        for name, work in operations:
            runs[name].append(timed_all(work))
    return list(runs.items())


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
    parser.add_argument("--repeats", type=int, default=5, help="runs of each replay/audit operation")
    parser.add_argument("--only-replay", action="store_true", help="skip parts 1 and 2 (caller cost, writer rate)")
    parser.add_argument(
        "--replay-log", default=None, help="URL of an existing single-pool log for part 3 (default: write one)"
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="nanoserve-bench-"))
    try:
        print(
            f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; python {sys.version.split()[0]}\n"
        )

        if args.only_replay:
            replay_part(folder, args)
            return 0
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
        replay_part(folder, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def replay_part(folder: Path, args: argparse.Namespace) -> None:
    if args.replay_log:
        url, written = args.replay_log, "given"
    else:
        url = f"sqlite:///{folder / 'big.db'}"
        log = open_log(url)
        pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        write_s, _ = timed(lambda: drive(pool, log, args.num_events))
        log.close(final_state=pool.snapshot())
        written = f"written in {write_s:.1f} s"
    num_events = audit(url).num_events
    print(f"3. replay + audit of a {num_events}-event SQLite log ({written}), {args.repeats} runs each")
    print("   CPU s counts every process (the chain verifier, the CLI); load average now", f"{os.getloadavg()[0]:.1f}")
    print(f"{'operation':<36}{'wall best':>10}{'wall median':>12}{'CPU best':>10}{'CPU median':>12}")
    medians = {}
    for name, runs in replay_audit(url, args.repeats):
        walls, cpus = [run[0] for run in runs], [run[1] for run in runs]
        medians[name] = statistics.median(walls)
        print(f"{name:<36}{min(walls):>10.2f}{medians[name]:>12.2f}{min(cpus):>10.2f}{statistics.median(cpus):>12.2f}")
    ratio = medians["audit, one process"] / medians["audit, chain verified in 2nd process"]
    print(f"ratio one process / 2nd process (median wall): {ratio:.2f}x")
    print("nanoserve log audit uses the 2nd process only when a core is idle (load average <= CPUs - 1.5);")
    print("target: replay + audit of 1M events < 3 s")


if __name__ == "__main__":
    sys.exit(main())
