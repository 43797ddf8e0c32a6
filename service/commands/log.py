"""``nanoserve log``: read, replay and audit the allocator's event log.

    nanoserve log audit  [--url URL] [--pool ID] [--epoch N]
    nanoserve log show   [--url URL] [--pool ID] [--epoch N] [--owner O] [--block B] [--kind K] [--from SEQ] [--to SEQ] [--limit N]
    nanoserve log state  --at SEQ [--url URL] [--pool ID] [--epoch N]
    nanoserve log epochs [--url URL] [--pool ID]

The URL defaults to $NANOSERVE_EVENT_LOG_URL, else the server's default log
file (``sqlite:///nanoserve-log.db`` in the working directory). Exit status:
0 clean, 1 violations found, 2 unusable input (no log there, unknown pool or
epoch, unreachable database).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone
from typing import Any

EXIT_CLEAN = 0
EXIT_VIOLATIONS = 1
EXIT_UNUSABLE = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "log",
        help="audit, show and replay the allocator's event log (exit 0 clean, 1 violations, 2 unusable input)",
        description="Read the block allocator's event log: audit it, show events, replay the pool at a seq, list epochs.",
    )
    actions = parser.add_subparsers(dest="log_command", metavar="ACTION", required=True)

    audit = actions.add_parser("audit", help="check every rule of the log; report leaks and crashed epochs")
    _add_source(audit, with_epoch=True)
    audit.set_defaults(func=run_audit)

    show = actions.add_parser("show", help="print events as a table")
    _add_source(show, with_epoch=True)
    show.add_argument("--owner", help="only events of this owner (request id)")
    show.add_argument("--block", type=int, metavar="BLOCK_ID", help="only events touching this block")
    show.add_argument("--kind", help="only events of this kind (allocate, allocate_for, free, free_all, snapshot, ...)")
    show.add_argument("--from", dest="from_seq", type=int, default=1, metavar="SEQ", help="first seq (default 1)")
    show.add_argument("--to", dest="to_seq", type=int, default=None, metavar="SEQ", help="last seq (default: the end)")
    show.add_argument("--limit", type=int, default=None, metavar="N", help="print at most N events")
    show.set_defaults(func=run_show)

    state = actions.add_parser("state", help="replay the pool as of one seq and print who holds which blocks")
    _add_source(state, with_epoch=True)
    state.add_argument("--at", dest="at_seq", type=int, required=True, metavar="SEQ", help="the seq to replay up to")
    state.set_defaults(func=run_state)

    epochs = actions.add_parser("epochs", help="list the epochs of every pool (or one)")
    _add_source(epochs, with_epoch=False)
    epochs.set_defaults(func=run_epochs)


def _add_source(parser: argparse.ArgumentParser, with_epoch: bool) -> None:
    from_env = os.environ.get("NANOSERVE_EVENT_LOG_URL")
    parser.add_argument(
        "--url",
        default=from_env,
        help="SQLAlchemy URL of the log [env NANOSERVE_EVENT_LOG_URL; default: sqlite:///nanoserve-log.db]",
    )
    parser.add_argument("--pool", dest="pool_id", default=None, help="pool id (default: the log's only pool)")
    if with_epoch:
        parser.add_argument("--epoch", type=int, default=None, help="epoch number (default: all for audit, else the newest)")


def _url(args: argparse.Namespace) -> str:
    from nanoserve.allocator import DEFAULT_EVENT_LOG_URL

    return args.url or DEFAULT_EVENT_LOG_URL


def _guarded(run: Any) -> Any:
    """Bad input (no log, unknown pool/epoch, unreachable database) -> message on stderr, exit 2."""

    def wrapper(args: argparse.Namespace) -> int:
        import sqlalchemy as sa

        try:
            return int(run(args))
        except (ValueError, sa.exc.SQLAlchemyError) as exc:
            print(f"nanoserve log {args.log_command}: {exc}", file=sys.stderr)
            return EXIT_UNUSABLE

    wrapper.__doc__ = run.__doc__
    return wrapper


@_guarded
def run_audit(args: argparse.Namespace) -> int:
    from nanoserve.allocator import audit, audit_all

    url = _url(args)
    if args.epoch is None:
        reports = audit_all(url, args.pool_id)
    else:
        reports = [audit(url, args.pool_id, args.epoch)]
    for report in reports:
        print(report.render())
    return EXIT_CLEAN if all(report.clean for report in reports) else EXIT_VIOLATIONS


@_guarded
def run_show(args: argparse.Namespace) -> int:
    from nanoserve.allocator import read_events

    if args.from_seq < 1 or (args.to_seq is not None and args.to_seq < args.from_seq):
        raise ValueError(f"--from must be >= 1 and --to >= --from, got --from {args.from_seq} --to {args.to_seq}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    events = read_events(
        _url(args),
        args.pool_id,
        args.epoch,
        args.from_seq,
        args.to_seq,
        owner=args.owner,
        kind=args.kind,
        block_id=args.block,
        limit=args.limit,
    )
    rows = [
        [
            str(event.seq),
            str(event.batch_seq),
            "" if event.step is None else str(event.step),
            _utc(event.wall_time_ns),
            event.kind,
            ",".join(map(str, event.block_ids)),
            event.owner or "",
            event.reason or "",
        ]
        for event in events
    ]
    print(_table(["seq", "batch", "step", "time (UTC)", "kind", "blocks", "owner", "reason"], rows))
    return EXIT_CLEAN


@_guarded
def run_state(args: argparse.Namespace) -> int:
    from nanoserve.allocator import replay

    if args.at_seq < 1:
        raise ValueError(f"--at must be >= 1, got {args.at_seq}")
    state = replay(_url(args), args.pool_id, args.epoch, until_seq=args.at_seq)
    print(
        f"pool {state.pool_id!r} epoch {state.epoch} at seq {state.last_seq}: "
        f"{state.num_free} free, {state.num_allocated} allocated of {state.num_blocks} blocks of {state.block_size} tokens"
    )
    held = state.blocks_by_owner()
    if held:
        print(_table(["owner", "num_blocks", "block ids"], [[o, str(len(b)), ",".join(map(str, b))] for o, b in held.items()]))
    print("free stack (next out first): " + ",".join(map(str, reversed(state.free_block_ids))))
    for violation in state.violations:
        print(f"violation: {violation}")
    return EXIT_CLEAN if not state.violations else EXIT_VIOLATIONS


@_guarded
def run_epochs(args: argparse.Namespace) -> int:
    from nanoserve.allocator.log_reader import LogNotFoundError, connect, list_epochs

    with connect(_url(args)) as conn:
        epochs = list_epochs(conn, args.pool_id)
    if not epochs:
        raise LogNotFoundError("the log holds no pools" if args.pool_id is None else f"the log holds no pool {args.pool_id!r}")
    rows = [
        [
            info.pool_id,
            str(info.epoch),
            str(info.num_blocks),
            str(info.block_size),
            info.model or "",
            _utc(info.opened_wall_ns),
            str(info.durable_seq),
            f"closed at seq {info.closed_seq}" if info.closed else "open or crashed",
        ]
        for info in epochs
    ]
    print(_table(["pool", "epoch", "num_blocks", "block_size", "model", "opened (UTC)", "durable_seq", "status"], rows))
    return EXIT_CLEAN


def _utc(wall_time_ns: int) -> str:
    return datetime.fromtimestamp(wall_time_ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
