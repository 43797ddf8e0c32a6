"""The OpenAI API through smg against our gRPC API directly: same replicas, same workload, same run.

Starts ``nanoserve gateway``'s topology (two ``nanoserve serve`` replicas and
smg with ``--policy cache_aware`` in front), then for each concurrency C in
(1, 16, 64), alternating for ``--rounds`` rounds, each side keeping its best:

  * direct: C client streams over ``nanoserve.v1.GenerationService/Generate``
    (the workload's prompt token ids), spread round-robin over the two replicas
    by the client itself;
  * gateway: C streams of the official ``openai`` client (chat completions,
    SSE, ``include_usage``; events read raw and decoded with ``json.loads``)
    through smg, which renders the chat template, tokenizes, routes, and
    detokenizes; once with ``cache_aware`` (the topology's smg) and once with
    ``round_robin`` (a second smg on the same replicas), so the gateway's own
    cost and its policy's placement show apart.

Both run bench/workload.py's chat requests (greedy, ignore_eos, max_tokens from
the workload). Printed: output tokens per second, TTFT p50/p99 (client clock),
gateway / direct throughput (target: >= 0.90 at 64 streams), and how smg spread
the gateway's requests over the replicas.

Then a shared-prefix workload (``--num-prefixes`` long system prompts, each
asked ``--questions-per-prefix`` questions, in a shuffled order) through smg with
cache_aware and, in the same run, a second smg with round_robin on the same
replicas: a prefix hit is a request sent to a replica that had already been
sent its system prompt (the first request of a prefix on each replica is a
miss). Without a prefix cache (issue 10) a hit saves no compute yet; this
measures the routing.

Two replicas sharing this machine's cores are not a scale test: the replicas
compete for the same cores, so the direct side is the ceiling and the ratio is
the gateway's overhead, not its speed-up.

    .venv/bin/python -m bench.gateway                       # SmolLM2, 2 rounds, 2 requests per stream
    .venv/bin/python -m bench.gateway --concurrency 1 16 64 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.workload import WORDS, WorkloadRequest, build_workload
from nanoserve.service.gateway.replicas import Topology, TopologyConfig, free_port, smg_executable
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc


@dataclass
class Run:
    """One side at one concurrency: wall time, output tokens, per-request TTFT (seconds), and (gateway
    only) each request with the id smg gave it, which is the request id its replica logs."""

    elapsed_s: float = 0.0
    num_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    request_ids: list[tuple[WorkloadRequest, str]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


def _percentile(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def _closed_loop(workload: list[Any], concurrency: int, send: Any, run: Run) -> Run:
    """``concurrency`` clients, each sending the next request when its last one ended."""
    pending = list(reversed(workload))

    async def client(index: int) -> None:
        while pending:
            await send(index, pending.pop(), run)

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    run.elapsed_s = time.perf_counter() - start
    return run


async def run_direct(addresses: list[str], workload: list[WorkloadRequest], concurrency: int) -> Run:
    channels = [grpc.aio.insecure_channel(address) for address in addresses]
    stubs = [generation_pb2_grpc.GenerationServiceStub(channel) for channel in channels]
    turn = itertools.count()

    async def send(_: int, request: WorkloadRequest, run: Run) -> None:
        message = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=request.prompt_token_ids),
            sampling=pb.SamplingParameters(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
        )
        sent_s = time.perf_counter()
        first_s = None
        num_tokens = 0
        async for response in stubs[next(turn) % len(stubs)].Generate(message):
            if response.token_ids and first_s is None:
                first_s = time.perf_counter()
            num_tokens += len(response.token_ids)
        assert num_tokens == request.max_tokens, f"expected {request.max_tokens} tokens, got {num_tokens}"
        assert first_s is not None
        run.num_tokens += num_tokens
        run.ttft_s.append(first_s - sent_s)

    try:
        return await _closed_loop(workload, concurrency, send, Run())
    finally:
        for channel in channels:
            await channel.close()


async def run_gateway(
    base_url: str, model: str, workload: list[WorkloadRequest], concurrency: int, ignore_eos: bool = True
) -> Run:
    """The workload's chats through smg's OpenAI API, streamed (SSE), with the official client.

    The client's raw streaming response is read line by line and each event decoded with
    ``json.loads``: building a pydantic object per token in this process would charge the
    gateway side for client work that competes with the replicas for the same cores.
    """
    import openai

    # the client's default pool (1,000 connections) holds every stream
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    async def send(_: int, request: WorkloadRequest, run: Run) -> None:
        sent_s = time.perf_counter()
        first_s = None
        num_tokens = 0
        request_id = ""
        async with client.chat.completions.with_streaming_response.create(
            model=model,
            messages=request.messages,  # type: ignore[arg-type]
            max_tokens=request.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": ignore_eos},
        ) as response:
            async for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue  # blank separators and the final "data: [DONE]"
                event = json.loads(line[len("data: ") :])
                request_id = event["id"]
                choices = event.get("choices")
                if first_s is None and choices and choices[0]["delta"].get("content"):
                    first_s = time.perf_counter()
                if event.get("usage"):
                    num_tokens = event["usage"]["completion_tokens"]
        if ignore_eos:
            assert num_tokens == request.max_tokens, f"expected {request.max_tokens} tokens, got {num_tokens}"
        run.num_tokens += num_tokens
        run.ttft_s.append((first_s or time.perf_counter()) - sent_s)
        run.request_ids.append((request, request_id))

    try:
        return await _closed_loop(workload, concurrency, send, Run())
    finally:
        await client.close()


def replica_of(log_dir: Path, pool_ids: list[str]) -> dict[str, str]:
    """request id -> the pool id of the replica that served it (its ``request_finished`` log line)."""
    served: dict[str, str] = {}
    for pool_id in pool_ids:
        for line in (log_dir / f"{pool_id}.log").read_text().splitlines():
            try:  # the replica may be writing the last line right now
                entry = json.loads(line) if line.startswith("{") else {}
            except ValueError:
                continue
            if entry.get("event") == "request_finished":
                served[entry["request_id"]] = pool_id
    return served


def shared_prefix_workload(tokenizer: Any, num_prefixes: int, questions: int, seed: int) -> list[WorkloadRequest]:
    """Each of ``num_prefixes`` system prompts (~300 tokens) asked ``questions`` questions, in a shuffled order
    (a fixed rotation would hand each prefix to one replica under round_robin by accident)."""
    rng = random.Random(seed)
    systems = [
        f"You are assistant #{index}. " + " ".join(rng.choice(WORDS) for _ in range(300))
        for index in range(num_prefixes)
    ]
    workload = []
    for question in range(questions):
        for system in systems:
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {question}: " + " ".join(rng.choice(WORDS) for _ in range(8))},
            ]
            workload.append(WorkloadRequest(messages, tokenizer.apply_chat_template(messages), 8))
    rng.shuffle(workload)
    return workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests-per-stream", type=int, default=2, help="workload size = this x concurrency")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per side; the best of each counts")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens a workload request asks for")
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--questions-per-prefix", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> None:
    from nanoserve.engine.model.weights import default_model_path
    from nanoserve.engine.text.tokenizer import Tokenizer

    work_dir = Path(tempfile.mkdtemp(prefix="nanoserve-bench-gateway-"))
    serve_args = ["--num-kv-blocks", str(args.num_kv_blocks), "--dtype", args.dtype]
    serve_args += ["--max-num-seqs", str(max(args.concurrency)), "--metrics-port", "off", "--log-format", "json"]
    if args.model:
        serve_args += ["--model", args.model]
    config = TopologyConfig(
        gateway_port=0,
        prometheus_port=0,
        event_log_url=f"sqlite:///{work_dir / 'log.db'}",
        serve_args=tuple(serve_args),
        log_dir=work_dir,
    )
    tokenizer = Tokenizer.from_path(Path(args.model) if args.model else default_model_path())
    with Topology(config) as topology:
        pool_ids = [replica.pool_id for replica in topology.replicas]
        round_robin, round_robin_url = _start_second_gateway(topology, "round_robin", work_dir)
        try:
            gateways = {"cache_aware": f"{topology.gateway_url}/v1", "round_robin": round_robin_url}
            model = await _model(gateways["cache_aware"])
            await _model(round_robin_url)
            rows = await _throughput_runs(args, tokenizer, topology, model, gateways, work_dir)
            prefix_rows = await _prefix_runs(args, tokenizer, model, gateways, work_dir, pool_ids)
        finally:
            round_robin.terminate()
            round_robin.wait(timeout=30)
    _print_throughput(rows, pool_ids)
    _print_prefix_hits(prefix_rows, pool_ids, args)


def _start_second_gateway(topology: Topology, policy: str, work_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Another smg, with another policy, on the same replicas; returns it and its OpenAI base URL."""
    port = free_port()
    command = [smg_executable(), "launch", "--backend", "vllm", "--worker-urls"]
    command += [replica.worker_url for replica in topology.replicas]
    command += ["--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--prometheus-port", str(free_port()), "--shutdown-grace-period-secs", "1", "--log-json"]
    with (work_dir / f"smg-{policy}.log").open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}/v1"


