"""Serving overhead: the engine's workload over gRPC against the offline engine, same run.

For each concurrency C in (1, 16, 64):
  * offline: ``LLM(max_num_seqs=C).generate`` on the workload's requests (the
    engine alone, batch C: the best the server could do);
  * gRPC: a ``nanoserve serve`` subprocess (max_num_seqs 64) and C concurrent
    client streams, each taking the next request when its stream ends.
Both run bench/workload.py's chat requests (prompt token ids, greedy,
ignore_eos, max_tokens from the workload) with the event log on and the same
``--speculative`` (the server's default, auto: ``LLM``'s own default is off, and
a server decoding speculatively against an offline engine that does not would
make the ratio the speculation's, not the serving's), alternating
for ``--rounds`` rounds, each side keeping its best (the machine may be shared). Printed:
output tokens per second, TTFT p50/p99 and TPOT p50/p99 (seconds; the client's
clock for gRPC, the engine's for offline), and gRPC / offline throughput.
Target: >= 0.90 at 64 streams.

    .venv/bin/python -m bench.grpc_load                           # 4 requests per stream, 2 rounds
    .venv/bin/python -m bench.grpc_load --requests-per-stream 1 --concurrency 1 16 64
    .venv/bin/python -m bench.grpc_load --runner-process false    # the model in the server's own process
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.workload import WorkloadRequest, build_workload
from nanoserve.engine import LLM, SamplingParams, TokensPrompt
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc


@dataclass
class Run:
    """One side at one concurrency: wall time, tokens, per-request latencies (seconds)."""

    elapsed_s: float
    num_tokens: int
    ttft_s: list[float]
    tpot_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


def run_offline(llm: LLM, workload: list[WorkloadRequest]) -> Run:
    """The workload through ``LLM.generate`` on a worker thread, as the server steps its
    engine (on this machine torch runs several times slower on the main thread)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_run_offline, llm, workload).result()


def _run_offline(llm: LLM, workload: list[WorkloadRequest]) -> Run:
    prompts = [TokensPrompt(r.prompt_token_ids) for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed_s = time.perf_counter() - start
    ttft_s, tpot_s = [], []
    for output in outputs:
        m = output.metrics
        ttft_s.append(m.first_token_time - m.arrival_time)
        if len(output.token_ids) > 1:
            tpot_s.append((m.finished_time - m.first_token_time) / (len(output.token_ids) - 1))
    return Run(elapsed_s, sum(len(o.token_ids) for o in outputs), ttft_s, tpot_s)


async def _stream(stub: generation_pb2_grpc.GenerationServiceStub, request: WorkloadRequest, run: Run) -> None:
    message = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=request.prompt_token_ids),
        sampling=pb.SamplingParameters(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
    )
    sent_s = time.perf_counter()
    first_s = None
    num_tokens = 0
    async for response in stub.Generate(message):
        if response.token_ids and first_s is None:
            first_s = time.perf_counter()
        num_tokens += len(response.token_ids)
    done_s = time.perf_counter()
    assert num_tokens == request.max_tokens, f"ignore_eos: expected {request.max_tokens} tokens, got {num_tokens}"
    run.num_tokens += num_tokens
    run.ttft_s.append(first_s - sent_s)
    if num_tokens > 1:
        run.tpot_s.append((done_s - first_s) / (num_tokens - 1))


async def run_grpc(address: str, workload: list[WorkloadRequest], concurrency: int) -> Run:
    run = Run(0.0, 0, [], [])
    pending = list(reversed(workload))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def client() -> None:
            while pending:
                await _stream(stub, pending.pop(), run)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        run.elapsed_s = time.perf_counter() - start
    return run


def start_server(engine_flags: list[str]) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
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
            "--log-format",
            "json",
            *engine_flags,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    for raw in process.stderr:
        line = json.loads(raw) if raw.startswith("{") else {}
        if line.get("event") == "server_started":
            # keep reading, or the server blocks once the pipe fills with request lines
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, line["address"]
    raise RuntimeError(f"server exited with {process.wait()}")


def _row(label: str, run: Run, ratio: str) -> str:
    return (
        f"{label:<16} {run.tokens_per_s:>9.1f} {_percentile(run.ttft_s, 50):>9.3f} {_percentile(run.ttft_s, 99):>9.3f} "
        f"{_percentile(run.tpot_s, 50):>9.4f} {_percentile(run.tpot_s, 99):>9.4f} {ratio:>8}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests-per-stream", type=int, default=4, help="workload size = this x concurrency")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds per side; the best of each is printed"
    )
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--runner-process", choices=("true", "false"), default="true", help="the server's setting (default: true)"
    )
    parser.add_argument(
        "--speculative",
        choices=("off", "ngram", "auto"),
        default="auto",
        help="both sides' setting (default: auto, the server's own default; LLM's is off)",
    )
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="nanoserve-bench-"))
    engine_args: dict[str, object] = {
        "num_kv_blocks": args.num_kv_blocks,
        "dtype": args.dtype,
        "event_log_url": f"sqlite:///{log_dir / 'offline.db'}",
        "speculative": args.speculative,
    }
    server, address = start_server(
        [
            "--num-kv-blocks",
            str(args.num_kv_blocks),
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(max(args.concurrency)),
            "--event-log-url",
            f"sqlite:///{log_dir / 'server.db'}",
            "--runner-process" if args.runner_process == "true" else "--no-runner-process",
            "--speculative",
            args.speculative,
        ]
    )
    try:
        rows = []
        for concurrency in args.concurrency:
            # the offline engine at batch C; its tokenizer (the server's is the same file) builds the workload
            # the two sides alternate and each keeps its best round: the machine is shared,
            # and a noisy neighbour should not decide the ratio
            offline_runs, served_runs = [], []
            with LLM(**engine_args, max_num_seqs=concurrency) as llm:
                workload = build_workload(llm.tokenizer, num_requests=args.requests_per_stream * concurrency, seed=0)
                for _ in range(args.rounds):
                    offline_runs.append(run_offline(llm, workload))
                    served_runs.append(asyncio.run(run_grpc(address, workload, concurrency)))
            offline = max(offline_runs, key=lambda run: run.tokens_per_s)
            served = max(served_runs, key=lambda run: run.tokens_per_s)
            rows.append((concurrency, len(workload), offline, served))
            print(
                f"C={concurrency}: offline {offline.tokens_per_s:.1f} tok/s, gRPC {served.tokens_per_s:.1f} tok/s",
                file=sys.stderr,
            )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    print(f"{'side':<16} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ratio':>8}")
    for concurrency, num_requests, offline, served in rows:
        print(f"-- {concurrency} streams, {num_requests} requests, {offline.num_tokens} output tokens")
        print(_row("offline engine", offline, ""))
        print(_row("gRPC", served, f"{served.tokens_per_s / offline.tokens_per_s:.2f}"))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
