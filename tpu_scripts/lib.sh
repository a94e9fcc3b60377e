# Shared pieces of the launch scripts (sourced, not run): the dry-run aware `run`, messages, the settings
# parser (defaults < env file < flags, from a table of settings) and the TPU settings and names.
# scripts/launch_gpu_multinode.sh and scripts/device_check.sh source it too.
# shellcheck shell=bash
# shellcheck disable=SC2034  # globals (EXTRA_ARGS, WHERE, REMOTE_*) read by the scripts that source this file

if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
  echo "bash >= 4.4 is needed (found $BASH_VERSION; on macOS: brew install bash)" >&2
  exit 2
fi

DRY_RUN=0
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

say() { echo "[$(basename "$0")] $*" >&2; }
die() {
  say "error: $*"
  exit 2
}

# One argument per word, quoted only where the shell needs it, so a printed line can be pasted back.
quote_args() {
  local arg out=()
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=@%+,~-]+$ ]]; then out+=("$arg"); else out+=("${arg@Q}"); fi
  done
  echo "${out[*]}"
}

# Runs a command, or under --dry-run prints it on stdout instead.
run() {
  if ((DRY_RUN)); then quote_args "$@"; else "$@"; fi
}

# A settings table has one "VARIABLE|--flag|default|help" entry per setting; an env file (--env FILE)
# sets the variables by name.
TPU_SETTINGS=(
  "PROJECT|--project||Google Cloud project"
  "ZONE|--zone||zone of every slice, e.g. us-east5-b"
  "RUN|--run||run name: names the slices and the run directory gs://BUCKET/runs/RUN"
  "BUCKET|--bucket||GCS bucket of the run directory (no gs:// prefix)"
  "BUCKET_LOCATION|--bucket-location||create: if set, create BUCKET there first (e.g. us-east5)"
  "CONFIG|--config||run config, a path inside the repository"
  "TRAINER_TYPE|--trainer-type||accelerator type of the trainer slice, e.g. v6e-16"
  "INFERENCE_TYPE|--inference-type||accelerator type of each inference slice, e.g. v6e-8"
  "INFERENCE_SLICES|--inference-slices|1|K, the number of inference slices (one rollout server each)"
  "RUNTIME_VERSION|--runtime-version||TPU VM software version, e.g. v2-alpha-tpuv6e"
  "SPOT|--spot|0|1: request Spot capacity"
  "REPO_URL|--repo-url||install: workers git clone this URL (default: copy a git archive of REF from here)"
  "REF|--ref|HEAD|install: the commit, branch or tag to install"
  "PYTHON|--python|python3.11|install: the Python of the workers' venv (installed with apt if missing)"
  "ROLE|--role|trainer|logs: trainer or rollout"
  "SERVER|--server|0|logs: the inference slice of --role rollout"
  "WORKER|--worker|all|logs: the worker(s) to follow, all or a 0-based index"
)

settings_help() {
  local -n table=$1
  local entry var flag default text
  echo "Settings (flag, or VARIABLE in the --env file; flags win):"
  printf '  %-40s %s\n' "--env FILE" "read settings from FILE (shell syntax, VARIABLE=value)"
  for entry in "${table[@]}"; do
    IFS='|' read -r var flag default text <<<"$entry"
    printf '  %-40s %s%s\n' "$flag ($var)" "$text" "${default:+ [default: $default]}"
  done
  printf '  %-40s %s\n' "--dry-run" "print every command instead of running it" "-h, --help" "this help"
}

