#!/usr/bin/env bash
# The code quality gates, configured in pyproject.toml: ruff lint, ruff format, mypy. Fails on any finding.
#
#   bash scripts/lint.sh                  # all three (scripts/test.sh runs this before the tests)
#   bash scripts/lint.sh mypy             # one or more of: ruff-check ruff-format mypy (the pre-commit hooks)
#
# Uses .venv (scripts/install.sh) unless a virtual environment is active already.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  . .venv/bin/activate
fi

# The source folders are the nanoserve.* packages only through setuptools' package-dir mapping, which
# mypy cannot follow: it reads them through links under .typecheck/nanoserve/ (gitignored, mypy_path).
link_typecheck_tree() {
  mkdir -p .typecheck/nanoserve
  local package
  for package in allocator engine service migrations; do
    ln -sfn "../../$package" ".typecheck/nanoserve/$package"
  done
  ln -sfn ../../protos/nanoserve/v1 .typecheck/nanoserve/v1
}

if [ $# -eq 0 ]; then
  set -- ruff-check ruff-format mypy
fi
failed=()
for gate in "$@"; do
  case "$gate" in
    ruff-check) python -m ruff check . || failed+=("$gate") ;;
    ruff-format) python -m ruff format --check . || failed+=("$gate (run: ruff format)") ;;
    mypy) link_typecheck_tree && python -m mypy || failed+=("$gate") ;;
    *)
      echo "lint.sh: unknown gate '$gate' (ruff-check, ruff-format, mypy)" >&2
      exit 2
      ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then
  printf 'lint.sh: failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
