"""Do readers starve generation? One stream's token rate while the log and journal are read hard.

A ``nanoserve serve`` subprocess (the default model) first finishes one long
request with logprobs (``--long-tokens``), then streams one long greedy
completion whose tokens the client counts. Phases of ``--phase-s`` seconds
each, in the same run against the same server, a quiet one around each loaded one:

  idle      nothing else arrives (the baseline);
  readers   ``--num-watchers`` WatchEvents subscribers catch up from seq 1 and
            ``--num-resumes`` Resume calls of the finished long request (with
            logprobs) run, all at once (the issue's reproduction);
  aborts    ``--num-aborts`` Aborts of unknown ids, ``--num-aborters`` at a time, each
            sent when the one before is answered (RetryInfo ignored), for ``--phase-s``
            seconds at most.

A stream slows as its context grows (attention reads more KV per token: on the default
model, 23 KB of float16 K/V per token of context against 92 MB of weights, so about half
the rate at 2,000 tokens of context than at 500), so the phases start once the stream has
``--warmup-tokens`` and a loaded phase is compared with the mean of the idle phases
before and after it.

A loaded phase lasts until its calls are done, and at least ``--phase-s``; its
rate is over that whole time, and the time the calls took is printed too.

The load runs in a spawned, niced process of its own (``--load-nice``), so the
figures measure the server's own work, not the load generator's CPU. Printed:
per phase, the stream's tokens per second and its ratio to idle, the server's CPU
seconds in the phase (all its threads and its model runner's process, the engine's OpenMP
workers included: compare one phase across versions, not a loaded phase with an idle one), the load
process's CPU seconds (the clients' share of the same cores, which a server with remote clients would
not pay), and the calls the load made by status. Target (issue 31): each loaded phase keeps >= 80%
of the idle token rate. On a shared machine the figures move with the neighbours: say so with them.

    .venv/bin/python -m bench.read_paths
    .venv/bin/python -m bench.read_paths --phase-s 6 --long-tokens 500
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from bench.grpc_load import start_server
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

LONG_ID = "bench-finished-long"


@dataclass
class Phase:
    name: str
    num_tokens: int = 0
    duration_s: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    load_s: float = 0.0  # seconds the phase's calls took
    server_cpu_s: float = 0.0  # the server process's CPU seconds (user + system) in the phase, all threads
    load_cpu_s: float = 0.0  # the load process's CPU seconds in the phase (the clients, on the same cores)

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.duration_s if self.duration_s else float("nan")


async def _stream(stub: generation_pb2_grpc.GenerationServiceStub, max_tokens: int, current: list[Phase]) -> None:
    request = pb.GenerateRequest(
        prompt="Count from one to one thousand: one, two,",
        sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    try:
        async for response in stub.Generate(request):
            current[0].num_tokens += len(response.token_ids)
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.CANCELLED:
            raise


def _count(calls: dict[str, int], code: grpc.StatusCode | str) -> None:
    name = code if isinstance(code, str) else code.name
    calls[name] = calls.get(name, 0) + 1


def _retry_delay_s(error: grpc.aio.AioRpcError) -> float:
    """The RetryInfo delay of a refused call, in seconds (0 without one)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    retry = error_details_pb2.RetryInfo()
    for detail in status.details if status is not None else ():
        if detail.Unpack(retry):
            return retry.retry_delay.ToNanoseconds() / 1e9
    return 0.0


