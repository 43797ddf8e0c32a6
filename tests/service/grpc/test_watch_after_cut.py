"""WatchEvents of an epoch whose older part the archiver moved into a segment file (issue 30).

The archived seqs are no longer in the live log. Asking for one of them is OUT_OF_RANGE naming
the archived range and the seq to ask for, never a stream that silently starts later; asking
for 1 (the epoch's start) streams from the checkpoint SNAPSHOT the live part begins with.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ..conftest import Served, engine_config, serving, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cut_served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> AsyncIterator[Served]:
    """A tiny-model server that checkpoints every 8 events, so a cut comes after a few requests."""
    log_url = f"sqlite:///{Path(tmp_path_factory.mktemp('cut-log')) / 'events.db'}"
    config = engine_config(
        log_url, model=str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_seqs=4, num_events_per_snapshot=8
    )
    async with serving(config, log_url, grace_s=2.0, metrics_port=0) as served:
        yield served


async def _cut(served: Served) -> int:
    """Serves six requests and a watcher catches up from seq 1 (the server keeps the page it read),
    then one pass of the server's own archiver, its bound lowered, cuts the open epoch: the last
    archived seq."""
    from nanoserve.allocator.log.archive import RetentionPolicy

    stub = generation_pb2_grpc.GenerationServiceStub(served.channel)
    for i in range(6):
        request = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=[100 + i, 7, 8, 9, 10]),
            sampling=pb.SamplingParameters(max_tokens=8, temperature=0.0, ignore_eos=True),
            request_id=f"cut-{i}",
        )
        assert len([r async for r in stub.Generate(request)]) > 1
    await wait_pool_free(served)
    allocation = allocation_pb2_grpc.AllocationServiceStub(served.channel)
    last_seq = (await allocation.GetPoolStatus(apb.GetPoolStatusRequest())).last_seq
    async for response in allocation.WatchEvents(apb.WatchEventsRequest(from_seq=1), timeout=10.0):
        if response.event.seq >= last_seq:
            break
    archiver = served.server.archiver  # type: ignore[attr-defined]
    archiver.policy = RetentionPolicy(retention_bytes=1)
    await asyncio.to_thread(archiver.run_once)  # its word that the kept pages went arrives before it returns
    [segment] = archiver.segments
    assert segment.first_seq == 1
    return int(segment.last_seq)


async def test_watch_from_an_archived_seq_is_out_of_range_and_from_one_starts_at_the_checkpoint(
    cut_served: Served,
) -> None:
    archived = await _cut(cut_served)
    assert archived > 1
    stub = allocation_pb2_grpc.AllocationServiceStub(cut_served.channel)
    epoch = (await stub.GetPoolStatus(apb.GetPoolStatusRequest())).epoch

    for from_seq in (2, archived):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.WatchEvents(apb.WatchEventsRequest(from_seq=from_seq), timeout=10.0):
                pass
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert (info.value.details() or "").startswith(
            f"from_seq: {from_seq} is archived (seqs 1..{archived} of epoch {epoch} moved to segment files"
        )
        assert (info.value.details() or "").endswith(
            f"ask for 1 (from the checkpoint at {archived + 1}) or at least {archived + 1}"
        )

    for from_seq in (0, 1, archived + 1):
        call = stub.WatchEvents(apb.WatchEventsRequest(from_seq=from_seq), timeout=10.0)
        first = (await call.read()).event
        call.cancel()
        assert (first.seq, first.kind) == (archived + 1, apb.EVENT_KIND_SNAPSHOT)

    # the first request's history went with the segment: Resume says where it may be, NOT_FOUND
    generation = generation_pb2_grpc.GenerationServiceStub(cut_served.channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in generation.Resume(pb.ResumeRequest(request_id="cut-0"), timeout=10.0):
            pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "running or in the live journal (never seen, or its history was archived" in (info.value.details() or "")
