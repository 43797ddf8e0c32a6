"""Fixtures for the request journal's tests: a migrated log URL on SQLite and on PostgreSQL, a pool id."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from nanoserve.migrations import upgrade


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def log_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated event-log database: a fresh SQLite file, or the shared PostgreSQL test database."""
    url = f"sqlite:///{tmp_path / 'log.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    upgrade(url)
    return url


@pytest.fixture
def pool_id() -> str:
    """A pool id of its own per test, so tests sharing the PostgreSQL database never collide."""
    return f"test-{uuid.uuid4().hex[:12]}"
