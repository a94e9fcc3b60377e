#!/usr/bin/env bash
# The test suites: installs what they need (.venv, and .venv-jetstream for the JetStream interop suite),
# lints, then runs pytest on tests/ (8 virtual CPU devices, 2 worker processes) and on tests_jetstream/.
# Extra arguments go to the main pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_venv.sh requirements-dev.txt
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --diff . | head -50; exit 1; }
set +e
# two workers, one test file each at a time (a file's module fixtures are built once): the suite waits on
# subprocesses, threads and compiles, so 2 workers on 2 cores finish it in ~8 instead of ~9.5 minutes
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: a suite that runs nothing is a failure" >&2
fi
[ "$status" -eq 0 ] || exit "$status"
# JetStream interop runs in its own environment (google-jetstream pulls TensorFlow).
bash scripts/setup_jetstream_env.sh
.venv-jetstream/bin/python -m pytest tests_jetstream
