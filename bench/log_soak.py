"""Soak: 48 streams against `nanoserve serve` while its event log's store comes and goes.

Two phases, each a fresh server process on the real model:
  * postgresql: the log on a throwaway PostgreSQL cluster (tests/faults.py) that is stopped and
    started again twice under load (once ``fast``, once ``immediate``, as a crash);
  * sqlite-tmpfs: the log on a small tmpfs that is filled to the last byte and freed, twice (early:
    see ``sqlite_phase`` on why a full disk bites only while SQLite's WAL grows).
48 client streams run all the time: each request has random max_tokens, and is either read to
its end, cancelled after a random time, or given a short deadline. A request refused because the
log is not durable (UNAVAILABLE) is retried after a short pause, as a client should. A
WatchEvents client follows the log live (resuming after UNAVAILABLE). Then the clients stop and
the server gets SIGTERM.

Printed per phase: streams served / cancelled / past their deadline / refused, tokens, events
written, the longest stall (the longest time no open stream got a message), tokens/s before the
first fault and during the faults (their ratio), the exit status, and the proofs: the pool all
free before SIGTERM and in POOL_CLOSE, the audit of the epoch clean and closed, and no event
lost (every seq 1..POOL_CLOSE stored, each received once by the live watcher). Needs root (for
the tmpfs mount) and PostgreSQL's initdb/pg_ctl; a few minutes on 2 cores. Not part of the suite.

    .venv/bin/python -m bench.log_soak                       # both phases, 100 s of load each
    .venv/bin/python -m bench.log_soak --phases sqlite-tmpfs --load-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from nanoserve.allocator.log import audit, read_events
from nanoserve.migrations import upgrade
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb
from tests.faults import PgCluster, Tmpfs

PROMPTS = (
    "Explain what a KV cache is.",
    "Write a short poem about the sea.",
    "List three uses of a paged allocator.",
    "What is continuous batching?",
    "Tell me a story about a lighthouse keeper.",
    "Why do servers need graceful shutdown?",
)
NUM_KV_BLOCKS = 1024
GRACE_S = 5.0


@dataclass
class Tally:
    """What the clients and the watcher saw in one phase."""

    served: int = 0
    cancelled: int = 0
    deadline: int = 0
    refused: int = 0
    other: list[str] = field(default_factory=list)
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    open_streams: int = 0
    last_message_t: float = 0.0
    longest_stall_s: float = 0.0
    watched: list[int] = field(default_factory=list)
    watch_reconnects: int = 0


class Server:
    """``nanoserve serve`` with JSON log lines on stderr."""

    def __init__(self, log_url: str, threads: int) -> None:
        command = [
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
            str(NUM_KV_BLOCKS),
            "--max-num-seqs",
            "48",
            "--max-model-len",
            "512",
            "--grace-s",
            str(GRACE_S),
            "--log-format",
            "json",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("NANOSERVE_")}
        env["OMP_NUM_THREADS"] = str(threads)
        self.records: list[dict] = []
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self._started = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._started.wait(300) or not any(r.get("event") == "server_started" for r in self.records):
            self.process.kill()
            raise RuntimeError(f"server did not start: {self.records[-5:]}")
        self.address = next(r for r in self.records if r.get("event") == "server_started")["address"]

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                record = {"event": "text", "text": raw.rstrip()}
            self.records.append(record)
            if record.get("event") == "server_started":
                self._started.set()
        self._started.set()

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=120)
        self._reader.join(timeout=5)
        return code

    def count(self, event: str) -> int:
        return sum(record.get("event") == event for record in self.records)


async def one_request(stub: generation_pb2_grpc.GenerationServiceStub, rng: random.Random, tally: Tally) -> None:
    """One request, read to its end, cancelled, or given a short deadline; UNAVAILABLE is retried by the caller."""
    behaviour = rng.choices(("end", "cancel", "deadline"), weights=(6, 2, 2))[0]
    request = pb.GenerateRequest(
        prompt=rng.choice(PROMPTS),
        sampling=pb.SamplingParameters(max_tokens=rng.randint(16, 128), temperature=0.8, seed=rng.getrandbits(32)),
    )
    timeout = rng.uniform(0.5, 4.0) if behaviour == "deadline" else 120.0
    call = stub.Generate(request, timeout=timeout)
    cancel_at = time.monotonic() + rng.uniform(0.2, 3.0) if behaviour == "cancel" else None
    tally.open_streams += 1
    try:
        while True:
            wait_s = None if cancel_at is None else max(0.0, cancel_at - time.monotonic())
            try:
                response = await asyncio.wait_for(call.read(), wait_s)
            except asyncio.TimeoutError:
                call.cancel()
                tally.cancelled += 1
                return
            if response is grpc.aio.EOF:
                tally.served += 1
                return
            now = time.monotonic()
            tally.tokens += len(response.token_ids)
            tally.token_times.append(now)
            tally.last_message_t = now
    except grpc.aio.AioRpcError as error:
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            tally.deadline += 1
        elif code == grpc.StatusCode.UNAVAILABLE:
            tally.refused += 1
            raise
        else:
            tally.other.append(f"{code.name}: {error.details()}")
    finally:
        tally.open_streams -= 1


async def client(channel: grpc.aio.Channel, seed: int, stop: asyncio.Event, tally: Tally) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    rng = random.Random(seed)
    while not stop.is_set():
        try:
            await one_request(stub, rng, tally)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(rng.uniform(0.2, 0.6))  # the log is not durable: back off and retry


async def watcher(channel: grpc.aio.Channel, tally: Tally) -> None:
    """Follows the log live until POOL_CLOSE, resuming from the next seq after UNAVAILABLE."""
    stub = allocation_pb2_grpc.AllocationServiceStub(channel)
    next_seq = 1
    while True:
        try:
            async for response in stub.WatchEvents(apb.WatchEventsRequest(from_seq=next_seq)):
                tally.watched.append(response.event.seq)
                next_seq = response.event.seq + 1
            return
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            tally.watch_reconnects += 1
            await asyncio.sleep(0.5)


async def stall_meter(tally: Tally, stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.monotonic()
        if tally.open_streams > 0 and tally.last_message_t:
            tally.longest_stall_s = max(tally.longest_stall_s, now - tally.last_message_t)
        elif tally.open_streams == 0:
            tally.last_message_t = now
        await asyncio.sleep(0.05)


async def wait_idle(channel: grpc.aio.Channel, timeout_s: float = 120.0) -> apb.GetPoolStatusResponse:
    stub = allocation_pb2_grpc.AllocationServiceStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = await stub.GetPoolStatus(apb.GetPoolStatusRequest())
            idle = status.num_running == 0 and status.num_waiting == 0 and status.num_free == status.num_blocks
            if idle and status.durable_seq == status.last_seq:
                return status
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not go idle with every event durable")
        await asyncio.sleep(0.2)


@dataclass
class Fault:
    at_s: float
    name: str
    begin: Callable[[], None]
    end: Callable[[], None]
    hold_s: float


@dataclass
class Timeline:
    """Monotonic times of one phase's load."""

    started: float
    first_fault: float
    last_fault_end: float
    ended: float


