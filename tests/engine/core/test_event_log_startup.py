"""The event log's store is checked before the model loads (issue 9, fault 7).

Every engine here names a model that does not exist: an engine that loaded the model first would
fail with FileNotFoundError; one that checks the log first fails with EventLogUnusableError, whose
one-line message names the store and the cause.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core.log_setup import build_engine
from nanoserve.engine.errors import EventLogUnusableError
from nanoserve.migrations import upgrade

from ...faults import Tmpfs, free_port

MISSING_MODEL = "/nonexistent/model.gguf"


def start(url: str, **kwargs: object) -> None:
    build_engine(EngineConfig.from_kwargs(model=MISSING_MODEL, event_log_url=url, **kwargs))


def unusable(url: str, **kwargs: object) -> str:
    with pytest.raises(EventLogUnusableError) as info:
        start(url, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_model_alone_is_found_after_the_log(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        start(f"sqlite:///{tmp_path / 'log.db'}")  # a usable log: the model's absence is what fails


def test_postgresql_that_is_down(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://postgres:secret@127.0.0.1:{free_port()}/nanoserve"
    message = unusable(url)
    assert message.startswith(f"event log postgresql+psycopg://postgres:***@127.0.0.1:{url.split(':')[3]}")
    assert "is unusable: OperationalError: connection failed:" in message
    assert "secret" not in message


def test_folder_that_does_not_exist(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'none' / 'log.db'}"
    assert unusable(url) == (
        f"event log {url} is unusable: event log store {url} is unavailable: "
        f"folder '{tmp_path / 'none'}' does not exist"
    )


def test_schema_missing_without_migrations(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bare.db'}"
    assert unusable(url, event_log_migrate=False) == (
        f"event log {url} is unusable: '{url}' holds no event log schema (run `nanoserve db upgrade {url}`)"
    )


needs_tmpfs = pytest.mark.skipif(not Tmpfs.available(), reason="needs root and a tmpfs mount")


@pytest.fixture
def media() -> Iterator[Tmpfs]:
    with Tmpfs(2 << 20) as tmpfs:
        yield tmpfs


@needs_tmpfs
def test_read_only_filesystem(media: Tmpfs) -> None:
    url = f"sqlite:///{media.path / 'log.db'}"
    upgrade(url)
    media.read_only()
    assert unusable(url) == (
        f"event log {url} is unusable: event log store {url} is unavailable: "
        f"folder '{media.path}' is on a read-only filesystem"
    )


@needs_tmpfs
def test_full_filesystem(media: Tmpfs) -> None:
    url = f"sqlite:///{media.path / 'log.db'}"
    upgrade(url)
    media.fill()
    message = unusable(url)
    assert message.startswith(f"event log {url} is unusable: event log store {url} is unavailable: its filesystem has ")
    assert message.endswith("bytes free, less than the 1048576 a new epoch needs")
