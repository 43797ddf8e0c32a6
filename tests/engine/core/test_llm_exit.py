"""An ``LLM`` used without ``with`` (or ``shutdown``) still closes its log's epoch when the script exits.

Issue 29, item 8: such a script left its epoch "open (running, or crashed)", the
last finished request still holding blocks (its frees never reached the log).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
from nanoserve.engine.core.llm import LLM
from nanoserve.engine.sampling.params import SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=32, block_size=4,
          event_log_url=sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
outputs = llm.generate(["hello there", "a second prompt"], params)
print("generated", [len(o.outputs[0].token_ids) for o in outputs], flush=True)
"""


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nanoserve.service.cli.main", *args], capture_output=True, text=True, timeout=120
    )


def test_a_script_that_never_closes_its_llm_closes_its_epoch_at_exit(tiny_model_dir: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    script = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir), url], capture_output=True, text=True, timeout=120
    )
    assert script.returncode == 0, script.stderr
    assert "generated [6, 6]" in script.stdout
    epochs = _cli("log", "epochs", "--url", url)
    assert epochs.returncode == 0, epochs.stderr
    rows = [line.split(None, 8) for line in epochs.stdout.splitlines() if line.startswith("default ")]
    assert len(rows) == 1, epochs.stdout
    durable_seq, status = rows[0][7], rows[0][8].strip()  # the opened time is two words
    assert status == f"closed at seq {durable_seq}"
    audit = _cli("log", "audit", "--url", url)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.splitlines()[:2] == [
        f"pool 'default' epoch 1: {durable_seq} events, last seq {durable_seq}, closed",
        "  clean",
    ]
    assert "held blocks" not in audit.stdout
