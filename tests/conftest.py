"""Fixtures shared by every test package.

PostgreSQL tests take ``pg_url``: the server named by NANOSERVE_TEST_PG_URL
(default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``). Where it cannot
be reached they skip, unless NANOSERVE_REQUIRE_PG=1 (set by CI), where they fail.
"""

from __future__ import annotations

import os

import pytest

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def pg_url() -> str:
    url = os.environ.get("NANOSERVE_TEST_PG_URL", DEFAULT_PG_URL)
    try:
        import sqlalchemy as sa

        engine = sa.create_engine(url)
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
        engine.dispose()
    except Exception as exc:  # pragma: no cover - depends on the machine
        if os.environ.get("NANOSERVE_REQUIRE_PG") == "1":
            pytest.fail(f"PostgreSQL at {url} is required but unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {url} unreachable: {exc}")
    return url
