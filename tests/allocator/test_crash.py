"""Crash: a process logging at full speed is SIGKILLed; the log keeps a consistent prefix."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from nanoserve.allocator.log import audit, read_events
from nanoserve.migrations import upgrade

# Drives a 64-block pool in scheduler steps as fast as it can and prints
# durable_seq now and then, until it is killed.
DRIVER = """
import random, sys
from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.allocator.log import EventLog
log = EventLog.open(sys.argv[1], pool_id="crash", num_blocks=64, block_size=16, num_events_per_snapshot=500)
print("epoch", log.epoch, flush=True)
pool = BlockAllocator(64, 16)
rng = random.Random(int(sys.argv[2]))
held = []
step = 0
while True:
    for _ in range(rng.randint(1, 8)):
        if held and (rng.random() < 0.45 or not pool.can_allocate(4)):
            pool.free_all(held.pop(rng.randrange(len(held))), FreeReason.FINISHED)
        else:
            held.append(pool.allocate_for(rng.randint(1, 64), f"req-{step}"))
    log.append_batch(step, pool.take_events(), pool.snapshot)
    step += 1
    if step % 200 == 0:
        print("durable", log.durable_seq, flush=True)
"""


def run_and_kill(url: str, seed: int) -> tuple[int, int]:
    """Start the driver, SIGKILL it at a random moment; returns (epoch, last durable_seq it reported)."""
    child = subprocess.Popen([sys.executable, "-c", DRIVER, url, str(seed)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    epoch = int(child.stdout.readline().split()[1])
    durable_seq = 1
    while durable_seq == 1:  # wait for the first group commit: it is running at full speed
        durable_seq = int(child.stdout.readline().split()[1])
    time.sleep(random.Random(seed).uniform(0.05, 0.3))
    child.send_signal(signal.SIGKILL)
    for line in child.stdout:
        fields = line.split()
        if line.endswith("\n") and len(fields) == 2:  # the kill may cut the last line short
            durable_seq = int(fields[1])
    child.wait()
    assert child.returncode == -signal.SIGKILL
    return epoch, durable_seq


def test_sigkilled_writer_leaves_a_consistent_prefix(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    upgrade(url)
    for round_index in range(3):
        epoch, reported_durable_seq = run_and_kill(url, seed=round_index)
        assert epoch == round_index + 1  # each start opens a new epoch
        report = audit(url, "crash", epoch)
        assert report.crashed
        assert report.violations == []  # no torn batch, no gap, chain intact, state rules hold
        assert report.last_seq >= reported_durable_seq > 1
        last = read_events(url, "crash", epoch, from_seq=report.last_seq)[0]
        assert last.batch_seq == last.seq  # the stored prefix ends on a whole batch
        assert report.state.num_free + report.state.num_allocated == 64
