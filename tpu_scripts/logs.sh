#!/usr/bin/env bash
# Follows the log files of one role (the trainer, or rollout server SERVER) on WORKER (default: all
# workers, interleaved; each file is announced by tail with the worker's hostname in its name).
set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "$0")/lib.sh"
tpu_settings "Usage: $(basename "$0") [--env FILE] [--role trainer|rollout] [--server I] [--worker all|N] [--dry-run]
Follows ~/$REMOTE_LOGS/*.log on the chosen slice (Ctrl-C to stop following; the roles keep running)." "$@"
require PROJECT ZONE RUN

case "$ROLE" in
  trainer) node=$(trainer_node) ;;
  rollout)
    ((SERVER < INFERENCE_SLICES)) || die "SERVER (--server) must be below INFERENCE_SLICES ($INFERENCE_SLICES), got $SERVER"
    node=$(inference_node "$SERVER")
    ;;
  *) die "ROLE (--role) must be trainer or rollout, got '$ROLE'" ;;
esac
on_workers "$node" "tail -n 100 -F $REMOTE_LOGS/*.log" "$WORKER"
