"""Fixtures for the allocator's log tests: a log URL on SQLite and on PostgreSQL."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def log_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated event-log database: a fresh SQLite file, or the shared PostgreSQL test database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'log.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def pool_id() -> str:
    """A pool id of its own per test, so tests sharing the PostgreSQL database never collide."""
    return f"test-{uuid.uuid4().hex[:12]}"
