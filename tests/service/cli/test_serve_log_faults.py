"""``nanoserve serve`` as a process when its event log's store fails (issue 9, faults 1 and 7).

- started with the database down: one line on stderr naming the store and the cause (and one
  structured line), exit 3, before the model loads; no traceback;
- SIGTERM with PostgreSQL stopped: the process ends within --grace-s + --event-log-close-timeout-s
  (plus start-up slack), says how many events it could not write and from which seq, exits 4, and
  the epoch stays open for the next start to see.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa

from nanoserve.migrations import upgrade
from nanoserve.service.cli.main import main
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ...faults import PgCluster, free_port


def serve_command(log_url: str, model: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nanoserve.service.cli.main",
        "serve",
        "--model",
        str(model),
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
        "--block-size",
        "4",
        "--dtype",
        "float32",
        "--log-format",
        "json",
        *extra,
    ]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("NANOSERVE_")}


def parse(stderr: str) -> tuple[list[dict], list[str]]:
    """JSON log lines and plain lines of a server's stderr."""
    records, plain = [], []
    for raw in stderr.splitlines():
        try:
            records.append(json.loads(raw))
        except json.JSONDecodeError:
            plain.append(raw)
    return records, plain


def test_serve_with_its_database_down_says_so_in_one_line_and_exits_3_before_the_model_loads(
    tiny_model_dir: Path,
) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nanoserve"
    done = subprocess.run(
        serve_command(url, tiny_model_dir), capture_output=True, text=True, timeout=120, env=clean_env()
    )
    records, plain = parse(done.stderr)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert len(plain) == 1
    assert plain[0].startswith(f"nanoserve serve: error: event log {url} is unusable: OperationalError: connection")
    (unusable,) = [record for record in records if record["event"] == "event_log_unusable"]
    assert unusable["url"] == url
    assert unusable["cause"].startswith("OperationalError: connection")
    assert not {"model_runner.ready", "engine_started"} & {record["event"] for record in records}


class ServeProcess:
    """``nanoserve serve`` with JSON log lines on stderr, read as they come."""

    def __init__(self, command: list[str]) -> None:
        self.records: list[dict] = []
        self.plain: list[str] = []
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=clean_env()
        )
        self.started = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert self.started.wait(120), f"server did not start: {self.records} {self.plain}"
        started = [r for r in self.records if r.get("event") == "server_started"]
        assert started, f"server did not start: {self.records} {self.plain}"
        address = started[0]["address"]
        self.channel = grpc.insecure_channel(address)

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                self.plain.append(raw.rstrip("\n"))
                continue
            self.records.append(record)
            if record.get("event") == "server_started":
                self.started.set()
        self.started.set()  # the process ended: no need to wait any longer

    def wait_durable(self) -> None:
        """Until every event the server assigned is committed."""
        stub = allocation_pb2_grpc.AllocationServiceStub(self.channel)
        deadline = time.monotonic() + 30
        while (status := stub.GetPoolStatus(apb.GetPoolStatusRequest())).durable_seq != status.last_seq:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)

    def generate(self, request_id: str) -> None:
        stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        request = pb.GenerateRequest(
            request_id=request_id, prompt="Hi", sampling=pb.SamplingParameters(max_tokens=8, ignore_eos=True)
        )
        assert list(stub.Generate(request, timeout=30))

    def generate_or_refusal(self, request_id: str) -> tuple[grpc.StatusCode, str] | None:
        """``generate``; None when the request ran, else the status code and details it was refused with."""
        try:
            self.generate(request_id)
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        return None

    def terminate(self) -> tuple[int, float]:
        """SIGTERM; returns the exit status and the seconds the process took to end."""
        self.channel.close()
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=120)
        elapsed_s = time.monotonic() - started
        self._reader.join(timeout=5)
        return code, elapsed_s


def _migrated_database(pg_cluster: PgCluster) -> str:
    """The URL of a new, migrated database on the throwaway cluster."""
    name = f"serve_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_cluster.url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = pg_cluster.url(name)
    upgrade(url)
    return url


