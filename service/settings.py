"""The settings table: every ``serve`` setting declared once, with its flag, variable, default and help.

A setting reaches the program three ways, in this order of precedence: a ``--flag``,
a ``NANOSERVE_*`` environment variable, the default. ``add_arguments`` turns the
table into argparse flags whose ``--help`` names the variable and the default;
``resolve`` reads them; ``nanoserve.service.config.build_configs`` builds the
configs; ``nanoserve.service.cli.config_docs`` writes docs/configuration.md's table.
A row's shape and the parsers of its values are in ``setting.py``; the engine layer's rows
(model, KV cache, scheduler, speculative decoding, streams, structured outputs, event log)
in ``engine_settings.py``, the server's here.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from nanoserve.service.engine_settings import ENGINE_SETTINGS
from nanoserve.service.setting import (
    Setting,
    parse_bool,
    parse_optional_bytes,
    parse_optional_int,
)

LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")


SETTINGS: tuple[Setting, ...] = (
    *ENGINE_SETTINGS,
    # server
    Setting("host", "server", str, "0.0.0.0", "address the gRPC server binds"),
    Setting("port", "server", int, 50051, "gRPC port (0 = any free port)"),
    Setting(
        "metrics_port",
        "server",
        parse_optional_int,
        9090,
        "Prometheus metrics HTTP port ('off' = no metrics, 0 = any free port); it answers without a token",
    ),
    Setting(
        "metrics_host",
        "server",
        str,
        "127.0.0.1",
        "address the metrics HTTP port binds; the default keeps metrics to this host (0.0.0.0: everyone)",
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
        "tls_client_ca",
        "server",
        str,
        None,
        "PEM CA certificates: mutual TLS, every client must present a certificate they signed (needs --tls-cert); "
        "a 'cert COMMON_NAME TENANT ROLE' line of --auth-tokens-file names its tenant",
        default_help="none: no client certificate asked for",
    ),
    Setting(
        "auth_token",
        "server",
        str,
        None,
        "require 'authorization: Bearer TOKEN' on every call except health",
        default_help="none: no token required",
    ),
    Setting(
        "auth_tokens_file",
        "server",
        str,
        None,
        "file of 'token TOKEN TENANT ROLE' and 'cert COMMON_NAME TENANT ROLE' lines (role client or admin; "
        "docs/security.md), read again on SIGHUP; excludes --auth-token and --auth-tokens",
        default_help="none: no token required, every caller is admin",
    ),
    Setting(
        "auth_tokens",
        "server",
        str,
        None,
        "the lines of --auth-tokens-file given as a value (';' also ends a line), for secrets handed in "
        "as environment variables; read at start only (SIGHUP reloads a file); excludes --auth-tokens-file "
        "and --auth-token",
        default_help="none",
    ),
    Setting(
        "share_prefix_cache_across_tenants",
        "server",
        parse_bool,
        False,
        "let tenants share prefix-cache blocks (off: each tenant's blocks are keyed by its name, like a cache_salt)",
    ),
    Setting(
        "max_request_bytes",
        "server",
        parse_optional_bytes,
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
    Setting(
        "max_read_calls_per_s",
        "server",
        float,
        100.0,
        "Abort and Resume calls one tenant (without auth: one address) may make per second (a burst of as many); "
        "more get RESOURCE_EXHAUSTED with RetryInfo",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per setting; an absent flag sets nothing, so env or default decide."""
    for setting in SETTINGS:
        help_text = f"{setting.help} [env {setting.env}; default: {setting.shown_default}]"
        if setting.parse is parse_bool:
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

    Raises ValueError naming the variable and the type it expects when an environment value does not parse.
    """
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        if args is not None and hasattr(args, setting.name):
            values[setting.name] = getattr(args, setting.name)
        elif setting.env in environ:
            raw = environ[setting.env]
            try:
                values[setting.name] = setting.parse(raw)
            except ValueError:
                raise ValueError(f"{setting.env}={raw!r}: expected {setting.expected}") from None
            if setting.choices and values[setting.name] not in setting.choices:
                raise ValueError(f"{setting.env} must be one of {setting.choices}, got {raw!r}")
        else:
            values[setting.name] = setting.default
    if isinstance(values["event_log_url"], str) and values["event_log_url"].lower() == "none":
        values["event_log_url"] = None
    return values
