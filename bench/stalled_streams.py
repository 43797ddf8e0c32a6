"""What do streams nobody reads cost the server? Its RSS with three unread streams against three read ones.

Two phases, each against a fresh ``nanoserve serve`` subprocess (the default
model), ``--num-streams`` greedy ``--max-tokens`` completions with
``--logprobs`` top logprobs each:

  read      the client reads every stream as it arrives (the baseline);
  unread    the client opens the streams and reads nothing until the server has
            no request running, then reads what it can.

The server's RSS (``/proc/PID/status`` VmRSS) is sampled every 0.1 s; printed
per phase: the peak RSS (MB), its growth over the RSS before the streams, the
tokens the client received, and how each stream ended (for the unread ones,
RESOURCE_EXHAUSTED naming ``--max-stream-buffer-messages`` or ``-bytes`` is the
cut-off at the bound), then the unread peak minus the read peak. Target (issue
31): within 100 MB, and the unread streams cut off at the bound.

The unread client turns HTTP/2 BDP probing off (``--client-bdp-probe`` keeps
it): its receive window then stays 64 KiB, as a client that stopped reading
before the window grew, so the server's writes wait and its outputs queue in
the stream, which is what the bound is for. With probing, gRPC's own buffers
may hold a short completion whole and no bound is reached.

    .venv/bin/python -m bench.stalled_streams
    .venv/bin/python -m bench.stalled_streams --max-tokens 2000
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.grpc_load import start_server
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

PROMPT = "Write a long story about a lighthouse keeper and the sea."


@dataclass
class Phase:
    name: str
    rss_before_mb: float = 0.0
    peak_rss_mb: float = 0.0
    num_tokens: int = 0
    endings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> str:
        growth = self.peak_rss_mb - self.rss_before_mb
        return (
            f"{self.name:<8} {self.peak_rss_mb:>9.0f} {growth:>9.0f} {self.num_tokens:>8} {self.seconds:>7.1f}  "
            f"{'; '.join(self.endings)}"
        )


def rss_mb(pid: int) -> float:
    """The process's resident set, MB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def _sample_peak(pid: int, phase: Phase, stop: asyncio.Event) -> None:
    while not stop.is_set():
        phase.peak_rss_mb = max(phase.peak_rss_mb, rss_mb(pid))
        await asyncio.sleep(0.1)


def _request(index: int, args: argparse.Namespace) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"stream-{index}",
        prompt=PROMPT,
        sampling=pb.SamplingParameters(
            max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=args.logprobs
        ),
    )


async def _read(call: grpc.aio.UnaryStreamCall, phase: Phase) -> None:
    try:
        async for response in call:
            phase.num_tokens += len(response.token_ids)
        phase.endings.append("OK")
    except grpc.aio.AioRpcError as error:
        phase.endings.append(f"{error.code().name}: {(error.details() or '')[:90]}")


async def _idle(address: str) -> None:
    """Until the server runs and queues no request."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = allocation_pb2_grpc.AllocationServiceStub(channel)
        while True:
            status = await stub.GetPoolStatus(apb.GetPoolStatusRequest())
            if status.num_running == 0 and status.num_waiting == 0:
                return
            await asyncio.sleep(0.2)


async def _phase(name: str, pid: int, address: str, args: argparse.Namespace) -> Phase:
    phase = Phase(name, rss_before_mb=rss_mb(pid))
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_peak(pid, phase, stop))
    options = [] if name == "read" or args.client_bdp_probe else [("grpc.http2.bdp_probe", 0)]
    start = time.perf_counter()
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        calls = [stub.Generate(_request(index, args), timeout=3600.0) for index in range(args.num_streams)]
        if name == "unread":
            await asyncio.sleep(1.0)  # the streams start
            await _idle(address)
        await asyncio.gather(*(_read(call, phase) for call in calls))
    phase.seconds = time.perf_counter() - start
    stop.set()
    await sampler
    return phase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-streams", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--client-bdp-probe", action="store_true", help="the unread client keeps BDP probing on")
    parser.add_argument("--server-flag", action="append", default=[], help="passed to nanoserve serve (repeatable)")
    args = parser.parse_args()

    phases = []
    for name in ("read", "unread"):
        log_dir = Path(tempfile.mkdtemp(prefix="nanoserve-bench-"))
        flags = ["--event-log-url", f"sqlite:///{log_dir / 'log.db'}", *args.server_flag]
        server, address = start_server(flags)
        try:
            phases.append(asyncio.run(_phase(name, server.pid, address, args)))
        finally:
            server.terminate()
            server.wait()
    read, unread = phases
    print(
        f"{args.num_streams} streams x {args.max_tokens} tokens, logprobs {args.logprobs}\n"
        f"{'phase':<8} {'peak MB':>9} {'grew MB':>9} {'tokens':>8} {'s':>7}  endings"
    )
    for phase in phases:
        print(phase.row())
    cut_off = all(e.startswith("RESOURCE_EXHAUSTED") and "max-stream-buffer" in e for e in unread.endings)
    print(
        f"unread peak - read peak: {unread.peak_rss_mb - read.peak_rss_mb:+.0f} MB (target <= 100); "
        f"unread streams cut off at the bound: {'yes' if cut_off else 'no'}"
    )


if __name__ == "__main__":
    main()
