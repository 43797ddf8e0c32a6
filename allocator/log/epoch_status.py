"""How the log's readers name an epoch: closed, open, crashed, or archived.

An epoch without POOL_CLOSE is open. The log alone cannot tell a running
server from a crashed one, except by what came after: a server holds its
pool's lock for as long as it writes (``pool_lock``), so once a later epoch
of the same pool opened, the older open one is crashed. An epoch the log's
manifest names (``archived_epochs``) is never its pool's newest: an archive
file holds its own epoch's manifest row (``archive.archive_epoch``), so a
reader of the file alone names it crashed too, and recovered by the epoch the
row names. Every reader (``log audit``, ``log epochs``, ``log plot``, ``log
requests``, ``log audit --archive``) names it by this one rule
(``OpenStatuses``).
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from nanoserve.allocator.log.archive import manifest_rows
from nanoserve.allocator.log.reader import list_epochs

# an epoch without POOL_CLOSE that is its pool's newest: a reader of the log cannot tell running from crashed
OPEN_STATUS = "open (running, or crashed)"


# an archived epoch without POOL_CLOSE whose recovering epoch its file does not name
ARCHIVED_CRASHED_STATUS = "crashed; a later epoch opened the pool after it (archived)"


def open_status(epoch: int, newest_epoch: int, recovered_by: int | None = None, archived: bool = False) -> str:
    """The status of an epoch without POOL_CLOSE, given its pool's newest epoch (live or archived): crashed
    when a later epoch opened, naming the epoch that recovered it where the journal says, or when it is
    ``archived`` (never a pool's newest); else OPEN_STATUS."""
    if recovered_by is not None:
        return f"crashed; recovered by epoch {recovered_by}"
    if epoch + 1 == newest_epoch:
        return f"crashed; epoch {newest_epoch} opened the pool after it"
    if epoch < newest_epoch:
        return f"crashed; epochs {epoch + 1}..{newest_epoch} opened the pool after it"
    return ARCHIVED_CRASHED_STATUS if archived else OPEN_STATUS


@dataclass(frozen=True)
class OpenStatuses:
    """What a log (or an archive file) says about its epochs without POOL_CLOSE.

    newest: pool_id -> its newest epoch (``newest_epochs``); archived: (pool_id, epoch) -> the epoch that
    recovered it (None: not named), of every epoch the log's manifest names, an archive file's own included;
    recovered_by: (pool_id, epoch) -> the recovering epoch, from the journal's RECOVER records (the caller's).
    """

    newest: dict[str, int]
    archived: dict[tuple[str, int], int | None]
    recovered_by: dict[tuple[str, int], int]

    def of(self, pool_id: str, epoch: int) -> str:
        """``open_status`` of an epoch of this log without POOL_CLOSE."""
        key = (pool_id, epoch)
        recovered_by = self.recovered_by.get(key, self.archived.get(key))
        return open_status(epoch, self.newest.get(pool_id, epoch), recovered_by, key in self.archived)

    def merged(self, other: OpenStatuses) -> OpenStatuses:
        """What this log and ``other`` (an archive file and its live log) say together."""
        newest = dict(self.newest)
        for pool_id, epoch in other.newest.items():
            newest[pool_id] = max(epoch, newest.get(pool_id, 0))
        archived = dict(other.archived)
        archived.update({key: by for key, by in self.archived.items() if by is not None or key not in archived})
        return OpenStatuses(newest, archived, {**other.recovered_by, **self.recovered_by})


def open_statuses(conn: sa.Connection, recovered_by: dict[tuple[str, int], int] | None = None) -> OpenStatuses:
    """The ``OpenStatuses`` of the log at ``conn``; ``recovered_by`` as the journal's RECOVER records say."""
    archived = {(entry.pool_id, entry.epoch): entry.recovered_by for entry in manifest_rows(conn)}
    return OpenStatuses(newest_epochs(conn), archived, dict(recovered_by or {}))


def newest_epochs(conn: sa.Connection) -> dict[str, int]:
    """pool_id -> its newest epoch, of the epochs in the log and those its manifest names as archived."""
    newest: dict[str, int] = {}
    for info in list_epochs(conn, None):
        newest[info.pool_id] = max(info.epoch, newest.get(info.pool_id, 0))
    for entry in manifest_rows(conn):
        newest[entry.pool_id] = max(entry.epoch, newest.get(entry.pool_id, 0))
    return newest
