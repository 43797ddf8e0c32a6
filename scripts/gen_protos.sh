#!/usr/bin/env bash
# Regenerates the Python code of the gRPC contract beside the .proto files:
# protos/nanoserve/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py. The only way those
# files are made; tests/service/grpc/test_protos.py checks that they are up to date.
#
#   bash scripts/gen_protos.sh [OUT_DIR]     (default: protos)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-protos}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
"$PY" -m grpc_tools.protoc -I protos \
  --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  protos/nanoserve/v1/*.proto
