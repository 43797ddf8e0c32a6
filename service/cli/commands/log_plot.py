"""``nanoserve log plot`` and ``nanoserve log state --svg``: pictures of the pool from its log.

    nanoserve log plot  [--url URL] [--pool ID] [--epoch N] [--from SEQ] [--to SEQ] [--x seq|step|time] -o FILE.svg|.png
    nanoserve log state --at SEQ --svg FILE [...]

``plot`` audits the epoch first: a log damaged from seq N (broken hash
chain, missing or malformed records...) is drawn up to seq N - 1 and said so;
broken allocator rules (double free, leaks...) are marked on the picture.
Exit status: 0 picture written and the epoch clean, 1 picture written but the
audit found violations (or the damage leaves nothing to draw), 2 no picture
(no log there, unknown pool or epoch, an epoch without allocations, a bad flag,
matplotlib not installed). An epoch cut into segments whose live part holds no
allocation is drawn from its checkpoint (its allocations are in the segment
files, said on stderr).

matplotlib is imported here, inside the commands, and only by them: it is the
``plot`` extra (``pip install 'nanoserve[plot]'``), not needed to serve.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

EXIT_CLEAN = 0
EXIT_VIOLATIONS = 1
EXIT_UNUSABLE = 2

# rules an intact log can break (the allocator's, not the log's): the picture shows them where they happened;
# any other violation means the log itself is damaged from its seq on, and the picture stops before it
ALLOCATOR_RULES = frozenset(
    ("allocate_of_allocated", "free_of_free_block", "owner_mismatch", "foreign_block", "leaked_block")
)
MISSING_PLOT_EXTRA = "matplotlib is not installed: pip install 'nanoserve[plot]'"


def add_plot(actions: Any, add_source: Any) -> argparse.ArgumentParser:
    """The ``plot`` action's parser under ``nanoserve log`` (``add_source`` adds --url, --pool and --epoch)."""
    plot: argparse.ArgumentParser = actions.add_parser(
        "plot",
        help="draw an epoch: block map over time and occupancy (SVG or PNG)",
        description="Draw one epoch as two aligned panels over time: a block map (y = block id, each block's held "
        "intervals coloured by owner; preemptions, aborts, leaks, POOL_CLOSE or the crash point marked) and the "
        "pool's occupancy (allocated and free blocks, running requests). Audits the epoch first: "
        "exit 0 clean, 1 violations (marked; a damaged log is drawn up to the seq before the damage), 2 no picture.",
    )
    add_source(plot, epoch_help="the epoch to draw (default: the newest)")
    plot.add_argument("--from", dest="from_seq", type=int, default=1, metavar="SEQ", help="first seq (default 1)")
    plot.add_argument("--to", dest="to_seq", type=int, default=None, metavar="SEQ", help="last seq (default: the end)")
    plot.add_argument(
        "--x",
        choices=("seq", "step", "time"),
        default="seq",
        help="the time axis: event seq, scheduler step, or wall time in seconds (default: seq)",
    )
    plot.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="the picture: FILE.svg (with tooltips) or FILE.png"
    )
    return plot


