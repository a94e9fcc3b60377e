"""The README's main job as a user runs it: `bash scripts/run_main.sh`, timed from the shell, then its
held-out accuracy before and after training read from the run's metrics.

The main job (`configs/train_cpu.yaml`) sets 200 prompts aside (`dataset.heldout`), evaluates them greedily
before the first step (`eval_before/pass@1`) and every `eval.every_steps` steps (`eval/pass@1`).
`--quick` stops after 100 steps. Issue 12's targets: held-out accuracy >= 0.8, a gain >= 0.4, wall <= 300 s.

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

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 steps instead of the main job's 200")
    args = parser.parse_args()
    output_dir = tempfile.mkdtemp(prefix="main-job-bench-")
    command = ["bash", str(ROOT / "scripts" / "run_main.sh"), f"output_dir={output_dir}", "report.live=never"]
    if args.quick:
        command += ["train_steps=100", "eval.every_steps=50"]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    lines = (Path(output_dir) / "async-arithmetic" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    before = metrics[0]["eval_before/pass@1"]
    after = next(m["eval/pass@1"] for m in reversed(metrics) if "eval/pass@1" in m)
    print(f"steps: {len(metrics)} steps")
    print(f"wall_seconds: {wall:.1f} s")
    print(f"accuracy_before: {before:.3f}")
    print(f"accuracy_after: {after:.3f}")
    print(f"accuracy_gain: {after - before:.3f}")
    print(f"correct_rate_last_20_steps: {sum(m['rollout/correct_mean'] for m in metrics[-20:]) / 20:.3f}")
    print(f"ratio heldout_accuracy: {after:.2f}")


if __name__ == "__main__":
    main()
