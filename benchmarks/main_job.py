"""The README's main job as a user runs it: `bash scripts/run_main.sh` (asynchronous RL on the embedded
running-sums task, `configs/chain_sums_cpu.yaml`), timed from the shell, then the held-out accuracy of the
policy at each stage read from the run directory.

The job trains a supervised warm start on the task's worked answers (`warm_start`, cached in
`<run>/warm_start`), then runs asynchronous RL from it. Accuracies on the 200 held-out prompts, which
neither stage trains on, all sampled pass@1 at temperature 1 (what the policy answers):

- `accuracy_random_init` and `accuracy_warm_start_teacher_forced`: from `warm_start/summary.json`, the
  probability of sampling the exact worked answer (teacher-forced), before and after the warm start;
- `accuracy_before`: the RL starting policy (= the warm start), evaluated by the run at version 0
  (`eval/pass@1` at step 0);
- `accuracy_after`: after RL (`eval/pass@1` of the last evaluation).

Issue 12's targets: final held-out accuracy >= 0.8, a gain >= 0.4, wall <= 300 s on 2 cores; the RL gain
is `accuracy_after - accuracy_before`, the job's `accuracy_after - accuracy_random_init`. `--quick` stops
after 30 RL steps (a smoke run of the whole job in about a minute, not a measure of learning).

Prints `name: value unit` lines; the last is `ratio heldout_accuracy` (the final held-out pass@1; a ratio
to 1.0, the all-correct policy).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from areal_jax.reporting.metric_keys import is_evaluation

ROOT = Path(__file__).resolve().parent.parent
RUN_NAME = "async-chain-sums"


def accuracy_by_terms(run_dir: Path) -> dict[int, float]:
    """Held-out pass@1 of the last evaluation by the problem's number of terms (the task draws each term
    count equally until its problems run out, so 5-term problems are ~78% of the held-out set)."""
    last = max((run_dir / "eval").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    correct: dict[int, list[bool]] = {}
    for sample in json.loads((last / "eval.json").read_text())["samples"]:
        correct.setdefault(sample["prompt"].count("+") + 1, []).append(bool(sample["correct"]))
    return {terms: sum(c) / len(c) for terms, c in sorted(correct.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 RL steps instead of the main job's 300")
    args = parser.parse_args()
    output_dir = tempfile.mkdtemp(prefix="main-job-bench-")
    command = ["bash", str(ROOT / "scripts" / "run_main.sh"), f"output_dir={output_dir}", "report.live=never"]
    if args.quick:
        command += ["train_steps=30", "eval.every_steps=30"]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    run_dir = Path(output_dir) / RUN_NAME
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    warm = json.loads((run_dir / "warm_start" / "summary.json").read_text())
    evaluations = {m["train/version"]: m["eval/pass@1"] for m in lines if is_evaluation(m)}
    before, after = evaluations[0], evaluations[max(evaluations)]
    metrics = [m for m in lines if not is_evaluation(m)]
    stale = [m["rollout/staleness_mean"] for m in metrics]
    last = metrics[-20:]
    print(f"steps: {len(metrics)} steps")
    print(f"wall_seconds: {wall:.1f} s")
    print(f"warm_start_seconds: {warm['seconds']:.1f} s")
    print(f"accuracy_random_init: {warm['heldout_before']['sampled_exact']:.3f}")
    print(f"accuracy_warm_start_teacher_forced: {warm['heldout_after']['sampled_exact']:.3f}")
    print(f"greedy_accuracy_warm_start_teacher_forced: {warm['heldout_after']['greedy_exact']:.3f}")
    print(f"accuracy_before: {before:.3f}")
    print(f"accuracy_after: {after:.3f}")
    print(f"accuracy_gain: {after - before:.3f}")
    print(f"correct_rate_last_20_steps: {sum(m['rollout/correct_mean'] for m in last) / len(last):.3f}")
    print(f"staleness_mean: {sum(stale) / len(stale):.2f} versions")
    print(f"staleness_min_of_step_means: {min(stale):.2f} versions")
    print(f"staleness_max: {max(m['rollout/staleness_max'] for m in metrics):.0f} versions")
    print(f"interruptions: {metrics[-1]['generator/interruptions']:.0f} interruptions")
    for terms, accuracy in accuracy_by_terms(run_dir).items():
        print(f"accuracy_after_{terms}_terms: {accuracy:.3f}")
    print(f"ratio heldout_accuracy: {after:.2f}")


if __name__ == "__main__":
    main()
