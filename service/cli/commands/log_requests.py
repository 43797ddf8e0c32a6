"""``nanoserve log requests``: the request journal, one line per request; a request's journal lines.

    nanoserve log requests [--url URL] [--pool ID] [--epoch N]

Each request admitted in the epoch (every epoch without --epoch): its epoch, how
it entered it (admitted, or recovered from a crashed epoch), its prompt and
output token counts as journaled, and its state: ``finished (stop|length)``,
``aborted (cause)``, ``running, or cut by a crash`` (its pool's newest epoch
without POOL_CLOSE: the log cannot tell), ``cut by a crash`` (a crashed epoch:
a later one opened, or the epoch is archived; ``; epoch M took the epoch over``
where known), ``recovered in epoch M`` (taken over after the crash). A log written before
the journal existed (migration 0003) has no requests to list.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from nanoserve.engine.journal.records import JournalEntry, JournalKind


def add_requests(actions: Any, add_source: Callable[[argparse.ArgumentParser, str | None], None]) -> Any:
    parser = actions.add_parser(
        "requests",
        help="list the journaled requests with their state and token counts",
        description="List the requests of the request journal: epoch, request id, how it was admitted "
        "(or recovered from which epoch), prompt and output tokens, and its state (finished, aborted with "
        "its cause, running or cut by a crash, recovered in a later epoch).",
    )
    add_source(parser, "only this epoch (default: every epoch)")
    return parser


def ended_epochs(url: str, pool_id: str | None) -> dict[int, int | None]:
    """The epochs of the pool (the log's only pool when None) that are not running: not its newest, or
    named by the log's manifest (an archive file names its own epoch) -> the epoch that recovered it
    (None: not known here)."""
    from nanoserve.allocator.log.epoch_status import open_statuses
    from nanoserve.allocator.log.reader import connect, list_epochs, resolve_epoch

    with connect(url) as conn:
        pool_id = resolve_epoch(conn, pool_id, None).pool_id
        statuses = open_statuses(conn)
        newest = statuses.newest.get(pool_id, 0)
        ended: dict[int, int | None] = {info.epoch: None for info in list_epochs(conn, pool_id) if info.epoch < newest}
    ended.update({epoch: by for (pool, epoch), by in statuses.archived.items() if pool == pool_id})
    return ended


def request_rows(entries: list[JournalEntry], ended: dict[int, int | None] | None = None) -> list[list[str]]:
    """One row per admission: epoch, request id, admitted, prompt tokens, output tokens, state.

    ended: the epochs known not to run (``ended_epochs``) -> the epoch that recovered each (None: not
    known): a request left unfinished there was cut by the crash, not running.

    A request id may be admitted more than once in an epoch (a recovered request aborted and sent
    again, or any id reused once its request ended): each ADMIT starts a row of its own, and the
    records after it, up to the next ADMIT of that id, are that row's."""
    rows: list[dict[str, Any]] = []
    current: dict[tuple[int, str], dict[str, Any]] = {}  # (epoch, request id) -> its latest admission's row
    recovered_in: dict[tuple[int, str], int] = {}  # (crashed epoch, request id) -> epoch that took it over
    for entry in entries:
        if entry.kind == JournalKind.RECOVER.value:
            for request_id in entry.data.get("recovered", []):
                recovered_in[(entry.data["epoch"], request_id)] = entry.epoch
            continue
        key = (entry.epoch, entry.request_id)
        if entry.kind == JournalKind.ADMIT.value:
            source = entry.data.get("recovered_from")
            sampling = entry.data.get("sampling")
            current[key] = {
                "key": key,
                "admitted": "admitted" if source is None else f"recovered from epoch {source}",
                "num_prompt_tokens": len(entry.data.get("prompt_token_ids", [])),
                "num_tokens": entry.data.get("num_prior_tokens", 0),
                "state": None,
                "num_samples": max(int(sampling.get("n") or 1), int(sampling.get("best_of") or 1))
                if isinstance(sampling, dict)
                else 1,
            }
            rows.append(current[key])
            continue
        row = current.get(key)
        if row is None:  # its ADMIT is not in what was read (an older part archived)
            row = current[key] = {"key": key, "admitted": "-", "num_prompt_tokens": 0, "num_tokens": 0, "state": None}
            rows.append(row)
        row["num_tokens"] = max(row["num_tokens"], entry.data["start"] + len(entry.data.get("token_ids", [])))
        if entry.kind == JournalKind.FINISH.value:
            row["state"] = _ending(entry.data)
    table = []
    for row in rows:
        epoch, request_id = row["key"]
        state = row["state"]
        if state is None:
            # only the id's last admission in the epoch can be the one a crash cut and a later epoch took over
            taken = recovered_in.get((epoch, request_id)) if current[(epoch, request_id)] is row else None
            state = "running, or cut by a crash" if taken is None else f"recovered in epoch {taken}"
            if taken is None and ended is not None and epoch in ended:
                by = ended[epoch]
                state = "cut by a crash" + ("" if by is None else f"; epoch {by} took the epoch over")
        num_samples = row.get("num_samples", 1)
        # parallel sampling: the samples' tokens are not journaled (docs/parallel-sampling.md), so none are counted
        output = str(row["num_tokens"]) if num_samples == 1 else f"- ({num_samples} samples, not journaled)"
        table.append([str(epoch), request_id, row["admitted"], str(row["num_prompt_tokens"]), output, state])
    return table


def _ending(finish: dict[str, Any]) -> str:
    """A FINISH's state: ``finished (stop)``, ``aborted (cause)``; a parallel request whose samples ended
    differently names each sample's reason by index: ``finished (#0 stop, #1 length)``."""
    reason = finish.get("finish_reason")
    if reason == "abort":
        detail = f": {finish['abort_detail']}" if finish.get("abort_detail") else ""
        return f"aborted ({finish.get('abort_cause')}{detail})"
    reasons = finish.get("sample_finish_reasons") or [reason]
    if len(set(reasons)) == 1:
        return f"finished ({reasons[0]})"
    return "finished (" + ", ".join(f"#{index} {sample}" for index, sample in enumerate(reasons)) + ")"


REQUEST_HEADER = ["epoch", "request_id", "admitted", "prompt_tokens", "output_tokens", "state"]


def read_entries(url: str, pool_id: str | None, epoch: int | None) -> list[JournalEntry]:
    """The journal of one pool (the log's only pool when None), one epoch or all; [] for a log
    without the journal's table."""
    from nanoserve.allocator.log.reader import connect, resolve_epoch
    from nanoserve.engine.journal.store import has_journal_table, read_journal

    with connect(url) as conn:
        info = resolve_epoch(conn, pool_id, epoch)
        if not has_journal_table(conn):
            return []
        return read_journal(conn, info.pool_id, epoch)


def journal_damage_lines(url: str, epochs: list[tuple[str, int]]) -> list[str]:
    """One line per damaged journal among ``(pool_id, epoch)``s: its first missing or altered step row."""
    from nanoserve.allocator.log.reader import connect
    from nanoserve.engine.journal.store import audit_journal

    lines: list[str] = []
    with connect(url) as conn:
        for pool_id, epoch in epochs:
            lines.extend(f"pool {pool_id!r} {damage.describe()}" for damage in audit_journal(conn, pool_id, epoch))
    return lines


def pool_damage_lines(url: str, pool_id: str | None, epoch: int | None) -> list[str]:
    """``journal_damage_lines`` of one pool (the log's only pool when None), one epoch or all."""
    from nanoserve.allocator.log.reader import connect, list_epochs, resolve_epoch

    with connect(url) as conn:
        pool_id = resolve_epoch(conn, pool_id, epoch).pool_id
        epochs = [info.epoch for info in list_epochs(conn, pool_id)] if epoch is None else [epoch]
    return journal_damage_lines(url, [(pool_id, number) for number in epochs])


def recovered_by(conn: Any, pool_id: str | None = None) -> dict[tuple[str, int], int]:
    """(pool_id, crashed epoch) -> the epoch that recovered it, of the open epochs of ``pool_id`` (None:
    every pool): the RECOVER record that opens the next epoch's journal (``recovering_epoch``: one row read
    per open epoch, not the whole journal). An epoch whose next one's first journal row does not decode
    is left out: ``log audit`` names that damage itself."""
    from nanoserve.allocator.log.reader import list_epochs
    from nanoserve.engine.journal.store import has_journal_table, recovering_epoch

    if not has_journal_table(conn):
        return {}
    found: dict[tuple[str, int], int] = {}
    for info in list_epochs(conn, pool_id):
        if info.closed:
            continue
        try:
            by = recovering_epoch(conn, info.pool_id, info.epoch)
        except ValueError:
            continue
        if by is not None:
            found[(info.pool_id, info.epoch)] = by
    return found


def owner_lines(url: str, pool_id: str, owner: str, collapse: bool = False) -> list[str]:
    """The journal's account of request ``owner`` across epochs, one line per record; with ``collapse``,
    a run of OUTPUT records of one epoch whose tokens follow on (one per engine step: 600 lines for a
    600-token request) is one line, ``journal: epoch 1 steps 911..1190 output: tokens 1..600``."""
    from nanoserve.allocator.log.reader import connect
    from nanoserve.engine.journal.store import has_journal_table

    with connect(url) as conn:
        if not has_journal_table(conn):
            return []
        from nanoserve.engine.journal.store import read_journal

        entries = [e for e in read_journal(conn, pool_id) if e.request_id == owner]
    if collapse:
        entries = _output_runs(entries)
    lines = []
    for entry in entries:
        data = entry.data
        if entry.kind == JournalKind.ADMIT.value:
            source = data.get("recovered_from")
            what = (
                "admitted"
                if source is None
                else f"recovered from epoch {source} with {data.get('num_prior_tokens', 0)} tokens"
            )
            what += f", {len(data.get('prompt_token_ids', []))} prompt tokens, seed {data['sampling'].get('seed')}"
        else:
            end = data["start"] + len(data.get("token_ids", []))
            what = f"tokens {data['start']}..{end}" if data.get("token_ids") else "no new tokens"
            if entry.kind == JournalKind.FINISH.value:
                what += f", ended: {data.get('finish_reason')}"
                if data.get("abort_cause"):
                    detail = f": {data['abort_detail']}" if data.get("abort_detail") else ""
                    what += f" ({data['abort_cause']}{detail})"
        step = "" if entry.step is None else f" step {entry.step}"
        if "last_step" in data:
            step = f" steps {entry.step}..{data['last_step']}"
        lines.append(f"journal: epoch {entry.epoch}{step} {entry.kind}: {what}")
    return lines


def _output_runs(entries: list[JournalEntry]) -> list[JournalEntry]:
    """``entries`` with each run of OUTPUT records (same epoch, each starting where the one before ended,
    more than one) made one OUTPUT whose ``token_ids`` are the run's and whose ``last_step`` is its last
    record's step."""
    import dataclasses

    runs: list[JournalEntry] = []
    for entry in entries:
        previous = runs[-1] if runs else None
        follows = (
            previous is not None
            and entry.kind == previous.kind == JournalKind.OUTPUT.value
            and entry.epoch == previous.epoch
            and entry.step is not None
            and previous.step is not None
            and entry.data["start"] == previous.data["start"] + len(previous.data.get("token_ids", []))
        )
        if not follows or previous is None:
            runs.append(entry)
            continue
        token_ids = [*previous.data.get("token_ids", []), *entry.data.get("token_ids", [])]
        data = dict(previous.data, token_ids=token_ids, last_step=entry.step)
        runs[-1] = dataclasses.replace(previous, data=data)
    return runs
