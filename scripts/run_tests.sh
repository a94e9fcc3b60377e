#!/usr/bin/env bash
# The test suite: installs what it needs into .venv, lints, then runs pytest (8 virtual CPU devices).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_venv.sh requirements-dev.txt
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --diff . | head -50; exit 1; }
set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 0
fi
exit "$status"
