"""Crash-resumable streams (issue 11): ``nanoserve serve`` killed with SIGKILL, restarted on the same log.

Eight streams (greedy and seeded) run while the server is killed at random moments: mid-stream,
during the start-up that recovers (a crash during recovery), and during a graceful shutdown. After
each restart every client resumes from the count of token ids it has received; the concatenation
equals an uninterrupted run token for token. A request cancelled or aborted before the crash stays
ended, a request finished before it is served from the journal without running again, each
crashed epoch is recovered once, and every epoch audits clean. On SQLite and on PostgreSQL.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from nanoserve.allocator.log import audit_all
from nanoserve.allocator.log.reader import connect
from nanoserve.engine.journal.records import JournalKind
from nanoserve.engine.journal.store import read_journal
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ...faults import free_port
from .test_serve_log_faults import clean_env

MAX_TOKENS = 160
PROMPTS = [f"Story number {i} begins with" for i in range(8)]


def sampling(index: int) -> pb.SamplingParameters:
    """Even streams greedy, odd ones seeded sampling."""
    if index % 2 == 0:
        return pb.SamplingParameters(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    return pb.SamplingParameters(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, seed=1000 + index)


def serve_command(url: str, model: Path, pool_id: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nanoserve.service.cli.main",
        "serve",
        *("--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "off"),
        *("--event-log-url", url, "--pool-id", pool_id, "--num-kv-blocks", "512", "--block-size", "4"),
        *("--dtype", "float32", "--log-format", "json", "--grace-s", "5"),
        *extra,
    ]


class Server:
    """One ``nanoserve serve`` process; its JSON log lines are read as they come."""

    def __init__(self, command: list[str], wait: bool = True) -> None:
        self.records: list[dict] = []
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=clean_env()
        )
        self.started = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.channel: grpc.Channel | None = None
        if wait:
            assert self.started.wait(120), self.records[-5:]
            address = next(r["address"] for r in self.records if r.get("event") == "server_started")
            self.channel = grpc.insecure_channel(address)

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                continue
            self.records.append(record)
            if record.get("event") == "server_started":
                self.started.set()
        self.started.set()

    @property
    def generation(self) -> generation_pb2_grpc.GenerationServiceStub:
        assert self.channel is not None
        return generation_pb2_grpc.GenerationServiceStub(self.channel)

    def pool_status(self) -> apb.GetPoolStatusResponse:
        assert self.channel is not None
        return allocation_pb2_grpc.AllocationServiceStub(self.channel).GetPoolStatus(apb.GetPoolStatusRequest())

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
        if self.channel is not None:
            self.channel.close()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        if self.channel is not None:
            self.channel.close()
        return code


@dataclass
class Client:
    """One client's view of a request: the token ids received, in order, and how it ended."""

    request_id: str
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish: pb.Finish | None = None
    error: grpc.StatusCode | None = None

    def read(self, call: Iterator[pb.GenerateResponse]) -> None:
        try:
            for response in call:
                self.token_ids.extend(response.token_ids)
                if response.HasField("finish"):
                    self.finish = response.finish
        except grpc.RpcError as exc:
            self.error = exc.code()


def start_reading(clients: list[Client], calls: list[Iterator[pb.GenerateResponse]]) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=c.read, args=(call,), daemon=True) for c, call in zip(clients, calls, strict=True)
    ]
    for thread in threads:
        thread.start()
    return threads


def generate_all(server: Server, clients: list[Client]) -> list[threading.Thread]:
    calls = [
        server.generation.Generate(
            pb.GenerateRequest(request_id=c.request_id, prompt=PROMPTS[c.index], sampling=sampling(c.index))
        )
        for c in clients
    ]
    return start_reading(clients, calls)


def resume_all(server: Server, clients: list[Client]) -> list[threading.Thread]:
    calls = [
        server.generation.Resume(pb.ResumeRequest(request_id=c.request_id, after_token_index=len(c.token_ids)))
        for c in clients
        if c.finish is None
    ]
    return start_reading([c for c in clients if c.finish is None], calls)


