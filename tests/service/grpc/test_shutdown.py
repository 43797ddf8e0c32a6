"""SIGTERM shuts `nanoserve serve` down gracefully; the next start opens a new epoch.

The server runs as a real subprocess (the CLI), so the signal handling is the
production path: streams that can finish within --grace-s do, the rest are
aborted, the log gets POOL_CLOSE, and the closed epoch audits clean.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.real_model

START_TIMEOUT_S = 120


class ServeProcess:
    """``nanoserve serve`` on 127.0.0.1, any free port, JSON log lines on stderr."""

    def __init__(self, log_url: str) -> None:
        self.lines: list[dict] = []
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nanoserve.service.cli.main",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--metrics-port",
                "off",
                "--event-log-url",
                log_url,
                "--num-kv-blocks",
                "64",
                "--dtype",
                "float32",
                "--max-model-len",
                "1024",
                "--grace-s",
                "2",
                "--log-format",
                "json",
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("NANOSERVE_")},
        )
        self.started = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert self.started.wait(START_TIMEOUT_S), f"server did not start: {self.lines}"
        address = next(line for line in self.lines if line.get("event") == "server_started")["address"]
        self.channel = grpc.insecure_channel(address)

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                line = {"event": "text", "text": raw}
            self.lines.append(line)
            if line.get("event") == "server_started":
                self.started.set()

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self._reader.join(timeout=5)
        return code


def test_sigterm_finishes_short_streams_aborts_long_ones_and_restart_opens_new_epoch(tmp_path: Path) -> None:
    from nanoserve.allocator.log import audit, read_events

    log_url = f"sqlite:///{tmp_path / 'events.db'}"
    first = ServeProcess(log_url)
    generation = generation_pb2_grpc.GenerationServiceStub(first.channel)
    epoch = allocation_pb2_grpc.AllocationServiceStub(first.channel).GetPoolStatus(apb.GetPoolStatusRequest()).epoch
    long_call = generation.Generate(
        pb.GenerateRequest(
            request_id="long",
            prompt="Count: one, two,",
            sampling=pb.SamplingParameters(max_tokens=900, temperature=0.0, ignore_eos=True),
        )
    )
    next(long_call)
    short_call = generation.Generate(
        pb.GenerateRequest(
            request_id="short",
            prompt="Hi",
            sampling=pb.SamplingParameters(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
    )
    short_first = next(short_call)
    assert first.terminate() == 0

    short_rest = list(short_call)
    assert (short_rest or [short_first])[-1].finish.reason == pb.FINISH_REASON_LENGTH
    long_rest = list(long_call)
    assert long_rest[-1].finish.reason == pb.FINISH_REASON_ABORT
    first.channel.close()
    events = [line["event"] for line in first.lines]
    assert events.index("shutdown_started") < events.index("shutdown_finished")
    finished = {line["request_id"]: line for line in first.lines if line["event"] == "request_finished"}
    assert (finished["long"]["finish_reason"], finished["long"]["cause"]) == ("abort", "shutdown")
    assert finished["short"]["finish_reason"] == "length"
    assert "cause" not in finished["short"]

    report = audit(log_url, pool_id="default", epoch=epoch)
    assert report.clean
    assert report.closed
    assert report.leaked == {}
    assert report.state.num_free == 64
    # a block the long request filled is registered, and released rather than freed (prefix caching)
    ends = ("free", "free_all", "release")
    frees = [e for e in read_events(log_url, "default", epoch) if e.owner == "long" and e.kind in ends]
    # speculation (on by default here) gives back rejected drafts' blocks as it goes; the ending is the abort
    assert {e.reason for e in frees if e.reason != "rejected_draft"} == {"aborted"}

    second = ServeProcess(log_url)
    status = allocation_pb2_grpc.AllocationServiceStub(second.channel).GetPoolStatus(apb.GetPoolStatusRequest())
    assert status.epoch == epoch + 1
    assert second.terminate() == 0
    second.channel.close()
    assert audit(log_url, pool_id="default", epoch=epoch).clean
