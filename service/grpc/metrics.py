"""Prometheus metrics of the server, served over HTTP by prometheus-client.

Counters and histograms are fed once per finished request
(``observe_finished``); the gauges (running and waiting requests, KV blocks
used and free, the event log's lag, backlog and durability) are refreshed from ``engine.pool_status()`` by
the server's monitor task (``observe_pool``). Each server owns its registry, so
several servers in one process (tests) do not collide.

Per tenant (label ``tenant``: the scope of the engine's request id, which the
service sets to the caller's tenant; "" on a server without auth): finished
requests and their tokens, and running and waiting requests and the blocks
they hold. The tenants are those of the tokens file, so the label's values are
bounded by the operator; a tenant whose requests all ended has its gauges at 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from nanoserve.engine.core.status import ScopeUsage, scope_of
from nanoserve.service.grpc.ports import PortUnavailableError

# seconds; the decode step of a small model on a CPU is ~10 ms, a long queue minutes
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# seconds; a small schema compiles in about a millisecond, a large one in a second or more
COMPILE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# seconds filling one step's grammar masks (all constrained rows together)
MASK_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


@dataclass(frozen=True)
class FinishedRequest:
    """What the metrics and the request log line need from one finished request (seconds)."""

    request_id: str
    finish_reason: str
    abort_cause: str | None  # why an aborted request ended (AbortCause value); None otherwise
    num_prompt_tokens: int
    num_completion_tokens: int
    queue_s: float | None
    ttft_s: float | None
    total_s: float | None
    num_preemptions: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.total_s is None or self.num_completion_tokens < 2:
            return None
        return (self.total_s - self.ttft_s) / (self.num_completion_tokens - 1)


class ServerMetrics:
    """The server's Prometheus metrics (names prefixed ``nanoserve_``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "nanoserve_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("nanoserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(
            "nanoserve_generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.preemptions = Counter("nanoserve_preemptions", "Preemptions suffered by finished requests", registry=r)
        self.ttft = Histogram(
            "nanoserve_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.tpot = Histogram(
            "nanoserve_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "nanoserve_e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.num_running = Gauge("nanoserve_num_requests_running", "Requests running", registry=r)
        self.num_waiting = Gauge("nanoserve_num_requests_waiting", "Requests waiting", registry=r)
        self.kv_blocks_used = Gauge("nanoserve_kv_blocks_used", "KV cache blocks allocated", registry=r)
        self.kv_blocks_free = Gauge("nanoserve_kv_blocks_free", "KV cache blocks free", registry=r)
        self.event_log_lag = Gauge(
            "nanoserve_event_log_lag_events", "Events assigned but not yet durable (last_seq - durable_seq)", registry=r
        )
        self.event_log_pending_batches = Gauge(
            "nanoserve_event_log_pending_batches",
            "Steps whose events wait for the log's store (generation waits at --event-log-max-pending-batches)",
            registry=r,
        )
        self.event_log_pending_bytes = Gauge(
            "nanoserve_event_log_pending_bytes", "Bytes of the log records that wait for the store", registry=r
        )
        self.journal_wait = Histogram(
            "nanoserve_journal_durability_wait_seconds",
            "Per step with outputs: from the step's end until its request journal batch was durable and its "
            "tokens went to the clients (the latency the journal adds; not fed with --stream-before-durable)",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.event_log_durable = Gauge(
            "nanoserve_event_log_durable",
            "1 while the event log commits, 0 while it cannot (new requests are refused)",
            registry=r,
        )

        self.kv_blocks_cached = Gauge(
            "nanoserve_kv_blocks_cached", "KV cache blocks registered in the prefix cache (held or free)", registry=r
        )
        self.kv_blocks_shared = Gauge(
            "nanoserve_kv_blocks_shared", "KV cache blocks held by more than one request", registry=r
        )
        self.prefix_cache_queries = Counter(
            "nanoserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            "nanoserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.cached_tokens = Counter(
            "nanoserve_cached_prompt_tokens",
            "Prompt tokens of finished requests served from the prefix cache",
            registry=r,
        )
        self.kv_blocks_forked = Counter(
            "nanoserve_kv_blocks_forked", "Block references parallel sampling's forks took", registry=r
        )
        self.kv_blocks_copied = Counter(
            "nanoserve_kv_blocks_copied", "Forked blocks copied on write by parallel samples", registry=r
        )
        self.speculative_draft_tokens = Counter(
            "nanoserve_speculative_draft_tokens", "Draft tokens speculative decoding verified", registry=r
        )
        self.speculative_accepted_tokens = Counter(
            "nanoserve_speculative_accepted_tokens",
            "Draft tokens speculative decoding accepted (acceptance rate: accepted / draft)",
            registry=r,
        )
        self.tenant_requests = Counter(
            "nanoserve_tenant_requests",
            "Finished requests by tenant and finish reason",
            ["tenant", "finish_reason"],
            registry=r,
        )
        self.tenant_prompt_tokens = Counter(
            "nanoserve_tenant_prompt_tokens", "Prompt tokens of finished requests by tenant", ["tenant"], registry=r
        )
        self.tenant_generation_tokens = Counter(
            "nanoserve_tenant_generation_tokens",
            "Generated tokens of finished requests by tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_running = Gauge(
            "nanoserve_tenant_requests_running", "Requests running by tenant", ["tenant"], registry=r
        )
        self.tenant_waiting = Gauge(
            "nanoserve_tenant_requests_waiting", "Requests waiting by tenant", ["tenant"], registry=r
        )
        self.tenant_blocks_held = Gauge(
            "nanoserve_tenant_kv_blocks_held",
            "KV blocks in the block tables of a tenant's running requests (a shared block counts for each holder)",
            ["tenant"],
            registry=r,
        )
        self._tenants_seen: set[str] = set()
        self.structured_requests = Counter(
            "nanoserve_structured_output_requests",
            "Requests admitted with a structured-output constraint, by kind (json_schema, regex, ...)",
            ["kind"],
            registry=r,
        )
        self.grammar_compile = Histogram(
            "nanoserve_structured_output_compile_seconds",
            "Time to compile one structured-output grammar (cache misses only)",
            buckets=COMPILE_BUCKETS_S,
            registry=r,
        )
        self.grammar_mask = Histogram(
            "nanoserve_structured_output_mask_seconds",
            "Per step with constrained rows: time to fill their allowed-token masks",
            buckets=MASK_BUCKETS_S,
            registry=r,
        )
        # (counter, labels) -> the engine's running total already counted (``_advance_to``)
        self._totals_seen: dict[tuple[int, tuple[tuple[str, str], ...]], int] = {}

    def observe_tenants(self, scopes: tuple[ScopeUsage, ...]) -> None:
        """The per-tenant gauges, from the engine's per-scope usage; tenants now absent go to 0."""
        usage = {u.scope: (u.num_running, u.num_waiting, u.num_blocks_held) for u in scopes}
        for tenant in self._tenants_seen | usage.keys():
            values = usage.get(tenant, (0, 0, 0))
            for gauge, value in zip(
                (self.tenant_running, self.tenant_waiting, self.tenant_blocks_held), values, strict=True
            ):
                gauge.labels(tenant=tenant).set(value)
        self._tenants_seen |= usage.keys()

    def observe_structured_outputs(
        self, num_requests_by_kind: dict[str, int], compile_times_s: list[float], mask_times_s: list[float]
    ) -> None:
        """The constrained-request counters advanced to the engine's running totals; each timing observed."""
        for kind, total in num_requests_by_kind.items():
            self._advance_to(self.structured_requests, total, kind=kind)
        for seconds in compile_times_s:
            self.grammar_compile.observe(seconds)
        for seconds in mask_times_s:
            self.grammar_mask.observe(seconds)

    def observe_prefix_cache(self, num_cached: int, num_shared: int, queries: int, hits: int) -> None:
        """The prefix cache's gauges, and its counters advanced to the engine's running totals."""
        self.kv_blocks_cached.set(num_cached)
        self.kv_blocks_shared.set(num_shared)
        self._advance_to(self.prefix_cache_queries, queries)
        self._advance_to(self.prefix_cache_hits, hits)

    def observe_forks(self, num_forked: int, num_copied: int) -> None:
        """The fork counters advanced to the engine's running totals."""
        self._advance_to(self.kv_blocks_forked, num_forked)
        self._advance_to(self.kv_blocks_copied, num_copied)

    def observe_speculation(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """The speculative decoding counters advanced to the engine's running totals."""
        self._advance_to(self.speculative_draft_tokens, num_draft_tokens)
        self._advance_to(self.speculative_accepted_tokens, num_accepted_tokens)

    def _advance_to(self, counter: Counter, total: int, **labels: str) -> None:
        """Advances ``counter`` (its ``labels`` child) to the engine's running ``total``: by what the
        total gained since the last call (never back: a total read late is not counted twice)."""
        key = (id(counter), tuple(sorted(labels.items())))
        seen = self._totals_seen.get(key, 0)
        (counter.labels(**labels) if labels else counter).inc(max(0, total - seen))
        self._totals_seen[key] = max(total, seen)

    def observe_finished(self, request: FinishedRequest) -> None:
        self.requests.labels(finish_reason=request.finish_reason).inc()
        tenant = scope_of(request.request_id)
        self.tenant_requests.labels(tenant=tenant, finish_reason=request.finish_reason).inc()
        self.tenant_prompt_tokens.labels(tenant=tenant).inc(request.num_prompt_tokens)
        self.tenant_generation_tokens.labels(tenant=tenant).inc(request.num_completion_tokens)
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.generation_tokens.inc(request.num_completion_tokens)
        self.preemptions.inc(request.num_preemptions)
        self.cached_tokens.inc(request.num_cached_tokens)
        if request.ttft_s is not None:
            self.ttft.observe(request.ttft_s)
        if request.tpot_s is not None:
            self.tpot.observe(request.tpot_s)
        if request.total_s is not None:
            self.e2e.observe(request.total_s)

    def observe_pool(
        self,
        num_running: int,
        num_waiting: int,
        num_allocated: int,
        num_free: int,
        last_seq: int | None,
        durable_seq: int | None,
        num_pending_batches: int | None = None,
        pending_bytes: int | None = None,
        log_durable: bool | None = None,
    ) -> None:
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_blocks_used.set(num_allocated)
        self.kv_blocks_free.set(num_free)
        if last_seq is not None and durable_seq is not None:
            self.event_log_lag.set(max(0, last_seq - durable_seq))
        if num_pending_batches is not None:
            self.event_log_pending_batches.set(num_pending_batches)
        if pending_bytes is not None:
            self.event_log_pending_bytes.set(pending_bytes)
        if log_durable is not None:
            self.event_log_durable.set(int(log_durable))

    def serve_http(self, host: str, port: int) -> tuple[object, int]:
        """Starts the /metrics HTTP server on a daemon thread; returns (server, bound port).

        Raises PortUnavailableError (an OSError naming --metrics-port) when the port cannot be bound."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise PortUnavailableError("--metrics-port", host, port, exc) from None
        return server, server.server_port
