"""Thread count from affinity and cgroup quota; the per-step-size thread tuner."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nanoserve.engine.model.threads import SPIN_ENV, ThreadTuner, available_cpus, cgroup_cpu_limit, prefer_bounded_spin


def test_cgroup_v2_quota_caps_the_thread_count(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    assert available_cpus(tmp_path) == min(len(os.sched_getaffinity(0)), 2)


def test_cgroup_v2_without_quota_leaves_the_affinity(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    assert available_cpus(tmp_path) == len(os.sched_getaffinity(0))


def test_cgroup_v1_quota_is_read(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 0.5
    assert available_cpus(tmp_path) == 1


def test_the_pool_spins_briefly_unless_the_user_chose():
    environ: dict[str, str] = {"PATH": "/bin"}
    assert prefer_bounded_spin(environ) == "GOMP_SPINCOUNT=10000 KMP_BLOCKTIME=1"
    assert environ == {"PATH": "/bin", "GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}


@pytest.mark.parametrize("chosen", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}, {"KMP_BLOCKTIME": "200"}])
def test_a_wait_policy_set_by_the_user_is_kept(chosen):
    environ = dict(chosen)
    prefer_bounded_spin(environ)
    assert environ == chosen


def test_the_command_line_sets_the_spin_before_torch_loads():
    """The entry point sets the wait policy (importing nanoserve sets none: tests/test_import_environment.py)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", *SPIN_ENV)}
    code = (
        "import sys, os, contextlib\n"
        "from nanoserve.service.cli.main import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(None):\n"
        "    main(['db', '--help'])\n"
        "print('torch' in sys.modules, os.environ['GOMP_SPINCOUNT'])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "10000"]


@pytest.mark.parametrize(("num_tokens", "bucket"), [(1, 1), (2, 2), (3, 4), (64, 64), (65, 128)])
def test_steps_fall_into_power_of_two_buckets(num_tokens, bucket):
    assert ThreadTuner.bucket(num_tokens) == bucket


def test_tuner_tries_every_count_then_keeps_the_fastest_and_explores_again():
    tuner = ThreadTuner(4, explore_every=8)
    assert tuner.candidates == [1, 2, 4]
    seconds = {1: 0.010, 2: 0.030, 4: 0.050}  # a busy neighbour: fewer threads win
    chosen = []
    for _ in range(16):
        n = tuner.choose(1)
        chosen.append(n)
        tuner.record(1, n, seconds[n])
    assert chosen == [1, 2, 4, 1, 1, 1, 1, 1, 1, 2, 4, 1, 1, 1, 1, 1]
    assert tuner.choose(200) == 1  # a new bucket starts its own trials


def test_tuner_follows_a_change_of_load():
    tuner = ThreadTuner(2, explore_every=4, smoothing=1.0)
    for n, s in ((1, 0.01), (2, 0.02)):
        tuner.record(1, n, s)
    tuner.record(1, 1, 0.01)
    tuner.record(1, 1, 0.01)
    assert tuner.choose(1) == 1
    tuner.record(1, 1, 0.05)  # the neighbour left: now two threads are faster
    tuner.record(1, 2, 0.005)
    assert tuner.choose(1) == 2


def test_tuner_takes_a_trial_as_it_comes_not_averaged_with_a_cold_first_step():
    # the first 2-thread step ran on cold caches (30 ms); 1 thread ran at 9 ms since. On the next
    # round of trials 2 threads take 6 ms: that count runs from then on, not hundreds of steps later
    tuner = ThreadTuner(2, explore_every=64)
    seconds = {1: 0.009, 2: 0.030}
    chosen = []
    for _ in range(70):
        n = tuner.choose(1)
        chosen.append(n)
        tuner.record(1, n, seconds[n])
        if len(chosen) == 2:
            seconds[2] = 0.006  # warm now
    assert chosen[:66] == [1, 2] + [1] * 62 + [1, 2]
    assert chosen[66:] == [2, 2, 2, 2]


def test_tuner_goes_back_when_a_trial_was_luckier_than_the_count_runs():
    tuner = ThreadTuner(2, explore_every=64)
    tuner.record(1, 1, 0.009)
    tuner.record(1, 2, 0.008)  # one lucky step
    assert tuner.choose(1) == 2
    tuner.record(1, 2, 0.012)  # its real speed: the average, 9.2 ms, passes 1 thread's 9 ms
    assert tuner.choose(1) == 1
