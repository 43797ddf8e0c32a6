"""Benchmark ``nanoserve log plot`` on a million-event epoch: what each part costs, against two peers.

    .venv/bin/python -m bench.log_plot [--num-events 1000000] [--repeats 3] [--log sqlite:///PATH] [--keep PNG]

The log: a pool of 1,456 blocks of 16 tokens (the issue's size) driven in
scheduler steps of 1..8 calls mixing allocate_for (1..64 tokens) and free_all of
a whole request (finished, 15 % preempted, 5 % aborted), until ``--num-events``;
then the requests still running finish, as at a clean shutdown, so the epoch
ends clean: no block held at POOL_CLOSE (the run checks it with the audit, and
the picture says "no block held then").

Timed, interleaved ``--repeats`` times (wall and CPU seconds of every process):
the parts of the plot (audit, reading the timeline, drawing, writing the PNG),
the whole command as the user runs it (``nanoserve log plot -o FILE.png`` in a
fresh process), and two peers in the same run:
- ``nanoserve log audit`` of the same log (replay + every check: the floor of
  anything that reads the whole epoch in Python);
- the naive picture: every held interval one bar (matplotlib's ``broken_barh``,
  one PolyCollection per block, the cheapest way to draw a shape per interval),
  from the same timeline, written as PNG.
Prints a table and the ratios plot / audit and naive / aggregated drawing.
"""

from __future__ import annotations

import argparse
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
from nanoserve.allocator.log import EventLog, audit
from nanoserve.migrations import upgrade
from nanoserve.service.pictures.pool_timeline import OPEN, PoolTimeline, read_timeline

NUM_BLOCKS = 1456
BLOCK_SIZE = 16


def write_log(url: str, num_events: int, seed: int = 0) -> None:
    """An epoch of about ``num_events`` events (see the module docstring)."""
    rng = random.Random(seed)
    upgrade(url)
    with EventLog.open(url, pool_id="bench", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as log:
        pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        held: list[list[int]] = []
        step = calls = 0
        while log.last_seq < num_events - len(held) - 2:
            for _ in range(rng.randint(1, 8)):
                if held and (rng.random() < 0.45 or not pool.can_allocate(4)):
                    draw = rng.random()
                    reason = FreeReason.PREEMPTED if draw < 0.15 else FreeReason.ABORTED if draw < 0.2 else None
                    pool.free_all(held.pop(rng.randrange(len(held))), reason or FreeReason.FINISHED)
                else:
                    held.append(pool.allocate_for(rng.randint(1, 64), f"req-{calls}"))
                calls += 1
            log.append_batch(step, pool.take_events(), pool.snapshot)
            step += 1
        for block_ids in held:
            pool.free_all(block_ids, FreeReason.FINISHED)
        log.append_batch(step, pool.take_events(), pool.snapshot)


def cpu_all_s() -> float:
    """CPU seconds of this process and of its waited-for children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(work: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), cpu_all_s()
    work()
    return time.perf_counter() - wall, cpu_all_s() - cpu


def cli(args: list[str], expect_rc: int = 0) -> None:
    done = subprocess.run([sys.executable, "-m", "nanoserve.service.cli.main", *args], capture_output=True, text=True)
    if done.returncode != expect_rc:
        raise RuntimeError(f"nanoserve {' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}")


def naive_png(timeline: PoolTimeline, path: Path) -> None:
    """Every held interval one bar: broken_barh per block (one PolyCollection each), written as PNG."""
    from matplotlib.figure import Figure

    spans: list[list[tuple[int, int]]] = [[] for _ in range(timeline.num_blocks)]
    last = timeline.num_events - 1
    for block, start, end in zip(
        timeline.interval_block_ids, timeline.interval_starts, timeline.interval_ends, strict=True
    ):
        stop = last if end == OPEN else end
        spans[block].append((timeline.seqs[start], timeline.seqs[stop] - timeline.seqs[start]))
    figure = Figure(figsize=(14, 8.5))
    ax = figure.subplots()
    for block, bars in enumerate(spans):
        ax.broken_barh(bars, (block - 0.42, 0.84), linewidth=0)
    ax.set_xlim(timeline.seqs[0], timeline.seqs[-1])
    ax.set_ylim(-0.5, timeline.num_blocks - 0.5)
    figure.savefig(path, format="png", dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-events", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log", default=None, help="URL of an existing log to plot (default: write one)")
    parser.add_argument("--keep", default=None, metavar="PNG", help="copy the plot there, to look at")
    args = parser.parse_args()
    from nanoserve.service.pictures import pool_plot
    from nanoserve.service.pictures.figure_file import Picture

    folder = Path(tempfile.mkdtemp(prefix="nanoserve-bench-plot-"))
    try:
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; python {sys.version.split()[0]}")
        url = args.log
        if url is None:
            url = f"sqlite:///{folder / 'log.db'}"
            wall, _ = timed(lambda: write_log(url, args.num_events))
            print(f"wrote a log of {args.num_events:,} events in {wall:.1f} s")
        timeline = read_timeline(url)
        report = audit(url)
        held = timeline.owners_now()
        print(
            f"epoch: {timeline.num_events:,} events, {timeline.num_intervals:,} held intervals, "
            f"{len(timeline.owners):,} requests, {timeline.num_blocks:,} blocks; audit: "
            f"{'clean' if report.clean else f'{len(report.violations):,} violations'}, "
            f"{len(held):,} blocks held at the end\n"
        )
        if args.log is None and (not report.clean or held):
            raise RuntimeError("the generated workload must end clean: every block freed before POOL_CLOSE")
        png = folder / "plot.png"
        pictures: dict[str, Picture] = {}

        def draw() -> None:
            pictures["last"] = pool_plot.plot_timeline(timeline)

        operations: list[tuple[str, Callable[[], object]]] = [
            ("audit (plot's first step)", lambda: audit(url)),
            ("read_timeline", lambda: read_timeline(url)),
            ("draw (aggregated)", draw),
            ("write PNG", lambda: pictures["last"].save(png)),
            ("write SVG", lambda: pictures["last"].save(folder / "plot.svg")),
            ("nanoserve log plot -o PNG (fresh process)", lambda: cli(["log", "plot", "--url", url, "-o", str(png)])),
            ("peer: nanoserve log audit (fresh process)", lambda: cli(["log", "audit", "--url", url])),
            ("peer: one bar per interval, PNG", lambda: naive_png(timeline, folder / "naive.png")),
        ]
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in operations}
        for _ in range(args.repeats):
            for name, work in operations:
                runs[name].append(timed(work))
        print(f"{'operation':<44} {'wall best':>10} {'wall median':>12} {'CPU best':>9}")
        for name, samples in runs.items():
            walls, cpus = [w for w, _ in samples], [c for _, c in samples]
            print(f"{name:<44} {min(walls):>9.2f}s {statistics.median(walls):>11.2f}s {min(cpus):>8.2f}s")

        def best(name: str) -> float:
            return min(w for w, _ in runs[name])

        plot_s = best("nanoserve log plot -o PNG (fresh process)")
        print(f"\nsummary: {pictures['last'].summary}")
        print(f"plot / audit (whole command, wall): {plot_s / best('peer: nanoserve log audit (fresh process)'):.2f}")
        naive_ratio = best("peer: one bar per interval, PNG") / (best("draw (aggregated)") + best("write PNG"))
        print(f"one bar per interval / aggregated (draw + PNG, wall): {naive_ratio:.1f}")
        if args.keep:
            shutil.copy(png, args.keep)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
