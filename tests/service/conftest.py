"""A real server on 127.0.0.1 (port 0) in front of the real SmolLM2, shared by a module.

Loading the model costs seconds, so one server serves every test of a module;
tests that need a different configuration put a second gRPC server in front of
the same engine (``NanoServer(..., owns_engine=False)``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

# small enough that 16 streams share it, large enough that none waits for blocks
NUM_KV_BLOCKS = 256
MAX_NUM_SEQS = 4
MAX_NUM_WAITING = 16


@dataclass
class Served:
    server: object  # NanoServer
    channel: grpc.aio.Channel
    log_url: str

    @property
    def engine(self):  # AsyncLLMEngine
        return self.server.engine  # type: ignore[attr-defined]


def engine_config(log_url: str, **overrides: object):  # -> EngineConfig
    from nanoserve.engine import EngineConfig

    settings: dict[str, object] = {
        "event_log_url": log_url,
        "num_kv_blocks": NUM_KV_BLOCKS,
        "block_size": 16,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_waiting": MAX_NUM_WAITING,
        "max_model_len": 1024,
        "dtype": "float32",
    }
    settings.update(overrides)
    return EngineConfig.from_kwargs(**settings)


@contextlib.asynccontextmanager
async def serving(
    config: object, log_url: str, *, grace_s: float = 2.0, metrics_port: int | None = 0
) -> AsyncIterator[Served]:
    """A real server on 127.0.0.1 (port 0) in front of a fresh engine built from ``config`` (an
    EngineConfig), with a channel to it; stopped (0.5 s grace) when the block ends."""
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer, start_engine

    engine = await start_engine(config)  # type: ignore[arg-type]
    server = NanoServer(engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=metrics_port, grace_s=grace_s))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Served(server, channel, log_url)
    finally:
        await server.stop(0.5)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    log_url = f"sqlite:///{Path(tmp_path_factory.mktemp('log')) / 'events.db'}"
    async with serving(engine_config(log_url), log_url) as served:
        yield served


async def wait_pool_free(served: Served, timeout_s: float = 10.0) -> object:
    """Polls GetPoolStatus until every block is free, no request runs or waits, and
    every event is durable (so the store, which Audit and WatchEvents read, has them)."""
    from nanoserve.v1 import allocation_pb2 as apb
    from nanoserve.v1 import allocation_pb2_grpc

    stub = allocation_pb2_grpc.AllocationServiceStub(served.channel)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status = await stub.GetPoolStatus(apb.GetPoolStatusRequest())
        idle = status.num_free == status.num_blocks and status.num_running == 0 and status.num_waiting == 0
        if idle and status.durable_seq == status.last_seq:
            return status
        assert asyncio.get_running_loop().time() < deadline, f"pool not free after {timeout_s} s: {status}"
        await asyncio.sleep(0.02)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tiny_served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> AsyncIterator[Served]:
    """A real server in front of the tiny random model: fast steps, for tests that drive many streams."""
    log_url = f"sqlite:///{Path(tmp_path_factory.mktemp('tiny-log')) / 'events.db'}"
    config = engine_config(
        log_url, model=str(tiny_model_dir), num_kv_blocks=512, block_size=4, max_num_seqs=8, max_num_waiting=64
    )
    async with serving(config, log_url) as served:
        yield served
