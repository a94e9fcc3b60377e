#!/usr/bin/env bash
# The main job on CPU: installs what it needs into .venv, then runs asynchronous RL on the embedded
# running-sums task (a short supervised warm start first, cached in the run directory).
# Extra arguments are config overrides, e.g. train_steps=100 rollout.staleness.max_head_offpolicyness=0,
# or --resume to continue the last run. Without --resume a rerun starts over (--overwrite): the earlier
# run in runs/async-chain-sums is deleted first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_venv.sh requirements.txt
mode=--overwrite
for arg in "$@"; do
  if [[ "$arg" == "--resume" || "$arg" == "--overwrite" ]]; then mode=""; fi
done
exec .venv/bin/areal-jax train $mode configs/chain_sums_cpu.yaml "$@"
