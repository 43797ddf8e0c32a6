"""``nanoserve serve`` runs the model in a child process (``--runner-process``, the default): the child
is the server's, ends with it however it ends, and its death is an engine failure that every caller
sees (UNAVAILABLE, health NOT_SERVING), never a hang."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanoserve.service.cli.main import main
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from .test_serve_log_faults import ServeProcess, serve_command


@pytest.fixture
def serve(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Callable[..., ServeProcess]]:
    """``serve(*flags)``: a server on the tiny model and a log in ``tmp_path``; any still running after
    the test (one that failed midway) is killed."""
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        started.append(ServeProcess(serve_command(f"sqlite:///{tmp_path / 'log.db'}", tiny_model_dir, *flags)))
        return started[-1]

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def _runner_pid(server: ServeProcess) -> int:
    [record] = [r for r in server.records if r.get("event") == "model_runner.process"]
    pid = int(record["pid"])
    parent_pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert parent_pid == server.process.pid  # the server's own child
    return pid


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not yet reaped
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the process tree")
def test_the_child_ends_with_a_sigterm_of_the_server(serve: Callable[..., ServeProcess]) -> None:
    server = serve()
    pid = _runner_pid(server)
    server.generate("r1")  # the model answers from the child
    code, _ = server.terminate()
    assert code == 0
    assert _gone_within(pid, 5)
    ready = [r for r in server.records if r.get("event") == "model_runner.ready"]
    assert len(ready) == 1  # the child's own log line, in the server's JSON format


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the process tree")
def test_the_child_exits_when_the_server_is_killed(serve: Callable[..., ServeProcess]) -> None:
    server = serve()
    pid = _runner_pid(server)
    server.channel.close()
    server.process.kill()
    server.process.wait(timeout=30)
    assert _gone_within(pid, 10)  # its pipe closed: it does not outlive the server


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the process tree")
def test_a_killed_child_is_an_engine_failure_every_caller_sees(
    serve: Callable[..., ServeProcess], tmp_path: Path
) -> None:
    server = serve("--num-kv-blocks", "256")
    pid = _runner_pid(server)
    stub = generation_pb2_grpc.GenerationServiceStub(server.channel)
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParameters(max_tokens=1000, ignore_eos=True))
    stream = stub.Generate(request, timeout=60)
    next(stream)  # running
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as cut:
        list(stream)
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"model runner process {pid} exited (exit code -9)" in (cut.value.details() or "")
    health = health_pb2_grpc.HealthStub(server.channel)
    deadline = time.monotonic() + 5  # the server refreshes health every 0.5 s (MONITOR_INTERVAL_S)
    while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "health still SERVING 5 s after the model runner process died"
        time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as refused:
        server.generate("after")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    code, elapsed_s = server.terminate()
    assert elapsed_s < 30
    assert code == 0  # the engine thread still closed the log (the request aborted, POOL_CLOSE): nothing lost
    assert main(["log", "audit", "--url", f"sqlite:///{tmp_path / 'log.db'}"]) == 0
