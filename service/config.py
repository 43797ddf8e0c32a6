"""Server configuration, and the one function that builds every config.

``ServerConfig`` holds what the gRPC process needs (addresses, TLS, auth,
shutdown grace, logging); the engine's dataclasses hold the rest. Every setting
is declared once in ``nanoserve.service.settings.SETTINGS``; ``build_configs``
resolves flags, ``NANOSERVE_*`` variables and defaults into both configs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.service.setting import ENV_PREFIX
from nanoserve.service.settings import LOG_FORMATS, LOG_LEVELS, SETTINGS, resolve
from nanoserve.service.tenants import TenantTable

if TYPE_CHECKING:  # the engine package imports torch; `nanoserve --help` should not
    from nanoserve.engine.config import EngineConfig


AUTH_SOURCES = ("auth_token", "auth_tokens_file", "auth_tokens")  # the ways to give tokens: one at most
AUTH_TOKENS_SOURCE = "--auth-tokens/NANOSERVE_AUTH_TOKENS"  # how a bad line of auth_tokens is named


def _check_port(name: str, port: int | None) -> None:
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in [0, 65535] (0 = any free port), got {port}")


@dataclass
class ServerConfig:
    """The gRPC process: where it listens and how it behaves.

    port / metrics_port: 0 binds any free port (tests); ``metrics_port=None``
        serves no metrics.
    tls_cert / tls_key: PEM files; both or neither (plaintext).
    tls_client_ca: PEM CA certificates; set, the TLS handshake requires a client
        certificate they signed (mutual TLS; needs tls_cert). The tokens file's
        ``cert`` lines map a certificate's subject common name to a tenant.
    auth_token: when set, every call but health must carry
        ``authorization: Bearer <token>``; the token is tenant ``default``, role admin.
    auth_tokens_file: the tokens file (``nanoserve.service.tenants``): each token
        names a tenant and a role; read at start (a bad file is a ValueError) and
        again on SIGHUP. With none of the three, the server is open: one anonymous
        tenant with admin rights.
    auth_tokens: the tokens file's lines themselves (``NANOSERVE_AUTH_TOKENS``,
        where a ``;`` also ends a line), for deployments that hand secrets in as
        environment variables; read once at start (a process's environment cannot
        change, so SIGHUP reloads only a file). ``auth_token``, ``auth_tokens_file``
        and ``auth_tokens`` exclude each other: with two set, neither wins and
        the server refuses to start.
    metrics_host: the address the metrics HTTP port binds (127.0.0.1: the
        metrics answer without a token, so only this host reads them by default).
    share_prefix_cache_across_tenants: tenants share prefix-cache blocks; off,
        each tenant's blocks are keyed by its name as by a ``cache_salt``.
    grace_s: on SIGTERM/SIGINT, seconds that streams in flight may take to
        finish before they are aborted.
    max_request_bytes: the largest request message the server reads; larger
        ones are refused by gRPC itself with RESOURCE_EXHAUSTED (no RetryInfo:
        the same request can never succeed). None derives it from the model:
        the longest prompt ``max_model_len`` allows plus ``REQUEST_OVERHEAD_BYTES``.
    event_log_retention_s / event_log_retention_bytes: finished epochs of the
        server's pool that ended longer ago / that lie beyond this many bytes
        of newer epochs are archived by a background thread (``log_retention``),
        and so is the open epoch's older part, in segments cut at checkpoints;
        0 turns a bound off, both 0 archive nothing.
    event_log_archive_dir: the archive files' folder; None: ``<log file>.archive``
        beside a SQLite log, ``./nanoserve-log-archive`` otherwise.
    max_read_calls_per_s: Abort and Resume calls one peer may make per second,
        in bursts of as many; more are refused with RESOURCE_EXHAUSTED and RetryInfo.
    """

    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int | None = 9090
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token: str | None = None
    auth_tokens_file: str | None = None
    auth_tokens: str | None = None
    metrics_host: str = "127.0.0.1"
    share_prefix_cache_across_tenants: bool = False
    grace_s: float = 10.0
    log_format: str = "auto"
    log_level: str = "info"
    max_request_bytes: int | None = None
    event_log_retention_s: float = 86_400.0
    event_log_retention_bytes: int = 4 << 30
    event_log_archive_dir: str | None = None
    max_read_calls_per_s: float = 100.0

    def __post_init__(self) -> None:
        if not self.event_log_retention_s >= 0:
            raise ValueError(f"event_log_retention_s must be >= 0 seconds (0: off), got {self.event_log_retention_s}")
        if self.event_log_retention_bytes < 0:
            raise ValueError(f"event_log_retention_bytes must be >= 0 (0: off), got {self.event_log_retention_bytes}")
        _check_port("port", self.port)
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024 bytes, got {self.max_request_bytes}")
        _check_port("metrics_port", self.metrics_port)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together (got only one)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key: client certificates are asked for over TLS")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0 seconds, got {self.grace_s}")
        if not self.max_read_calls_per_s > 0:
            raise ValueError(f"max_read_calls_per_s must be > 0, got {self.max_read_calls_per_s}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.auth_token == "":
            raise ValueError("auth_token must not be empty (leave it unset to disable auth)")
        given = [name for name in AUTH_SOURCES if getattr(self, name) is not None]
        if len(given) > 1:
            flags = " and ".join(f"--{name.replace('_', '-')} ({ENV_PREFIX}{name.upper()})" for name in given)
            raise ValueError(f"{flags} are exclusive: give the tokens one way (none of them wins over another)")
        if self.auth_tokens_file is not None or self.auth_tokens is not None:
            self.tenant_table()  # bad tokens are refused at start (TenantsFileError is a ValueError)

    @property
    def auth_enabled(self) -> bool:
        return any(getattr(self, name) is not None for name in AUTH_SOURCES)

    def tenant_table(self) -> TenantTable | None:
        """The tokens as configured now (the file read again); None without auth.

        Raises TenantsFileError (a ValueError) naming the file (or variable) and line."""
        if self.auth_tokens_file is not None:
            return TenantTable.read(self.auth_tokens_file)
        if self.auth_tokens is not None:
            return TenantTable.parse(self.auth_tokens.replace(";", "\n"), AUTH_TOKENS_SOURCE)
        if self.auth_token is not None:
            return TenantTable.single_token(self.auth_token)
        return None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def build_configs(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> tuple[ServerConfig, EngineConfig]:
    """Builds ``ServerConfig`` and ``EngineConfig`` from flags and ``NANOSERVE_*`` variables.

    Raises ValueError (from the dataclasses) naming a bad value and its range.
    """
    from nanoserve.engine.config import EngineConfig

    environ = os.environ if environ is None else environ
    values = resolve(args, environ)
    server = {s.name: values[s.name] for s in SETTINGS if s.layer == "server"}
    engine = {s.name: values[s.name] for s in SETTINGS if s.layer == "engine"}
    try:
        return ServerConfig(**server), EngineConfig.from_kwargs(**engine)
    except ValueError as exc:
        raise ValueError(_with_variable(str(exc), args, environ)) from None


def _with_variable(message: str, args: argparse.Namespace | None, environ: Mapping[str, str]) -> str:
    """``message`` (``"<setting> must be ..."``) led by the variable that gave the value, when a
    ``NANOSERVE_*`` variable and not a flag did: the user set the variable, not the name."""
    name = message.partition(" ")[0]
    setting = next((s for s in SETTINGS if s.name == name), None)
    if setting is None or (args is not None and hasattr(args, name)) or setting.env not in environ:
        return message
    return f"{setting.env}={environ[setting.env]!r}: {message}"
