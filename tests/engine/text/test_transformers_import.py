"""transformers is imported one thread at a time, whichever threads ask first.

Issue 29, item 2: ``GetTokenizer`` (``Tokenizer.export_files``, which imports
transformers' ``PreTrainedTokenizerFast``) failed with ``ImportError: cannot import
name ... from partially initialized module`` while the chat-template thread
imported transformers' renderer. Each child interpreter below starts both at
the same moment, in a process where transformers is not yet imported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import sys, threading
from pathlib import Path
from nanoserve.engine.text.saved_tokenizer import load_saved_tokenizer
from nanoserve.engine.text.tokenizer import Tokenizer

saved = load_saved_tokenizer(Path(sys.argv[1]))
assert saved is not None, "the tiny model's tokenizer is the generic fast one"
assert "transformers" not in sys.modules, "transformers imported before the race"
tokenizer = Tokenizer(saved, {2}, "tiny")
barrier = threading.Barrier(2)
errors = []
files = {}

def run(work):
    barrier.wait()
    try:
        work()
    except Exception as exc:
        errors.append(repr(exc))

threads = [
    threading.Thread(target=run, args=(tokenizer.prepare_chat_template,)),
    threading.Thread(target=run, args=(lambda: files.update(tokenizer.export_files()),)),
]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("errors", errors)
print("files", sorted(files))
"""


@pytest.mark.parametrize("attempt", [1, 2])
def test_the_chat_template_import_and_a_tokenizer_export_at_once_both_succeed(
    tiny_model_dir: Path, attempt: int
) -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_model_dir)], capture_output=True, text=True, timeout=180
    )
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert "errors []" in lines, child.stdout
    assert any(line.startswith("files [") and "'tokenizer.json'" in line for line in lines), child.stdout
