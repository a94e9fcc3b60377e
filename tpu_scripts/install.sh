#!/usr/bin/env bash
# Installs areal-jax on every worker of every slice: the code (a git archive of REF copied with
# tpu-vm scp, or a git clone of REPO_URL at REF), Python (apt, if missing) and .venv with
# requirements-tpu.txt (scripts/ensure_venv.sh, as on a workstation).
set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "$0")/lib.sh"
tpu_settings "Usage: $(basename "$0") [--env FILE] [flags] [--dry-run]
Installs the repository at REF into ~/$REMOTE_REPO with its .venv on every worker of RUN-trainer and
RUN-rollout-0..K-1. Without REPO_URL the commit REF of this checkout is copied (uncommitted changes are not)." "$@"
require PROJECT ZONE RUN

py=$(quote_args "$PYTHON")
get_python="command -v $py >/dev/null || { sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q $py $py-venv; }"
venv="cd $REMOTE_REPO && PYTHON=$py bash scripts/ensure_venv.sh requirements-tpu.txt"

if [[ -n "$REPO_URL" ]]; then
  get_code="rm -rf $REMOTE_REPO && git clone -q $(quote_args "$REPO_URL") $REMOTE_REPO && git -C $REMOTE_REPO checkout -q $(quote_args "$REF")"
else
  tarball="${TMPDIR:-/tmp}/areal-jax-$RUN.tar.gz"
  run git -C "$REPO_ROOT" archive --format=tar.gz "--output=$tarball" "$REF"
  get_code="rm -rf $REMOTE_REPO && mkdir $REMOTE_REPO && tar -xzf $REMOTE_REPO.tar.gz -C $REMOTE_REPO"
fi

while read -r node; do
  [[ -n "$REPO_URL" ]] || run gcloud compute tpus tpu-vm scp "$tarball" "$node:$REMOTE_REPO.tar.gz" "${WHERE[@]}" --worker=all
  on_workers "$node" "set -e; $get_python; $get_code; $venv"
done < <(all_nodes)
((DRY_RUN)) || say "installed on every worker; next: start.sh"
