#!/usr/bin/env bash
# Requests the trainer slice and K inference slices as Cloud TPU queued resources, then waits until
# every one is ACTIVE (a queued request can wait for capacity for a long time; Ctrl-C stops the wait,
# not the requests: teardown.sh deletes them).
set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "$0")/lib.sh"
tpu_settings "Usage: $(basename "$0") [--env FILE] [flags] [--dry-run]
Creates queued resources RUN-trainer-qr (node RUN-trainer, TRAINER_TYPE) and RUN-rollout-I-qr
(node RUN-rollout-I, INFERENCE_TYPE) for I = 0..K-1, and waits until all are ACTIVE." "$@"
require PROJECT ZONE RUN TRAINER_TYPE INFERENCE_TYPE RUNTIME_VERSION

request() {
  local node=$1 type=$2 tier=()
  ((SPOT)) && tier=(--spot)
  run gcloud compute tpus queued-resources create "$node-qr" "${WHERE[@]}" "--node-id=$node" \
    "--accelerator-type=$type" "--runtime-version=$RUNTIME_VERSION" "${tier[@]}"
}

wait_active() {
  local node=$1 state=""
  local describe=(gcloud compute tpus queued-resources describe "$node-qr" "${WHERE[@]}" "--format=value(state.state)")
  if ((DRY_RUN)); then
    quote_args "${describe[@]}"
    return
  fi
  while [[ "$state" != ACTIVE ]]; do
    local now
    now=$("${describe[@]}")
    [[ "$now" != "$state" ]] && say "$node: $now"
    state=$now
    case "$state" in
      FAILED | SUSPENDED | SUSPENDING) die "$node-qr is $state: gcloud compute tpus queued-resources describe $node-qr ${WHERE[*]}" ;;
      ACTIVE) ;;
      *) sleep 30 ;;
    esac
  done
}

if [[ -n "$BUCKET_LOCATION" ]]; then
  require BUCKET
  run gcloud storage buckets create "gs://$BUCKET" "--project=$PROJECT" "--location=$BUCKET_LOCATION" --uniform-bucket-level-access
fi
request "$(trainer_node)" "$TRAINER_TYPE"
for ((i = 0; i < INFERENCE_SLICES; i++)); do request "$(inference_node "$i")" "$INFERENCE_TYPE"; done
while read -r node; do wait_active "$node"; done < <(all_nodes)
((DRY_RUN)) || say "all $((INFERENCE_SLICES + 1)) slices are ACTIVE; next: install.sh"
