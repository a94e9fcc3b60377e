#!/usr/bin/env bash
# Starts the roles on every worker, detached (nohup), one log file per worker in ~/areal-logs: the
# trainer (`areal-jax trainer`) on RUN-trainer, rollout server I (`areal-jax rollout --server I`) on
# RUN-rollout-I. All share the run directory gs://BUCKET/runs/RUN. The workers of each slice form one
# jax.distributed job (distributed.enabled=true; peers found from the TPU environment): the trainer's, and
# each inference slice's, whose server then spans all its hosts (worker 0 drives, the others follow).
set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "$0")/lib.sh"
tpu_settings "Usage: $(basename "$0") [--env FILE] [flags] [--dry-run] [-- OVERRIDE ...]
Starts the trainer and the K rollout servers; words after -- are passed to both roles
(config overrides such as train_steps=500, or --resume)." "$@"
require PROJECT ZONE RUN BUCKET CONFIG

# The remote command that starts a role (NAME SUBCOMMAND [ARGS]) unless it already runs there.
launch() {
  local name=$1 sub=$2 pid="../$REMOTE_LOGS/$1.pid" args
  shift 2
  args=$(quote_args "$sub" "$CONFIG" "$@" "output_dir=$(run_dir)" "name=$RUN" \
    "cluster.rollout_servers=$INFERENCE_SLICES" "${EXTRA_ARGS[@]}")
  echo "set -e; cd $REMOTE_REPO; mkdir -p ../$REMOTE_LOGS;" \
    "if [ -f $pid ] && kill -0 \$(cat $pid) 2>/dev/null; then echo '$name already runs' >&2; exit 1; fi;" \
    "PYTHONUNBUFFERED=1 nohup .venv/bin/areal-jax $args" \
    "> ../$REMOTE_LOGS/$name-\$(hostname).log 2>&1 < /dev/null & echo \$! > $pid"
}

on_workers "$(trainer_node)" "$(launch trainer trainer distributed.enabled=true)"
for ((i = 0; i < INFERENCE_SLICES; i++)); do
  on_workers "$(inference_node "$i")" "$(launch "rollout-$i" rollout --server "$i" distributed.enabled=true)"
done
((DRY_RUN)) || say "started; follow with logs.sh, stop with stop.sh"
