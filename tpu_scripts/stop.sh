#!/usr/bin/env bash
# Stops the roles: SIGTERM to each process started by start.sh (its pid file on each worker), then waits
# up to 5 minutes for it to exit. The trainer goes first: on SIGTERM it writes a checkpoint to the run
# directory, so a later start.sh -- --resume continues from there.
set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "$0")/lib.sh"
tpu_settings "Usage: $(basename "$0") [--env FILE] [flags] [--dry-run]
Stops the trainer on RUN-trainer, then the rollout servers on RUN-rollout-0..K-1." "$@"
require PROJECT ZONE RUN

stop_command="for f in $REMOTE_LOGS/*.pid; do [ -e \"\$f\" ] || continue; pid=\$(cat \"\$f\");"
stop_command+=" if kill -TERM \"\$pid\" 2>/dev/null; then timeout 300 tail --pid=\"\$pid\" -f /dev/null || echo \"pid \$pid still runs\" >&2; fi;"
stop_command+=" rm -f \"\$f\"; done"
while read -r node; do on_workers "$node" "$stop_command"; done < <(all_nodes)
