"""Structured logging for the server (structlog).

JSON lines when stderr is not a terminal (containers, log shippers), readable
colour-free console lines on one. Every line has a UTC ISO timestamp, the level
and an event name; the fields carry units in their names (``ttft_s``).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(log_format: str = "auto", log_level: str = "info", stream: TextIO | None = None) -> None:
    """Routes structlog (and the standard library's ``logging``) to ``stream`` (default stderr).

    log_format: ``json``, ``console`` or ``auto`` (console when ``stream`` is a TTY).
    """
    stream = stream or sys.stderr
    if log_format == "auto":
        log_format = "console" if stream.isatty() else "json"
    level = getattr(logging, log_level.upper())
    # console: the renderer formats exceptions itself
    renderers: list[structlog.typing.Processor] = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        if log_format == "json"
        else [structlog.dev.ConsoleRenderer(colors=False)]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            *renderers,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    # libraries that log through the standard library (alembic, grpc) share the stream
    logging.basicConfig(
        stream=stream, level=max(level, logging.WARNING), format="%(levelname)s %(name)s: %(message)s", force=True
    )
