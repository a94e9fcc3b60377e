"""The running system killed for real and resumed in one process (engine, generator, log, pipeline,
trainer: `areal-jax train`, SIGKILL at three random points and SIGTERM once): it trains every prompt exactly
once under the group id an uninterrupted run gives it, within the staleness bound, and logs each step once.
The same for the multi-process shape (`launch local`, its trainer SIGKILLed, then SIGTERM) is
tests/test_gcs_run.py, on a bucket."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from areal_jax.config import load_experiment
from areal_jax.data.rollout_log_reader import logged_groups
from areal_jax.exit_codes import EXIT_RESUMABLE
from areal_jax.jsonl import read_jsonl
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.trainer.checkpoint import TrainCheckpointer
from tests.prompt_order import uninterrupted_prompts
from tests.short_runs import SHORT_TRAIN_CPU
from tests.xla_flags import xla_flags

PROMPTS = 40  # 20 steps: every interruption below lands well inside the epoch (at 16 steps, one CI run saw the
# third run reach the last step before its SIGKILL landed: nothing was left for the resumed run to do)
BATCH = 2
ETA = 2
RUN = [
    "configs/train_cpu.yaml",
    "train_steps=100",  # more than the data: the run ends when the single epoch is used up
    "dataset.epochs=1",
    f"dataset.arithmetic_problems={PROMPTS}",
    f"rollout.staleness.batch_prompts={BATCH}",
    f"rollout.staleness.max_head_offpolicyness={ETA}",
    "rollout.workflow.n_samples=2",
    *SHORT_TRAIN_CPU,
    "train_checkpoint.every_steps=2",
    "dataset.heldout=0",  # every prompt is trained
]


DYNAMIC = [
    "rollout.dynamic_sampling.enabled=true",
    "reward.kind=tests.dynamic_sampling_rewards:half_uniform",
    "rollout.workflow.truncation=keep",  # a truncated sample would be penalised to the same reward
]


def _start(output_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "areal_jax.cli", "train", *extra, *RUN, f"output_dir={output_dir}"]
    command += ["compilation_cache_dir=null"]  # the test session's cache: each restart loads its programs
    log = output_dir.parent / f"output-{time.time_ns()}.log"  # a file: a pipe nobody reads fills up and blocks
    with log.open("w") as sink:
        env = {**os.environ, "XLA_FLAGS": xla_flags(1)}  # one CPU device, as on a user's machine
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    process.started = time.time()  # type: ignore[attr-defined]
    process.log = log  # type: ignore[attr-defined]
    return process


def _output(process: subprocess.Popen) -> str:
    return process.log.read_text()[-3000:]  # type: ignore[attr-defined]


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL to the run's every process at once (its process group)."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _trained(run_dir: Path) -> list[tuple[int, int, str]]:
    """(step, group id, prompt id) of every trained group, in step order."""
    lines = (run_dir / "trained_groups.jsonl").read_text().splitlines()
    return [(row["version"], g, p) for row in map(json.loads, lines) for g, p in row["groups"]]


def _steps_done(run_dir: Path, since: float = 0.0) -> int:
    """Steps logged, counted once this process has written the log (a resumed run first cuts it back)."""
    path = run_dir / "trained_groups.jsonl"
    if not path.exists() or path.stat().st_mtime < since:
        return 0
    return len(path.read_text().splitlines())


def _run_until(process: subprocess.Popen, run_dir: Path, step: int, extra_delay: float) -> None:
    """Wait for `step` logged steps and a committed checkpoint (a step's checkpoint is saved in the background:
    on a loaded machine the step after it can be logged first), then `extra_delay` seconds."""
    deadline = time.monotonic() + 300
    started: float = process.started  # type: ignore[attr-defined]
    while _steps_done(run_dir, started) < step or TrainCheckpointer.latest_in(run_dir / "checkpoints") is None:
        assert process.poll() is None, _output(process)
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.02)
    time.sleep(extra_delay)  # somewhere inside the next step: generating, training or checkpointing


def _uninterrupted_prompts() -> dict[int, str]:
    """Group id -> prompt id of any run of this config: the prompt stream is a function of the seed."""
    return uninterrupted_prompts(load_experiment(RUN[0], RUN[1:]), range(PROMPTS))


def test_killed_and_resumed_system_trains_every_prompt_once_in_the_same_order(tmp_path):
    run_dir = tmp_path / "b" / "async-arithmetic"
    rng = random.Random(7)
    process = _start(tmp_path / "b")
    for low, high in ((3, 4), (6, 8), (10, 11)):  # SIGKILLs at random points after the first checkpoint
        _run_until(process, run_dir, rng.randint(low, high), rng.uniform(0.0, 0.5))
        _kill(process)
        process = _start(tmp_path / "b", "--resume")
    _run_until(process, run_dir, 13, 0.0)
    process.send_signal(signal.SIGTERM)  # graceful: a checkpoint, nothing exported, "resumable" exit code
    assert process.wait(timeout=120) == EXIT_RESUMABLE, _output(process)
    stopped_at = _steps_done(run_dir)
    assert stopped_at < PROMPTS // BATCH and TrainCheckpointer.latest_in(run_dir / "checkpoints") == stopped_at
    assert not (run_dir / "hf_final").exists()
    process = _start(tmp_path / "b", "--resume")
    assert process.wait(timeout=300) == 0, _output(process)

    got = _trained(run_dir)
    assert sorted(g for _, g, _ in got) == list(range(PROMPTS)), "a group was lost or trained twice"
    expected = _uninterrupted_prompts()
    assert sorted(expected.values()) == sorted(f"arith-{i}" for i in range(PROMPTS))
    assert {g: p for _, g, p in got} == expected  # the prompt an uninterrupted run gives each group id
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [int(m["train/version"]) for m in metrics]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == PROMPTS // BATCH  # each step once
    assert all(m["rollout/staleness_max"] <= ETA for m in metrics)
    _, model = load_hf_checkpoint(run_dir / "hf_final")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))


def test_killed_and_resumed_run_with_dynamic_sampling_trains_each_usable_prompt_once(tmp_path):
    """DAPO dynamic sampling across a SIGKILL: even prompts never earn a reward (uniform groups: logged
    untrained, replaced), odd ones train; each group id ends either trained once or logged untrained."""
    run_dir, extra = tmp_path / "b" / "async-arithmetic", DYNAMIC
    process = _start(tmp_path / "b", *extra)
    _run_until(process, run_dir, 3, random.Random(3).uniform(0.0, 0.5))
    _kill(process)
    process = _start(tmp_path / "b", "--resume", *extra)
    assert process.wait(timeout=300) == 0, _output(process)

    got = _trained(run_dir)
    trained = [g for _, g, _ in got]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    untrained = {g for g, trains in logged_groups(run_dir / "rollout_log").items() if not trains}
    assert not untrained & set(trained) and untrained | set(trained) == set(range(PROMPTS))
    expected = _uninterrupted_prompts()
    assert {g: p for _, g, p in got} == {g: expected[g] for g in trained}
    assert all(int(p.split("-")[1]) % 2 for _, _, p in got)  # only prompts that can earn different rewards
    assert {expected[g] for g in untrained} >= {f"arith-{i}" for i in range(0, PROMPTS, 2)}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [int(m["train/version"]) for m in metrics] == list(range(1, len(metrics) + 1))  # each step once
    assert all(m["rollout/staleness_max"] <= ETA for m in metrics)
