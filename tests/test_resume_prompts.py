"""The running system killed mid-epoch and resumed uses every prompt exactly once, each under the group id
an uninterrupted run gives it (the prompt order is fixed by the seed, whatever the crash)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = 24
RUN = [
    "configs/train_cpu.yaml",
    "train_steps=100",  # more than the data: the run ends when the single epoch is used up
    "dataset.epochs=1",
    f"dataset.arithmetic_problems={PROMPTS}",
    "rollout.staleness.batch_prompts=2",
    "rollout.staleness.max_head_offpolicyness=2",
    "rollout.workflow.n_samples=2",
    "rollout.engine.max_slots=8",
    "trainer.packing.token_budget=256",
    "trainer.packing.rows=4",
    "train_checkpoint.every_steps=2",
    "train_checkpoint.async_save=false",
    "compilation_cache_dir=null",
]


def _train(output_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "areal_jax.cli", "train", *RUN, f"output_dir={output_dir}", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _trained(run_dir: Path) -> list[tuple[int, int, str]]:
    """(step, group id, prompt id) of every trained group, in step order."""
    lines = (run_dir / "trained_groups.jsonl").read_text().splitlines()
    return [(row["version"], g, p) for row in map(json.loads, lines) for g, p in row["groups"]]


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "trained_groups.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_kill_and_resume_mid_epoch_trains_every_prompt_once_in_the_same_order(tmp_path):
    reference = _train(tmp_path / "a")
    interrupted = _train(tmp_path / "b")
    run_dir = tmp_path / "b" / "async-arithmetic"
    deadline = time.monotonic() + 300
    while _steps_done(run_dir) < 5:  # past the step-4 checkpoint, in the middle of the epoch
        assert interrupted.poll() is None, interrupted.stdout.read()
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)
    os.kill(interrupted.pid, signal.SIGKILL)
    interrupted.wait()
    resumed = _train(tmp_path / "b", "--resume")
    out_resumed, _ = resumed.communicate(timeout=300)
    out_reference, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, out_reference
    assert resumed.returncode == 0, out_resumed

    expected = _trained(tmp_path / "a" / "async-arithmetic")
    got = _trained(run_dir)
    assert sorted(g for _, g, _ in expected) == list(range(PROMPTS))  # one epoch: every group once
    assert sorted(g for _, g, _ in got) == list(range(PROMPTS)), "a group was lost or trained twice"
    assert {g: p for _, g, p in got} == {g: p for _, g, p in expected}  # same prompt under each group id
    assert len({p for _, _, p in got}) == PROMPTS
    steps = [s for s, _, _ in got]
    assert steps == sorted(steps) and len(set(steps)) == steps[-1]  # each step logged once after the resume
    assert "groups re-issued" in out_resumed
