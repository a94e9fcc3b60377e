"""End to end: asynchronous RL against the synchronous baseline, on the distributed topology.

`--mode distributed` (default): `areal-jax launch local` runs one rollout server process and the trainer
process, each on its own half of this machine's CPU cores, on a workload with long-tailed answer lengths:
running sums of 2-5 terms answered by a random-init policy, whose answers end when it happens to sample
`<eos>` (about geometric: median ~19 tokens, the longest of a batch ~5x that; capped at 112). Every
reward is 0, so the policy does not move and every run generates the same answers: the length
distribution stays put over the run and across runs. The two distributed runs differ only in
`rollout.staleness.max_head_offpolicyness`: 4 (rollouts run up to four versions ahead while the trainer
works) against 0 (each batch comes from the current version only, so generation and training take turns).
A third run is the colocated synchronous baseline: one process (`areal-jax train`), all cores for each
phase, eta = 0.

Measures, over the steady state (the steps after the first quarter, which include compilation and
warm-up), from the trainer's metrics (`time/unix` at each step's end, `time/batch_wait`) and the
rollout log (each group's start and append time):

- steps per second, sustained: trained steps, less any part the backlog of groups written before the
  window supplied (so a run draining a head start is not counted faster than it can go on);
- per step, the trainer's busy time (the step minus its wait for the batch) and its wait; in the eta = 0
  run the wait splits into weights-to-generation (the new version reaching the server), generation (first
  group started to last sample written) and log-to-train (the trainer seeing and reading the batch);
- the ideal overlap bound of the split: the eta = 0 step over max(trainer busy, trainer wait) of that run,
  i.e. what eta = 4 gains if each side kept its eta = 0 pace and never waited for the other;
- the trainer's CPU share (`time/process_cpu` over wall time): ~1 core when it had its core to itself.
  On a machine shared with other work it is lower, and the runs compare only as far as it is alike.

`--quick`: 40 steps per run, one run each; full: 120 steps, two runs each, alternating, the best of each.
`--mode inprocess`: the earlier measurement, both sides in one process (`configs/train_cpu.yaml`, eta 2
against 0). Prints `name: value unit` lines; the last is `ratio async_vs_sync`. The runs share a persistent
XLA compilation cache (`runs/xla_cache`): the first run on a machine compiles, the later ones load.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from areal_jax.data.rollout_log_reader import read_shard
from areal_jax.data.rollout_log_shards import list_shards

ROOT = Path(__file__).resolve().parent.parent
CHAIN_SUMS = ROOT / "configs" / "chain_sums_cpu.yaml"
ARITHMETIC = ROOT / "configs" / "train_cpu.yaml"
CACHE = ROOT / "runs" / "xla_cache"
ETA_ASYNC = 4

# The same settings for all three runs (the config's task, no warm start); no held-out evaluation or
# checkpoint inside the timing.
WORKLOAD = (
    "warm_start.steps=0",
    "model.max_position_embeddings=128",
    "dataset.max_prompt_tokens=16",  # "Q: 9+9+9+9+9\nA: " is 16 characters
    "rollout.workflow.sampling.max_new_tokens=112",
    "rollout.engine.max_length=128",
    "rollout.staleness.batch_prompts=4",  # 4 prompts x 8 samples per step
    "rollout.engine.max_slots=32",  # a whole batch at once
    "trainer.packing.token_budget=1792",
    "trainer.packing.rows=14",
    "trainer.packing.min_row_length=128",  # one shape, [1, 14, 128], for nearly every step: no compilation later
    "cluster.weight_transfer=direct",  # a version reaches the server in milliseconds (the store: ~0.1 s)
    "cluster.weights_poll_s=0.01",
    "pipeline.poll_max_s=0.02",  # the trainer sees a finished group within 20 ms (default: up to 0.5 s)
    "dataset.heldout=0",
    # one update per step, proximal log-probs interpolated (exact at eta 0), the config's own model (hidden
    # 64): generation (~0.06 s to the batch's longest answer) is about as long as the train step (~0.08 s),
    # as on accelerators, where the paper gives generation 3/4 of the devices
    "trainer.ppo.prox_logp_method=loglinear",
    "trainer.ppo_minibatches=1",
    "eval.every_steps=0",
    "report.plots=false",
    "train_checkpoint.every_steps=100000",
)


@dataclasses.dataclass(frozen=True)
class Measured:
    """One run's steady state; the per-step times are means over its steps."""

    steps_per_second: float  # sustained (see the module docstring)
    trained_steps_per_second: float  # trainer steps per second, head start or not
    busy_seconds: float  # the step minus the trainer's wait for its batch
    wait_seconds: float  # the trainer waiting for its batch (and reading it)
    weights_seconds: float  # previous step's end -> the first group of this batch started
    generation_seconds: float  # first group of the batch started -> its last sample written
    log_seconds: float  # last sample written -> the train step started
    train_seconds: float  # the train step and the blocking part of the publication
    trainer_cpu_share: float  # the trainer's CPU seconds / wall seconds: 1.0 per core it had to itself
    staleness_mean: float
    interruptions: float
    lengths: np.ndarray  # response tokens of every sample trained in the steady state
    batch_tail: float  # mean over steps of (longest / median response) in the batch

    @property
    def seconds_per_step(self) -> float:
        return 1.0 / self.steps_per_second


@dataclasses.dataclass(frozen=True)
class _Group:
    started: float  # unix time the workflow took the group up
    written: float  # unix time its samples were appended to the log
    lengths: list[int]  # response tokens per sample


def run_cli(args: list[str], log: Path) -> None:
    """`python -m areal_jax.cli ARGS`; its output goes to `log` (printed if it fails)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as out:
        code = subprocess.call(
            [sys.executable, "-m", "areal_jax.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    if code != 0:
        sys.stdout.write(log.read_text()[-5000:])
        raise RuntimeError(f"areal-jax {' '.join(args[:3])} exited {code}; log: {log}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_groups(run_dir: Path) -> dict[int, _Group]:
    """Every group of the run's rollout log by id (a group's samples are generated and appended together)."""
    samples: dict[int, list[tuple[float, float, int]]] = {}
    directory = run_dir / "rollout_log"
    for shard in list_shards(directory):
        entries, _ = read_shard(directory, shard)
        for entry in entries:
            t = entry.trajectory
            started = entry.appended_at - t.timings["total"]
            samples.setdefault(t.group_id, []).append((started, entry.appended_at, t.length - t.prompt_length))
    return {
        g: _Group(min(s[0] for s in group), max(s[1] for s in group), [s[2] for s in group])
        for g, group in samples.items()
    }


def measure(run_dir: Path, steps: int) -> Measured:
    """The steady state of a finished run (`time/unix`: each step's end, on the clock of the log's times)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    trained = read_jsonl(run_dir / "trained_groups.jsonl")
    if len(metrics) != steps:
        raise RuntimeError(f"{run_dir}: {len(metrics)} steps logged, expected {steps}")
    skip = steps // 4
    ends = np.array([m["time/unix"] for m in metrics])
    groups = log_groups(run_dir)
    weights, generation, log, lengths, tails = [], [], [], [], []
    for v in range(skip, steps):
        batch = [groups[g] for g, _ in trained[v]["groups"]]
        started, written = min(g.started for g in batch), max(g.written for g in batch)
        train = metrics[v]["train/step_time"] + metrics[v].get("weights/publish_blocking_seconds", 0.0)
        weights.append(started - ends[v - 1])
        generation.append(written - started)
        log.append(ends[v] - train - written)
        batch_lengths = np.array([n for g in batch for n in g.lengths])
        lengths.append(batch_lengths)
        tails.append(batch_lengths.max() / np.median(batch_lengths))
    steady = metrics[skip:]
    window = ends[-1] - ends[skip - 1]
    wait = float(np.mean([m["time/batch_wait"] for m in steady]))
    trained_groups = sum(len(line["groups"]) for line in trained[skip:])
    produced = sum(ends[skip - 1] < g.written <= ends[-1] for g in groups.values())
    return Measured(
        steps_per_second=(steps - skip) * min(produced, trained_groups) / trained_groups / window,
        trained_steps_per_second=(steps - skip) / window,
        busy_seconds=window / (steps - skip) - wait,
        wait_seconds=wait,
        weights_seconds=float(np.mean(weights)),
        generation_seconds=float(np.mean(generation)),
        log_seconds=float(np.mean(log)),
        train_seconds=float(
            np.mean([m["train/step_time"] + m.get("weights/publish_blocking_seconds", 0.0) for m in steady])
        ),
        trainer_cpu_share=(metrics[-1]["time/process_cpu"] - metrics[skip - 1]["time/process_cpu"]) / window,
        staleness_mean=float(np.mean([m["rollout/staleness_mean"] for m in steady])),
        interruptions=float(metrics[-1]["generator/interruptions"] - metrics[skip - 1]["generator/interruptions"]),
        lengths=np.concatenate(lengths),
        batch_tail=float(np.mean(tails)),
    )


def distributed_run(eta: int, steps: int, root: Path, name: str, trainer_cores: int, extra: list[str]) -> Measured:
    overrides = [*WORKLOAD, *extra, f"output_dir={root}", f"name={name}", f"compilation_cache_dir={CACHE}"]
    overrides += [f"train_steps={steps}", f"rollout.staleness.max_head_offpolicyness={eta}"]
    # the store's background write of every version took ~15% of the trainer's core at eta 4 (the trainer never
    # waits, so the write lands in its steps; at eta 0 it hides in the wait): every (eta + 1)-th, the most allowed
    overrides.append(f"cluster.direct_store_every={eta + 1}")
    launch = ["launch", "local", "--rollout", "1", "--trainer-cores", str(trainer_cores), str(CHAIN_SUMS)]
    run_cli([*launch, *overrides], root / f"{name}.log")
    return measure(root / name, steps)


def colocated_run(steps: int, root: Path, name: str, extra: list[str]) -> Measured:
    overrides = [*WORKLOAD, *extra, f"output_dir={root}", f"name={name}", f"compilation_cache_dir={CACHE}"]
    overrides += [f"train_steps={steps}", "rollout.staleness.max_head_offpolicyness=0"]
    run_cli(["train", str(CHAIN_SUMS), *overrides], root / f"{name}.log")
    return measure(root / name, steps)


def print_run(name: str, result: Measured, phases: bool) -> None:
    print(f"{name}_steps_per_second: {result.steps_per_second:.3f} steps/s")
    print(f"{name}_seconds_per_step: {result.seconds_per_step:.3f} s")
    print(f"{name}_trainer_busy_seconds: {result.busy_seconds:.3f} s")
    print(f"{name}_train_step_seconds: {result.train_seconds:.3f} s")
    print(f"{name}_trainer_wait_seconds: {result.wait_seconds:.3f} s")
    print(f"{name}_trainer_cpu_share: {result.trainer_cpu_share:.2f} cores")
    if phases:  # the wait of a synchronous run, phase by phase
        print(f"{name}_weights_to_generation_seconds: {result.weights_seconds:.3f} s")
        print(f"{name}_generation_seconds: {result.generation_seconds:.3f} s")
        print(f"{name}_log_to_train_seconds: {result.log_seconds:.3f} s")
    else:
        print(f"{name}_trained_steps_per_second: {result.trained_steps_per_second:.3f} steps/s")
        print(f"{name}_staleness_mean: {result.staleness_mean:.2f} versions")
        print(f"{name}_interruptions: {result.interruptions:.0f} samples")