async def _readers(address: str, num_watchers: int, num_resumes: int, events_per_message: int) -> dict[str, int]:
    """WatchEvents from seq 1 until caught up (``events_per_message``: its max_events_per_message),
    and Resume of the long request, all at once."""
    calls: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        allocation = allocation_pb2_grpc.AllocationServiceStub(channel)
        generation = generation_pb2_grpc.GenerationServiceStub(channel)
        last_seq = (await allocation.GetPoolStatus(apb.GetPoolStatusRequest())).last_seq

        async def watcher() -> None:
            request = apb.WatchEventsRequest(from_seq=1, max_events_per_message=events_per_message)
            call = allocation.WatchEvents(request)
            try:
                async for response in call:
                    if (response.events[-1] if response.events else response.event).seq >= last_seq:
                        break
                _count(calls, grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                _count(calls, error.code())
            finally:
                call.cancel()

        async def resumer() -> None:
            while True:  # as a client does: past the server's rate, again after RetryInfo's delay
                try:
                    async for _ in generation.Resume(pb.ResumeRequest(request_id=LONG_ID)):
                        pass
                    _count(calls, grpc.StatusCode.OK)
                    return
                except grpc.aio.AioRpcError as error:
                    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        _count(calls, error.code())
                        return
                    _count(calls, "RETRIED")
                    await asyncio.sleep(_retry_delay_s(error))

        await asyncio.gather(*(watcher() for _ in range(num_watchers)), *(resumer() for _ in range(num_resumes)))
    return {f"watch+resume {code}": n for code, n in calls.items()}


async def _aborters(address: str, num_aborters: int, num_aborts: int, max_s: float) -> dict[str, int]:
    """``num_aborts`` Aborts of unknown ids, ``num_aborters`` at a time, each sent as soon as the one
    before is answered (RetryInfo ignored: a flood); none sent after ``max_s`` seconds."""
    calls: dict[str, int] = {}
    end_s = time.monotonic() + max_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def aborter(index: int) -> None:
            for serial in range(index, num_aborts, num_aborters):
                if time.monotonic() >= end_s:
                    return
                try:
                    await stub.Abort(pb.AbortRequest(request_id=f"unknown-{serial}"))
                    _count(calls, grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as error:
                    _count(calls, error.code())

        await asyncio.gather(*(aborter(index) for index in range(num_aborters)))
    return {f"abort {code}": n for code, n in calls.items()}


def _load_process(kind: str, address: str, args: argparse.Namespace) -> tuple[dict[str, int], float, float]:
    """The phase's calls by status, the seconds they took, and the CPU seconds the load process spent on them."""
    start_s, start_cpu_s = time.perf_counter(), time.process_time()
    if kind == "readers":
        calls = asyncio.run(_readers(address, args.num_watchers, args.num_resumes, args.watch_events_per_message))
    else:
        calls = asyncio.run(_aborters(address, args.num_aborters, args.num_aborts, args.phase_s))
    return calls, time.perf_counter() - start_s, time.process_time() - start_cpu_s


async def _finish_long_request(address: str, num_tokens: int) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(
            request_id=LONG_ID,
            prompt="Write a long story about a lighthouse keeper.",
            sampling=pb.SamplingParameters(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=5),
        )
        async for _ in stub.Generate(request):
            pass
        return (
            await allocation_pb2_grpc.AllocationServiceStub(channel).GetPoolStatus(apb.GetPoolStatusRequest())
        ).last_seq


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far, its children's (the model runner's process) included
    (Linux ``/proc``; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [
            int(child)
            for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()
        ]
    except OSError:
        return float("nan")
    own_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own_s + sum(_cpu_s(child) for child in children)


async def _run(address: str, server_pid: int, args: argparse.Namespace) -> list[Phase]:
    phases = [Phase("idle"), Phase("readers"), Phase("idle"), Phase("aborts"), Phase("idle")]
    warmup = Phase("warmup")
    current = [warmup]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        stream = asyncio.create_task(_stream(stub, info.max_model_len - 64, current))
        while warmup.num_tokens < args.warmup_tokens and not stream.done():  # past the steepest slowing
            await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        spawn = multiprocessing.get_context("spawn")  # a forked child of a process with gRPC threads hangs
        with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=spawn, initializer=os.nice, initargs=(args.load_nice,)
        ) as load:
            await loop.run_in_executor(load, os.getpid)  # the process is up before the clock starts
            for phase in phases:
                start_s, start_cpu_s = time.perf_counter(), _cpu_s(server_pid)
                current[0] = phase
                if phase.name == "idle":
                    await asyncio.sleep(args.phase_s)
                else:
                    phase.calls, phase.load_s, phase.load_cpu_s = await loop.run_in_executor(
                        load, _load_process, phase.name, address, args
                    )
                    await asyncio.sleep(max(0.0, args.phase_s - (time.perf_counter() - start_s)))
                phase.duration_s = time.perf_counter() - start_s
                phase.server_cpu_s = _cpu_s(server_pid) - start_cpu_s
                if stream.done():  # it ended early: a failure of the benchmark, not a figure
                    stream.result()
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=10.0)
    parser.add_argument("--long-tokens", type=int, default=1000, help="tokens of the finished request Resume reads")
    parser.add_argument(
        "--warmup-tokens", type=int, default=1500, help="tokens the stream makes before the first phase"
    )
    parser.add_argument("--num-watchers", type=int, default=100)
    parser.add_argument(
        "--watch-events-per-message",
        type=int,
        default=1,
        help="the watchers' max_events_per_message (1: one event a message, as a client that does not set it)",
    )
    parser.add_argument("--num-resumes", type=int, default=200)
    parser.add_argument("--num-aborts", type=int, default=20_000)
    parser.add_argument("--num-aborters", type=int, default=20, help="Aborts in flight at once")
    parser.add_argument("--max-concurrent-log-reads", type=int, default=4, help="the server's setting")
    parser.add_argument(
        "--max-read-calls-per-s",
        type=float,
        default=100.0,
        help="the server's setting (the load is one peer: Resumes past it are sent again after RetryInfo's delay)",
    )
    parser.add_argument(
        "--max-read-items-per-s", type=float, default=0.0, help="the server's setting (0: read paths not paced)"
    )
    parser.add_argument(
        "--max-read-loop-share", type=float, default=0.0, help="the server's setting (0: read paths not gated)"
    )
    parser.add_argument("--num-threads", type=int, default=None, help="the server's setting (unset: auto)")
    parser.add_argument(
        "--runner-process", choices=("true", "false"), default="true", help="the server's setting (default: true)"
    )
    parser.add_argument("--load-nice", type=int, default=10, help="niceness of the load process")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="nanoserve-bench-"))
    flags = [
        "--dtype",
        args.dtype,
        "--event-log-url",
        f"sqlite:///{log_dir / 'log.db'}",
        "--max-concurrent-log-reads",
        str(args.max_concurrent_log_reads),
        "--max-read-calls-per-s",
        str(args.max_read_calls_per_s),
        "--max-read-items-per-s",
        str(args.max_read_items_per_s),
        "--max-read-loop-share",
        str(args.max_read_loop_share),
        *(["--num-threads", str(args.num_threads)] if args.num_threads is not None else []),
        "--runner-process" if args.runner_process == "true" else "--no-runner-process",
    ]
    server, address = start_server(flags)
    try:
        num_events = asyncio.run(_finish_long_request(address, args.long_tokens))
        phases = asyncio.run(_run(address, server.pid, args))
    finally:
        server.terminate()
        server.wait()
    print(
        f"finished request: {args.long_tokens} tokens with logprobs 5; epoch at {num_events} events before the stream; "
        f"{args.num_watchers} watchers ({args.watch_events_per_message} events a message), "
        f"{args.num_resumes} Resume callers, {args.num_aborts} Aborts "
        f"(one peer, nice {args.load_nice}); --max-concurrent-log-reads {args.max_concurrent_log_reads}, "
        f"--max-read-calls-per-s {args.max_read_calls_per_s:g}, --max-read-items-per-s {args.max_read_items_per_s:g}, "
        f"--max-read-loop-share {args.max_read_loop_share:g}, --runner-process {args.runner_process}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'phase':<8} {'tokens':>7} {'seconds':>8} {'calls s':>8} {'cpu s':>6} {'load cpu s':>10} {'tok/s':>7} "
        f"{'vs idle':>8}  calls"
    )
    ratios = {}
    for index, phase in enumerate(phases):
        if phase.name != "idle":  # against the quiet phases on either side of it
            ratios[index] = phase.tok_per_s / ((phases[index - 1].tok_per_s + phases[index + 1].tok_per_s) / 2)
    for index, phase in enumerate(phases):
        calls = ", ".join(f"{name} {n}" for name, n in sorted(phase.calls.items())) or "-"
        ratio = f"{ratios[index]:>7.0%}" if index in ratios else f"{'':>7}"
        print(
            f"{phase.name:<8} {phase.num_tokens:>7} {phase.duration_s:>8.1f} {phase.load_s:>8.1f} "
            f"{phase.server_cpu_s:>6.1f} {phase.load_cpu_s:>10.1f} "
            f"{phase.tok_per_s:>7.1f} {ratio}  {calls}"
        )
    worst = min(ratios.values())
    print(f"target: every loaded phase >= 80% of idle: worst {worst:.0%}, {'met' if worst >= 0.8 else 'NOT met'}")


if __name__ == "__main__":
    main()
