"""Migration 0012: the manifest's ``recovered_by``; an archive file of a crashed epoch names who recovered it,
and a log or file without the column (before 0012) still reads."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command

from nanoserve.allocator.log.archive import ManifestEntry, manifest_rows
from nanoserve.allocator.log.schema import archived_epochs
from nanoserve.migrations import alembic_config, upgrade

ENTRY = ManifestEntry("p", 1, 1, 9, b"h" * 32, "/a/p-epoch-00000001.db", "ab" * 32, 4096, 5, recovered_by=2)


def _read(url: str) -> list[ManifestEntry]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return manifest_rows(conn)
    finally:
        engine.dispose()


def test_recovered_by_is_stored_and_a_downgrade_keeps_the_rows_without_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.insert(archived_epochs).values(**ENTRY.__dict__))
    engine.dispose()
    assert _read(url) == [ENTRY]
    command.downgrade(alembic_config(url), "0011")
    assert _read(url) == [ManifestEntry(**{**ENTRY.__dict__, "recovered_by": None})]  # read as before 0012
    upgrade(url)
    assert _read(url) == [ManifestEntry(**{**ENTRY.__dict__, "recovered_by": None})]
