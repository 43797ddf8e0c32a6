"""VllmEngine/SubscribeKvEvents across a replica restart (tiny model): batch numbers carry the
epoch, and a subscriber resubscribing with its cursor of the old epoch gets the new epoch's
``cleared`` first, at once, so a gateway's index of the replica resyncs without retries.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.service.grpc.kv_events import batch_number

from ..conftest import Served, engine_config, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

READ_TIMEOUT_S = 10.0
RESYNC_WITHIN_S = 1.0


async def _serve_one_epoch(log_url: str, model_dir: Path, body, **server: object) -> None:  # type: ignore[no-untyped-def]
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer, start_engine

    config = engine_config(log_url, model=str(model_dir), num_kv_blocks=64, block_size=4, max_num_seqs=4)
    engine = await start_engine(config)
    server = NanoServer(engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=0, grace_s=1.0, **server))  # type: ignore[arg-type]
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            await body(Served(server, channel, log_url))
    finally:
        await server.stop(0.5)


async def test_a_stale_cursor_after_a_restart_starts_with_the_new_epochs_cleared_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    log_url = f"sqlite:///{tmp_path / 'events.db'}"
    seen: list[cpb.KvEventBatch] = []

    async def first_epoch(served: Served) -> None:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        call = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
        seen.append(await asyncio.wait_for(call.read(), READ_TIMEOUT_S))  # POOL_INIT's cleared
        request = vpb.GenerateRequest(
            tokenized=vpb.TokenizedInput(input_ids=list(range(300, 308))),
            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=2),
        )
        [r async for r in stub.Generate(request)]
        await wait_pool_free(served)
        seen.append(await asyncio.wait_for(call.read(), READ_TIMEOUT_S))  # the prompt's blocks stored
        call.cancel()

    resumed: list[cpb.KvEventBatch] = []
    waited_s: list[float] = []

    async def second_epoch(served: Served) -> None:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        cursor = seen[-1].sequence_number + 1  # what a gateway resubscribes with: the next batch it expects
        started = time.monotonic()
        call = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=cursor))
        resumed.append(await asyncio.wait_for(call.read(), READ_TIMEOUT_S))
        waited_s.append(time.monotonic() - started)
        call.cancel()

    await _serve_one_epoch(log_url, tiny_model_dir, first_epoch)
    await _serve_one_epoch(log_url, tiny_model_dir, second_epoch)

    assert [b.sequence_number for b in seen] == [batch_number(1, 1), batch_number(1, 2)]
    assert [e.WhichOneof("data") for e in seen[1].events] == ["stored"]
    [first] = resumed
    assert first.sequence_number == batch_number(2, 1) == (2 << 32) + 1
    assert list(first.events) == [cpb.KvCacheEvent(event_id=1, cleared=cpb.KvCacheCleared())]  # POOL_INIT
    assert waited_s[0] < RESYNC_WITHIN_S


async def test_a_server_with_a_retention_bound_archives_the_finished_epochs_of_its_pool(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from nanoserve.allocator.log.archive import manifest

    log_url = f"sqlite:///{tmp_path / 'events.db'}"
    archived: list[int] = []

    async def idle(served: Served) -> None:
        await wait_pool_free(served)

    async def archiving(served: Served) -> None:
        archiver = served.server.archiver  # type: ignore[attr-defined]
        deadline = time.monotonic() + READ_TIMEOUT_S
        while not archiver.archived and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        archived.extend(entry.epoch for entry in archiver.archived)

    await _serve_one_epoch(log_url, tiny_model_dir, idle, event_log_retention_s=0, event_log_retention_bytes=0)
    await _serve_one_epoch(
        log_url,
        tiny_model_dir,
        archiving,
        event_log_retention_bytes=1,
        event_log_archive_dir=str(tmp_path / "archive"),
    )
    assert archived == [1]
    [entry] = manifest(log_url)
    assert Path(entry.path) == (tmp_path / "archive" / "default-epoch-00000001.db").resolve()