def run_plot(args: argparse.Namespace, url: str) -> int:
    """Audit the epoch, read its timeline (up to the damage, if any), draw --from..--to, write it.

    Raises ValueError (and LogNotFoundError) for unusable input: the caller prints it and exits 2.
    """
    from nanoserve.allocator.log import audit
    from nanoserve.service.pictures.pool_timeline import read_timeline

    if args.from_seq < 1 or (args.to_seq is not None and args.to_seq < args.from_seq):
        raise ValueError(f"--from must be >= 1 and --to >= --from, got --from {args.from_seq} --to {args.to_seq}")
    draw = _drawing("plot")
    if draw is None:
        return EXIT_UNUSABLE
    pool_plot, figure_file = draw
    figure_file.figure_format(args.output)
    report = audit(url, args.pool_id, args.epoch)
    damage = next((v for v in report.violations if v.rule not in ALLOCATOR_RULES), None)
    intact_seq = None  # the whole epoch is read (not only up to --to): a bar still held at its end is a leak or a crash
    if damage is not None:
        print(f"nanoserve log plot: the log is damaged from seq {damage.seq}: {damage}", file=sys.stderr)
        if damage.seq <= max(args.from_seq, 2):
            print("nanoserve log plot: nothing before the damage to draw", file=sys.stderr)
            return EXIT_VIOLATIONS
        intact_seq = damage.seq - 1
    timeline = read_timeline(url, report.pool_id, report.epoch, intact_seq)
    cut_seq = timeline.seqs[0] if timeline.seqs and timeline.seqs[0] > 1 else None  # the checkpoint at a cut
    if not timeline.num_intervals:
        if cut_seq is None:
            raise ValueError(f"nothing to plot: epoch {report.epoch} of pool {report.pool_id!r} holds no allocations")
        # its allocations are all in the segment files: the picture is the pool from the checkpoint on
        print(
            f"nanoserve log plot: the live log holds no allocation of epoch {report.epoch} from its checkpoint at "
            f"seq {cut_seq}: seqs 1..{cut_seq - 1} are archived in segment files (`nanoserve log state --at SEQ` "
            "names the one holding a seq; plot it with --url sqlite:///FILE)",
            file=sys.stderr,
        )
    picture = pool_plot.plot_timeline(
        timeline,
        from_seq=args.from_seq,
        to_seq=args.to_seq,
        x=args.x,
        violations=report.violations,
        damaged_seq=None if damage is None else damage.seq,
        open_status=_open_status(url, report.pool_id, report.epoch),
    )
    picture.save(args.output)
    print(f"wrote {args.output}: {picture.summary}")
    if report.violations:
        print(
            f"nanoserve log plot: the audit found {len(report.violations)} violation(s), first bad seq "
            f"{report.first_bad_seq} (`nanoserve log audit` lists them)",
            file=sys.stderr,
        )
        return EXIT_VIOLATIONS
    return EXIT_CLEAN


def write_state_picture(url: str, state: Any, path: str) -> int:
    """``log state --svg``: the grid of ``state`` (replayed from ``url``) written to ``path``; the exit status."""
    from nanoserve.allocator.log import LogDamagedError, read_events
    from nanoserve.service.pictures.pool_timeline import read_timeline

    draw = _drawing("state")
    if draw is None:
        return EXIT_UNUSABLE
    _, figure_file = draw
    fmt = figure_file.figure_format(path)
    from nanoserve.service.pictures.pool_grid import draw_pool_grid

    try:
        timeline = read_timeline(url, state.pool_id, state.epoch, state.last_seq)
        events = read_events(url, state.pool_id, state.epoch, state.last_seq, state.last_seq)
    except LogDamagedError as exc:  # the damage is named above, among the violations
        print(f"nanoserve log state: no picture: the log is damaged: {exc}", file=sys.stderr)
        return EXIT_VIOLATIONS
    picture = draw_pool_grid(state, timeline, events[0] if events else None)
    picture.save(path, fmt)
    print(f"wrote {path}: {picture.summary}")
    return EXIT_CLEAN


def _drawing(action: str) -> tuple[Any, Any] | None:
    """The drawing modules, or None (said on stderr) when matplotlib is missing."""
    try:
        from nanoserve.service.pictures import figure_file, pool_plot
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("matplotlib"):
            raise
        print(f"nanoserve log {action}: {MISSING_PLOT_EXTRA}", file=sys.stderr)
        return None
    return pool_plot, figure_file


def _open_status(url: str, pool_id: str, epoch: int) -> str:
    """How the picture names the epoch if it has no POOL_CLOSE: as ``log epochs`` does."""
    from nanoserve.allocator.log.epoch_status import open_statuses
    from nanoserve.allocator.log.reader import connect
    from nanoserve.service.cli.commands.log_requests import recovered_by

    with connect(url) as conn:
        return open_statuses(conn, recovered_by(conn)).of(pool_id, epoch)