async def _throughput_runs(
    args: argparse.Namespace, tokenizer: Any, topology: Topology, model: str, gateways: dict[str, str], work_dir: Path
) -> list[tuple[int, int, dict[str, Run], dict[str, Counter[str]]]]:
    """Per concurrency: the best round of each side, and how each gateway spread its requests."""
    pool_ids = [replica.pool_id for replica in topology.replicas]
    addresses = [replica.address for replica in topology.replicas]
    rows = []
    for concurrency in args.concurrency:
        workload = build_workload(
            tokenizer,
            num_requests=args.requests_per_stream * concurrency,
            min_max_tokens=min(16, args.max_tokens),
            max_max_tokens=args.max_tokens,
            seed=concurrency,
        )
        runs: dict[str, list[Run]] = {"direct": [], **{policy: [] for policy in gateways}}
        for _ in range(args.rounds):  # the sides alternate: a noisy neighbour should not decide the ratio
            runs["direct"].append(await run_direct(addresses, workload, concurrency))
            for policy, base_url in gateways.items():
                runs[policy].append(await run_gateway(base_url, model, workload, concurrency))
        best = {side: max(side_runs, key=lambda run: run.tokens_per_s) for side, side_runs in runs.items()}
        served = replica_of(work_dir, pool_ids)
        spreads = {
            policy: Counter(served[request_id] for run in runs[policy] for _, request_id in run.request_ids)
            for policy in gateways
        }
        rows.append((concurrency, len(workload), best, spreads))
        summary = ", ".join(f"{side} {run.tokens_per_s:.1f} tok/s" for side, run in best.items())
        print(f"C={concurrency}: {summary}", file=sys.stderr)
    return rows


