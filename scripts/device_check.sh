#!/usr/bin/env bash
# The benchmarks on an accelerator machine in one go: installs the pinned JAX CUDA build and the package
# into .venv, runs every benchmark's --quick (benchmarks/*.py) and the
# full model_forward.py, each under a timeout, and prints the markdown table for docs/benchmarks.md
# (scripts/benchmark_table.py). Everything stays within BUDGET seconds, the install included: a benchmark
# that would start too late is listed as skipped. Outputs: OUT/<label>.log, OUT/runs.tsv, OUT/table.md.
# The install needs a package index (pip's own PIP_INDEX_URL / PIP_FIND_LINKS apply) unless .venv is current.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tpu_scripts/lib.sh
source tpu_scripts/lib.sh
# shellcheck disable=SC2034  # read by parse_settings through its name
DEVICE_SETTINGS=(
  "OUT|--out|runs/device_check|directory of the logs and the table"
  "BUDGET|--budget|480|seconds for everything, the install included"
  "QUICK_TIMEOUT|--timeout|60|seconds allowed to each --quick benchmark"
  "FULL_TIMEOUT|--full-timeout|150|seconds allowed to the full model_forward.py"
  "SCALE_TIMEOUT|--scale-timeout|240|seconds allowed to benchmarks/scale.py (Qwen2.5-0.5B and 1.5B shapes, 3 steps)"
  "CPU|--cpu|0|1 (or --cpu alone): no install, run the benchmarks with PYTHON (main_job.py still uses .venv)"
  "PYTHON|--python|.venv/bin/python|the Python of the benchmarks in --cpu mode"
  "ONLY|--only||comma-separated labels to run, e.g. rewards,model_forward-full"
)
args=()
for arg in "$@"; do
  if [[ "$arg" == --cpu ]]; then args+=(--cpu 1); else args+=("$arg"); fi
done
parse_settings DEVICE_SETTINGS "Usage: $(basename "$0") [--cpu] [--only LABELS] [flags] [--dry-run]
Installs requirements-cuda.txt into .venv, runs the benchmarks, prints the table for docs/benchmarks.md." \
  "${args[@]}"
for var in BUDGET QUICK_TIMEOUT FULL_TIMEOUT SCALE_TIMEOUT; do
  [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || die "$var must be a number of seconds >= 1, got '${!var}'"
done
deadline=$((SECONDS + BUDGET))

# jax[cuda13] needs driver >= 580; an older driver gets jax[cuda12] at the same jax pin.
cuda_requirements() {
  local driver
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1) || true
  [[ "$driver" =~ ^[0-9]+\. ]] || die "no NVIDIA driver found (nvidia-smi); --cpu runs without CUDA"
  if ((${driver%%.*} >= 580)); then
    echo requirements-cuda.txt
  else
    local pin
    pin=$(grep -E '^jax==' requirements.txt | cut -d= -f3)
    mkdir -p "$OUT"
    printf -- '-r %s\njax[cuda12]==%s\n' "$PWD/requirements.txt" "$pin" >"$OUT/requirements-cuda12.txt"
    say "driver $driver is older than 580 (CUDA 13): installing jax[cuda12]==$pin"
    echo "$OUT/requirements-cuda12.txt"
  fi
}

if ((CPU)); then
  py=$PYTHON
else
  # requirements.txt first, so that benchmarks/main_job.py (scripts/run_main.sh) finds .venv up to date
  run bash scripts/ensure_venv.sh requirements.txt
  if ((DRY_RUN)); then
    run bash scripts/ensure_venv.sh requirements-cuda.txt
  else
    requirements=$(cuda_requirements)
    run bash scripts/ensure_venv.sh "$requirements"
  fi
  py=.venv/bin/python
fi
probe='import jax; d = jax.devices(); print(f"{d[0].device_kind} x{len(d)} ({jax.default_backend()})")'
if ((DRY_RUN)); then
  run "$py" -c "$probe"
  device="(dry run)"
else
  device=$("$py" -c "$probe")
  say "device: $device"
fi

# label|timeout|arguments of each run, in run order: model_forward first (the headline of issue 14), then the
# real shapes (issue 22: bf16 compute, the GSM8K recipe at a small batch, peak memory against the plan).
invocations=("model_forward|$QUICK_TIMEOUT|benchmarks/model_forward.py --quick"
  "model_forward-full|$FULL_TIMEOUT|benchmarks/model_forward.py"
  "scale|$SCALE_TIMEOUT|benchmarks/scale.py --steps 3")
for script in benchmarks/*.py; do
  name=$(basename "$script" .py)
  case "$name" in
    common | model_forward | scale) ;;
    *) invocations+=("$name|$QUICK_TIMEOUT|$script --quick") ;;
  esac
done

run mkdir -p "$OUT"
((DRY_RUN)) || : >"$OUT/runs.tsv"
for entry in "${invocations[@]}"; do
  IFS='|' read -r label limit command <<<"$entry"
  [[ -z "$ONLY" || ",$ONLY," == *",$label,"* ]] || continue
  read -r -a words <<<"$command"
  log="$OUT/$label.log"
  if ((DRY_RUN)); then
    echo "$(quote_args timeout --kill-after=10 "$limit" "$py" "${words[@]}") > $(quote_args "$log") 2>&1"
    continue
  fi
  allowed=$((deadline - SECONDS))
  ((allowed < limit)) || allowed=$limit
  started=$SECONDS
  if ((allowed < 10)); then
    status=skipped
  else
    status=0
    timeout --kill-after=10 "$allowed" "$py" "${words[@]}" >"$log" 2>&1 || status=$?
    ((status == 124 || status == 137)) && status=timeout
  fi
  printf '%s\t%s\t%s\t%s\n' "$label" "$status" "$((SECONDS - started))" "$command" >>"$OUT/runs.tsv"
  say "$label: $status ($((SECONDS - started)) s) $(tail -n1 "$log" 2>/dev/null || true)"
done

table=("$py" scripts/benchmark_table.py "$OUT" --device "$device" --date "$(date -u +%F)")
if ((DRY_RUN)); then
  echo "$(quote_args "${table[@]}") | tee $(quote_args "$OUT/table.md")"
else
  "${table[@]}" | tee "$OUT/table.md"
fi
