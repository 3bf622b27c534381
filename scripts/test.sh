#!/usr/bin/env bash
# Set up (see setup.sh) and run the whole test suite, then lint (ruff) and the
# type check (mypy). Extra arguments go to pytest. Fails if any of them fails.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
status=0
.venv/bin/python -m pytest "$@" || status=$?
echo "lint: ruff check and ruff format --check"
.venv/bin/ruff check replication storage workers scripts tests || status=1
.venv/bin/ruff format --check --quiet replication storage workers scripts tests || status=1
echo "types: mypy (replication, storage, workers, scripts)"
.venv/bin/mypy || status=1
exit "$status"
