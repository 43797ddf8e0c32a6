"""Log lines: JSON off a terminal, console on one; fields keep their names and units."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog

from nanoserve.service.logs import configure_logging


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    configure_logging("auto", "info", stream=stream)
    structlog.get_logger("t").info("request_finished", request_id="r1", ttft_s=0.25)
    line = json.loads(stream.getvalue())
    assert (line["event"], line["request_id"], line["ttft_s"], line["level"]) == (
        "request_finished",
        "r1",
        0.25,
        "info",
    )
    assert line["timestamp"].endswith("Z")


def test_console_lines_on_a_terminal() -> None:
    stream = _Terminal()
    configure_logging("auto", "info", stream=stream)
    structlog.get_logger("t").info("server_started", address="127.0.0.1:50051")
    text = stream.getvalue()
    assert "server_started" in text
    assert "address=127.0.0.1:50051" in text
    assert not text.startswith("{")


def test_level_filters_lower_lines() -> None:
    stream = io.StringIO()
    configure_logging("json", "warning", stream=stream)
    structlog.get_logger("t").info("hidden")
    structlog.get_logger("t").warning("shown")
    assert [json.loads(line)["event"] for line in stream.getvalue().splitlines()] == ["shown"]
