#!/usr/bin/env bash
# The main job on CPU: installs what it needs into .venv, then runs the embedded default task.
# Extra arguments are config overrides, e.g. generation.temperature=0.7
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_venv.sh requirements.txt
exec .venv/bin/areal-jax demo configs/demo.yaml "$@"
