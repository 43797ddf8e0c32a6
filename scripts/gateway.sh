#!/usr/bin/env bash
# The OpenAI API in front of nanoserve replicas, as processes on this machine: `nanoserve gateway`
# (two `nanoserve serve` replicas, pool ids replica-0 and replica-1, sharing one event log, and the
# smg gateway in front: `smg launch --backend vllm --worker-urls grpc://... --policy cache_aware`).
#
#   bash scripts/gateway.sh                                   # OpenAI API on 127.0.0.1:8000, log ./nanoserve-log.db
#   bash scripts/gateway.sh --event-log-url postgresql+psycopg://postgres@127.0.0.1:5432/test
#   bash scripts/gateway.sh --port 8080 --policy prefix_hash -- --num-kv-blocks 1024   # after --: every replica
#
# Prints one `gateway_ready` JSON line when the gateway routes to every replica; Ctrl-C or SIGTERM stops
# the gateway, then the replicas (streams drain, epochs close). `nanoserve gateway --help` lists the flags.
# Uses .venv (scripts/install.sh) unless a virtual environment is active already.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  . .venv/bin/activate
fi
exec nanoserve gateway "$@"
