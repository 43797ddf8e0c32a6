"""``nanoserve gateway --log-dir``: what a failure quotes of a log file appended to across runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nanoserve.service.gateway.replicas import Topology, TopologyConfig


def test_a_process_that_exits_while_starting_is_quoted_from_this_runs_lines_only(tmp_path: Path) -> None:
    # the file keeps earlier runs' output (appended, as an operator's history); a new user's failure
    # quoted an older run's last lines as if they were this one's
    (tmp_path / "replica-0.log").write_text("old run: listening on 127.0.0.1:50051\nold run: done\n")
    topology = Topology(TopologyConfig(num_replicas=1, log_dir=tmp_path))
    process = topology._spawn(
        [sys.executable, "-c", "import sys; print('new run: port 50051 taken', file=sys.stderr); sys.exit(3)"],
        "replica-0.log",
        "replica-0",
    )
    process.wait(timeout=30)
    with pytest.raises(RuntimeError) as raised:
        topology._check_alive(process, "replica-0", "replica-0.log")
    topology.stop()  # closes the log files
    message = str(raised.value)
    assert message.startswith("replica replica-0 exited with status 3 while starting; its last lines:")
    assert "replica-0 | new run: port 50051 taken" in message
    assert "old run" not in message
    # the history is kept
    assert (tmp_path / "replica-0.log").read_text().startswith("old run: listening on 127.0.0.1:50051\n")


def test_a_process_that_wrote_nothing_this_run_says_so_whatever_the_file_held(tmp_path: Path) -> None:
    (tmp_path / "smg.log").write_text("old run: smg started\n")
    topology = Topology(TopologyConfig(num_replicas=1, log_dir=tmp_path))
    process = topology._spawn([sys.executable, "-c", "raise SystemExit(2)"], "smg.log", "smg")
    process.wait(timeout=30)
    expected = r"^smg exited with status 2 while starting; its last lines: \(it wrote nothing\)"
    with pytest.raises(RuntimeError, match=expected):
        topology._check_alive(process, "smg", "smg.log")
    topology.stop()
