#!/usr/bin/env bash
# Checks the gRPC contract in protos/: `buf lint` (STANDARD rules, protos/buf.yaml), then
# `buf breaking` (FILE rules) against the contract of the previous commit.
#
#   bash scripts/check_protos.sh
#
# buf is the npm package @bufbuild/buf at the exact version pinned in package.json and
# package-lock.json; `npm ci --ignore-scripts` installs it into node_modules/ when it is
# missing or another version. BUF=/path/to/buf uses that binary instead.
#
# The previous commit:
#   - protos/ has uncommitted changes: HEAD, the parent of the commit being prepared;
#   - otherwise HEAD~1; for a merge commit that is its first parent, the branch merged into.
#   - A shallow clone that lacks HEAD~1 fetches one more commit (`git fetch --deepen=1`);
#     when that fails the check fails and says how to fetch it. A root commit, or a
#     previous commit without protos/, has no contract to break.
#
# An intentional break is declared in the message of a commit being checked (HEAD~1..HEAD:
# the commit itself, or any commit a merge brings in) by a trailer, in the last paragraph:
#
#     Proto-Breaking: <what breaks, and what clients must change>
#
# buf's findings are then printed as accepted and the check passes. Exit 0: lint clean, and
# no break or a declared one; 1: lint findings, an undeclared break, or no history to compare.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${BUF:-}" ]; then
  pinned=$(node -p "require('./package.json').devDependencies['@bufbuild/buf']")
  if [ ! -x node_modules/.bin/buf ] || [ "$(node_modules/.bin/buf --version 2>/dev/null)" != "$pinned" ]; then
    echo "check_protos: installing buf $pinned (npm ci)" >&2
    npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2
  fi
  BUF=node_modules/.bin/buf
fi

echo "check_protos: buf lint protos" >&2
if ! "$BUF" lint protos; then
  echo "check_protos: buf lint failed (above); STANDARD rules, protos/buf.yaml" >&2
  exit 1
fi

if ! git rev-parse --git-dir >/dev/null 2>&1; then
  echo "check_protos: not a git checkout; buf breaking needs the previous commit" >&2
  exit 1
fi
if [ -n "$(git status --porcelain -- protos)" ]; then
  base=HEAD
else
  if ! git rev-parse -q --verify 'HEAD~1^{commit}' >/dev/null; then
    if [ "$(git rev-parse --is-shallow-repository)" = true ]; then
      echo "check_protos: shallow clone without HEAD~1; fetching one more commit" >&2
      if ! git fetch --quiet --deepen=1 || ! git rev-parse -q --verify 'HEAD~1^{commit}' >/dev/null; then
        echo "check_protos: cannot fetch HEAD~1; run 'git fetch --deepen=1' (or clone with --depth 2) and retry" >&2
        exit 1
      fi
    else
      echo "check_protos: HEAD is a root commit; no previous contract to break" >&2
      exit 0
    fi
  fi
  base=HEAD~1
fi
if ! git cat-file -e "$base:protos" 2>/dev/null; then
  echo "check_protos: $base has no protos/; no previous contract to break" >&2
  exit 0
fi

previous=$(mktemp -d)
trap 'rm -rf "$previous"' EXIT
git archive "$base" protos | tar -x -C "$previous"
echo "check_protos: buf breaking protos against $base ($(git rev-parse --short "$base"))" >&2
status=0
findings=$("$BUF" breaking protos --against "$previous/protos" 2>&1) || status=$?
if [ "$status" -eq 0 ]; then
  exit 0
fi
if [ "$status" -ne 100 ]; then  # 100: breaking changes found; anything else: buf itself failed
  printf '%s\n' "$findings" >&2
  exit "$status"
fi
declared=$(git log --format='%(trailers:key=Proto-Breaking,valueonly,separator=%x20)' "$base..HEAD" | sed '/^$/d')
if [ -z "$declared" ]; then
  printf '%s\n' "$findings" >&2
  echo "check_protos: the contract breaks $base's. Keep it compatible, or declare the break with a" >&2
  echo "  'Proto-Breaking: <what breaks, and what clients must change>' trailer in the commit message." >&2
  exit 1
fi
printf '%s\n' "$findings" >&2
echo "check_protos: breaking changes against $base accepted, declared by Proto-Breaking:" >&2
printf '  %s\n' "$declared" >&2