async def run_load(
    channel: grpc.aio.Channel, faults: list[Fault], load_s: float, tally: Tally
) -> tuple[Timeline, asyncio.Future[None]]:
    """48 clients and a watcher for ``load_s`` seconds while ``faults`` happen; returns when every
    client has stopped and the server is idle with every event durable. The watcher keeps running
    (it ends at POOL_CLOSE)."""
    stop = asyncio.Event()
    started = time.monotonic()
    clients = [asyncio.ensure_future(client(channel, seed, stop, tally)) for seed in range(48)]
    watching = asyncio.ensure_future(watcher(channel, tally))
    meter = asyncio.ensure_future(stall_meter(tally, stop))
    spans = []
    for fault in faults:
        await asyncio.sleep(max(0.0, started + fault.at_s - time.monotonic()))
        begin = time.monotonic()
        await asyncio.to_thread(fault.begin)
        print(f"  {begin - started:6.1f} s  {fault.name}", flush=True)
        await asyncio.sleep(fault.hold_s)
        await asyncio.to_thread(fault.end)
        spans.append((begin, time.monotonic()))
    await asyncio.sleep(max(0.0, started + load_s - time.monotonic()))
    stop.set()
    await asyncio.gather(*clients)
    meter.cancel()
    return Timeline(started, spans[0][0], spans[-1][1], time.monotonic()), watching


