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
    import sqlalchemy as sa
    from alembic.util.exc import CommandError

    from nanoserve.migrations import upgrade

    try:
        sa.engine.make_url(args.url)
        upgrade(args.url, args.revision)
    except (sa.exc.SQLAlchemyError, CommandError) as exc:
        print(f"nanoserve db upgrade: {exc}", file=sys.stderr)
        return 2
    print(f"{args.url}: schema at {args.revision}")
    return 0


def run_downgrade(args: argparse.Namespace) -> int:
    import sqlalchemy as sa
    from alembic import command
    from alembic.util.exc import CommandError

    from nanoserve.migrations import alembic_config

    try:
        sa.engine.make_url(args.url)
        command.downgrade(alembic_config(args.url), args.revision)
    except (sa.exc.SQLAlchemyError, CommandError) as exc:
        print(f"nanoserve db downgrade: {exc}", file=sys.stderr)
        return 2
    print(f"{args.url}: schema at {args.revision}")
    return 0
