"""``nanoserve log``: read, replay and audit the allocator's event log.

    nanoserve log audit  [--url URL] [--pool ID] [--epoch N]
    nanoserve log show   [--url URL] [--pool ID] [--epoch N] [--owner O] [--block B] [--kind K]
                         [--from SEQ] [--to SEQ] [--limit N]
    nanoserve log state  --at SEQ [--url URL] [--pool ID] [--epoch N] [--full]
    nanoserve log epochs [--url URL] [--pool ID]
    nanoserve log requests [--url URL] [--pool ID] [--epoch N]   (the request journal: see ``log_requests``)
    nanoserve log plot   [--url URL] [--pool ID] [--epoch N] [--from SEQ] [--to SEQ] [--x seq|step|time] -o FILE
    nanoserve log state  --at SEQ --svg FILE ...     (the pictures: see ``log_plot``)

The URL defaults to $NANOSERVE_EVENT_LOG_URL, else the server's default log
file (``sqlite:///nanoserve-log.db`` in the working directory). Exit status:
0 clean, 1 violations or damage found, 2 unusable input (no log there, unknown
pool or epoch, unreachable database, a bad flag). A migrated log with no
epochs yet is not an error: ``epochs`` says "no epochs in the log" and
``audit`` says "nothing to audit", both exit 0.

Damaged logs never end in a traceback: ``audit`` names the first bad seq
(exit 1); ``show`` prints every event it can read and names each damaged row
in its place (exit 1); ``state`` replays what it can and lists what broke
(exit 1). SQLite files are opened read-only, so logs on read-only media work.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from nanoserve.allocator import EventKind
from nanoserve.allocator.log.epoch_status import OPEN_STATUS, open_statuses
from nanoserve.service.cli.commands import log_archive, log_format, log_owner, log_plot, log_requests

EVENT_KINDS = tuple(kind.value for kind in EventKind)

EXIT_CLEAN = 0
EXIT_VIOLATIONS = 1
EXIT_UNUSABLE = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "log",
        help="audit, show and replay the allocator's event log (exit 0 clean, 1 violations, 2 unusable input)",
        description="Read the block allocator's event log: audit it, show events, replay the pool at a seq, "
        "list epochs.",
    )
    actions = parser.add_subparsers(dest="log_command", metavar="ACTION", required=True)

    audit = actions.add_parser(
        "audit",
        help="check every rule of the log; report leaks and open epochs",
        description="Replay every epoch (or --epoch N) from its genesis (or, for an epoch whose older part is archived "
        "as segments, from its cut, chained to the manifest's head hash) and check every rule of the log: "
        "exit 0 clean, 1 violations (with the first bad seq), 2 unusable input. "
        "For an open epoch (running, or crashed) it prints who held which blocks at the last durable event.",
    )
    _add_source(audit, epoch_help="epoch number (default: every epoch)")
    audit.add_argument(
        "--archive",
        metavar="FILE",
        help="audit this archive file (an epoch's from `log archive`, or a segment of an open epoch from the "
        "server's archiver) instead; with --url, also check its sha256 and head hash against the live log's "
        "manifest (exit 1 when they differ)",
    )
    audit.set_defaults(func=run_audit)

    show = actions.add_parser(
        "show",
        help="print events as a table",
        description="Print the events of one epoch as a table (seq, batch, step, time, kind, blocks, owner, reason), "
        "filtered by owner, block, kind or seq range; --owner also lists the samples forked from that request "
        "(n, best_of) and their fork and copy events. A damaged row is printed as DAMAGED in its place and named "
        "below the table (exit 1). With --owner and no --epoch it follows the request across every epoch "
        "(an epoch column when the log holds several) and prints its request journal records below.",
    )
    _add_source(show, epoch_help="the epoch whose events to print (default: the newest; with --owner: every epoch)")
    show.add_argument("--owner", help="only events of this owner (request id)")
    show.add_argument("--block", type=int, metavar="BLOCK_ID", help="only events touching this block")
    show.add_argument("--kind", choices=EVENT_KINDS, help="only events of this kind")
    show.add_argument("--from", dest="from_seq", type=int, default=1, metavar="SEQ", help="first seq (default 1)")
    show.add_argument("--to", dest="to_seq", type=int, default=None, metavar="SEQ", help="last seq (default: the end)")
    show.add_argument("--limit", type=int, default=None, metavar="N", help="print at most N events")
    show.add_argument(
        "--full",
        action="store_true",
        help="every block id and key of each event (default: a long block list as runs cut to "
        f"{log_format.MAX_BLOCKS_CHARS} characters, the first {log_format.MAX_KEYS_SHOWN} keys and their count), "
        "and one journal line per record (default: consecutive outputs as one line)",
    )
    show.set_defaults(func=run_show)

    state = actions.add_parser(
        "state",
        help="replay the pool as of one seq and print who holds which blocks",
        description="Replay one epoch up to --at SEQ and print the pool then: counts, each owner's blocks, "
        "the free blocks (as ranges; --full: the free stack in LIFO order) and any rule broken on the way.",
    )
    _add_source(state, epoch_help="the epoch to replay (default: the newest)")
    state.add_argument(
        "--at",
        dest="at_seq",
        type=int,
        required=True,
        metavar="SEQ",
        help="the seq to replay up to (past the epoch's end: its last seq, said on stderr)",
    )
    state.add_argument(
        "--full",
        action="store_true",
        help="print the free stack block by block, next out first, instead of sorted ranges",
    )
    state.add_argument(
        "--trust-snapshot",
        action="store_true",
        help="start from the newest SNAPSHOT at or before --at without verifying the hash chain of the records "
        "before it (faster on long epochs; by default they are verified, and a broken chain replays from the "
        "epoch's start instead)",
    )
    state.add_argument(
        "--svg",
        metavar="FILE",
        help="also draw the pool then as FILE.svg (or .png): blocks coloured by owner, free stack, block tables",
    )
    state.set_defaults(func=run_state)

    epochs = actions.add_parser(
        "epochs",
        help="list the epochs of every pool (or one)",
        description="List each epoch: pool, epoch, pool size, model, when it opened, durable seq, and its status: "
        "'closed at seq N'; 'crashed; recovered by epoch N' (the journal's RECOVER record); 'crashed; epoch N "
        "opened the pool after it' (no POOL_CLOSE, and a later epoch opened: its server is gone); "
        f"'{OPEN_STATUS}' (no POOL_CLOSE, the pool's newest: the log cannot tell which); or 'archived to FILE' "
        "(moved out of the live log whole: `log audit --archive FILE` reads it).",
    )
    _add_source(epochs, epoch_help=None)
    epochs.set_defaults(func=run_epochs)

    log_archive.add_archive(actions, _add_source).set_defaults(func=run_archive)
    log_plot.add_plot(actions, _add_source).set_defaults(func=run_plot)
    log_requests.add_requests(actions, _add_source).set_defaults(func=run_requests)


def _add_source(parser: argparse.ArgumentParser, epoch_help: str | None) -> None:
    from_env = os.environ.get("NANOSERVE_EVENT_LOG_URL")
    parser.add_argument(
        "--url",
        default=from_env,
        help="SQLAlchemy URL of the log [env NANOSERVE_EVENT_LOG_URL; default: sqlite:///nanoserve-log.db]",
    )
    parser.add_argument("--pool", dest="pool_id", default=None, help="pool id (default: the log's only pool)")
    if epoch_help is not None:
        parser.add_argument("--epoch", type=int, default=None, help=epoch_help)


def _url(args: argparse.Namespace) -> str:
    from nanoserve.allocator.log import DEFAULT_EVENT_LOG_URL

    return args.url or DEFAULT_EVENT_LOG_URL


def _default_live_log() -> str | None:
    """The default log's URL (``DEFAULT_EVENT_LOG_URL``) when its SQLite file exists; else None."""
    from nanoserve.allocator.log import DEFAULT_EVENT_LOG_URL

    return DEFAULT_EVENT_LOG_URL if Path(DEFAULT_EVENT_LOG_URL.removeprefix("sqlite:///")).is_file() else None


