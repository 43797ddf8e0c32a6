"""The OpenAI API through smg in front of two nanoserve replicas (``nanoserve gateway``), processes on 127.0.0.1.

The topology is started the way a user starts it, with ``scripts/gateway.sh`` (``nanoserve gateway``):
two replicas of the tiny random model (the real SmolLM2 tokenizer) writing one
PostgreSQL log under their own pool ids, and smg in front with the cache_aware
policy. The official ``openai`` client talks to smg. One test puts smg in front
of the real SmolLM2 served in-process, where the greedy text is the point.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ..conftest import Served

openai = pytest.importorskip("openai", reason="the openai client comes with nanoserve[dev]")

pytestmark = pytest.mark.postgres
ROOT = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 180.0
GRACE_S = 3.0
AUDIT_COMMAND = (sys.executable, "-m", "nanoserve.service.cli.main", "log", "audit")
SYSTEM_PROMPT = (
    "You are the on-call assistant of a GPU inference cluster. Answer briefly, name the component at fault, "
    "and give one command that shows its state. The cluster runs paged attention with 16-token KV blocks, "
    "continuous batching and preemption by recompute; its block allocator is event-sourced and audited. "
) * 3


@dataclass
class Gateway:
    """A running ``nanoserve gateway``: its own process, and what it printed when ready."""

    process: subprocess.Popen[bytes]
    ready: dict[str, Any]
    log_dir: Path
    log_url: str
    output: Path
    api_key: str = "unused"  # the key the client sends: a --tenant-api-key's, when the gateway has any

    @property
    def client(self) -> Any:  # openai.OpenAI
        return self.client_with(self.api_key)

    def client_with(self, api_key: str) -> Any:  # openai.OpenAI
        return openai.OpenAI(base_url=self.ready["openai_base_url"], api_key=api_key, max_retries=0, timeout=60)

    @property
    def replicas(self) -> list[dict[str, Any]]:
        return list(self.ready["replicas"])

    def pool_status(self, replica: dict[str, Any]) -> apb.GetPoolStatusResponse:
        with grpc.insecure_channel(replica["address"]) as channel:
            stub = allocation_pb2_grpc.AllocationServiceStub(channel)
            return stub.GetPoolStatus(apb.GetPoolStatusRequest(), timeout=5)

    def audit(self, replica: dict[str, Any]) -> apb.AuditResponse:
        with grpc.insecure_channel(replica["address"]) as channel:
            return allocation_pb2_grpc.AllocationServiceStub(channel).Audit(apb.AuditRequest(), timeout=30)

    def finished(self, replica: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The replica's ``request_finished`` log lines, by request id."""
        lines = {}
        for entry in _json_lines((self.log_dir / f"{replica['pool_id']}.log").read_text()):
            if entry.get("event") == "request_finished":
                lines[entry["request_id"]] = entry
        return lines

    def wait_for_line(self, expected: dict[str, Any], timeout_s: float = 30.0) -> None:
        """Until ``nanoserve gateway`` prints ``expected`` (one JSON line)."""
        deadline = time.monotonic() + timeout_s
        while expected not in _json_lines(self.output.read_text()):
            assert time.monotonic() < deadline, f"no {expected} line:\n{self.tails()}"
            time.sleep(0.1)

    def tails(self, num_chars: int = 3000) -> str:
        """The end of the launcher's output and of each process's log, for a failure message."""
        parts = [f"== nanoserve gateway\n{self.output.read_text()[-num_chars:]}"]
        for name in ["smg", *(replica["pool_id"] for replica in self.replicas)]:
            path = self.log_dir / f"{name}.log"
            if path.exists():
                parts.append(f"== {name}\n{path.read_text()[-num_chars:]}")
        return "\n".join(parts)

    def wait_all_free(self, timeout_s: float = 15.0) -> None:
        """Until every replica that runs has every block free, nothing running or waiting, the log durable."""
        deadline = time.monotonic() + timeout_s
        for replica in self.replicas:
            while True:
                status = self.pool_status(replica)
                if (
                    status.num_free == status.num_blocks
                    and status.num_running == status.num_waiting == 0
                    and status.durable_seq == status.last_seq
                ):
                    break
                assert time.monotonic() < deadline, f"{replica['pool_id']} not free: {status}"
                time.sleep(0.05)

    def stop(self) -> dict[str, Any]:
        """SIGTERM to ``nanoserve gateway``: it stops smg, then the replicas; its last line reports each status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=GRACE_S + 60)
        stopped = [line for line in _json_lines(self.output.read_text()) if line.get("event") == "gateway_stopped"]
        return stopped[-1] if stopped else {}


def _json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON object lines of a process's output; a line still being written is left out."""
    lines = []
    for line in text.splitlines():
        try:
            entry = json.loads(line) if line.startswith("{") else None
        except ValueError:
            continue
        if isinstance(entry, dict):
            lines.append(entry)
    return lines


