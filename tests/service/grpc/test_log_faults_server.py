"""A real server (the tiny model) whose event log's store fails under it (issue 9, faults 1-4).

- a full disk: health turns NOT_SERVING, new requests get UNAVAILABLE saying the log is not
  durable, the backlog shows in the metrics and warnings and stops at its bound; freeing the disk
  brings everything back, nothing lost;
- PostgreSQL stopped: Audit and WatchEvents get UNAVAILABLE naming the store; shutdown is bounded
  and reports the events it could not write; the epoch stays open;
- the SQLite file deleted: the server says so at once, refuses requests, and reports the epoch lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from nanoserve.allocator.log import audit
from nanoserve.allocator.log.reader import connect, list_epochs
from nanoserve.migrations import upgrade
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc, generation_pb2_grpc
from nanoserve.v1 import generation_pb2 as pb

from ...faults import PgCluster, Tmpfs
from ..conftest import engine_config

GENERATION = "nanoserve.v1.GenerationService"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Running:
    server: object  # NanoServer
    channel: grpc.aio.Channel

    @property
    def engine(self):  # AsyncLLMEngine
        return self.server.engine  # type: ignore[attr-defined]

    async def health(self, service: str = GENERATION) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

    async def generate(self, request_id: str, max_tokens: int = 8) -> list[pb.GenerateResponse]:
        stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt="Once upon a time",
            sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        return [response async for response in stub.Generate(request, timeout=30)]

    def metric(self, name: str) -> float:
        for line in generate_latest(self.server.metrics.registry).decode().splitlines():  # type: ignore[attr-defined]
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"no metric {name}")


@contextlib.asynccontextmanager
async def running(log_url: str, tiny_model_dir: Path, **overrides: object) -> AsyncIterator[Running]:
    """A server on the tiny model with its log at ``log_url``; stopped (grace 0.5 s) at the end."""
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer, start_engine

    config = engine_config(
        log_url, model=str(tiny_model_dir), num_kv_blocks=256, block_size=4, max_num_seqs=8, **overrides
    )
    engine = await start_engine(config)
    server = NanoServer(engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=None, grace_s=0.5))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Running(server, channel)
    finally:
        await server.stop()


async def eventually(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` (awaited when it is awaitable) is true."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, f"not true within {timeout_s} s"
        await asyncio.sleep(0.05)


async def refused(serving: Running) -> str:
    """The message of a Generate refused with UNAVAILABLE."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await serving.generate(f"refused-{uuid.uuid4().hex[:6]}")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    return info.value.details() or ""


# -- a full disk ------------------------------------------------------------------------------------


@pytest.mark.skipif(not Tmpfs.available(), reason="needs root and a tmpfs mount")
async def test_full_disk_is_visible_and_honest_and_recovers_without_loss(tiny_model_dir: Path) -> None:
    with Tmpfs(8 << 20) as media, structlog.testing.capture_logs() as logs:
        url = f"sqlite:///{media.path / 'log.db'}"
        async with running(url, tiny_model_dir, event_log_max_pending_batches=8) as serving:
            assert len(await serving.generate("before")) >= 1
            assert (await serving.health(), serving.metric("nanoserve_event_log_durable")) == (SERVING, 1.0)

            media.fill()
            long_stream = asyncio.ensure_future(serving.generate("during", max_tokens=120))
            await eventually(lambda: serving.engine.pool_status().num_pending_batches == 8)  # the bound
            await eventually(lambda: _is(serving.health(), NOT_SERVING))
            message = await refused(serving)
            assert message.startswith(f"event log not durable: commits to {url} have failed for ")
            assert "(OperationalError: database or disk is full)" in message
            assert message.endswith("new requests are refused until it is (retry later, or on another server)")
            await eventually(lambda: serving.metric("nanoserve_event_log_pending_batches") == 8.0)
            assert serving.metric("nanoserve_event_log_durable") == 0.0
            assert serving.metric("nanoserve_event_log_pending_bytes") > 0
            assert not long_stream.done()  # generation waits for the store: the bound holds

            media.free()
            await eventually(lambda: _is(serving.health(), SERVING))
            responses = await long_stream
            assert sum(len(response.token_ids) for response in responses) == 120
            assert len(await serving.generate("after")) >= 1
            await eventually(lambda: serving.engine.pool_status().durable_seq == serving.engine.pool_status().last_seq)
            # the monitor logs the drained backlog at its next look (every MONITOR_INTERVAL_S)
            await eventually(lambda: any(entry["event"] == "event_log_backlog_cleared" for entry in logs))
        assert serving.engine.log_close_error is None
        report = audit(url)
        assert (report.clean, report.closed, report.state.num_free) == (True, True, 256)
    events = [entry["event"] for entry in logs]
    assert "event_log_not_durable" in events
    assert "event_log_durable_again" in events
    backlog = [entry for entry in logs if entry["event"] == "event_log_backlog"]
    assert backlog  # one warning per quarter of the bound the monitor saw filled, the last one full
    assert (backlog[-1]["num_pending_batches"], backlog[-1]["max_pending_batches"], backlog[-1]["full"]) == (8, 8, True)
    assert "event_log_backlog_cleared" in events