def _url_source(url: str | None) -> str:
    """Where the log's URL came from, for a reader that found no file there: --url, else
    $NANOSERVE_EVENT_LOG_URL, else ./nanoserve-log.db (``serve``'s default, relative to its folder)."""
    from nanoserve.allocator.log import DEFAULT_EVENT_LOG_URL

    where = (
        "the log is where `nanoserve serve --event-log-url` put it: pass that URL as --url, "
        f"or run this in the folder serve ran in (its default, {DEFAULT_EVENT_LOG_URL}, is relative to it)"
    )
    if url is None:
        return (
            f"no --url and no $NANOSERVE_EVENT_LOG_URL, so the URL was the default {DEFAULT_EVENT_LOG_URL} "
            f"(nanoserve-log.db in this folder, {os.getcwd()}); {where}"
        )
    if url == os.environ.get("NANOSERVE_EVENT_LOG_URL"):
        return f"the URL came from $NANOSERVE_EVENT_LOG_URL (no --url given); {where}"
    return f"the URL came from --url; {where}"


def _guarded(run: Any) -> Any:
    """Bad input (no log, unknown pool/epoch, unreachable database) -> message on stderr, exit 2."""

    def wrapper(args: argparse.Namespace) -> int:
        import sqlalchemy as sa

        from nanoserve.allocator.log import EventLogError
        from nanoserve.allocator.log.errors import LogFileMissingError

        try:
            return int(run(args))
        except (ValueError, EventLogError, sa.exc.SQLAlchemyError) as exc:
            print(f"nanoserve log {args.log_command}: {_one_line(exc)}", file=sys.stderr)
            if isinstance(exc, LogFileMissingError):
                print(f"hint: {_url_source(args.url)}", file=sys.stderr)
            return EXIT_UNUSABLE

    wrapper.__doc__ = run.__doc__
    return wrapper


