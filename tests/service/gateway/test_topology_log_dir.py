"""``nanoserve gateway``'s processes: where their output goes (``--log-dir``, or our stderr), what a failure quotes."""

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


def test_without_a_log_dir_the_processes_output_goes_to_stderr_and_stdout_keeps_the_ready_line_alone(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """smg logs to stdout: a new user's script reading `gateway_ready` from the gateway's stdout got smg's
    JSON log lines mixed in."""
    topology = Topology(TopologyConfig(num_replicas=1))
    process = topology._spawn(
        [sys.executable, "-c", "import sys; print('smg: to stdout'); print('smg: to stderr', file=sys.stderr)"],
        "smg.log",
        "smg",
    )
    process.wait(timeout=30)
    topology._tails["smg"][0].join(timeout=30)
    out, err = capfd.readouterr()
    assert out == ""
    assert sorted(err.splitlines()) == ["smg: to stderr", "smg: to stdout"]


def test_the_gateways_metrics_listen_on_loopback_unless_asked() -> None:
    """smg's /metrics answers without a key; it listened on every interface (smg's default)."""
    command = Topology(TopologyConfig(num_replicas=1)).smg_command()
    assert command[command.index("--prometheus-host") + 1] == "127.0.0.1"
    command = Topology(TopologyConfig(num_replicas=1, prometheus_host="0.0.0.0")).smg_command()
    assert command[command.index("--prometheus-host") + 1] == "0.0.0.0"
