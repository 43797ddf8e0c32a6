"""Benchmark the full offline audit of a prefix-cache epoch: the C fold against the Python replay.

    .venv/bin/python -m bench.full_audit [--num-events 200000 1000000] [--repeats 3] [--url-dir DIR]

For each ``--num-events`` N, writes a crashed epoch of N events of
bench/recovery.py's live prefix-cache workload (requests sharing a few prompts:
ALLOCATE_FOR, SHARE, REGISTER, FREE_ALL, RELEASE, EVICT; a SNAPSHOT every
10,000 events; its request journal) as the writer stores it (packed rows, keys
named by id), then times the full audit from genesis (``audit()``, what
``nanoserve log audit`` runs per epoch) in this process, the Python replay
(``fold=False``), the C fold of an intact epoch (``intact_fold``, with its
helper threads: one per further CPU, three at most) and the fold on the caller's
thread alone, alternately, best of ``--repeats``; and ``nanoserve log audit`` once each way
in a fresh process (start-up, imports and the journal's chain included;
``NANOSERVE_AUDIT_FOLD=python`` for the Python replay). Both reports must be
equal and clean. Prints events/s and the ratio. Target: >= 1,000,000 events/s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import recovery
from nanoserve.allocator.log import AuditReport, audit, intact_fold, intact_fold_build
from nanoserve.migrations import upgrade


def cli_audit_s(url: str, fold: bool) -> float:
    """Wall seconds of ``nanoserve log audit --url URL`` in a fresh process."""
    env = dict(os.environ)
    if not fold:
        env["NANOSERVE_AUDIT_FOLD"] = "python"
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "nanoserve.service.cli.main", "log", "audit", "--url", url],
        capture_output=True,
        text=True,
        env=env,
    )
    elapsed = time.perf_counter() - began
    if done.returncode != 0 or "clean" not in done.stdout:
        raise RuntimeError(f"nanoserve log audit failed ({done.returncode}): {done.stdout}{done.stderr}")
    return elapsed


def audit_s(url: str, way: str) -> tuple[float, AuditReport]:
    """Wall seconds and report of ``audit()`` the given way: ``python``, ``fold`` (with its helper threads)
    or ``fold 1 thread`` (the caller's thread alone)."""
    helpers = intact_fold._num_helpers
    if way == "fold 1 thread":
        intact_fold._num_helpers = lambda: 0
    try:
        began = time.perf_counter()
        report = audit(url, recovery.POOL_ID, 1, fold=way != "python")
        return time.perf_counter() - began, report
    finally:
        intact_fold._num_helpers = helpers


def measure(url: str, repeats: int) -> dict[str, float]:
    """Best seconds of each way, the runs interleaved so the machine's load hits all alike."""
    best = {"python": float("inf"), "fold": float("inf"), "fold 1 thread": float("inf")}
    reports: dict[str, AuditReport] = {}
    for _ in range(repeats):
        for way in best:
            seconds, reports[way] = audit_s(url, way)
            best[way] = min(best[way], seconds)
    if reports["python"] != reports["fold"] or reports["fold"] != reports["fold 1 thread"]:
        raise RuntimeError("the reports differ")
    if not reports["fold"].clean or not reports["fold"].folded:
        raise RuntimeError(f"the epoch was not folded clean: {reports['fold'].render()}")
    best["events"] = reports["fold"].num_events
    best["cli python"], best["cli fold"] = cli_audit_s(url, False), cli_audit_s(url, True)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-events", type=int, nargs="+", default=[200_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--url-dir", type=Path, default=None, help="where the SQLite logs go (default: a temp dir)")
    args = parser.parse_args()
    if intact_fold_build.load() is None:
        print(f"intact_fold not built: {intact_fold_build.unavailable_reason()}")
        return 1
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; best of {args.repeats}")
    print(f"helper threads of the fold: {intact_fold._num_helpers()}")
    print(
        f"{'events':>10} {'Python replay':>14} {'C fold':>8} {'1 thread':>9} {'Python events/s':>16} "
        f"{'fold events/s':>14} {'1 thread':>10} {'ratio':>6} {'log audit: Python':>18} {'fold':>7}"
    )
    with tempfile.TemporaryDirectory(dir=args.url_dir) as tmp:
        for num_events in args.num_events:
            url = f"sqlite:///{Path(tmp) / f'audit-{num_events}.db'}"
            upgrade(url)
            written = argparse.Namespace(real_events=num_events, events_per_snapshot=10_000, seed=0)
            recovery.write_crashed_epoch(url, num_events, written)
            best = measure(url, args.repeats)
            events = best["events"]
            print(
                f"{events:>10,.0f} {best['python']:>12.2f} s {best['fold']:>6.3f} s {best['fold 1 thread']:>7.3f} s "
                f"{events / best['python']:>16,.0f} {events / best['fold']:>14,.0f} "
                f"{events / best['fold 1 thread']:>10,.0f} {best['python'] / best['fold']:>5.1f}x "
                f"{best['cli python']:>16.2f} s {best['cli fold']:>5.2f} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