def _one_line(exc: BaseException) -> str:
    """An error as one line: a SQLAlchemy error without its SQL echo and help link."""
    import sqlalchemy as sa

    from nanoserve.allocator.log.errors import store_cause

    return store_cause(exc) if isinstance(exc, sa.exc.SQLAlchemyError) else str(exc)


@_guarded
def run_audit(args: argparse.Namespace) -> int:
    from nanoserve.allocator.log import audit, audit_all
    from nanoserve.allocator.log.reader import connect, list_epochs

    if args.archive is not None:
        live_url = args.url or _default_live_log()
        matches, reports = log_archive.run_audit_archive(args, live_url)
        archive_url = f"sqlite:///{args.archive}"
        with connect(archive_url) as conn:  # the file's own manifest row: a finished epoch, and who recovered it
            statuses = open_statuses(conn, log_requests.recovered_by(conn))
        if live_url is not None:  # an archived epoch without POOL_CLOSE is crashed when a later one opened
            with connect(live_url) as conn:
                statuses = statuses.merged(open_statuses(conn, log_requests.recovered_by(conn)))
        for report in reports:
            print(report.render(open_status=statuses.of(report.pool_id, report.epoch)))
        damage = log_requests.journal_damage_lines(archive_url, [(report.pool_id, report.epoch) for report in reports])
        for line in damage:
            print(f"request journal damaged: {line}")
        clean = matches and all(report.clean for report in reports) and not damage
        return EXIT_CLEAN if clean else EXIT_VIOLATIONS
    url = _url(args)
    if args.epoch is None and args.pool_id is None:
        with connect(url) as conn:
            if not list_epochs(conn, None):
                print("nothing to audit: the log holds no epochs")
                return EXIT_CLEAN
    reports = audit_all(url, args.pool_id) if args.epoch is None else [audit(url, args.pool_id, args.epoch)]
    with connect(url) as conn:
        statuses = open_statuses(conn, log_requests.recovered_by(conn))
    for report in reports:
        print(report.render(open_status=statuses.of(report.pool_id, report.epoch)))
    journal_damage = log_requests.journal_damage_lines(url, [(report.pool_id, report.epoch) for report in reports])
    for line in journal_damage:
        print(f"request journal damaged: {line}")
    clean = all(report.clean for report in reports) and not journal_damage
    return EXIT_CLEAN if clean else EXIT_VIOLATIONS