def start_gateway(
    tmp_path: Path,
    log_url: str,
    model: Path,
    pool_id_prefix: str,
    num_kv_blocks: int = 512,
    tenant_api_keys: tuple[str, ...] = (),
) -> Gateway:
    """``scripts/gateway.sh`` with two tiny-model replicas; with ``tenant_api_keys`` (``TENANT:KEY``), the
    returned Gateway's client sends the first pair's key."""
    output = tmp_path / "gateway.out"
    log_dir = tmp_path / "logs"
    command = [
        "bash",
        str(ROOT / "scripts" / "gateway.sh"),
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--pool-id-prefix",
        pool_id_prefix,
        "--event-log-url",
        log_url,
        "--log-dir",
        str(log_dir),
        "--grace-s",
        str(GRACE_S),
        "--startup-timeout-s",
        str(STARTUP_TIMEOUT_S),
        *(arg for pair in tenant_api_keys for arg in ("--tenant-api-key", pair)),
        "--",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        str(num_kv_blocks),
        "--block-size",
        "4",
        "--max-num-seqs",
        "8",
        "--metrics-port",
        "off",
        "--log-format",
        "json",
    ]
    # the script runs `nanoserve gateway` of the active environment: this test's
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VIRTUAL_ENV": sys.prefix, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    with output.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S + 30
    while True:
        for line in _json_lines(output.read_text()):
            if line.get("event") == "gateway_ready":
                api_key = tenant_api_keys[0].partition(":")[2] if tenant_api_keys else "unused"
                return Gateway(process, line, log_dir, log_url, output, api_key)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"nanoserve gateway did not get ready:\n{output.read_text()[-4000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, pg_url: str, tiny_model_dir: Path) -> Iterator[Gateway]:
    running = start_gateway(
        tmp_path_factory.mktemp("gateway"),
        pg_url,
        tiny_model_dir,
        pool_id_prefix=f"gw-{uuid.uuid4().hex[:8]}",
        tenant_api_keys=TENANT_API_KEYS,
    )
    yield running
    running.stop()


def _model(gateway: Gateway) -> str:
    [model] = [m.id for m in gateway.client.models.list()]
    return str(model)


CHAT = [{"role": "user", "content": "What is a KV cache?"}]
# the module's gateway requires a key (its client sends acme's); blue's works as well
TENANT_API_KEYS = ("acme:key-of-acme-7f3a", "blue:key-of-blue-91c2")


def test_models_lists_the_replicas_model(gateway: Gateway, tiny_model_dir: Path) -> None:
    assert _model(gateway) == tiny_model_dir.name


def test_the_openai_api_refuses_a_request_without_a_tenant_key_and_serves_each_tenants_key(gateway: Gateway) -> None:
    model = _model(gateway)
    body = json.dumps({"model": model, "messages": CHAT, "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{gateway.ready['openai_base_url']}/chat/completions", body, {"content-type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as missing:  # no Authorization header at all
        urllib.request.urlopen(request, timeout=30)
    assert missing.value.code == 401
    with pytest.raises(openai.AuthenticationError) as wrong:
        gateway.client_with("key-of-nobody").chat.completions.create(model=model, messages=CHAT, max_tokens=4)
    assert wrong.value.status_code == 401
    texts = []
    for pair in TENANT_API_KEYS:
        client = gateway.client_with(pair.partition(":")[2])
        reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)
        texts.append(reply.choices[0].message.content)
    assert texts[0] == texts[1]
    assert texts[0]


def test_streamed_chat_joins_to_the_unstreamed_text_with_one_finish_reason_and_usage(gateway: Gateway) -> None:
    client, model = gateway.client, _model(gateway)
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usages = [c.usage for c in chunks if c.usage is not None]
    assert text == whole.choices[0].message.content
    assert len(text) > 0
    assert finish_reasons == ["length"] == [whole.choices[0].finish_reason]
    [usage] = usages
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 24)


def test_n_2_returns_two_choices_each_the_greedy_answer(gateway: Gateway) -> None:
    client, model = gateway.client, _model(gateway)
    single = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    pair = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0, n=2)
    assert sorted(choice.index for choice in pair.choices) == [0, 1]
    assert [choice.message.content for choice in pair.choices] == [single.choices[0].message.content] * 2


