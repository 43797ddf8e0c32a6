"""smg's KV-event index of a replica that crashed and came back (issue 30, KV events across restarts).

A replica (``nanoserve serve``, the tiny random model, an SQLite log) behind ``smg launch``: smg
subscribes to its KV events and indexes its cached blocks. The replica is SIGKILLed and started
again on the same port and log (a new epoch; its cache is empty). smg reconnects (on its own
back-off: 0.4, 0.8, 1.6, 3.2 s) and resubscribes with its cursor of the old epoch; the batch
numbers carry the epoch (``epoch << 32 | n``), so the first batch it gets is the new epoch's
``cleared``, numbered past its cursor. smg (1.13) takes that as a gap, asks once for a replay from
its cursor, gets the ``cleared`` again, and continues from the live stream with its index of the
worker cleared: one resync (``smg_kv_event_resyncs_total``), no stale batch skipped, within a
second of its reconnect.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanoserve.service.gateway.replicas import free_port, smg_executable

from ..cli.test_serve_log_faults import clean_env, serve_command

CONNECTED = "KV event stream connected"
RESYNCED = "KV event gap could not be replayed; continuing from the live stream"
RESYNC_WITHIN_S = 1.0
STARTUP_TIMEOUT_S = 120.0

try:
    smg_executable()
except FileNotFoundError:  # pragma: no cover - the gateway extra is part of the dev install
    pytest.skip("smg is not installed (nanoserve[gateway])", allow_module_level=True)


def _replica(port: int, log_url: str, model: Path, output: Path) -> subprocess.Popen[bytes]:
    command = serve_command(log_url, model, "--max-model-len", "1024")
    command[command.index("--port") + 1] = str(port)
    command[command.index("--num-kv-blocks") + 1] = "256"
    with output.open("ab") as sink:
        return subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env={**clean_env(), "OMP_NUM_THREADS": "1"}
        )


def _wait_serving(port: int, process: subprocess.Popen[bytes], output: Path) -> float:
    """Polls health until SERVING; returns the monotonic time it answered so."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            assert process.poll() is None, output.read_text()[-3000:]
            assert time.monotonic() < deadline, output.read_text()[-3000:]
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:
                status = None
            if status == health_pb2.HealthCheckResponse.SERVING:
                return time.monotonic()
            time.sleep(0.05)


def _get_json(url: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except OSError:
        return None


def _resyncs(prometheus_port: int) -> float:
    """smg's ``smg_kv_event_resyncs_total``, summed over its labels (0 before the first)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("smg_kv_event_resyncs_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


class SmgLog:
    """smg's JSON log lines, each with the monotonic time this test first read it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self._seen = 0

    def poll(self) -> list[tuple[float, dict[str, Any]]]:
        now = time.monotonic()
        text = self.path.read_text(errors="replace")
        complete = text[: text.rfind("\n") + 1]
        for raw in complete.splitlines()[self._seen :]:
            self._seen += 1
            try:
                entry = json.loads(raw) if raw.startswith("{") else None
            except ValueError:
                continue
            if isinstance(entry, dict):
                self.lines.append((now, entry))
        return self.lines

    def messages(self, message: str) -> list[float]:
        return [seen for seen, entry in self.poll() if entry.get("message") == message]

    def wait(self, message: str, count: int, timeout_s: float) -> list[float]:
        deadline = time.monotonic() + timeout_s
        while len(found := self.messages(message)) < count:
            assert time.monotonic() < deadline, (
                f"smg did not log {message!r} {count}x:\n{self.path.read_text()[-4000:]}"
            )
            time.sleep(0.02)
        return found


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    running: list[subprocess.Popen[bytes]] = []
    yield running
    for process in running:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in running:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def test_smg_clears_its_index_of_a_replica_restarted_after_sigkill_within_a_second(
    tmp_path: Path, tiny_model_dir: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    port, gateway_port, prometheus_port = free_port(), free_port(), free_port()
    log_url = f"sqlite:///{tmp_path / 'events.db'}"
    replica_out = tmp_path / "replica.log"
    replica = _replica(port, log_url, tiny_model_dir, replica_out)
    processes.append(replica)
    _wait_serving(port, replica, replica_out)
    smg_out = tmp_path / "smg.log"
    with smg_out.open("wb") as sink:
        gateway = subprocess.Popen(
            [
                smg_executable(),
                "launch",
                "--backend",
                "vllm",
                "--worker-urls",
                f"grpc://127.0.0.1:{port}",
                "--policy",
                "cache_aware",
                "--host",
                "127.0.0.1",
                "--port",
                str(gateway_port),
                "--prometheus-port",
                str(prometheus_port),
                "--log-json",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    processes.insert(0, gateway)  # stopped first
    smg = SmgLog(smg_out)
    base = f"http://127.0.0.1:{gateway_port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ((_get_json(f"{base}/readiness") or {}).get("healthy_workers") == 1 and _get_json(f"{base}/v1/models")):
        assert gateway.poll() is None, smg_out.read_text()[-4000:]
        assert time.monotonic() < deadline, smg_out.read_text()[-4000:]
        time.sleep(0.1)
    smg.wait(CONNECTED, 1, 30)
    chat = {
        "model": (_get_json(f"{base}/v1/models") or {})["data"][0]["id"],
        "messages": [{"role": "user", "content": "Name the blocks of a paged KV cache, one by one. " * 4}],
        "max_tokens": 4,
        "temperature": 0,
    }
    assert _get_json(f"{base}/v1/chat/completions", chat) is not None
    time.sleep(0.5)  # the stored blocks' batch reaches smg
    assert smg.messages(RESYNCED) == []
    resyncs_before = _resyncs(prometheus_port)

    replica.send_signal(signal.SIGKILL)
    replica.wait(timeout=30)
    restarted = _replica(port, log_url, tiny_model_dir, replica_out)
    processes.append(restarted)
    _wait_serving(port, restarted, replica_out)
    (resynced_at,) = smg.wait(RESYNCED, 1, 30)
    lines = [entry for _, entry in smg.poll()]
    (resynced,) = [entry for entry in lines if entry.get("message") == RESYNCED]
    assert resynced["cleared"] is True, resynced
    reconnected_at = smg.messages(CONNECTED)[1]  # the first connection to the restarted replica
    assert resynced_at - reconnected_at <= RESYNC_WITHIN_S, smg_out.read_text()[-4000:]
    (gap,) = [entry for entry in lines if str(entry.get("message", "")).startswith("Sequence gap detected")]
    assert gap["expected"] >> 32 == 1  # smg's cursor: the old epoch
    assert gap["received"] == (2 << 32) | 1  # the new epoch's first batch: its `cleared`
    assert [entry for entry in lines if entry.get("message") == "Skipping stale KV event batch"] == []
    assert _resyncs(prometheus_port) == resyncs_before + 1
    # the restarted replica serves through smg, and smg stays up
    assert _get_json(f"{base}/v1/chat/completions", chat) is not None
    assert gateway.poll() is None