async def _prefix_runs(
    args: argparse.Namespace,
    tokenizer: Any,
    model: str,
    gateways: dict[str, str],
    work_dir: Path,
    pool_ids: list[str],
) -> list[tuple[str, int, int, Counter[str]]]:
    """The shared-prefix workload through each gateway: prefix hits and requests per replica."""
    workload = shared_prefix_workload(tokenizer, args.num_prefixes, args.questions_per_prefix, seed=1)
    rows = []
    for policy, base_url in gateways.items():
        run = await run_gateway(base_url, model, workload, concurrency=4, ignore_eos=False)
        served = replica_of(work_dir, pool_ids)
        # the first request of a system prompt on each replica is a miss, every later one a hit
        pairs = {(request.messages[0]["content"], served[request_id]) for request, request_id in run.request_ids}
        spread = Counter(served[request_id] for _, request_id in run.request_ids)
        rows.append((policy, len(workload), len(workload) - len(pairs), spread))
    return rows


async def _model(base_url: str) -> str:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    deadline = time.monotonic() + 120
    while True:
        try:
            models = [m.id async for m in client.models.list()]
        except openai.APIError:
            models = []
        if models:
            return str(models[0])
        if time.monotonic() > deadline:
            raise RuntimeError(f"no model at {base_url}")
        await asyncio.sleep(0.25)


def _row(label: str, run: Run, ratio: str) -> str:
    return (
        f"{label:<20} {run.tokens_per_s:>9.1f} {_percentile(run.ttft_s, 50):>9.3f} "
        f"{_percentile(run.ttft_s, 99):>9.3f} {ratio:>7}"
    )


def _print_throughput(rows: list[Any], pool_ids: list[str]) -> None:
    print(f"{'side':<20} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ratio':>7}   requests per replica")
    for concurrency, num_requests, best, spreads in rows:
        direct = best["direct"]
        print(f"-- {concurrency} streams, {num_requests} requests, {direct.num_tokens} output tokens")
        print(_row("direct (round-robin)", direct, ""))
        for policy, spread in spreads.items():
            shares = "  ".join(f"{pool_id} {spread[pool_id]}" for pool_id in pool_ids)
            ratio = f"{best[policy].tokens_per_s / direct.tokens_per_s:.2f}"
            print(_row(f"smg {policy}", best[policy], ratio) + f"   {shares}")


def _print_prefix_hits(rows: list[Any], pool_ids: list[str], args: argparse.Namespace) -> None:
    print(
        f"\nshared prefixes: {args.num_prefixes} system prompts x {args.questions_per_prefix} questions, "
        "shuffled, 4 streams; a hit = sent to a replica that had been sent its system prompt"
    )
    print(f"{'policy':<12} {'requests':>8} {'hits':>6} {'best':>6}   requests per replica")
    best = args.num_prefixes * (args.questions_per_prefix - 1)
    for policy, num_requests, hits, spread in rows:
        shares = "  ".join(f"{pool_id} {spread[pool_id]}" for pool_id in pool_ids)
        print(f"{policy:<12} {num_requests:>8} {hits:>6} {best:>6}   {shares}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
