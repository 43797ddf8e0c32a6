"""transformers' names, imported one thread at a time.

transformers is a lazy module: ``from transformers import X`` (and any import of
a submodule) runs its initialisation on first attribute access. Two threads
doing that at once see each other's partly initialised modules, and one gets
``ImportError: cannot import name ... from partially initialized module``
(issue 29: GetTokenizer failed with INTERNAL on 5 of 8 fresh starts while the
chat-template thread imported transformers). Every import of transformers in
nanoserve goes through ``transformers_name``, which holds one process-wide lock
for the whole import, so the race cannot happen whichever threads ask; a call
into transformers that may import more of it lazily (``from_pretrained``,
``save_pretrained``) runs inside ``transformers_exclusive()``, under the same lock.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any

# held for the whole of each import of transformers (or one of its submodules) and the lookup of its name,
# and for each call that may import more of it; reentrant: such a call may look names up itself
_IMPORT_LOCK = threading.RLock()


def transformers_name(module: str, name: str) -> Any:
    """``from <module> import <name>``, with no other thread importing transformers meanwhile.

    module: ``transformers`` or one of its submodules (``transformers.utils.chat_template_utils``).
    Raises ImportError (transformers missing or broken) or AttributeError (no such name).
    """
    assert module == "transformers" or module.startswith("transformers."), f"not a transformers module: {module}"
    with _IMPORT_LOCK:
        return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def transformers_exclusive() -> Iterator[None]:
    """Holds the import lock for a block that calls into transformers and may import more of it lazily."""
    with _IMPORT_LOCK:
        yield
