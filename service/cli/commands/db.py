"""``nanoserve db upgrade URL`` / ``nanoserve db downgrade URL --revision REV``: the event log's schema.

The event log's tables are created only by the Alembic migrations in
``nanoserve.migrations``; ``upgrade`` runs them (``alembic upgrade head``),
``downgrade`` undoes those after REV (``alembic downgrade REV``, each
migration's own downgrade: every row is kept, in the older form). Exit 0 on
success, 2 when the database cannot be reached, the URL is not one or the
revision is unknown.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "db",
        help="manage the event log's database schema (Alembic migrations)",
        description="Manage the allocator event log's database schema.",
    )
    actions = parser.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    upgrade = actions.add_parser(
        "upgrade",
        help="migrate the database at URL to the newest schema",
        description="Run the event log's Alembic migrations on the database at URL (alembic upgrade head, or "
        "--revision): creates the tables on a new database, brings an older one up to date. "
        "Exit 0 done, 2 unreachable database or bad URL.",
    )
    upgrade.add_argument(
        "url", metavar="URL", help="SQLAlchemy URL: sqlite:///FILE or postgresql+psycopg://USER@HOST/DB"
    )
    upgrade.add_argument("--revision", default="head", help="target revision (default: head)")
    upgrade.set_defaults(func=run_upgrade)
    downgrade = actions.add_parser(
        "downgrade",
        help="take the database at URL back to an older schema (--revision)",
        description="Undo the event log's Alembic migrations after --revision on the database at URL (alembic "
        "downgrade REV), for an older nanoserve: each keeps every row, in the older form (e.g. 0008 writes "
        "the stored keys back into the records). Stop the servers writing it first. "
        "Exit 0 done, 2 unreachable database, bad URL or unknown revision.",
    )
    downgrade.add_argument(
        "url", metavar="URL", help="SQLAlchemy URL: sqlite:///FILE or postgresql+psycopg://USER@HOST/DB"
    )
    downgrade.add_argument(
        "--revision", required=True, metavar="REV", help="the revision to go back to, e.g. 0009 (see docs/event-log.md)"
    )
    downgrade.set_defaults(func=run_downgrade)


def run_upgrade(args: argparse.Namespace) -> int:
    from nanoserve.migrations import upgrade

    return _migrate("upgrade", args.url, args.revision, lambda: upgrade(args.url, args.revision))


def run_downgrade(args: argparse.Namespace) -> int:
    from alembic import command

    from nanoserve.migrations import alembic_config

    return _migrate(
        "downgrade", args.url, args.revision, lambda: command.downgrade(alembic_config(args.url), args.revision)
    )


def _migrate(action: str, url: str, revision: str, migrate: Callable[[], None]) -> int:
    """Runs ``migrate`` on the log at ``url``; a store it cannot reach is one line naming the store and
    the cause, as ``serve`` words it (a SQLite file's missing or read-only folder is named before
    SQLite's "unable to open database file"), exit 2."""
    import sqlalchemy as sa
    from alembic.util.exc import CommandError

    from nanoserve.allocator.log.errors import LogUnavailableError, safe_url, store_error
    from nanoserve.allocator.log.store_probe import check_filesystem

    try:
        sa.engine.make_url(url)
        check_filesystem(url, min_free_bytes=0)
        migrate()
    except sa.exc.ArgumentError as exc:
        print(f"nanoserve db {action}: {exc}", file=sys.stderr)
        return 2
    except sa.exc.SQLAlchemyError as exc:
        print(f"nanoserve db {action}: {store_error(url, exc)}", file=sys.stderr)
        return 2
    except (LogUnavailableError, CommandError) as exc:
        print(f"nanoserve db {action}: {exc}", file=sys.stderr)
        return 2
    print(f"{safe_url(url)}: schema at {revision}")
    return 0