def wait_for_tokens(clients: list[Client], num_tokens: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(len(c.token_ids) for c in clients) < num_tokens and not all(c.finish for c in clients):
        assert time.monotonic() < deadline, [len(c.token_ids) for c in clients]
        time.sleep(0.005)


def read_rest(process: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """The rest of ``process``'s stdout and all its stderr once it exits, killed after ``timeout_s``.

    stdout is read through the reader the test already read from: ``communicate()`` reads the pipe
    itself and skips what ``readline()`` buffered (lines the CLI wrote early, as under load)."""
    stdout, stderr = process.stdout, process.stderr
    assert stdout is not None
    assert stderr is not None
    killer = threading.Timer(timeout_s, process.kill)
    killer.start()
    try:
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.append(stderr.read()), daemon=True)
        reader.start()
        out = stdout.read()
        reader.join()
        process.wait()
    finally:
        killer.cancel()
    return out, err[0]


def test_read_rest_keeps_the_lines_readline_buffered() -> None:
    """The oracle of the CLI tests below: lines the child wrote before the test read its first ones
    are kept (``communicate()`` lost them: a token missing from a resumed CLI's output, seen under load)."""
    script = "import sys, time\nprint(*range(6), sep='\\n', flush=True)\ntime.sleep(0.3)\nprint('end', flush=True)"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    time.sleep(0.2)  # all six lines are in the pipe before the first readline
    first = [child.stdout.readline() for _ in range(3)]
    out, err = read_rest(child, 30)
    assert first + out.splitlines(keepends=True) == ["0\n", "1\n", "2\n", "3\n", "4\n", "5\n", "end\n"]
    assert (err, child.returncode) == ("", 0)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The eight completions of an uninterrupted run."""
    url = f"sqlite:///{tmp_path_factory.mktemp('reference') / 'log.db'}"
    server = Server(serve_command(url, tiny_model_dir, "ref", 0))
    try:
        clients = [Client(f"ref-{i}", i) for i in range(len(PROMPTS))]
        for thread in generate_all(server, clients):
            thread.join(60)
    finally:
        server.stop()
    assert all(c.finish is not None and len(c.token_ids) == MAX_TOKENS for c in clients)
    return [c.token_ids for c in clients]


def journal_of(url: str, pool_id: str) -> list:
    with connect(url) as conn:
        return read_journal(conn, pool_id)


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_sigkilled_streams_resume_exactly_across_several_crashes(
    store: str, reference: list[list[int]], tiny_model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}" if store == "sqlite" else request.getfixturevalue("pg_url")
    pool_id = f"crash-{uuid.uuid4().hex[:8]}"
    rng = random.Random(11)
    command = serve_command(url, tiny_model_dir, pool_id, 0)
    clients = [Client(f"stream-{i}", i) for i in range(len(PROMPTS))]

    # round 1: the streams start; a short request finishes, one is cancelled, one aborted; then SIGKILL
    server = Server(command)
    short = Client("short", 0)
    start_reading(
        [short],
        [
            server.generation.Generate(
                pb.GenerateRequest(
                    request_id="short",
                    prompt=PROMPTS[0],
                    sampling=pb.SamplingParameters(max_tokens=5, ignore_eos=True, temperature=0.0),
                )
            )
        ],
    )
    cancelled_call = server.generation.Generate(
        pb.GenerateRequest(request_id="cancelled", prompt=PROMPTS[1], sampling=sampling(0))
    )
    next(cancelled_call)
    cancelled_call.cancel()
    aborted = Client("aborted", 0)
    start_reading(
        [aborted],
        [
            server.generation.Generate(
                pb.GenerateRequest(
                    request_id="aborted",
                    prompt=PROMPTS[2],
                    sampling=pb.SamplingParameters(max_tokens=800, ignore_eos=True),
                )
            )
        ],
    )
    wait_for_tokens([aborted], 1)
    server.generation.Abort(pb.AbortRequest(request_id="aborted"))
    generate_all(server, clients)
    wait_for_tokens([short, aborted], 10**6, timeout_s=30)  # both ended
    wait_for_tokens(clients, rng.randint(40, 200))
    server.kill()

    # round 2: restart, resume, SIGKILL again mid-stream
    server = Server(command)
    assert _recovered_ids(server) <= {c.request_id for c in clients}
    assert _recovered_ids(server)
    resume_all(server, clients)
    wait_for_tokens(clients, sum(len(c.token_ids) for c in clients) + rng.randint(20, 150))
    server.kill()

    # round 3: SIGKILL during the start-up that recovers (no client yet)
    starting = Server(command, wait=False)
    time.sleep(rng.uniform(0.5, 2.5))
    starting.kill()

    # round 4: restart, resume, SIGTERM (graceful shutdown begins, streams still within the grace), SIGKILL
    server = Server(command)
    resume_all(server, clients)
    wait_for_tokens(clients, sum(len(c.token_ids) for c in clients) + rng.randint(20, 150))
    server.process.send_signal(signal.SIGTERM)
    time.sleep(rng.uniform(0.0, 0.3))
    server.kill()

    # last round: restart and resume every stream to its end
    server = Server(command)
    threads = resume_all(server, clients)
    for thread in threads:
        thread.join(60)
    for probe in ("short", "cancelled", "aborted"):
        assert probe not in _recovered_ids(server)

    # the finished request comes from the journal; the cancelled and aborted ones stay ended
    replay = Client("short", 0)
    replay.read(server.generation.Resume(pb.ResumeRequest(request_id="short", after_token_index=0)))
    assert replay.token_ids == short.token_ids == reference[0][:5]
    assert replay.finish is not None
    assert replay.finish.reason == pb.FINISH_REASON_LENGTH
    for request_id in ("cancelled", "aborted"):
        ended = Client(request_id, 0)
        ended.read(server.generation.Resume(pb.ResumeRequest(request_id=request_id, after_token_index=0)))
        assert ended.finish is not None, request_id
        assert ended.finish.reason == pb.FINISH_REASON_ABORT, request_id
        if request_id == "aborted":  # what its client got before the abort, and nothing after
            assert ended.token_ids == aborted.token_ids
            assert aborted.finish is not None
    assert server.stop() == 0
    server._reader.join(30)
    # nobody streams a recovered request, yet it is logged and counted once, as every request is
    finished = [r for r in server.records if r.get("event") == "request_finished"]
    assert sorted(r["request_id"] for r in finished if r["api"] == "recovered") == sorted(_recovered_ids(server))
    assert {r["finish_reason"] for r in finished if r["api"] == "recovered"} == {"length"}

    # every stream, concatenated over its calls, is the uninterrupted run: no gap, no repeat
    for client in clients:
        assert client.finish is not None, client
        assert client.finish.reason == pb.FINISH_REASON_LENGTH, client
        assert client.token_ids == reference[client.index], client.request_id

    journal = journal_of(url, pool_id)
    recovers = [entry for entry in journal if entry.kind == JournalKind.RECOVER.value]
    recovered_epochs = [entry.data["epoch"] for entry in recovers]
    assert len(recovered_epochs) == len(set(recovered_epochs)) >= 2  # each crashed epoch recovered once
    for entry in recovers:
        assert not {"short", "cancelled", "aborted"} & set(entry.data["recovered"])
    # the short request ran once: one admission, in the first epoch, and never again
    assert [e.epoch for e in journal if e.request_id == "short" and e.kind == JournalKind.ADMIT.value] == [1]
    reports = audit_all(url, pool_id)
    assert all(report.clean for report in reports), [r.render() for r in reports]
    assert reports[-1].closed
    assert not reports[-1].leaked


def _recovered_ids(server: Server) -> set[str]:
    return {i for r in server.records if r.get("event") == "requests_recovered" for i in r.get("request_ids", [])}


def test_a_token_not_yet_durable_is_never_sent_and_the_resumed_stream_is_contiguous(
    reference: list[list[int]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    database = tmp_path / "log.db"
    url = f"sqlite:///{database}"
    command = serve_command(url, tiny_model_dir, "durable", 0)
    server = Server(command)
    clients = [Client(f"stream-{i}", i) for i in (0, 1)]
    generate_all(server, clients)
    wait_for_tokens(clients, 16)
    blocker = sqlite3.connect(database, timeout=10)
    blocker.execute("BEGIN IMMEDIATE")  # the server's commits now wait: its steps go on, sampling tokens
    try:
        before = server.pool_status()
        time.sleep(0.5)
        seen = [len(c.token_ids) for c in clients]
        status = server.pool_status()
        assert status.last_seq > before.last_seq > 0
        assert status.durable_seq < status.last_seq
        time.sleep(0.5)
        assert [len(c.token_ids) for c in clients] == seen  # nothing more was sent
        server.kill()
    finally:
        blocker.rollback()
        blocker.close()
    server = Server(command)
    for thread in resume_all(server, clients):
        thread.join(60)
    server.stop()
    for client in clients:
        assert client.token_ids == reference[client.index]


def test_generate_resumes_by_itself_when_the_server_comes_back(
    reference: list[list[int]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    port = free_port()
    command = serve_command(url, tiny_model_dir, "cli", port)
    server = Server(command)
    cli = subprocess.Popen(
        [
            sys.executable,
            *("-m", "nanoserve.service.cli.main", "generate", PROMPTS[0], "--server", f"127.0.0.1:{port}"),
            *("--wait-ready", "60", "--json", "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--temperature", "0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    assert cli.stdout is not None
    lines = [cli.stdout.readline() for _ in range(3)]
    server.kill()
    server = Server(command)
    out, err = read_rest(cli, 120)
    server.stop()
    messages = [json.loads(line) for line in lines + out.splitlines() if line.strip()]
    token_ids = [t for m in messages for t in m.get("token_ids", [])]
    assert cli.returncode == 0, err
    assert "resuming request" in err
    assert token_ids == reference[0]
    assert messages[-1]["finish"]["reason"] == "FINISH_REASON_LENGTH"


def test_generate_resumed_text_is_the_uninterrupted_text(
    reference: list[list[int]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Text mode: stdout across the crash is byte for byte what an uninterrupted run prints (no line break
    where the stream was cut); what happened is said on stderr."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    port = free_port()
    command = serve_command(url, tiny_model_dir, "cli-text", port)
    flags = ["--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--temperature", "0", "--server", f"127.0.0.1:{port}"]
    generate = [sys.executable, "-m", "nanoserve.service.cli.main", "generate", PROMPTS[0], *flags]
    server = Server(command)
    cli = subprocess.Popen(
        [*generate, "--wait-ready", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    assert cli.stdout is not None
    first = cli.stdout.read(8)  # some text has been streamed
    server.kill()
    server = Server(command)
    out, err = read_rest(cli, 120)
    uninterrupted = subprocess.run(generate, capture_output=True, text=True, env=clean_env(), timeout=120, check=True)
    server.stop()
    assert cli.returncode == 0, err
    assert "resuming request" in err
    assert first + out == uninterrupted.stdout


@pytest.mark.real_model
def test_sampled_streams_of_the_real_model_resume_exactly_with_batch_invariance(tmp_path: Path) -> None:
    """Issue 32: on the default quantized path, with ``--batch-invariant on``, a seeded sampled stream
    resumed after SIGKILL equals an uninterrupted run. Recovery recomputes each stream's prompt and
    tokens as one prefill where the first run decoded them one at a time, batched with the others:
    only batch invariance keeps the logits, hence the samples, the same."""
    clients_of = lambda prefix: [Client(f"{prefix}-{i}", i) for i in (1, 3, 5, 7)]  # noqa: E731 (seeded ones)

    def command(url: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "nanoserve.service.cli.main",
            "serve",
            *("--host", "127.0.0.1", "--port", "0", "--metrics-port", "off", "--event-log-url", url),
            *("--num-kv-blocks", "256", "--log-format", "json", "--grace-s", "5", "--batch-invariant", "on"),
        ]

    server = Server(command(f"sqlite:///{tmp_path / 'reference.db'}"))
    reference = clients_of("ref")
    try:
        for thread in generate_all(server, reference):
            thread.join(120)
    finally:
        server.stop()
    assert all(c.finish is not None and len(c.token_ids) == MAX_TOKENS for c in reference)

    crashed = command(f"sqlite:///{tmp_path / 'crashed.db'}")
    server = Server(crashed)
    clients = clients_of("stream")
    generate_all(server, clients)
    wait_for_tokens(clients, 150)
    server.kill()
    server = Server(crashed)
    try:
        for thread in resume_all(server, clients):
            thread.join(120)
    finally:
        assert server.stop() == 0
    assert [len(c.token_ids) for c in clients] == [MAX_TOKENS] * 4
    assert [c.token_ids for c in clients] == [c.token_ids for c in reference]
