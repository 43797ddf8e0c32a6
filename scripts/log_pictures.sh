#!/usr/bin/env bash
# Renders the example pictures of README's "Looking at the log" into docs/:
#   docs/log-plot.png    nanoserve log plot of a real workload (block map and occupancy over the steps)
#   docs/log-state.svg   nanoserve log state --svg at its first preemption (open it in a browser: tooltips)
# The workload: SmolLM2-135M-Instruct (float32, CPU) serving 12 chat requests on a pool of 40 blocks of
# 16 tokens, small enough that requests are preempted and recomputed; one request is aborted. Every
# request ignores EOS and stops at its max_tokens, so the blocks taken, and the pictures, are the same on
# every machine (the wall times differ; the pictures use steps).
#
#   bash scripts/log_pictures.sh [KEEP.db]   (after scripts/install.sh; about a minute on 2 cores)
#
# KEEP.db: keep the workload's log there, to draw other pictures of it (`nanoserve log plot --url sqlite:///KEEP.db`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
KEEP=${1:-}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
URL="sqlite:///$WORK/log.db"

OMP_NUM_THREADS=1 "$PY" - "$URL" "$WORK/seq" >/dev/null <<'EOF'
import sys

from nanoserve.allocator.log import read_events
from nanoserve.engine import AbortCause, ChatPrompt, LLMEngine, SamplingParams
from nanoserve.engine.config import EngineConfig

QUESTIONS = [
    "What is a KV cache?", "Explain paged attention in one paragraph.", "Name three sorting algorithms.",
    "Why is the sky blue?", "Write a haiku about memory.", "What does a scheduler do in an inference server?",
    "Give me a recipe for pancakes.", "What is preemption?", "Summarise the plot of Hamlet.",
    "How do hash chains detect tampering?", "What is continuous batching?", "Tell me a joke about caches.",
]
config = EngineConfig.from_kwargs(
    event_log_url=sys.argv[1], num_kv_blocks=40, block_size=16, max_num_seqs=8, dtype="float32", device="cpu"
)
engine = LLMEngine(config)
for i, question in enumerate(QUESTIONS):
    params = SamplingParams(temperature=0.0, max_tokens=40 + 12 * (i % 6), ignore_eos=True)
    engine.add_request(f"req-{i}", ChatPrompt([{"role": "user", "content": question}]), params)
step = 0
while engine.has_unfinished_requests():
    engine.step()
    step += 1
    if step == 60:
        engine.abort("req-9", AbortCause.CANCELLED)  # a client that went away
engine.shutdown()
with open(sys.argv[2], "w") as seq_file:  # the seq of the first preemption, for the grid
    seq_file.write(str(next(event.seq for event in read_events(sys.argv[1]) if event.reason == "preempted")))
EOF
SEQ=$(cat "$WORK/seq")
mkdir -p docs
"$PY" -m nanoserve.service.cli.main log plot --url "$URL" --x step -o docs/log-plot.png
"$PY" -m nanoserve.service.cli.main log state --url "$URL" --at "$SEQ" --svg docs/log-state.svg
if [ -n "$KEEP" ]; then
  cp "$WORK/log.db" "$KEEP"
fi
