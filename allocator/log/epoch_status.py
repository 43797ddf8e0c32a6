"""How the log's readers name an epoch: closed, open, crashed, or archived.

An epoch without POOL_CLOSE is open. The log alone cannot tell a running
server from a crashed one, except by what came after: a server holds its
pool's lock for as long as it writes (``pool_lock``), so once a later epoch
of the same pool opened, the older open one is crashed. Every reader (``log
audit``, ``log epochs``, ``log plot``, ``log audit --archive``) names it by
this one rule.
"""

from __future__ import annotations

import sqlalchemy as sa

from nanoserve.allocator.log.archive import manifest_rows
from nanoserve.allocator.log.reader import list_epochs

# an epoch without POOL_CLOSE that is its pool's newest: a reader of the log cannot tell running from crashed
OPEN_STATUS = "open (running, or crashed)"


def open_status(epoch: int, newest_epoch: int, recovered_by: int | None = None) -> str:
    """The status of an epoch without POOL_CLOSE, given its pool's newest epoch (live or archived): crashed
    when a later epoch opened, naming the epoch that recovered it where the journal says; else OPEN_STATUS."""
    if recovered_by is not None:
        return f"crashed; recovered by epoch {recovered_by}"
    if epoch + 1 == newest_epoch:
        return f"crashed; epoch {newest_epoch} opened the pool after it"
    if epoch < newest_epoch:
        return f"crashed; epochs {epoch + 1}..{newest_epoch} opened the pool after it"
    return OPEN_STATUS


def newest_epochs(conn: sa.Connection) -> dict[str, int]:
    """pool_id -> its newest epoch, of the epochs in the log and those its manifest names as archived."""
    newest: dict[str, int] = {}
    for info in list_epochs(conn, None):
        newest[info.pool_id] = max(info.epoch, newest.get(info.pool_id, 0))
    for entry in manifest_rows(conn):
        newest[entry.pool_id] = max(entry.epoch, newest.get(entry.pool_id, 0))
    return newest
