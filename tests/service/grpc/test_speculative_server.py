"""Speculative decoding through the gRPC API: `serve --speculative ngram` streams the tokens plain decoding
streams, GetPoolStatus counts the drafts, and the log of the run audits clean."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from nanoserve.allocator.log import audit
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ..conftest import Served, engine_config, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

COPY_PROMPT = [5, 17, 300, 42, 9, 77] * 5  # a period-6 pattern the tiny model keeps repeating


def _request(request_id: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParameters(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=pb.TokenIds(ids=COPY_PROMPT), sampling=sampling)


async def _generate(channel: grpc.aio.Channel, request_id: str) -> tuple[list[int], list[float]]:
    responses = [r async for r in generation_pb2_grpc.GenerationServiceStub(channel).Generate(_request(request_id))]
    return [t for r in responses for t in r.token_ids], [round(lp.logprob, 4) for r in responses for lp in r.logprobs]


async def test_a_speculating_server_streams_the_plain_tokens_and_counts_its_drafts(
    tiny_served: Served, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer, start_engine

    plain = await _generate(tiny_served.channel, "plain-copy")
    log_url = f"sqlite:///{tmp_path / 'events.db'}"
    config = engine_config(
        log_url,
        model=str(tiny_model_dir),
        num_kv_blocks=512,
        block_size=4,
        speculative="ngram",
        num_speculative_tokens=4,
        speculative_ngram_min=1,
    )
    engine = await start_engine(config)
    server = NanoServer(engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=None, grace_s=0.5))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            speculated = await _generate(channel, "speculated-copy")
            served = Served(server, channel, log_url)
            await wait_pool_free(served)
            status = await allocation_pb2_grpc.AllocationServiceStub(channel).GetPoolStatus(apb.GetPoolStatusRequest())
    finally:
        await server.stop(0.5)
    assert speculated[0] == plain[0]
    assert speculated[1] == plain[1]
    assert len(speculated[0]) == 40
    assert status.num_accepted_draft_tokens > 0
    assert status.num_draft_tokens >= status.num_accepted_draft_tokens
    report = audit(log_url)
    assert report.clean, report.render()
    assert report.closed