def test_completion_with_stop_strings_ends_before_the_first_match(gateway: Gateway) -> None:
    client, model = gateway.client, _model(gateway)
    prompt = "The paged KV cache holds"
    unstopped = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    stop = unstopped[len(unstopped) // 2 : len(unstopped) // 2 + 3]
    choice = client.completions.create(
        model=model, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\u2603never"]
    ).choices[0]
    assert choice.text == unstopped[: unstopped.index(stop)]
    assert choice.finish_reason == "stop"


def test_a_client_that_disconnects_mid_stream_aborts_the_request_on_its_replica(gateway: Gateway) -> None:
    stream = gateway.client.chat.completions.create(
        model=_model(gateway),
        messages=[{"role": "user", "content": "Count to one thousand."}],
        max_tokens=900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    request_id = None
    for index, chunk in enumerate(stream):
        request_id = chunk.id
        if index == 4:
            break
    stream.close()
    gateway.wait_all_free()
    lines = {k: v for replica in gateway.replicas for k, v in gateway.finished(replica).items()}
    line = lines[request_id]
    assert line["finish_reason"] == "abort"
    assert line["cause"] in ("abort_rpc", "cancelled")  # smg sends Abort, and drops the call
    assert 4 <= line["completion_tokens"] < 900
    for replica in gateway.replicas:
        report = gateway.audit(replica)
        assert report.clean, report.summary


def test_requests_sharing_a_long_system_prompt_land_on_the_same_replica_under_cache_aware(gateway: Gateway) -> None:
    client, model = gateway.client, _model(gateway)
    ids = []
    for question in ("Why is replica 1 slow?", "Why did the audit fail?"):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        ids.append(client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0).id)
    holders = {replica["pool_id"] for replica in gateway.replicas for i in ids if i in gateway.finished(replica)}
    assert len(holders) == 1, holders


def test_the_second_request_sharing_a_long_system_prompt_reports_cached_tokens(gateway: Gateway) -> None:
    client, model = gateway.client, _model(gateway)
    usages = []
    system = "A system prompt no earlier test sent. " + SYSTEM_PROMPT  # so the first request is a miss
    for question in ("What does the scheduler preempt first?", "How is a block freed?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        usages.append(client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0).usage)
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    # every whole 16-token block of the shared system prompt is served from the replica's cache
    assert usages[1].prompt_tokens_details.cached_tokens >= len(SYSTEM_PROMPT) // 8


def test_smg_follows_each_replicas_kv_events_and_learns_its_block_size_from_them(gateway: Gateway) -> None:
    """smg subscribes to SubscribeKvEvents on every worker that offers it; a stored event's
    block_size reaches it, and its KV event monitor logs no warning or error."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Which block is cached?"}]
    gateway.client.chat.completions.create(model=_model(gateway), messages=messages, max_tokens=2, temperature=0)
    block_size = gateway.pool_status(gateway.replicas[0]).block_size
    deadline = time.monotonic() + 10
    while True:
        lines = _json_lines((gateway.log_dir / "smg.log").read_text())
        learned = [line for line in lines if line.get("message") == "Learned block_size from KV event"]
        if learned or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    connected = {line.get("worker_url") for line in lines if line.get("message") == "KV event stream connected"}
    assert connected >= {f"grpc://{replica['address']}" for replica in gateway.replicas}, gateway.tails()
    assert [line["block_size"] for line in learned][:1] == [block_size], gateway.tails()
    monitor_trouble = [
        line
        for line in lines
        if "kv_event_monitor" in str(line.get("target")) and line.get("level") in ("WARN", "ERROR")
    ]
    assert monitor_trouble == []


def _long_stream(client: Any, model: str, index: int, outcomes: dict[int, Any]) -> None:
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Stream {index}: count to one thousand."}],
            max_tokens=900,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        outcomes[index] = ("completed", [c.choices[0].finish_reason for c in chunks if c.choices][-1])
    except openai.APIError as exc:
        outcomes[index] = ("error", str(exc))


def _wait_for_replica_line(gateway: Gateway, replica: dict[str, Any], event: str, timeout_s: float = 30.0) -> None:
    """Until the replica's log holds a line whose ``event`` is ``event``."""
    path = gateway.log_dir / f"{replica['pool_id']}.log"
    deadline = time.monotonic() + timeout_s
    while not any(entry.get("event") == event for entry in _json_lines(path.read_text())):
        assert time.monotonic() < deadline, f"no {event} line from {replica['pool_id']}:\n{gateway.tails()}"
        time.sleep(0.05)


def test_sigterm_to_one_replica_drains_or_fails_its_streams_clearly_and_the_other_serves(gateway: Gateway) -> None:
    """The last test of the module: it takes a replica away, then stops the topology and audits both pools."""
    client, model = gateway.client, _model(gateway)
    outcomes: dict[int, Any] = {}
    streams = [threading.Thread(target=_long_stream, args=(client, model, i, outcomes)) for i in range(6)]
    for thread in streams:
        thread.start()
    deadline = time.monotonic() + 20
    while True:
        running = [gateway.pool_status(replica).num_running for replica in gateway.replicas]
        if sum(running) == len(streams) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    victim, survivor = sorted(gateway.replicas, key=lambda r: -running[gateway.replicas.index(r)])
    assert running[gateway.replicas.index(victim)] > 0, running
    os.kill(victim["pid"], signal.SIGTERM)
    # a call that reaches the victim before its signal handler runs is still its own to serve:
    # the calls below start once the victim refuses new ones
    _wait_for_replica_line(gateway, victim, "shutdown_started")
    after = [
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"after {i}"}], max_tokens=4, temperature=0
        )
        for i in range(4)
    ]
    for thread in streams:
        thread.join(timeout=120)
    assert [r.choices[0].finish_reason for r in after] == ["length"] * 4
    deadline = time.monotonic() + 30  # the survivor logs request_finished as its last message goes out
    while not {r.id for r in after} <= set(gateway.finished(survivor)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {r.id for r in after} <= set(gateway.finished(survivor)), gateway.tails()
    for outcome in outcomes.values():
        if outcome[0] == "completed":
            assert outcome[1] == "length"
        else:  # past the replica's grace: an error that says why, never a quietly short completion
            assert "the server shut down before request" in outcome[1]
            assert "retry on another replica" in outcome[1]
    assert len(outcomes) == len(streams)
    gateway.wait_for_line({"event": "process_exited", "name": victim["pool_id"]})  # drained and gone
    statuses = gateway.stop()["exit_statuses"]
    assert statuses == {"smg": 0, victim["pool_id"]: 0, survivor["pool_id"]: 0}, gateway.tails()
    for replica in gateway.replicas:
        audit = subprocess.run(
            [*AUDIT_COMMAND, "--url", gateway.log_url, "--pool", replica["pool_id"]],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert audit.returncode == 0, audit.stdout + audit.stderr
        assert audit.stdout.rstrip().endswith("clean"), audit.stdout
        assert "closed" in audit.stdout


# ---- the real model: smg's detokenized text equals our own API's text -----------------------------------


@pytest.mark.real_model
@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_text_through_smg_equals_our_grpc_apis(served: Served, tmp_path: Path) -> None:
    async with smg_in_front_of(served.server.port, tmp_path) as (client, model):
        question = "What is the capital of France?"
        ours = [
            r
            async for r in generation_pb2_grpc.GenerationServiceStub(served.channel).Generate(
                pb.GenerateRequest(
                    chat=pb.ChatMessages(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content=question)]),
                    sampling=pb.SamplingParameters(max_tokens=48, temperature=0.0),
                )
            )
        ]
        theirs = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=48, temperature=0
        )
        assert theirs.choices[0].message.content == "".join(r.text for r in ours)
        assert theirs.choices[0].message.content == "The capital of France is Paris."
        assert theirs.usage.prompt_tokens == ours[-1].finish.usage.prompt_tokens
        assert theirs.choices[0].finish_reason == "stop"


