#!/usr/bin/env bash
# From a fresh machine: install nanoserve, serve SmolLM2-135M-Instruct over gRPC,
# stream one chat completion from it with the CLI client, then stop the server
# gracefully (SIGTERM: streams finish, the event log is closed).
#
#   bash scripts/demo.sh ["your question"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate

PORT=${NANOSERVE_PORT:-50051}
SERVER_LOG=${NANOSERVE_DEMO_LOG:-nanoserve-demo.log}
QUESTION=${1:-"What is a KV cache in a language model? Answer in two sentences."}

nanoserve serve --port "$PORT" --metrics-port off --log-format console >"$SERVER_LOG" 2>&1 &
SERVER_PID=$!
stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID" || true
  fi
}
trap stop_server EXIT

echo "nanoserve: loading the model (server log: $SERVER_LOG)" >&2
until nanoserve health --server "localhost:$PORT" >/dev/null 2>&1; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "nanoserve: the server exited; its log:" >&2
    cat "$SERVER_LOG" >&2
    exit 1
  fi
  sleep 0.5
done

echo "> $QUESTION" >&2
nanoserve generate --server "localhost:$PORT" --chat "$QUESTION" --max-tokens 128 --temperature 0

stop_server
trap - EXIT
echo "nanoserve: server stopped; last lines of its log:" >&2
tail -n 4 "$SERVER_LOG" >&2
