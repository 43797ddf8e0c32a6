#!/usr/bin/env bash
# Installs what the tests need (scripts/install.sh), runs the code quality gates
# (scripts/lint.sh: ruff lint and format, mypy) and the whole suite, PostgreSQL
# tests included (server at 127.0.0.1:5432, database `test`). The tests run even
# when a gate fails, so one run reports both; either failing fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate

export NANOSERVE_TEST_PG_URL=${NANOSERVE_TEST_PG_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}
if command -v pg_isready >/dev/null && ! pg_isready -q -h 127.0.0.1 -p 5432; then
  # The machine's PostgreSQL may have stopped; start it when we can.
  if command -v pg_ctlcluster >/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start || true
  fi
fi
# In CI the PostgreSQL tests must run, not skip.
if [ "${CI:-}" = "true" ]; then export NANOSERVE_REQUIRE_PG=1; fi

lint_status=0
bash scripts/lint.sh || lint_status=$?
python -m pytest "$@"
if [ "$lint_status" -ne 0 ]; then
  echo "test.sh: the tests passed but scripts/lint.sh failed (see above)" >&2
  exit "$lint_status"
fi
