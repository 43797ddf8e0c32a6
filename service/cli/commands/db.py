"""``nanoserve db upgrade URL``: migrate an event-log database to the newest schema.

The event log's tables are created only by the Alembic migrations in
``nanoserve.migrations``; this runs them (``alembic upgrade head``). Exit 0 on
success, 2 when the database cannot be reached or the URL is not one.
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