# parse_settings TABLE USAGE ARGS...: sets the variables of TABLE from ARGS, the --env file and the
# defaults (not from the caller's environment: names like RUN or PYTHON are too common); the words after
# `--` land in EXTRA_ARGS.
parse_settings() {
  local -n table=$1
  SETTINGS_TABLE=$1
  local usage=$2 entry var flag default text env_file=""
  shift 2
  declare -A from_flags=()
  declare -A flag_var=()
  for entry in "${table[@]}"; do
    IFS='|' read -r var flag default text <<<"$entry"
    flag_var[$flag]=$var
    unset "$var"
  done
  EXTRA_ARGS=()
  while (($#)); do
    case "$1" in
      -h | --help)
        echo "$usage"
        echo
        settings_help "$SETTINGS_TABLE"
        exit 0
        ;;
      --dry-run) DRY_RUN=1 ;;
      --env)
        (($# >= 2)) || die "--env needs a value"
        env_file=$2
        shift
        ;;
      --)
        shift
        EXTRA_ARGS=("$@")
        break
        ;;
      *)
        [[ -n "${flag_var[$1]:-}" ]] || die "unknown argument '$1' (see --help)"
        (($# >= 2)) || die "$1 needs a value"
        from_flags[${flag_var[$1]}]=$2
        shift
        ;;
    esac
    shift
  done
  if [[ -n "$env_file" ]]; then
    [[ -f "$env_file" ]] || die "--env: no file $env_file"
    # shellcheck disable=SC1090  # the user's settings file
    source "$env_file"
  fi
  for entry in "${table[@]}"; do
    IFS='|' read -r var flag default text <<<"$entry"
    if [[ -n "${from_flags[$var]+set}" ]]; then
      printf -v "$var" '%s' "${from_flags[$var]}"
    elif [[ -z "${!var:-}" ]]; then
      printf -v "$var" '%s' "$default"
    fi
  done
}

# The TPU scripts' settings, checked, and the gcloud placement flags.
tpu_settings() {
  parse_settings TPU_SETTINGS "$@"
  [[ "$INFERENCE_SLICES" =~ ^[1-9][0-9]*$ ]] ||
    die "INFERENCE_SLICES (--inference-slices) must be >= 1, got '$INFERENCE_SLICES'"
  [[ "$SERVER" =~ ^[0-9]+$ ]] || die "SERVER (--server) must be a 0-based index, got '$SERVER'"
  [[ "$WORKER" == all || "$WORKER" =~ ^[0-9]+$ ]] ||
    die "WORKER (--worker) must be all or a 0-based index, got '$WORKER'"
  [[ "$SPOT" == 0 || "$SPOT" == 1 ]] || die "SPOT (--spot) must be 0 or 1, got '$SPOT'"
  [[ -z "$RUN" || "$RUN" =~ ^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$ ]] ||
    die "RUN (--run) must be lowercase letters, digits and dashes, starting with a letter (a TPU name), got '$RUN'"
  WHERE=("--zone=$ZONE" "--project=$PROJECT")
}

# Fails naming each setting that is still empty.
require() {
  local -n table=$SETTINGS_TABLE
  local var entry missing=()
  for var in "$@"; do
    [[ -n "${!var:-}" ]] && continue
    for entry in "${table[@]}"; do
      [[ "$entry" == "$var|"* ]] && missing+=("$var ($(cut -d'|' -f2 <<<"$entry"))")
    done
  done
  ((${#missing[@]} == 0)) || die "missing settings: ${missing[*]}"
}

# Slice names: the trainer slice, then inference slice I; each queued resource is its node's name + -qr.
trainer_node() { echo "$RUN-trainer"; }
inference_node() { echo "$RUN-rollout-$1"; }
all_nodes() {
  local i
  trainer_node
  for ((i = 0; i < INFERENCE_SLICES; i++)); do inference_node "$i"; done
}

run_dir() { echo "gs://$BUCKET/runs"; }

# Runs COMMAND on every worker of NODE (gcloud opens one ssh per worker, concurrently).
on_workers() {
  local node=$1 command=$2 workers=${3:-all}
  run gcloud compute tpus tpu-vm ssh "$node" "${WHERE[@]}" "--worker=$workers" "--command=$command"
}

# Where the repository and the logs live on each worker, relative to the home directory (where ssh starts).
REMOTE_REPO=areal-jax
REMOTE_LOGS=areal-logs
