"""Checks that a log store can take a new epoch, made before a server commits to it.

A server loads its model for many seconds; a store that is down, read-only or
full should stop it before that, with one line naming the store and the cause.
``check_filesystem`` looks at a SQLite file's folder (there, writable, not
full) before anything touches it; ``probe_store`` connects, finds the log's
schema and makes a write that changes nothing, so a read-only store or one
whose write lock is held refuses it now rather than at the first commit.
"""

from __future__ import annotations

import os

import sqlalchemy as sa

from nanoserve.allocator.log.errors import (
    LogNotFoundError,
    LogUnavailableError,
    is_store_unavailable,
    safe_url,
    store_error,
)
from nanoserve.allocator.log.schema import pool_epochs
from nanoserve.allocator.log.store import create_log_engine, sqlite_file

__all__ = ["MIN_FREE_BYTES", "check_filesystem", "check_schema", "probe_store"]

# a SQLite log's filesystem needs room for an epoch's first commits (the WAL grows a page at a time)
MIN_FREE_BYTES = 1 << 20


def check_filesystem(url: str, min_free_bytes: int = MIN_FREE_BYTES) -> None:
    """For a SQLite log: its folder exists, can be written, and has ``min_free_bytes`` free.

    SQLite writes beside the file (its ``-wal`` and ``-shm``), so the folder
    must be writable. Raises LogUnavailableError naming the store and what is
    wrong; does nothing for other stores.
    """
    path = sqlite_file(url)
    if path is None:
        return
    folder = path.resolve().parent
    problem = None
    if not folder.is_dir():
        problem = f"folder {str(folder)!r} does not exist"
    else:
        stats = os.statvfs(folder)
        if stats.f_flag & os.ST_RDONLY:
            problem = f"folder {str(folder)!r} is on a read-only filesystem"
        elif not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            problem = f"no permission to write {str(path)!r} and its -wal file"
        elif stats.f_bavail * stats.f_frsize < min_free_bytes:
            free = stats.f_bavail * stats.f_frsize
            problem = f"its filesystem has {free} bytes free, less than the {min_free_bytes} a new epoch needs"
    if problem is not None:
        raise LogUnavailableError(f"event log store {safe_url(url)} is unavailable: {problem}")


def probe_store(url: str) -> None:
    """Connect, find the log's schema, and make a write that changes nothing.

    Raises LogNotFoundError (no schema: run ``nanoserve db upgrade URL``) and
    LogUnavailableError (down, read-only, locked, full) naming the store.
    """
    engine = create_log_engine(url)
    try:
        check_schema(engine, url)
        with engine.begin() as conn:  # read-only stores refuse the write itself, rows or not
            conn.execute(sa.update(pool_epochs).where(sa.false()).values(closed_seq=None))
    except Exception as exc:
        if is_store_unavailable(exc):
            raise store_error(url, exc) from exc
        raise
    finally:
        engine.dispose()


def check_schema(engine: sa.Engine, url: str) -> None:
    """LogNotFoundError when the database behind ``engine`` holds no log schema."""
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(pool_epochs.name):
            shown = safe_url(url)
            raise LogNotFoundError(f"{shown!r} holds no event log schema (run `nanoserve db upgrade {shown}`)")
