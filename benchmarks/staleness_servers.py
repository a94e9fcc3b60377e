"""The staleness bound over two rollout servers of unequal speed: `areal-jax launch local --rollout 2` on
`configs/train_cpu.yaml` (eta = max_head_offpolicyness 2, 4 prompts x 4 samples a step, no held-out
evaluation), with server 1 slowed (`AREAL_JAX_SLOW_ROLLOUT_SERVER=1:<seconds>`: it waits that long before
each decode step, `system/slowed_engine.py`), so its groups run for several of the trainer's versions while
server 0's fill the batches in completion order.

The bound (docs/distributed.md): a group admitted at version v trains at v + eta + 1 at most, so every step's
`rollout/staleness_max` is at most eta + 1. It checks that on every step of metrics.jsonl and prints the
histogram of the steps' `rollout/staleness_max` and of the trained samples' staleness
(`pipeline/kept_by_staleness/<k>`). `--quick`: 24 steps (about 2 minutes on the shared 2-core machine, most
of it the three processes' start); full: 120. Prints `name: value unit` lines; the last is
`ratio staleness_max_over_bound: X.XX` (the run's highest staleness over eta + 1; above 1.00 the bound was
broken and the benchmark exits 1 after printing it).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from areal_jax.jsonl import read_jsonl
from areal_jax.reporting.metric_keys import KEPT_BY_STALENESS
from areal_jax.system.slowed_engine import SLOW_SERVER_ENV

ROOT = Path(__file__).resolve().parent.parent
ETA = 2
RUN = (
    f"rollout.staleness.max_head_offpolicyness={ETA}",
    "rollout.staleness.batch_prompts=4",
    "rollout.workflow.n_samples=4",
    "rollout.engine.max_slots=8",
    "rollout.engine.max_prefill_batch=2",
    "trainer.packing.token_budget=256",
    "trainer.packing.rows=4",
    "report.plots=false",
    "dataset.heldout=0",
    "eval.every_steps=0",
    "train_checkpoint.every_steps=1000000",
    "cluster.status_every_s=0.2",
)


def launch(steps: int, delay_s: float, output_dir: str) -> tuple[Path, float]:
    """Run the job with server 1 slowed by `delay_s` per decode step; (its run directory, wall seconds)."""
    command = [sys.executable, "-m", "areal_jax.cli", "launch", "local", "--rollout", "2"]
    command += [str(ROOT / "configs" / "train_cpu.yaml"), *RUN, f"train_steps={steps}"]
    command += [f"output_dir={output_dir}", "name=run"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    env[SLOW_SERVER_ENV] = f"1:{delay_s}"
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"launch local exited {done.returncode}:\n{done.stdout[-3000:]}")
    return Path(output_dir) / "run", time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="24 steps (not 120)")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds server 1 waits before each decode step")
    parser.add_argument("--output-dir", help="keep the run here (default: a temporary directory, deleted)")
    args = parser.parse_args()
    steps = 24 if args.quick else 120
    with tempfile.TemporaryDirectory() as temporary:
        run_dir, wall = launch(steps, args.delay, args.output_dir or temporary)
        metrics = read_jsonl(run_dir / "metrics.jsonl")
    by_step = [int(m["rollout/staleness_max"]) for m in metrics]
    last = metrics[-1]
    by_sample = {int(k[len(KEPT_BY_STALENESS) :]): int(v) for k, v in last.items() if k.startswith(KEPT_BY_STALENESS)}
    walls = [m["time/wall"] for m in metrics]
    print(f"run_seconds: {wall:.1f} s")
    print(f"steps: {len(metrics)} steps")
    print(f"step_seconds_median: {statistics.median(b - a for a, b in itertools.pairwise(walls)):.3f} s")
    print(f"slow_server_delay: {args.delay} s per decode step")
    for staleness, count in sorted(collections.Counter(by_step).items()):
        print(f"steps_with_staleness_max_{staleness}: {count} steps")
    for staleness, count in sorted(by_sample.items()):
        print(f"samples_with_staleness_{staleness}: {count} samples")
    over = [step for step, staleness in enumerate(by_step, start=1) if staleness > ETA + 1]
    print(f"steps_over_the_bound: {len(over)} steps{f' (steps {over})' if over else ''}")
    print(f"ratio staleness_max_over_bound: {max(by_step) / (ETA + 1):.2f}")
    if over:
        sys.exit(1)


if __name__ == "__main__":
    main()
