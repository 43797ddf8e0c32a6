"""Fixtures for the allocator's log tests: a migrated log URL on SQLite and on PostgreSQL."""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path

import pytest

from nanoserve.migrations import upgrade

# the module, not the function that nanoserve.allocator exports under the same name
replay_module = importlib.import_module("nanoserve.allocator.log.replay")


@pytest.fixture(params=["sqlite", "sqlite-verifier", pytest.param("postgresql", marks=pytest.mark.postgres)])
def log_url(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A migrated event-log database: a fresh SQLite file, or the shared PostgreSQL test database.

    ``sqlite-verifier`` replays every epoch the way a large one is replayed:
    hash chain verified in a second process, rows applied by the fast loop.
    """
    if request.param == "sqlite-verifier":
        monkeypatch.setattr(replay_module, "NUM_EVENTS_FOR_VERIFIER", 1)
        monkeypatch.setattr(replay_module, "_has_idle_core", lambda: True)
    url = (
        f"sqlite:///{tmp_path / 'log.db'}" if request.param.startswith("sqlite") else request.getfixturevalue("pg_url")
    )
    upgrade(url)
    return url


@pytest.fixture
def pool_id() -> str:
    """A pool id of its own per test, so tests sharing the PostgreSQL database never collide."""
    return f"test-{uuid.uuid4().hex[:12]}"
