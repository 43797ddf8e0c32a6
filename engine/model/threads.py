"""How many CPU threads the model's math uses, and how they wait.

A container with a CPU quota or a VM with a neighbour gives a process fewer CPUs
than the host has; an OpenMP pool sized to the host, spinning while it waits for
work, then fights for the CPUs it shares and throughput falls several-fold. So
the thread count comes from what this process may use (its affinity mask and its
cgroup's ``cpu.max`` quota), and the pool spins only briefly before it sleeps:
``GOMP_SPINCOUNT=10000`` (libgomp, torch's OpenMP on Linux) and ``KMP_BLOCKTIME=1``
(ms, Intel's OpenMP), unless the environment already chose (either of those, or
``OMP_WAIT_POLICY``). libgomp's own default spins 300,000 times, milliseconds,
which a neighbour pays for; ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) makes
every parallel op of a decode step wake its workers through the kernel, 70-80 us
per op measured here, which cost a quarter of single-stream speed (30 against 41
tok/s, SmolLM2-135M Q4_1 on 2 AVX2 cores). A bounded spin covers the gaps between
the ops of one step and sleeps between steps. These are read once, when torch
first starts its pool: ``prefer_bounded_spin`` must run before ``import torch``.
The CLI's ``main`` calls it first thing; a script using ``LLM`` calls it itself
before importing torch (``LLM(...)`` would be too late: libgomp reads the
variables when torch loads). Importing nanoserve changes no environment variable.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SPIN_ENV = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}  # libgomp: spins; Intel OpenMP: milliseconds
CGROUP_ROOT = Path("/sys/fs/cgroup")


def prefer_bounded_spin(environ: MutableMapping[str, str] = os.environ) -> str:
    """Sets the bounded spin of ``SPIN_ENV`` unless the environment chose a wait policy; returns the policy in force.

    A user's ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME`` is kept as given.
    """
    if not any(name in environ for name in (WAIT_POLICY_ENV, *SPIN_ENV)):
        environ.update(SPIN_ENV)
    return wait_policy(environ)


def wait_policy(environ: Mapping[str, str] = os.environ) -> str:
    """How the OpenMP pool waits, as the environment says, for the start-up log."""
    chosen = [f"{name}={environ[name]}" for name in (WAIT_POLICY_ENV, *SPIN_ENV) if name in environ]
    return " ".join(chosen) or "libgomp default (spins 300000 times, then sleeps)"


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup quota allows (``cpu.max`` of cgroup v2, or v1's cfs quota/period); None: no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup quota (rounded up), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


@dataclass(frozen=True)
class ThreadSettings:
    """What the model's math runs with: ``num_threads`` OpenMP threads waiting by ``wait_policy``."""

    num_threads: int
    available_cpus: int
    wait_policy: str
    source: str  # "setting" or "affinity/cgroup"


def configure_threads(num_threads: int | None) -> ThreadSettings:
    """Sizes torch's intra-op pool: ``num_threads`` when given, else ``available_cpus()``.

    Call from the thread that will run the model (libgomp keeps one pool per calling thread).
    """
    import torch

    cpus = available_cpus()
    chosen = num_threads if num_threads is not None else cpus
    torch.set_num_threads(chosen)
    return ThreadSettings(
        num_threads=chosen,
        available_cpus=cpus,
        wait_policy=wait_policy(),
        source="setting" if num_threads is not None else "affinity/cgroup",
    )


class ThreadTuner:
    """Picks, per step size, the thread count that has been fastest lately.

    On a quiet machine more threads finish a big step sooner; on a shared one a
    step split over N threads waits for the slowest, and a thread whose CPU a
    neighbour holds stalls the whole step (measured here: batch-1 decode at 13-19
    tok/s on 2 threads against 76-102 on 1 while other processes kept the CPUs
    busy). So each step-size bucket (tokens in the step, powers of two) keeps a
    moving average of seconds per step for each candidate count (1, half, all),
    runs the fastest, and every ``explore_every`` steps of the bucket tries the
    others once, so a change in the neighbours' load is noticed. The count that
    runs is averaged step by step (``smoothing``); a trial of another count
    replaces that count's figure, which is ``explore_every`` steps old: averaged
    in, a first trial slowed by a cold cache kept 2 threads out for hundreds of
    steps (quiet, single-stream decode runs at 87-101 tok/s on 1 thread, 134-151 on 2).
    Invariant: ``choose`` returns a member of ``candidates``.
    """

    def __init__(self, max_threads: int, explore_every: int = 64, smoothing: float = 0.3) -> None:
        self.candidates = sorted({1, max(1, max_threads // 2), max_threads})
        self.explore_every = explore_every
        self.smoothing = smoothing
        self._seconds: dict[tuple[int, int], float] = {}  # (bucket, num_threads) -> moving average s/step
        self._steps: dict[int, int] = {}  # bucket -> steps run

    @staticmethod
    def bucket(num_tokens: int) -> int:
        """The step-size bucket of a step: the power of two at or above ``num_tokens``."""
        return 1 << max(0, num_tokens - 1).bit_length()

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of ``num_tokens`` tokens."""
        bucket = self.bucket(num_tokens)
        step = self._steps.get(bucket, 0)
        untried = [n for n in self.candidates if (bucket, n) not in self._seconds]
        if untried:
            return untried[0]
        if step % self.explore_every < len(self.candidates):  # a round of exploration
            return self.candidates[step % self.explore_every]
        fastest = self._fastest(bucket)
        assert fastest is not None  # every count has been timed
        return fastest

    def record(self, num_tokens: int, num_threads: int, seconds: float) -> None:
        """Takes the wall time of a step run with ``num_threads``."""
        bucket = self.bucket(num_tokens)
        self._steps[bucket] = self._steps.get(bucket, 0) + 1
        key = (bucket, num_threads)
        old = self._seconds.get(key)
        if old is not None and num_threads == self._fastest(bucket):  # the count that runs: averaged
            seconds = old + self.smoothing * (seconds - old)
        self._seconds[key] = seconds

    def _fastest(self, bucket: int) -> int | None:
        """The count with the least average seconds in ``bucket`` (None before any is timed)."""
        timed = [n for n in self.candidates if (bucket, n) in self._seconds]
        return min(timed, key=lambda n: self._seconds[(bucket, n)]) if timed else None