def rate(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / max(end - start, 1e-9)


def run_phase(name: str, log_url: str, faults: list[Fault], load_s: float, threads: int) -> dict:
    upgrade(log_url)
    print(f"{name}: starting the server (log {log_url})", flush=True)
    server = Server(log_url, threads)
    tally = Tally()

    async def drive() -> tuple[Timeline, apb.GetPoolStatusResponse, int]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            timeline, watching = await run_load(channel, faults, load_s, tally)
            before = await wait_idle(channel)
            code = await asyncio.to_thread(server.terminate)
            await asyncio.wait_for(watching, 30)
        return timeline, before, code

    try:
        timeline, before, code = asyncio.run(drive())
    finally:
        if server.process.poll() is None:
            server.process.kill()
    report = audit(log_url)
    stored = [event.seq for event in read_events(log_url, epoch=report.epoch)]
    close_data = next(event.data for event in read_events(log_url, epoch=report.epoch, kind="pool_close"))
    before_rate = rate(tally.token_times, timeline.started, timeline.first_fault)
    during_rate = rate(tally.token_times, timeline.first_fault, timeline.last_fault_end)
    no_event_lost = report.closed and stored == list(range(1, report.last_seq + 1)) and sorted(tally.watched) == stored
    return {
        "phase": name,
        "served": tally.served,
        "cancelled": tally.cancelled,
        "deadline": tally.deadline,
        "refused": tally.refused,
        "other errors": len(tally.other),
        "tokens": tally.tokens,
        "events written": len(stored),
        "longest stall s": round(tally.longest_stall_s, 2),
        "tok/s before faults": round(before_rate, 1),
        "tok/s during faults": round(during_rate, 1),
        "during/before": round(during_rate / before_rate, 2) if before_rate else None,
        "failed commits": server.count("event_log_commit_failed"),
        "not-durable spells": server.count("event_log_not_durable"),
        "watch reconnects": tally.watch_reconnects,
        "exit status": code,
        "pool free before SIGTERM": before.num_free == before.num_blocks,
        "pool free in POOL_CLOSE": close_data == {"num_allocated": 0, "num_free": NUM_KV_BLOCKS},
        "audit clean and closed": report.clean and report.closed,
        "no event lost": no_event_lost,
        "load s": round(timeline.ended - timeline.started, 1),
        "errors": tally.other[:3],
    }


def postgresql_phase(load_s: float, threads: int) -> dict:
    with PgCluster() as cluster:
        faults = [
            Fault(0.25 * load_s, "PostgreSQL stopped (fast) for 8 s", lambda: cluster.stop("fast"), cluster.start, 8.0),
            Fault(
                0.6 * load_s,
                "PostgreSQL killed (immediate) for 6 s",
                lambda: cluster.stop("immediate"),
                cluster.start,
                6,
            ),
        ]
        return run_phase("postgresql", cluster.url(), faults, load_s, threads)


def sqlite_phase(load_s: float, threads: int) -> dict:
    # Both fills come while SQLite's WAL still grows (it reaches its checkpoint size, 1000 pages, after
    # some 25-40 s of this load). Later, a checkpointed WAL is written again from its start, into space
    # the file already has: a full disk then stops nothing until the WAL must grow past that size.
    with Tmpfs(16 << 20) as media:
        faults = [
            Fault(min(8.0, 0.25 * load_s), "tmpfs filled for 6 s", media.fill, media.free, 6.0),
            Fault(min(19.0, 0.6 * load_s), "tmpfs filled for 5 s", media.fill, media.free, 5.0),
        ]
        return run_phase("sqlite-tmpfs", f"sqlite:///{media.path / 'log.db'}", faults, load_s, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", nargs="+", default=["postgresql", "sqlite-tmpfs"])
    parser.add_argument("--load-s", type=float, default=100.0, help="seconds of load per phase")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (OMP_NUM_THREADS)")
    args = parser.parse_args()
    phases = {"postgresql": postgresql_phase, "sqlite-tmpfs": sqlite_phase}
    results = [phases[name](args.load_s, args.threads) for name in args.phases]
    print()
    keys = [key for key in results[0] if key != "phase"]
    width = max(map(len, keys))
    print(f"{'':{width}}  " + "  ".join(f"{r['phase']:>14}" for r in results))
    for key in keys:
        print(f"{key:{width}}  " + "  ".join(f"{r[key]!s:>14}" for r in results))
    ok = all(
        r["not-durable spells"] == 2  # each fault bit
        and r["exit status"] == 0
        and r["pool free before SIGTERM"]
        and r["pool free in POOL_CLOSE"]
        and r["audit clean and closed"]
        and r["no event lost"]
        and not r["other errors"]
        for r in results
    )
    print("\nverdict:", "PASS: every fault bit; pool all free, audits clean, no event lost" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
