#!/usr/bin/env bash
# The test suites: installs what they need (.venv, and .venv-jetstream for the JetStream interop suite),
# lints and type-checks, then runs pytest on tests/ (8 virtual CPU devices, 2 worker processes) and on
# tests_jetstream/. Extra arguments go to the main pytest run.
#   --fast  the edit-and-test tier: every test but the whole-system runs and the slow compiles (markers
#           `system` and `slow`, set by file in tests/conftest.py), no JetStream suite; within FAST_BUDGET_S.
# Each run prints its 15 slowest tests and heaviest files (scripts/suite_file_times.py) and fails when the
# main pytest run takes longer than its budget (SUITE_BUDGET_S, FAST_BUDGET_S), so a change that makes the
# suite slower is seen when it lands, not several changes later. On 2026-12-04 the full suite took 657-691 s
# and the fast tier 120 s on the idle 2-core machine (the same commit has run 27% slower 40 minutes later), so
# the budgets sit ~40% above them, past that noise. The suite keeps both cores busy (98% in vmstat): running
# the type check and the JetStream suite beside it saved nothing (measured). Most of its time is JAX tracing,
# lowering and XLA compiling small programs: the code generator is set for compile time (tests/xla_flags.py),
# and modules are compiled to bytecode once (the .venv's at install, scripts/install_requirements.sh; this
# repository's below), not in every process.
set -euo pipefail
cd "$(dirname "$0")/.."
SUITE_BUDGET_S=${SUITE_BUDGET_S:-960}
FAST_BUDGET_S=${FAST_BUDGET_S:-300}
fast=0
if [ "${1:-}" = --fast ]; then
  fast=1
  shift
fi
bash scripts/ensure_venv.sh requirements-dev.txt
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --diff . | head -50; exit 1; }
.venv/bin/mypy areal_jax
# (where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, nothing else writes them)
.venv/bin/python -m compileall -q -j 0 areal_jax tests scripts benchmarks >/dev/null
tier=()
budget=$SUITE_BUDGET_S
if [ "$fast" = 1 ]; then
  tier=(-m "not system and not slow")
  budget=$FAST_BUDGET_S
fi
report=$(mktemp --suffix=.xml)
trap 'rm -f "$report"' EXIT
started=$(date +%s)
set +e
# two workers, one test file each at a time (a file's module fixtures are built once): the suite waits on
# subprocesses, threads and compiles, so 2 workers on 2 cores finish it sooner than one
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15 --junitxml="$report" "${tier[@]}" "$@"
status=$?
set -e
elapsed=$(($(date +%s) - started))
# informational: a report it cannot read (a run cut short) does not hide pytest's own status below
[ -s "$report" ] && { .venv/bin/python scripts/suite_file_times.py "$report" || true; }
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: a suite that runs nothing is a failure" >&2
fi
[ "$status" -eq 0 ] || exit "$status"
echo "pytest took ${elapsed} s (budget ${budget} s)"
if [ "$elapsed" -gt "$budget" ]; then
  echo "the suite took ${elapsed} s, over its budget of ${budget} s: find what grew in the slowest tests above" >&2
  exit 1
fi
[ "$fast" = 1 ] && exit 0
# JetStream interop runs in its own environment (google-jetstream pulls TensorFlow).
bash scripts/setup_jetstream_env.sh
.venv-jetstream/bin/python -m pytest tests_jetstream
