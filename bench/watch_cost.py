"""What does a WatchEvents catch-up cost the server per event? nanoserve against grpcio's own floor.

One ``nanoserve serve`` subprocess (the default model) finishes ``--num-requests``
greedy completions of ``--max-tokens`` tokens, so its epoch holds a few hundred
events, and then runs nothing. Then, for one and for ``--batch`` events a message:

  nanoserve   ``--num-watchers`` WatchEvents calls from seq 1, at once, each read
              until it has every stored event (raw bytes: the client parses nothing);
  floor       a bare ``grpc.aio`` server in a process of its own (no interceptor, no
              log, no engine) streams the very same messages, captured from nanoserve,
              to the same number of calls: what grpcio itself costs per message.

Each load runs ``--rounds`` times, alternating; each side keeps its least CPU.
Printed per row: messages and events sent, the server's CPU microseconds (user +
system, ``/proc/PID/stat``, all threads and child processes) per message and per
event, and nanoserve's per-message cost over the floor's (the peer here is grpcio:
what nanoserve adds to each send). The client's own CPU per message is printed too:
on a machine whose cores the client shares, a one-event-a-message catch-up costs
about as much again on the client's side.

Why it matters (issue 31): a crowd of watchers catching up one event a message sends
one gRPC message per event per watcher, and on a 2-core machine whose cores the
forward pass fills, that CPU comes out of generation (``bench.read_paths``).

    .venv/bin/python -m bench.watch_cost
    .venv/bin/python -m bench.watch_cost --num-watchers 20 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import os
import resource
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.grpc_load import start_server
from bench.read_paths import _cpu_s
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

WATCH_METHOD = "/nanoserve.v1.AllocationService/WatchEvents"


@dataclass
class Load:
    num_messages: int
    num_events: int
    server_cpu_s: float
    client_cpu_s: float

    def per_message_us(self, cpu_s: float) -> float:
        return 1e6 * cpu_s / self.num_messages


def _client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _watch(address: str, num_watchers: int, events_per_message: int, num_messages: int) -> list[bytes]:
    """``num_watchers`` WatchEvents calls from seq 1 at once, each cancelled after ``num_messages``
    messages (the stored events); returns the first call's messages, as sent."""
    request = apb.WatchEventsRequest(from_seq=1, max_events_per_message=events_per_message)
    async with grpc.aio.insecure_channel(address) as channel:
        watch = channel.unary_stream(WATCH_METHOD, request_serializer=apb.WatchEventsRequest.SerializeToString)

        async def one() -> list[bytes]:
            call = watch(request)
            messages: list[bytes] = []
            try:
                async for message in call:
                    messages.append(message)
                    if len(messages) == num_messages:
                        break
            finally:
                call.cancel()
            return messages

        results = await asyncio.gather(*(one() for _ in range(num_watchers)))
    if any(len(messages) != num_messages for messages in results):
        raise RuntimeError(f"a watcher got {[len(m) for m in results]} messages, expected {num_messages} each")
    return results[0]


def _measure(
    server_pid: int, address: str, num_watchers: int, events_per_message: int, num_messages: int, num_events: int
) -> Load:
    """One catch-up of ``num_events`` events in ``num_messages`` messages by each of ``num_watchers``."""
    server_start, client_start = _cpu_s(server_pid), _client_cpu_s()
    asyncio.run(_watch(address, num_watchers, events_per_message, num_messages))
    server_s, client_s = _cpu_s(server_pid) - server_start, _client_cpu_s() - client_start
    return Load(num_messages * num_watchers, num_events * num_watchers, server_s, client_s)


def _floor_server(conn: multiprocessing.connection.Connection) -> None:
    """A bare grpc.aio server whose WatchEvents streams the messages it is handed, as they are."""
    messages: list[bytes] = []

    async def watch_events(request: bytes, context: grpc.aio.ServicerContext) -> object:
        for message in messages:
            yield message

    async def serve() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_stream_rpc_method_handler(watch_events)  # bytes in, bytes out
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("nanoserve.v1.AllocationService", {"WatchEvents": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        loop = asyncio.get_running_loop()
        while (new := await loop.run_in_executor(None, conn.recv)) is not None:
            messages[:] = new
            conn.send("ok")
        await server.stop(None)

    asyncio.run(serve())


async def _finish_requests(address: str, num_requests: int, max_tokens: int) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for index in range(num_requests):
            request = pb.GenerateRequest(
                prompt=f"Write a story about lighthouse number {index}.",
                sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            )
            async for _ in stub.Generate(request):
                pass
        status = await allocation_pb2_grpc.AllocationServiceStub(channel).GetPoolStatus(apb.GetPoolStatusRequest())
        return status.last_seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-watchers", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="the batched watchers' max_events_per_message")
    parser.add_argument("--num-requests", type=int, default=3, help="finished requests that fill the epoch")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="nanoserve-bench-"))
    server, address = start_server(["--event-log-url", f"sqlite:///{log_dir / 'log.db'}"])
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    floor = spawn.Process(target=_floor_server, args=(theirs,), daemon=True)
    floor.start()
    floor_address = f"127.0.0.1:{ours.recv()}"
    rows: dict[tuple[str, int], Load] = {}
    try:
        last_seq = asyncio.run(_finish_requests(address, args.num_requests, args.max_tokens))
        captured: dict[int, list[bytes]] = {}
        for per_message in (1, args.batch):
            num_messages = -(-last_seq // per_message)
            captured[per_message] = asyncio.run(_watch(address, 1, per_message, num_messages))
        for _ in range(args.rounds):
            for per_message, messages in captured.items():
                for side, pid, target in (("nanoserve", server.pid, address), ("floor", floor.pid, floor_address)):
                    if side == "floor":
                        ours.send(messages)
                        ours.recv()
                    load = _measure(pid, target, args.num_watchers, per_message, len(messages), last_seq)
                    best = rows.get((side, per_message))
                    if best is None or load.server_cpu_s < best.server_cpu_s:
                        rows[(side, per_message)] = load
    finally:
        server.terminate()
        server.wait()
        ours.send(None)
        floor.join(5)
        if floor.is_alive():
            floor.kill()
    print(
        f"epoch of {last_seq} events; {args.num_watchers} watchers from seq 1, at once; least of {args.rounds} "
        f"rounds; nothing generating; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'events/msg':>10} {'server':<10} {'messages':>9} {'cpu s':>6} {'us/msg':>7} {'us/event':>8} "
        f"{'client us/msg':>13} {'vs floor':>8}"
    )
    for (side, per_message), load in sorted(rows.items(), key=lambda item: (item[0][1], item[0][0] != "nanoserve")):
        floor_load = rows[("floor", per_message)]
        ratio = load.per_message_us(load.server_cpu_s) / floor_load.per_message_us(floor_load.server_cpu_s)
        print(
            f"{per_message:>10} {side:<10} {load.num_messages:>9} {load.server_cpu_s:>6.2f} "
            f"{load.per_message_us(load.server_cpu_s):>7.1f} {1e6 * load.server_cpu_s / load.num_events:>8.2f} "
            f"{load.per_message_us(load.client_cpu_s):>13.1f} {ratio:>7.2f}x"
        )


if __name__ == "__main__":
    main()
