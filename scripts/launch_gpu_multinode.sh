#!/usr/bin/env bash
# Starts a multi-node GPU run inside a SLURM allocation (salloc/sbatch of TRAINER_NODES + ROLLOUT_SERVERS x
# ROLLOUT_NODES nodes): one `srun` step for the trainer (one process per GPU on each trainer node;
# jax.distributed reads SLURM's environment) and one per rollout server (one process with all GPUs of its
# node; over several nodes, one process per GPU in one jax.distributed job, its first process driving).
# Waits for the trainer, then stops the rollout servers. See docs/gpu.md.
set -euo pipefail
# shellcheck source=tpu_scripts/lib.sh
source "$(dirname "$0")/../tpu_scripts/lib.sh"
# shellcheck disable=SC2034  # read by parse_settings through its name
GPU_SETTINGS=(
  "CONFIG|--config||run config (a path readable on every node)"
  "OUTPUT_DIR|--output-dir||root of run directories, on a filesystem every node shares, or gs://BUCKET/runs"
  "RUN|--run||run name; the run directory is OUTPUT_DIR/RUN"
  "TRAINER_NODES|--trainer-nodes|1|nodes of the trainer (the first ones of the allocation)"
  "ROLLOUT_SERVERS|--rollout-servers|1|rollout servers (on the next nodes)"
  "ROLLOUT_NODES|--rollout-nodes|1|nodes of each rollout server (>1: one server spanning them)"
  "GPUS_PER_NODE|--gpus-per-node|8|GPUs of each node"
  "NODELIST|--nodelist||comma-separated hosts [default: the allocation's, from scontrol]"
  "VENV|--venv|$REPO_ROOT/.venv|the virtualenv with areal-jax (pip install -r requirements-cuda.txt), on every node"
  "LOG_DIR|--log-dir|$REPO_ROOT/runs/slurm-logs|where srun writes each task's output"
)
parse_settings GPU_SETTINGS "Usage: $(basename "$0") [--env FILE] [flags] [--dry-run] [-- OVERRIDE ...]
Inside a SLURM allocation: the trainer on the first TRAINER_NODES nodes, rollout server I on the next
ROLLOUT_NODES nodes after server I-1's; words after -- go to both roles (config overrides, or --resume)." "$@"
require CONFIG OUTPUT_DIR RUN
for var in TRAINER_NODES ROLLOUT_SERVERS ROLLOUT_NODES GPUS_PER_NODE; do
  [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || die "$var must be an integer >= 1, got '${!var}'"
done

if [[ -n "$NODELIST" ]]; then
  IFS=, read -r -a hosts <<<"$NODELIST"
else
  [[ -n "${SLURM_JOB_NODELIST:-}" ]] || die "not inside a SLURM allocation (no SLURM_JOB_NODELIST); give --nodelist"
  mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
fi
needed=$((TRAINER_NODES + ROLLOUT_SERVERS * ROLLOUT_NODES))
((${#hosts[@]} >= needed)) ||
  die "$needed nodes needed (TRAINER_NODES + ROLLOUT_SERVERS x ROLLOUT_NODES), the allocation has ${#hosts[@]}"

common=("output_dir=$OUTPUT_DIR" "name=$RUN" "cluster.rollout_servers=$ROLLOUT_SERVERS" "${EXTRA_ARGS[@]}")
pids=()
# Starts a step in the background (under --dry-run prints it, ending in &).
step() {
  if ((DRY_RUN)); then
    echo "$(quote_args "$@") &"
  else
    "$@" &
    pids+=($!)
  fi
}

run mkdir -p "$LOG_DIR"
trainer_hosts=$(IFS=,; echo "${hosts[*]:0:TRAINER_NODES}")
step srun "--nodes=$TRAINER_NODES" "--ntasks-per-node=$GPUS_PER_NODE" "--gpus-per-node=$GPUS_PER_NODE" \
  "--nodelist=$trainer_hosts" --kill-on-bad-exit=1 "--output=$LOG_DIR/$RUN-trainer-%t.log" \
  "$VENV/bin/areal-jax" trainer "$CONFIG" distributed.enabled=true "${common[@]}"
for ((i = 0; i < ROLLOUT_SERVERS; i++)); do
  first=$((TRAINER_NODES + i * ROLLOUT_NODES))
  if ((ROLLOUT_NODES == 1)); then
    step srun --nodes=1 --ntasks=1 "--gpus-per-node=$GPUS_PER_NODE" "--nodelist=${hosts[first]}" \
      "--output=$LOG_DIR/$RUN-rollout-$i.log" "$VENV/bin/areal-jax" rollout "$CONFIG" --server "$i" "${common[@]}"
  else  # one task per GPU, as the trainer's: jax.distributed under srun gives each task its SLURM_LOCALID's GPU
    step srun "--nodes=$ROLLOUT_NODES" "--ntasks-per-node=$GPUS_PER_NODE" "--gpus-per-node=$GPUS_PER_NODE" \
      "--nodelist=$(IFS=,; echo "${hosts[*]:first:ROLLOUT_NODES}")" --kill-on-bad-exit=1 \
      "--output=$LOG_DIR/$RUN-rollout-$i-%t.log" "$VENV/bin/areal-jax" rollout "$CONFIG" --server "$i" \
      distributed.enabled=true "${common[@]}"
  fi
done
((DRY_RUN)) && exit 0

say "trainer on $trainer_hosts, rollout servers on ${hosts[*]:TRAINER_NODES:ROLLOUT_SERVERS*ROLLOUT_NODES}; logs in $LOG_DIR"
trap 'kill -TERM "${pids[@]}" 2>/dev/null' INT TERM
status=0
wait "${pids[0]}" || status=$?
say "trainer exited ($status); stopping the rollout servers"
kill -TERM "${pids[@]:1}" 2>/dev/null || true
wait "${pids[@]:1}" || true
exit "$status"
