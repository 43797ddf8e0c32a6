"""A client that does not read its Generate stream is cut off at the stream's bound (issue 31):
its request is aborted at once (blocks freed) and the call ends RESOURCE_EXHAUSTED naming the bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from ..conftest import Served, engine_config, serving, wait_pool_free

pytestmark = pytest.mark.asyncio(loop_scope="module")

# a reader that does not come back for this many steps is cut off: the tiny model's steps take a few ms,
# so 32 (as before) cut the stream read as it comes whenever CI's load stalled this process's event loop for
# about 0.1 s; 256 allows a second, and the unread stream is still cut long before its 1000 tokens (its first
# outputs fill the 64 KiB HTTP/2 window, about 130 of these messages, then 256 more wait)
MAX_STREAM_BUFFER_MESSAGES = 256


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bounded(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> AsyncIterator[Served]:
    log_url = f"sqlite:///{Path(tmp_path_factory.mktemp('bounded-log')) / 'events.db'}"
    config = engine_config(
        log_url,
        model=str(tiny_model_dir),
        num_kv_blocks=512,
        block_size=4,
        max_stream_buffer_messages=MAX_STREAM_BUFFER_MESSAGES,
    )
    async with serving(config, log_url, grace_s=2.0, metrics_port=0) as served:
        yield served


def _request(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt="Once upon a time",
        sampling=pb.SamplingParameters(max_tokens=1000, temperature=0.0, ignore_eos=True, logprobs=20),
    )


async def test_an_unread_stream_ends_resource_exhausted_and_frees_its_blocks(bounded: Served) -> None:
    # without BDP probing the client's HTTP/2 window stays 64 KiB: the server's writes then wait for the
    # reader after a few hundred of these messages, and the outputs after those wait in the stream
    address = f"127.0.0.1:{bounded.server.port}"  # type: ignore[attr-defined]
    async with grpc.aio.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(_request("unread"), timeout=120.0)
        await asyncio.sleep(0.5)  # let it start: the server runs ahead of the client
        status = await wait_pool_free(bounded, timeout_s=60.0)  # aborted long before its 1000 tokens
        num_tokens = 0
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for response in call:
                num_tokens += len(response.token_ids)
                assert not response.HasField("finish")
    assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"--max-stream-buffer-messages={MAX_STREAM_BUFFER_MESSAGES}" in (error.value.details() or "")
    assert num_tokens < 1000
    assert status.num_free == status.num_blocks  # type: ignore[attr-defined]


async def test_a_stream_read_as_it_comes_is_whole(bounded: Served) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(bounded.channel)
    responses = [response async for response in stub.Generate(_request("read"), timeout=120.0)]
    assert responses[-1].finish.usage.completion_tokens == 1000
    assert sum(len(response.token_ids) for response in responses) == 1000
    assert all(len(response.logprobs) == len(response.token_ids) for response in responses)
