"""The request journal's cost and its recovery time, over gRPC, in one run.

Two ``nanoserve serve`` subprocesses on the same model and flags, each with its
own SQLite event log: one keeps the request journal (the default: tokens reach
clients only once their journal batch is durable), one runs ``--no-journal``.
For each concurrency C in (1, 16, 64) both serve bench/workload.py's requests
(the bench/grpc_load.py workload: greedy, ignore_eos) from C concurrent
streams, alternating for ``--rounds`` rounds; each side keeps its best round
(the machine is shared). Printed: output tokens per second, TTFT and TPOT
p50/p99 (client clock), and journal on / off throughput (target: >= 0.95 at 64
streams, i.e. under 5% cost). Then what the logs hold per generated token:
allocator events and journal records, rows and bytes of their stored records.

Then the wait itself: in this process, an AsyncLLMEngine on the same model
runs the workload at each concurrency and records, per step with outputs, the
time from the step's end until its journal batch was durable and its tokens
were released (what ``nanoserve_journal_durability_wait_seconds`` shows live):
p50, p90 and max, in milliseconds.

Last, recovery: 64 streams run on the journaled server until each has
``--kill-after`` tokens, the server is SIGKILLed and started again on the same
log, and each client calls Resume from the count of token ids it received.
Printed: restart to SERVING (process start, model load, recovery), and restart
to the first resumed token (first, median and last of the 64).

    .venv/bin/python -m bench.journal                          # 1 request per stream, 2 rounds
    .venv/bin/python -m bench.journal --concurrency 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import sqlalchemy as sa

from bench.grpc_load import Run, _percentile, run_grpc
from bench.workload import WorkloadRequest, build_workload
from nanoserve.engine.model.weights import default_model_path
from nanoserve.engine.text.tokenizer import Tokenizer
from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc


class Server:
    """A ``nanoserve serve`` subprocess; ``started_s`` is when it said server_started (perf_counter)."""

    def __init__(self, flags: list[str]) -> None:
        self.spawned_s = time.perf_counter()
        self.process = subprocess.Popen(
            [
                sys.executable,
                *("-m", "nanoserve.service.cli.main", "serve", "--host", "127.0.0.1", "--port", "0"),
                *("--metrics-port", "off", "--log-format", "json", *flags),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stderr is not None
        self.recovered: dict[str, object] = {}
        for raw in self.process.stderr:
            line = json.loads(raw) if raw.startswith("{") else {}
            if line.get("event") == "requests_recovered":
                self.recovered = line
            if line.get("event") == "server_started":
                self.started_s = time.perf_counter()
                self.address: str = line["address"]
                threading.Thread(target=self.process.stderr.read, daemon=True).start()
                return
        raise RuntimeError(f"server exited with {self.process.wait()}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=60)


def log_volume(url: str) -> dict[str, tuple[int, int]]:
    """table -> (rows, bytes of their stored records) in the log at ``url``."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            volume = {}
            # an event row's record, or a packed row's records (migration 0008); a journal step's body
            payloads = (
                ("allocator_events", "LENGTH(record) + COALESCE(LENGTH(records), 0)"),
                ("journal_steps", "LENGTH(body)"),
            )
            for table, payload in payloads:
                rows, size = conn.execute(sa.text(f"SELECT COUNT(*), COALESCE(SUM({payload}), 0) FROM {table}")).one()
                volume[table] = (int(rows), int(size))
            return volume
    finally:
        engine.dispose()


def _row(label: str, run: Run, ratio: str) -> str:
    return (
        f"{label:<12} {run.tokens_per_s:>9.1f} {_percentile(run.ttft_s, 50):>9.3f} {_percentile(run.ttft_s, 99):>9.3f} "
        f"{_percentile(run.tpot_s, 50):>9.4f} {_percentile(run.tpot_s, 99):>9.4f} {ratio:>8}"
    )


