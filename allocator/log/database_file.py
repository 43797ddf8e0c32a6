"""``DatabaseFile``: the SQLite file a writer opened, and whether the file at its path is still that one."""

from __future__ import annotations

import os
from pathlib import Path

from nanoserve.allocator.log.errors import LogFileLostError


class DatabaseFile:
    """A SQLite log file by (device, inode), taken when the writer starts.

    A file deleted or replaced under a running writer takes the epoch's rows
    with it; a commit into it is not durable, so the writer checks after every
    commit and every idle half second.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.identity = _identity(path)

    def check(self, pool_id: str, epoch: int, chained_seq: int) -> None:
        """Raises LogFileLostError, naming the pool, the epoch and the seqs lost, when the file at the
        path is gone or another file."""
        identity = _identity(self.path)
        if identity != self.identity:
            what = "deleted" if identity is None else "replaced by another file"
            raise LogFileLostError(
                f"the event log file {str(self.path)!r} was {what} while this server wrote it: "
                f"pool {pool_id!r} epoch {epoch} is lost with it (seqs 1..{chained_seq}); "
                "no later event is recorded"
            )


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``; None when there is none."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino
