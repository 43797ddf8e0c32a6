"""``nanoserve log archive`` and ``nanoserve log audit --archive``: epochs out of the live log, and their check.

``log archive`` moves finished epochs into one SQLite file each under
``--dest`` (``nanoserve.allocator.log.archive``): every epoch but each pool's
newest, or those a retention bound no longer keeps, or one ``--epoch``.
``log audit --archive FILE`` replays the file's epochs (hash chain and rules,
like any log) and, with the live log (``--url``, else the default log when
its file exists), checks the file's sha256 and head hash against the
manifest row that names it: ``archived_epochs`` for an
epoch's file, ``archived_segments`` for a segment of an open epoch (its head
hash is the file's stored hash at the segment's last seq).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_archive(actions: Any, add_source: Any) -> argparse.ArgumentParser:
    archive: argparse.ArgumentParser = actions.add_parser(
        "archive",
        help="move finished epochs out of the live log into one SQLite file each",
        description="Move finished epochs of the live log (--url) into DEST/<pool>-epoch-<N>.db: the epoch's rows "
        "as stored (its events and request journal), so `nanoserve log audit --archive FILE` verifies the hash "
        "chain and `log show/state/plot --url sqlite:///FILE` read it. A manifest row in the live log names each "
        "file with its seq range, head hash and sha256. A pool's newest epoch is never archived. Without a bound "
        "or --epoch: every epoch but each pool's newest.",
    )
    add_source(archive, epoch_help="archive this epoch only (default: every epoch the bounds no longer keep)")
    archive.add_argument("--dest", required=True, metavar="DIR", help="folder of the archive files (made 0700)")
    archive.add_argument(
        "--retention-s",
        type=float,
        default=0.0,
        metavar="S",
        help="archive epochs that ended more than S seconds ago (0: no age bound)",
    )
    archive.add_argument(
        "--retention-bytes",
        type=int,
        default=0,
        metavar="B",
        help="keep the newest epochs while they hold at most B bytes; archive the older (0: no size bound)",
    )
    return archive


def run_archive(args: argparse.Namespace, url: str) -> int:
    """Archives, printing one line per file; 0 (also when nothing was due)."""
    from nanoserve.allocator.log.archive import RetentionPolicy, archive_due, archive_epoch
    from nanoserve.allocator.log.store import create_log_engine
    from nanoserve.engine.journal.store import recovering_epoch
    from nanoserve.migrations import upgrade

    dest = Path(args.dest)
    if args.epoch is not None:
        if args.pool_id is None:
            raise ValueError("--epoch needs --pool")
        live = create_log_engine(url)
        try:
            entries = [archive_epoch(live, args.pool_id, args.epoch, dest, upgrade, recovering_epoch)]
        finally:
            live.dispose()
    else:
        policy = RetentionPolicy(args.retention_s, args.retention_bytes)
        if not policy.enabled:
            policy = RetentionPolicy(retention_bytes=1)  # every epoch but the newest
        entries = archive_due(url, dest, policy, upgrade, pool_id=args.pool_id, recovery_of=recovering_epoch)
    for entry in entries:
        print(
            f"archived pool {entry.pool_id} epoch {entry.epoch} (seq {entry.first_seq}..{entry.last_seq}, "
            f"{entry.num_bytes} bytes) -> {entry.path} sha256 {entry.sha256}"
        )
    if not entries:
        print("nothing to archive")
    return 0


def run_audit_archive(args: argparse.Namespace, live_url: str | None) -> tuple[bool, list[Any]]:
    """(the file matches the live log's manifest, or no live log was given; the audit reports of its epochs).

    ``live_url``: the live log (``--url``, else the default log when its file exists), named on stdout; None:
    not checked against a manifest.

    Raises ValueError when the live log's manifest names none of the file's epochs.
    """
    from nanoserve.allocator.log import audit_all
    from nanoserve.allocator.log.archive import file_sha256, manifest
    from nanoserve.allocator.log.reader import connect, list_epochs, stored_hash
    from nanoserve.allocator.log.segment_archive import segment_manifest

    path = Path(args.archive)
    if not path.is_file():
        raise ValueError(f"no archive at {str(path)!r}")
    archive_url = f"sqlite:///{path}"
    reports = audit_all(archive_url, args.pool_id)
    if live_url is None:
        print(f"{path}: sha256 {file_sha256(path)} (no live log given or found: not checked against a manifest)")
        return True, reports
    print(f"checked against the manifest of the live log {live_url}")
    named = {(e.pool_id, e.epoch): e for e in manifest(live_url)}
    listed = segment_manifest(live_url)
    listed_in: dict[tuple[str, int, int], str] = {}  # a segment listed elsewhere than the live log -> that file
    with connect(archive_url) as conn:
        infos = list_epochs(conn, args.pool_id)
        starts = {(info.pool_id, info.epoch): _first_seq(conn, info.pool_id, info.epoch) for info in infos}
        for info in infos:  # a segment of an epoch archived whole since: the epoch's file lists it now
            whole = named.get((info.pool_id, info.epoch))
            if whole is not None and Path(whole.path).is_file() and whole.path != str(path):
                moved = [e for e in segment_manifest(f"sqlite:///{whole.path}") if e.epoch == info.epoch]
                listed += moved
                listed_in.update({(e.pool_id, e.epoch, e.first_seq): whole.path for e in moved})
        segment_heads = {
            entry.first_seq: stored_hash(conn, entry.pool_id, entry.epoch, entry.last_seq)
            for entry in listed
            if starts.get((entry.pool_id, entry.epoch)) == entry.first_seq
        }
    segments = {(e.pool_id, e.epoch, e.first_seq): e for e in listed}
    digest = file_sha256(path)
    matches = True
    for info in infos:
        segment = segments.get((info.pool_id, info.epoch, starts[(info.pool_id, info.epoch)]))
        entry = segment or named.get((info.pool_id, info.epoch))
        if entry is None:
            raise ValueError(f"the live log's manifest names no archive of pool {info.pool_id} epoch {info.epoch}")
        head = segment_heads.get(segment.first_seq) if segment is not None else info.head_hash
        what = f"seqs {entry.first_seq}..{entry.last_seq} of " if segment is not None else ""
        if entry.sha256 != digest:
            print(f"{path}: sha256 {digest} differs from the manifest's {entry.sha256} (the file changed)")
            matches = False
        elif head != entry.head_hash:
            shown = "none" if head is None else head.hex()
            print(f"{path}: head hash {shown} differs from the manifest's {entry.head_hash.hex()}")
            matches = False
        else:
            where = ""
            if segment is not None and (segment.pool_id, segment.epoch, segment.first_seq) in listed_in:
                where = f" in {listed_in[(segment.pool_id, segment.epoch, segment.first_seq)]} (its epoch's file)"
            print(
                f"{path}: sha256 {digest} and head hash match the manifest{where} "
                f"({what}pool {entry.pool_id} epoch {entry.epoch})"
            )
    return matches, reports


def _first_seq(conn: Any, pool_id: str, epoch: int) -> int:
    """Where the epoch's rows begin in a file: 1, or its cut when it holds a later segment."""
    from nanoserve.allocator.log.segment import epoch_cut

    cut = epoch_cut(conn, pool_id, epoch)
    return 1 if cut is None else cut.first_seq