def measure_recovery(flags: list[str], workload: list[WorkloadRequest], num_streams: int, kill_after: int) -> None:
    """64 streams in flight, SIGKILL, restart, Resume each: restart -> SERVING, restart -> first resumed token."""
    server = Server(flags)
    channel = grpc.insecure_channel(server.address)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    received = [0] * num_streams
    ready = threading.Barrier(num_streams + 1)

    def stream(i: int) -> None:
        request = workload[i % len(workload)]
        message = pb.GenerateRequest(
            request_id=f"recover-{i}",
            prompt_token_ids=pb.TokenIds(ids=request.prompt_token_ids),
            sampling=pb.SamplingParameters(max_tokens=256, temperature=0.0, ignore_eos=True),
        )
        waited = False
        try:
            for response in stub.Generate(message):
                received[i] += len(response.token_ids)
                if received[i] >= kill_after and not waited:
                    waited = True
                    ready.wait()
        except grpc.RpcError:
            pass
        if not waited:
            ready.wait()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    ready.wait()
    server.kill()
    channel.close()
    for thread in threads:
        thread.join(30)
    restarted = Server(flags)
    channel = grpc.insecure_channel(restarted.address)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    first_token_s: list[float] = [0.0] * num_streams

    def resume(i: int) -> None:
        call = stub.Resume(pb.ResumeRequest(request_id=f"recover-{i}", after_token_index=received[i]))
        for response in call:
            if response.token_ids:
                first_token_s[i] = time.perf_counter() - restarted.spawned_s
                call.cancel()
                return

    resumers = [threading.Thread(target=resume, args=(i,), daemon=True) for i in range(num_streams)]
    for thread in resumers:
        thread.start()
    for thread in resumers:
        thread.join(120)
    restarted.stop()
    channel.close()
    times = sorted(first_token_s)
    print(
        f"recovery of {num_streams} in-flight streams ({kill_after}+ tokens each; "
        f"{restarted.recovered.get('num_recovered')} re-admitted): restart -> SERVING "
        f"{restarted.started_s - restarted.spawned_s:.2f} s (of which opening the log with the recovery "
        f"{restarted.recovered.get('log_open_s')} s); restart -> first resumed token: "
        f"first {times[0]:.2f} s, median {statistics.median(times):.2f} s, last {times[-1]:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests-per-stream", type=int, default=1, help="workload size = this x concurrency")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per side; the best is printed")
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--recovery-streams", type=int, default=64)
    parser.add_argument("--kill-after", type=int, default=8, help="tokens each stream has when the server is killed")
    parser.add_argument("--recovery-only", action="store_true", help="only the recovery measurement")
    parser.add_argument("--skip-wait", action="store_true", help="skip the in-process measurement of the wait")
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="nanoserve-journal-bench-"))
    tokenizer = Tokenizer.from_path(default_model_path())
    common = ["--num-kv-blocks", str(args.num_kv_blocks), "--dtype", args.dtype]
    common += ["--max-num-seqs", str(max(max(args.concurrency), args.recovery_streams))]
    if not args.recovery_only:
        measure_cost(args, common, log_dir, tokenizer)
        if not args.skip_wait:
            asyncio.run(measure_wait(args, log_dir, tokenizer))
    recovery_flags = [*common, "--event-log-url", f"sqlite:///{log_dir / 'recovery.db'}"]
    workload = build_workload(tokenizer, num_requests=args.recovery_streams, seed=1)
    measure_recovery(recovery_flags, workload, args.recovery_streams, args.kill_after)


async def measure_wait(args: argparse.Namespace, log_dir: Path, tokenizer: Tokenizer) -> None:
    """Per step with outputs: step end -> journal batch durable -> tokens released, in process."""
    from nanoserve.engine import AsyncLLMEngine, EngineConfig, SamplingParams, TokensPrompt
    from nanoserve.engine.core.log_setup import build_engine

    config = EngineConfig.from_kwargs(
        num_kv_blocks=args.num_kv_blocks,
        dtype=args.dtype,
        max_num_seqs=max(args.concurrency),
        event_log_url=f"sqlite:///{log_dir / 'wait.db'}",
    )
    engine = AsyncLLMEngine(config, load=build_engine)
    await engine.start()
    waits: list[float] = []
    engine.observe_durability_wait = waits.append
    try:
        for concurrency in args.concurrency:
            waits.clear()
            workload = build_workload(tokenizer, num_requests=concurrency, seed=2)

            async def one(index: int, request: WorkloadRequest) -> None:
                params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
                async for _ in engine.generate(TokensPrompt(request.prompt_token_ids), params, f"wait-{index}"):
                    pass

            await asyncio.gather(*(one(i, request) for i, request in enumerate(workload)))
            ms = sorted(1e3 * wait for wait in waits)
            print(
                f"durability wait per step, {concurrency} streams (SQLite, synchronous=FULL): "
                f"p50 {statistics.median(ms):.2f} ms, p90 {ms[int(0.9 * (len(ms) - 1))]:.2f} ms, "
                f"max {ms[-1]:.2f} ms over {len(ms)} steps"
            )
    finally:
        await engine.shutdown(grace_s=0.0)


def measure_cost(args: argparse.Namespace, common: list[str], log_dir: Path, tokenizer: Tokenizer) -> None:
    """Journal on vs off at each concurrency, then the log's rows and bytes per generated token."""
    urls = {side: f"sqlite:///{log_dir / f'{side}.db'}" for side in ("on", "off")}
    servers = {
        "on": Server([*common, "--event-log-url", urls["on"]]),
        "off": Server([*common, "--event-log-url", urls["off"], "--no-journal"]),
    }
    rows = []
    num_tokens = {"on": 0, "off": 0}
    try:
        for concurrency in args.concurrency:
            workload = build_workload(tokenizer, num_requests=args.requests_per_stream * concurrency, seed=0)
            runs: dict[str, list[Run]] = {"on": [], "off": []}
            for _ in range(args.rounds):
                for side in ("off", "on"):
                    run = asyncio.run(run_grpc(servers[side].address, workload, concurrency))
                    runs[side].append(run)
                    num_tokens[side] += run.num_tokens
            best = {side: max(runs[side], key=lambda run: run.tokens_per_s) for side in runs}
            spread = {side: [round(run.tokens_per_s, 1) for run in runs[side]] for side in runs}
            rows.append((concurrency, len(workload), best, spread))
            print(f"C={concurrency}: rounds (tok/s) {spread}", file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()
    print(f"{'side':<12} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'on/off':>8}")
    for concurrency, num_requests, best, spread in rows:
        print(
            f"-- {concurrency} streams, {num_requests} requests, {best['on'].num_tokens} output tokens; rounds {spread}"
        )
        print(_row("journal off", best["off"], ""))
        print(_row("journal on", best["on"], f"{best['on'].tokens_per_s / best['off'].tokens_per_s:.3f}"))
    for side in ("off", "on"):
        volume = log_volume(urls[side])
        per_token = ", ".join(
            f"{table}: {rows_ / num_tokens[side]:.3f} rows and {size / num_tokens[side]:.1f} bytes per token"
            for table, (rows_, size) in volume.items()
        )
        print(f"log written with the journal {side} ({num_tokens[side]} generated tokens): {per_token}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
