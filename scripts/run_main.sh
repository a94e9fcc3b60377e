#!/usr/bin/env bash
# The main job on CPU: installs what it needs into .venv, then runs asynchronous RL on the embedded
# arithmetic task.
# Extra arguments are config overrides, e.g. train_steps=100 rollout.staleness.max_head_offpolicyness=0
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_venv.sh requirements.txt
exec .venv/bin/areal-jax train configs/train_cpu.yaml "$@"