async def _wait_for_model(client: Any, smg: subprocess.Popen[bytes], gateway_url: str) -> str:
    """The replica's model id, once smg lists it and its /readiness says ready: smg lists the
    model before it has fetched the tokenizer, and answers 503 ("not registered yet") until then."""
    import asyncio

    from nanoserve.service.gateway.replicas import _get_json

    deadline = time.monotonic() + 60
    while True:
        try:
            models = [m.id async for m in client.models.list()]
        except openai.APIError:
            models = []
        if models and await asyncio.to_thread(_get_json, f"{gateway_url}/readiness") is not None:
            return str(models[0])
        assert smg.poll() is None, "smg exited"
        assert time.monotonic() < deadline, "smg did not register the replica"
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def smg_in_front_of(worker_port: int, log_dir: Path) -> AsyncIterator[tuple[Any, str]]:
    """``smg launch`` in front of one replica (gRPC ``worker_port``), its log in ``log_dir/smg.log``:
    yields the `openai` client of its HTTP API and the replica's model id once smg serves it; smg
    gets SIGTERM on the way out."""
    from nanoserve.service.gateway.replicas import free_port, smg_executable

    port = free_port()
    command = [smg_executable(), "launch", "--backend", "vllm", "--worker-urls", f"grpc://127.0.0.1:{worker_port}"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    command += ["--shutdown-grace-period-secs", "1", "--log-json"]
    with (log_dir / "smg.log").open("wb") as sink:
        smg = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        yield client, await _wait_for_model(client, smg, f"http://127.0.0.1:{port}")
    finally:
        smg.send_signal(signal.SIGTERM)
        smg.wait(timeout=30)