@_guarded
def run_archive(args: argparse.Namespace) -> int:
    return log_archive.run_archive(args, _url(args))


def _say_archived(url: str, pool_id: str | None, epoch: int | None, from_seq: int) -> None:
    """On stderr: the shown range starts before the epoch's cut, so its first seqs are in segment files."""
    from nanoserve.allocator.log.reader import connect, resolve_epoch
    from nanoserve.allocator.log.segment import epoch_cut

    with connect(url) as conn:
        info = resolve_epoch(conn, pool_id, epoch)
        cut = epoch_cut(conn, info.pool_id, info.epoch)
    if cut is not None and from_seq < cut.first_seq:
        print(
            f"seqs 1..{cut.num_archived} of epoch {info.epoch} are archived in segment files (`nanoserve log state "
            f"--at SEQ` names the one holding a seq): shown from seq {cut.first_seq}",
            file=sys.stderr,
        )


@_guarded
def run_show(args: argparse.Namespace) -> int:
    from nanoserve.allocator.log import Damage, scan_events

    if args.from_seq < 1 or (args.to_seq is not None and args.to_seq < args.from_seq):
        raise ValueError(f"--from must be >= 1 and --to >= --from, got --from {args.from_seq} --to {args.to_seq}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    from nanoserve.allocator.log.reader import connect, list_epochs, resolve_epoch

    pool_id, epochs = args.pool_id, [args.epoch]
    if args.owner is not None and args.epoch is None:  # follow the request across every epoch
        with connect(_url(args)) as conn:
            pool_id = resolve_epoch(conn, args.pool_id, None).pool_id
            epochs = [info.epoch for info in list_epochs(conn, pool_id)]
    rows: list[list[str]] = []
    damage: list[Damage] = []
    for epoch in epochs:
        owners = [args.owner]
        if args.owner is not None:
            owners += log_owner.forked_children(_url(args), pool_id, epoch, args.owner, args.from_seq, args.to_seq)
        epoch_rows: list[tuple[int, list[str]]] = []  # (seq, cells): one owner's events, then its samples'
        for owner in owners:
            scan = scan_events(
                _url(args),
                pool_id,
                epoch,
                args.from_seq,
                args.to_seq,
                owner=owner,
                kind=args.kind,
                block_id=args.block,
            )
            try:
                for item in scan:
                    prefix = [str(epoch)] if len(epochs) > 1 else []
                    if isinstance(item, Damage):
                        damage.append(item)
                        epoch_rows.append((item.seq, [*prefix, str(item.seq), "", "", "", "DAMAGED", "", "", "", ""]))
                        continue
                    epoch_rows.append((item.seq, [*prefix, *log_format.event_cells(item, args.full)]))
                    if args.limit is not None and len(rows) + len(epoch_rows) >= args.limit and len(owners) == 1:
                        break
            finally:
                scan.close()
        rows += [cells for _, cells in sorted(epoch_rows, key=lambda entry: entry[0])]
        if args.limit is not None and len(rows) >= args.limit:
            rows = rows[: args.limit]
            break
    header = ["seq", "batch", "step", "time (UTC)", "kind", "blocks", "owner", "reason", "keys (=count, <-parent)"]
    if not any(row[-1] for row in rows):  # no prefix-cache event: the table of the plain pool
        header.pop()
        rows = [row[:-1] for row in rows]
    if rows:
        print(log_format.table(["epoch", *header] if len(epochs) > 1 else header, rows))
    else:  # as `log requests` and `log epochs` say they found nothing: exit 0
        print(_nothing_found(args, pool_id, epochs))
    for item in damage:
        print(f"damaged: {item}")
    for epoch in epochs:
        _say_archived(_url(args), pool_id, epoch, args.from_seq)
    if args.owner is not None and pool_id is not None:
        for line in log_requests.owner_lines(_url(args), pool_id, args.owner, collapse=not args.full):
            print(line)
    if args.owner is not None and not rows:  # the archived epochs first: the likelier place of an old request
        not_searched = (
            None if args.epoch is not None or pool_id is None else log_owner.not_searched_line(_url(args), pool_id)
        )
        if not_searched is not None:
            print(f"note: {not_searched}", file=sys.stderr)
        hint = log_owner.tenant_hint(_url(args), pool_id, epochs, args.owner)
        if hint is not None:
            print(hint, file=sys.stderr)
    return EXIT_CLEAN if not damage else EXIT_VIOLATIONS


def _nothing_found(args: argparse.Namespace, pool_id: str | None, epochs: list[int | None]) -> str:
    """The line said instead of an empty table: which filters found no event in which pool and epochs."""
    from nanoserve.allocator.log.reader import connect, resolve_epoch

    if pool_id is None or epochs == [None]:  # the log's only pool, its newest epoch: named, as the others are
        with connect(_url(args)) as conn:
            info = resolve_epoch(conn, pool_id, epochs[0])
        pool_id, epochs = info.pool_id, epochs if epochs != [None] else [info.epoch]
    what = "no event"
    if args.owner is not None:
        what += f" of owner {args.owner!r}"
    if args.kind is not None:
        what += f" of kind {args.kind}"
    if args.block is not None:
        what += f" touching block {args.block}"
    if args.from_seq > 1 or args.to_seq is not None:
        what += f" in seqs {args.from_seq}..{'' if args.to_seq is None else args.to_seq}"
    numbers = ", ".join(str(epoch) for epoch in epochs)
    return f"{what} in pool {pool_id!r} epoch{'s' if len(epochs) > 1 else ''} {numbers}"


@_guarded
def run_requests(args: argparse.Namespace) -> int:
    entries = log_requests.read_entries(_url(args), args.pool_id, args.epoch)
    rows = log_requests.request_rows(entries, log_requests.ended_epochs(_url(args), args.pool_id))
    journal_damage = log_requests.pool_damage_lines(_url(args), args.pool_id, args.epoch)
    if not rows:
        print("no journaled requests" + ("" if args.epoch is None else f" in epoch {args.epoch}"))
    else:
        print(log_format.table(log_requests.REQUEST_HEADER, rows))
    for line in journal_damage:
        print(f"request journal damaged: {line}")
    return EXIT_VIOLATIONS if journal_damage else EXIT_CLEAN


@_guarded
def run_state(args: argparse.Namespace) -> int:
    from nanoserve.allocator.log import replay

    if args.at_seq < 1:
        raise ValueError(f"--at must be >= 1, got {args.at_seq}")
    state = replay(_url(args), args.pool_id, args.epoch, until_seq=args.at_seq, verify_chain=not args.trust_snapshot)
    if args.trust_snapshot:
        print(
            "note: --trust-snapshot: the records before the SNAPSHOT replay started from were not verified",
            file=sys.stderr,
        )
    if state.last_seq is not None and state.last_seq < args.at_seq:
        print(
            f"note: epoch {state.epoch} ends at seq {state.last_seq}; "
            f"showing the pool there, not at --at {args.at_seq}",
            file=sys.stderr,
        )
    unread = [v.message.partition(" (one packed row)")[0] for v in state.violations if v.rule == "bad_record"]
    if unread:  # records that could not be read are not in the pool shown (other violations' events are)
        print(
            f"note: the pool at seq {state.last_seq} is what the records that could be read give, without the "
            f"unreadable {', '.join(unread)} (the violations below)",
            file=sys.stderr,
        )
    print(
        f"pool {state.pool_id!r} epoch {state.epoch} at seq {state.last_seq}: "
        f"{state.num_free} free{f' ({state.num_cached_free} of them cached)' if state.num_cached_free else ''}, "
        f"{state.num_allocated} allocated "
        f"of {state.num_blocks} blocks of {state.block_size} tokens"
    )
    held = state.blocks_by_owner()
    if held:
        print(
            log_format.table(
                ["owner", "num_blocks", "block ids"], [[o, str(len(b)), ",".join(map(str, b))] for o, b in held.items()]
            )
        )
    _print_preempted(_url(args), state, set(held))
    if args.full:
        cached = f" (and {state.num_cached_free} cached-free, evicted after it: below)" if state.cached_free else ""
        print(f"free stack (next out first){cached}: " + ",".join(map(str, reversed(state.free_block_ids))))
    else:
        # the free stack and the cached-free list are disjoint; together they are the header's "N free"
        cached = f"; cached: {log_format.block_ranges(state.cached_free)}" if state.cached_free else ""
        print("free blocks: " + (log_format.block_ranges(state.free_block_ids) or "none") + cached)
    if state.block_keys or state.sharers:  # prefix-cache blocks, or forked ones (parallel sampling)
        log_format.print_cache(state, args.full)
    for violation in state.violations:
        print(f"violation: {violation}")
    status = EXIT_CLEAN if not state.violations else EXIT_VIOLATIONS
    if args.svg is not None:
        status = max(status, log_plot.write_state_picture(_url(args), state, args.svg))
    return status


def _print_preempted(url: str, state: Any, holding: set[str]) -> None:
    """The requests preempted (blocks freed for recompute) that hold no block at the state's seq: they wait
    to run again. ``log state --svg`` lists them the same way (``PoolTimeline.without_blocks``)."""
    from nanoserve.allocator.log import LogDamagedError
    from nanoserve.service.pictures.pool_timeline import read_timeline

    if state.last_seq is None:
        return
    try:
        timeline = read_timeline(url, state.pool_id, state.epoch, state.last_seq)
    except LogDamagedError:  # the damage is named below, among the violations
        return
    waiting = timeline.without_blocks(holding).get("preempted", [])
    if waiting:
        names = ", ".join(f"{owner} (since seq {seq})" for owner, seq in waiting)
        print(f"preempted, waiting to be recomputed ({len(waiting)}, holding no block): {names}")


@_guarded
def run_plot(args: argparse.Namespace) -> int:
    return log_plot.run_plot(args, _url(args))


@_guarded
def run_epochs(args: argparse.Namespace) -> int:
    from nanoserve.allocator.log.archive import manifest_rows
    from nanoserve.allocator.log.errors import LogNotFoundError
    from nanoserve.allocator.log.reader import connect, list_epochs

    with connect(_url(args)) as conn:
        epochs = list_epochs(conn, args.pool_id)
        statuses = open_statuses(conn, log_requests.recovered_by(conn))
        in_log = {(info.pool_id, info.epoch) for info in epochs}
        # epochs moved out of the live log whole (one still in it is being archived: listed once, as it is)
        archived = [entry for entry in manifest_rows(conn, args.pool_id) if (entry.pool_id, entry.epoch) not in in_log]
    if not epochs and not archived and args.pool_id is not None:
        raise LogNotFoundError(f"the log holds no pool {args.pool_id!r}")
    if not epochs and not archived:
        print("no epochs in the log")
        return EXIT_CLEAN
    live = [
        (
            (info.pool_id, info.epoch),
            [
                info.pool_id,
                str(info.epoch),
                str(info.num_blocks),
                str(info.block_size),
                info.model or "",
                log_format.utc(info.opened_wall_ns),
                str(info.durable_seq),
                f"closed at seq {info.closed_seq}" if info.closed else statuses.of(info.pool_id, info.epoch),
            ],
        )
        for info in epochs
    ]
    moved = [
        (
            (entry.pool_id, entry.epoch),
            [
                entry.pool_id,
                str(entry.epoch),
                "",
                "",
                "",
                "",
                str(entry.last_seq),
                ("" if entry.recovered_by is None else f"crashed; recovered by epoch {entry.recovered_by}; ")
                + f"archived to {entry.path} (`log audit --archive` reads it)",
            ],
        )
        for entry in archived
    ]
    rows = [row for _, row in sorted(live + moved, key=lambda keyed: keyed[0])]
    print(
        log_format.table(
            ["pool", "epoch", "num_blocks", "block_size", "model", "opened (UTC)", "durable_seq", "status"], rows
        )
    )
    return EXIT_CLEAN
