"""Admission through gRPC: a burst fills the free running slots before anything is refused.

Issue 29, item 5: with max_num_seqs 4 and max_num_waiting 2, twelve Generate calls
sent at once are 6 admitted (4 run, 2 wait) and 6 refused with RESOURCE_EXHAUSTED,
whether or not an engine step ran between their arrivals.
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

NUM_CALLS = 12


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small_queue(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> AsyncIterator[Served]:
    log_url = f"sqlite:///{Path(tmp_path_factory.mktemp('admission-log')) / 'events.db'}"
    config = engine_config(
        log_url, model=str(tiny_model_dir), num_kv_blocks=512, block_size=4, max_num_seqs=4, max_num_waiting=2
    )
    async with serving(config, log_url, grace_s=0.5, metrics_port=None) as served:
        yield served


def _long(request_id: str) -> pb.GenerateRequest:
    # 1000 new tokens: no admitted request ends while the test counts
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=pb.TokenIds(ids=[101, 202, 303]),
        sampling=pb.SamplingParameters(max_tokens=1000, temperature=0.0, ignore_eos=True),
    )


async def test_a_burst_of_12_with_4_slots_and_a_queue_of_2_admits_6_and_refuses_6(small_queue: Served) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(small_queue.channel)
    calls = [stub.Generate(_long(f"burst{i}")) for i in range(NUM_CALLS)]
    reads = [asyncio.ensure_future(call.read()) for call in calls]
    try:
        # 4 running calls stream a first token and 6 refused calls fail; 2 waiting calls stay silent
        pending: set[asyncio.Future[object]] = set(reads)
        while len(pending) > NUM_CALLS - 10:
            finished, pending = await asyncio.wait(pending, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert finished, f"{len(pending)} calls still silent after 60 s"
        done = [read for read in reads if read.done()]
        errors = [read.exception() for read in done if read.exception() is not None]
        assert len(done) - len(errors) == 4
        assert [error.code() for error in errors] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6  # type: ignore[union-attr]
        assert all(
            "(max_num_seqs 4 + max_num_waiting 2)" in (error.details() or "")  # type: ignore[union-attr]
            for error in errors
        )
        allocation = allocation_pb2_grpc.AllocationServiceStub(small_queue.channel)
        status = await allocation.GetPoolStatus(apb.GetPoolStatusRequest())
        assert (status.num_running, status.num_waiting) == (4, 2)
        assert not any(read.done() for read in pending)
    finally:
        for call in calls:
            call.cancel()
        for read in reads:
            read.cancel()
    await wait_pool_free(small_queue)
