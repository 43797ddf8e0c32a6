"""SIGHUP reloads the tokens file of a running `nanoserve serve` (issue 31).

The server runs as a real subprocess (the CLI), so the signal handler is the
production path: a revoked token is refused from then on, a new one works,
and the reload is logged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

START_TIMEOUT_S = 180
RELOAD_TIMEOUT_S = 60


class Served:
    """``nanoserve serve`` of the tiny model on 127.0.0.1, any free port, JSON log lines on stderr."""

    def __init__(self, model_dir: Path, extra: list[str], env: dict[str, str] | None = None) -> None:
        self.lines: list[dict] = []
        command = [sys.executable, "-m", "nanoserve.service.cli.main", "serve", "--model", str(model_dir)]
        command += ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "off", "--event-log-url", "none"]
        command += ["--num-kv-blocks", "64", "--dtype", "float32", "--log-format", "json", *extra]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("NANOSERVE_")}
        self.process = subprocess.Popen(
            command,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**environ, **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        started = self.wait_for("server_started", START_TIMEOUT_S)
        self.channel = grpc.insecure_channel(started["address"])
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                line = {"event": "text", "text": raw}
            self.lines.append(line)

    def wait_for(self, event: str, timeout_s: float) -> dict:
        """The first log line of ``event``, waiting up to ``timeout_s`` for it (no speed assumed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = next((line for line in list(self.lines) if line.get("event") == event), None)
            if found is not None:
                return found
            assert self.process.poll() is None, f"server exited {self.process.returncode}: {self.lines[-5:]}"
            time.sleep(0.05)
        raise AssertionError(f"no {event!r} line within {timeout_s} s: {self.lines[-5:]}")

    def code(self, token: str) -> grpc.StatusCode:
        """The status of a GetModelInfo call made with ``token``."""
        try:
            self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", f"Bearer {token}"),))
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    def stop(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self._reader.join(timeout=5)


@pytest.fixture
def served_factory(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    started: list[Served] = []

    def start(extra: list[str], env: dict[str, str] | None = None) -> Served:
        started.append(Served(tiny_model_dir, extra, env))
        return started[-1]

    yield start
    for served in started:
        served.stop()


def test_sighup_revokes_a_removed_token_admits_a_new_one_and_logs_the_reload(served_factory, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("token old-key acme client\ntoken ops-key ops admin\n")
    served = served_factory(["--auth-tokens-file", str(tokens)])
    assert served.code("old-key") == grpc.StatusCode.OK
    assert served.code("new-key") == grpc.StatusCode.UNAUTHENTICATED

    tokens.write_text("token new-key blue client\ntoken ops-key ops admin\n")
    served.process.send_signal(signal.SIGHUP)
    reloaded = served.wait_for("tenants_reloaded", RELOAD_TIMEOUT_S)

    assert reloaded["num_tokens"] == 2
    assert served.code("old-key") == grpc.StatusCode.UNAUTHENTICATED
    assert served.code("new-key") == grpc.StatusCode.OK
    assert served.code("ops-key") == grpc.StatusCode.OK
    assert served.process.poll() is None  # SIGHUP reloads; it does not stop the server


def test_tokens_from_the_environment_serve_and_sighup_says_they_are_not_reloaded(served_factory) -> None:
    served = served_factory([], {"NANOSERVE_AUTH_TOKENS": "token env-key acme client; token ops-key ops admin"})
    assert served.code("env-key") == grpc.StatusCode.OK
    assert served.code("other") == grpc.StatusCode.UNAUTHENTICATED
    served.process.send_signal(signal.SIGHUP)
    kept = served.wait_for("tenants_not_reloaded", RELOAD_TIMEOUT_S)
    assert kept["reason"] == (
        "no --auth-tokens-file: the tokens come from --auth-tokens / NANOSERVE_AUTH_TOKENS, read at start only"
    )
    assert served.code("env-key") == grpc.StatusCode.OK
