"""The full audit's fast path: an intact epoch folded in C, everything else left to the Python replay.

``log audit`` replays an epoch from its genesis and checks every rule
(``replay_state.Replayer``). Nearly every epoch it reads is intact, and for
those the answer is short: no rule broken, and this is the pool at the end.
``fold_intact`` asks the compiled fold (intact_fold.c, built by
``intact_fold_build``) for exactly that answer. It reads the epoch's stored
rows as they are (``row_scan.stored_rows``: packed rows not expanded) and, in
C, inflates each packed row and names its keys back (``key_refs``), checks
that every record chains to its row's stored hash (rows inflate and chain on
up to four threads, the caller's included), and applies the records in seq
order as the replay's inlined cases do (``Replayer.apply_intact_rows``,
``cache_replay``): blocks taken from the free stack's top, plain blocks freed
by their owner, REGISTER, SHARE, RELEASE and EVICT that break no rule, a
SNAPSHOT whose text is the replayed state's canonical JSON, POOL_INIT first,
nothing after POOL_CLOSE, whole batches.

At the first thing it does not handle or that breaks a rule (a hash that does
not match, a seq out of line, an older record encoding, a kind it does not
inline, a FORK, a block freed twice, ...) it gives up, and the Python replay
audits the whole epoch: it names what is wrong. So the fold decides nothing
the Python path would decide otherwise; it is stricter, never looser (numbers
must be canonical, keys sha256 in base64url). The rest of the audit (the
end-of-epoch checks of ``Replayer.finish``, leaks at POOL_CLOSE, the
speculative-decoding rule) is the Python code both paths share. Equality of
the two paths' reports is tested on random logs, clean and damaged
(tests/allocator/test_intact_fold.py).

Not folded, by design: a tail audit from a checkpoint (recovery reads at most
one snapshot interval), an epoch whose older part is archived (its cut starts
from a loaded snapshot), and a log whose key rows are not contiguous.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator.log.errors import is_store_unavailable
from nanoserve.allocator.log.hash_chain import genesis_hash
from nanoserve.allocator.log.key_refs import KEY_BYTES
from nanoserve.allocator.log.key_table import has_key_table
from nanoserve.allocator.log.reader import EpochInfo
from nanoserve.allocator.log.replay_state import Replayer
from nanoserve.allocator.log.row_scan import stored_rows
from nanoserve.allocator.log.schema import allocator_keys
from nanoserve.allocator.log.segment import epoch_cut

__all__ = ["Folded", "fold_intact"]

# threads besides the caller's that inflate and chain rows (the C side takes at most 3)
MAX_HELPERS = 3
# stored rows per chunk handed to C: a packed row holds up to 1,024 events
_CHUNK_ROWS = 64


@dataclass
class Folded:
    """An epoch the C fold found intact: the replayer at its end (``finish`` done, no violation), and
    whether a record names a speculative-decoding reason (the audit then runs ``draft_audit``'s rule)."""

    replayer: Replayer
    has_drafts: bool


def fold_intact(conn: sa.Connection, info: EpochInfo) -> Folded | None:
    """The epoch from its genesis folded in C when it is provably intact; None when the Python replay must
    audit it (not intact, not foldable, or the fold not built: ``intact_fold_build.load``).

    Raises the store's error when it cannot be reached (as the Python replay would); any other error of
    the store makes it None.
    """
    from nanoserve.allocator.log.intact_fold_build import load  # late: `python -m` runs that module as a script

    module = load()
    if module is None or epoch_cut(conn, info.pool_id, info.epoch) is not None:
        return None
    dbapi_error = conn.dialect.loaded_dbapi.Error
    try:
        keys = _stored_keys(conn, info)
        if keys is None:
            return None
        rows = stored_rows(conn, info.pool_id, info.epoch, _CHUNK_ROWS)
        try:
            answer = module.fold_epoch(
                info.num_blocks, genesis_hash(info.pool_id, info.epoch), keys, rows, _num_helpers()
            )
        finally:
            rows.close()
    except (dbapi_error, sa.exc.DBAPIError) as exc:
        if is_store_unavailable(exc):
            raise
        return None
    if not answer[0]:
        return None
    return _finished(info, answer[2])


def _finished(info: EpochInfo, state: tuple[Any, ...]) -> Folded | None:
    """A replayer holding the fold's end state, after ``Replayer.finish``; None when that finds a violation."""
    free, owners, sharers, cached, block_keys, key_blocks, expected_seq, batch_end, head, closed, num, drafts = state
    replayer = Replayer(info)
    pool = replayer.pool
    pool.free_block_ids, pool.owners, pool.sharers, pool.cached_free = free, owners, sharers, cached
    pool.block_keys, pool.key_blocks = block_keys, key_blocks
    replayer.expected_seq, replayer.last_seq, replayer.batch_end = expected_seq, expected_seq - 1, batch_end
    replayer.previous_hash, replayer.closed_seq, replayer.num_events = head, closed, num
    replayer.finish()
    if replayer.violations:
        return None  # the Python replay names them, with everything else it finds
    return Folded(replayer, drafts)


def _stored_keys(conn: sa.Connection, info: EpochInfo) -> bytes | None:
    """The epoch's stored keys back to back, key id 0 first (b'' without a key table); None when its rows
    are not one contiguous run of whole keys from id 0 (``key_refs.KeyChunks`` then decides, in Python)."""
    if not has_key_table(conn):
        return b""
    table = allocator_keys.c
    query = (
        sa.select(table.first_key_id, table.block_keys)
        .where(table.pool_id == info.pool_id, table.epoch == info.epoch)
        .order_by(table.first_key_id)
    )
    parts: list[bytes] = []
    num_keys = 0
    for first_key_id, keys in conn.execute(query):
        if first_key_id != num_keys or not isinstance(keys, (bytes, memoryview)) or len(keys) % KEY_BYTES:
            return None
        parts.append(bytes(keys))
        num_keys += len(keys) // KEY_BYTES
    return b"".join(parts)


def _num_helpers() -> int:
    """Threads to add to the caller's: one per further CPU this process may run on, at most MAX_HELPERS."""
    try:
        num_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        num_cpus = os.cpu_count() or 1
    return max(0, min(MAX_HELPERS, num_cpus - 1))
