"""nanoserve's on-disk cache of what start-up derives from a model file (a tokenizer, a GGUF header).

Entries are named by a hash of what they were derived from, so a changed file
or library version misses instead of reading a stale entry. Writes are atomic
(a reader sees a whole entry or none) and best-effort: a cache that cannot be
written costs the next start its time, never a failure.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """``$NANOSERVE_CACHE_DIR/<kind>``, else ``$XDG_CACHE_HOME/nanoserve/<kind>``, else ``~/.cache/nanoserve/<kind>``.

    kind: a folder per kind of entry (``tokenizers``, ``gguf``).
    """
    root = os.environ.get("NANOSERVE_CACHE_DIR")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nanoserve")
    return Path(root) / kind


def write_atomically(path: Path, text: str) -> bool:
    """Writes ``text`` to ``path`` through a temporary file and a rename; False when it could not be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".staging-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(staging, path)
        return True
    except OSError:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(staging)
        return False