def main_distributed(quick: bool, root: Path, extra: list[str]) -> None:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        raise SystemExit("the distributed mode needs at least 2 CPU cores (one per role)")
    trainer_cores = cores // 2
    steps, repeats = (40, 1) if quick else (120, 2)
    CACHE.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[Measured]] = {"async": [], "sync": [], "colocated": []}
    load_before = os.getloadavg()[0]
    for repeat in range(repeats):
        runs["async"].append(distributed_run(ETA_ASYNC, steps, root, f"async-{repeat}", trainer_cores, extra))
        runs["sync"].append(distributed_run(0, steps, root, f"sync-{repeat}", trainer_cores, extra))
        runs["colocated"].append(colocated_run(steps, root, f"colocated-{repeat}", extra))
    async_, sync, colocated = (max(runs[k], key=lambda r: r.steps_per_second) for k in runs)
    lengths = sync.lengths
    # other work on the machine takes cores from the pinned roles: see the *_trainer_cpu_share lines
    print(f"load_average_before: {load_before:.2f} processes")
    print(f"load_average_after: {os.getloadavg()[0]:.2f} processes")
    print(f"cores_trainer: {trainer_cores} cores")
    print(f"cores_rollout: {cores - trainer_cores} cores")
    print(f"steps_per_run: {steps} steps")
    print(f"response_length_median: {np.median(lengths):.0f} tokens")
    print(f"response_length_p90: {np.percentile(lengths, 90):.0f} tokens")
    print(f"response_length_max: {lengths.max():.0f} tokens")
    print(f"batch_longest_over_median: {sync.batch_tail:.2f} x")
    print_run("sync", sync, phases=True)
    print_run("async", async_, phases=False)
    print_run("colocated", colocated, phases=True)
    ideal = max(sync.busy_seconds, sync.wait_seconds)
    bound = sync.seconds_per_step / ideal
    ratio = async_.steps_per_second / sync.steps_per_second
    print(f"ideal_async_seconds_per_step: {ideal:.3f} s")
    print(f"ideal_bound_async_vs_sync: {bound:.2f} x")
    print(f"achieved_fraction_of_bound: {ratio / bound:.2f}")
    print(f"ratio async_vs_colocated: {async_.steps_per_second / colocated.steps_per_second:.2f}")
    print(f"ratio async_vs_sync: {ratio:.2f}")


def main_inprocess(quick: bool, root: Path, extra: list[str]) -> None:
    steps, repeats = (48, 1) if quick else (200, 2)
    overrides = ["train_checkpoint.every_steps=100000", "report.plots=false", f"compilation_cache_dir={CACHE}"]
    runs: dict[int, list[float]] = {2: [], 0: []}
    for repeat in range(repeats):
        for eta in runs:
            name = f"eta{eta}-{repeat}"
            args = [f"output_dir={root}", f"name={name}", f"train_steps={steps}"]
            args.append(f"rollout.staleness.max_head_offpolicyness={eta}")
            run_cli(["train", str(ARITHMETIC), *overrides, *extra, *args], root / f"{name}.log")
            wall = np.array([m["time/wall"] for m in read_jsonl(root / name / "metrics.jsonl")])
            skip = steps // 4
            runs[eta].append((len(wall) - skip) / (wall[-1] - wall[skip - 1]))
    print(f"sync_steps_per_second: {max(runs[0]):.2f} steps/s")
    print(f"async_steps_per_second: {max(runs[2]):.2f} steps/s")
    print(f"ratio async_vs_sync: {max(runs[2]) / max(runs[0]):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 steps per run, one run each")
    parser.add_argument("--mode", choices=("distributed", "inprocess"), default="distributed")
    parser.add_argument("--keep", type=Path, help="keep the runs (logs, metrics, rollout logs) in this directory")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides for every run")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)
        (main_distributed if args.mode == "distributed" else main_inprocess)(args.quick, root, args.overrides)


if __name__ == "__main__":
    main()
