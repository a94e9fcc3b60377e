#!/usr/bin/env bash
# Deletes the queued resources of the run and their TPU VMs (--force). The run directory in GCS stays.
# Run stop.sh first for a final checkpoint.
set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "$0")/lib.sh"
tpu_settings "Usage: $(basename "$0") [--env FILE] [flags] [--dry-run]
Deletes RUN-trainer-qr and RUN-rollout-0..K-1-qr with their nodes (asynchronously; check with
gcloud compute tpus queued-resources list)." "$@"
require PROJECT ZONE RUN

while read -r node; do
  run gcloud compute tpus queued-resources delete "$node-qr" "${WHERE[@]}" --force --async --quiet
done < <(all_nodes)