def test_sigterm_with_postgresql_stopped_is_bounded_reports_the_loss_and_exits_4(
    pg_cluster: PgCluster, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _migrated_database(pg_cluster)
    # --stream-before-durable: the request admitted as the store goes away streams to its end (with the
    # journal's default its tokens would wait for the store, and the call for its deadline)
    server = ServeProcess(
        serve_command(
            url, tiny_model_dir, "--grace-s", "1", "--event-log-close-timeout-s", "2", "--stream-before-durable"
        )
    )
    try:
        server.generate("before")
        server.wait_durable()
        pg_cluster.stop()
        # a request that arrives before the server sees the store away is admitted and its events
        # wait; once a commit or the pool lock's probe has failed, it is refused (UNAVAILABLE) and
        # only POOL_CLOSE waits. Which one happens is a race with the probe: both are checked.
        refusal = server.generate_or_refusal("during")
        min_waiting = 2  # the second request's blocks and POOL_CLOSE
        if refusal is not None:
            code, details = refusal
            assert code == grpc.StatusCode.UNAVAILABLE, details
            assert "event log not durable" in details
            assert "new requests are refused until it is" in details
            min_waiting = 1  # POOL_CLOSE
        code, elapsed_s = server.terminate()
    finally:
        server.process.kill()
        pg_cluster.start_if_stopped()
    assert code == 4, (server.records[-5:], server.plain)
    assert elapsed_s < 1 + 2 + 3  # grace, close timeout, slack for the process to exit
    (incomplete,) = [record for record in server.records if record["event"] == "event_log_incomplete"]
    first_seq, num_events = incomplete["first_seq"], incomplete["num_events"]
    assert num_events >= min_waiting
    assert incomplete["last_seq"] == first_seq + num_events - 1
    assert server.plain == [
        f"nanoserve serve: error: event log {url} is incomplete: {num_events} events "
        f"(seqs {first_seq}..{incomplete['last_seq']}) not written: the store did not take them within 2.0 s; "
        f"its last error: {incomplete['reason'].split('its last error: ')[1]}; the epoch stays open"
    ]
    assert "Traceback" not in "\n".join(server.plain)

    assert main(["log", "epochs", "--url", url]) == 0
    (row,) = capsys.readouterr().out.splitlines()[2:]
    assert row.endswith(f"{first_seq - 1}            open (running, or crashed)")


def test_postgresql_restarted_under_a_live_server_refuses_a_second_server_and_the_first_writes_on(
    pg_cluster: PgCluster, tiny_model_dir: Path
) -> None:
    """Issue 30: the pool's advisory lock dies with the database session; the live server takes it
    again when the store is back, a second server on the same pool id exits 3 naming the lock, and
    the first server's later requests are written under the lock it holds again."""
    url = _migrated_database(pg_cluster)
    first = ServeProcess(serve_command(url, tiny_model_dir, "--grace-s", "1"))
    try:
        first.generate("before")
        first.wait_durable()
        pg_cluster.stop("immediate")  # as a crash of the database would: every session ends
        pg_cluster.start()
        second = subprocess.run(
            serve_command(url, tiny_model_dir), capture_output=True, text=True, timeout=120, env=clean_env()
        )
        first.generate("after")
        first.wait_durable()
        code, _ = first.terminate()
    finally:
        first.process.kill()
    assert second.returncode == 3, second.stderr
    assert "Traceback" not in second.stderr
    _, plain = parse(second.stderr)
    (line,) = plain  # the open finds the lock taken again, or the yield sees the first server take it
    assert line.startswith("nanoserve serve: error: "), line
    assert "pool 'default' is being written by another live server" in line
    assert code == 0, (first.records[-5:], first.plain)
    retaken = [record for record in first.records if record["event"] == "event_log_pool_lock_retaken"]
    assert len(retaken) == 1
    assert "event_log_pool_lock_lost" not in {record["event"] for record in first.records}