async def _is(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


# -- PostgreSQL stopped -------------------------------------------------------------------------------


async def test_postgresql_outage_gives_unavailable_and_a_bounded_shutdown_reports_what_is_lost(
    pg_cluster: PgCluster, tiny_model_dir: Path
) -> None:
    name = f"serve_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_cluster.url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = pg_cluster.url(name)
    upgrade(url)
    try:
        # streams in flight go on while the store is away only when tokens need not wait for their
        # journal batch (with the journal's default, they wait for the store: tests/service/test_journal_server.py)
        async with running(url, tiny_model_dir, event_log_close_timeout_s=1.0, stream_before_durable=True) as serving:
            await serving.generate("before")
            await eventually(lambda: serving.engine.pool_status().durable_seq == serving.engine.pool_status().last_seq)
            allocation = allocation_pb2_grpc.AllocationServiceStub(serving.channel)
            pg_cluster.stop()
            for call in (
                allocation.Audit(apb.AuditRequest()),
                _first(allocation.WatchEvents(apb.WatchEventsRequest(from_seq=1))),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert (info.value.details() or "").startswith(
                    f"event log store {url} is unavailable: OperationalError"
                )

            stream = asyncio.ensure_future(serving.generate("during", max_tokens=40))
            await eventually(lambda: _is(serving.health(), NOT_SERVING))
            assert (await refused(serving)).startswith(f"event log not durable: commits to {url} have failed")
            assert sum(len(r.token_ids) for r in await stream) == 40  # the backlog is far from its bound
            status = serving.engine.pool_status()
            started = time.monotonic()
        # server.stop(): grace 0.5 s, then the log gets 1 s
        assert time.monotonic() - started < 4.0
        error = serving.engine.log_close_error
        assert error is not None
        assert (error.first_seq, error.last_seq) == (status.durable_seq + 1, status.last_seq + 1)  # + POOL_CLOSE
        assert str(error).startswith(
            f"event log {url} is incomplete: {error.num_events} events "
            f"(seqs {error.first_seq}..{error.last_seq}) not written: the store did not take them within 1.0 s"
        )
    finally:
        pg_cluster.start_if_stopped()
    with connect(url) as conn:
        (info,) = list_epochs(conn)
    assert (info.closed, info.durable_seq) == (False, status.durable_seq)  # the next start sees it crashed
    report = audit(url)
    assert (report.clean, report.crashed) == (True, True)


async def _first(call: grpc.aio.UnaryStreamCall) -> object:
    async for response in call:
        return response
    return None


# -- the SQLite file deleted ------------------------------------------------------------------------


async def test_deleted_log_file_is_noticed_and_the_epoch_reported_lost(tmp_path: Path, tiny_model_dir: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    async with running(url, tiny_model_dir) as serving:
        await serving.generate("before")
        await eventually(lambda: serving.engine.pool_status().durable_seq == serving.engine.pool_status().last_seq)
        last_seq = serving.engine.pool_status().last_seq
        for suffix in ("", "-wal", "-shm"):
            Path(f"{tmp_path / 'log.db'}{suffix}").unlink(missing_ok=True)
        await eventually(lambda: _is(serving.health(), NOT_SERVING), timeout_s=3.0)
        message = await refused(serving)
        assert message.startswith(
            f"event log not durable: the event log failed: the event log file '{tmp_path / 'log.db'}' was deleted"
        )
        assert serving.engine.pool_status().durable_seq == 0
    error = serving.engine.log_close_error
    assert error is not None
    assert (error.first_seq, error.last_seq) == (1, last_seq)
