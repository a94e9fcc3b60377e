"""Exact resume: train k steps from a fixed rollout log, checkpoint, SIGKILL, resume, train to 2k; the
final params equal an uninterrupted 2k-step run and every record is consumed exactly once."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areal_jax.data.rollout_log import RolloutLogWriter
from tests.rollout_log_worker import make_trajectory
from tests.xla_flags import xla_flags

K = 3
ROOT = Path(__file__).resolve().parents[1]


def _run(log_dir, ckpt_dir, out, total, kill_after):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "resume_worker.py"),
            str(log_dir),
            str(ckpt_dir),
            str(out),
            str(total),
            str(kill_after),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _consumed(out):
    return [tuple(x) for line in Path(str(out) + ".consumed.jsonl").read_text().splitlines() for x in json.loads(line)]


@pytest.mark.multiprocess
def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path):
    log_dir = tmp_path / "log"
    rng = np.random.default_rng(0)
    with RolloutLogWriter(log_dir, "w0") as writer:
        for group in range(2 * K * 2 + 2):  # groups_per_batch = 2; two spare groups stay unconsumed
            for sample in range(2):
                trajectory = make_trajectory(group, sample, length=int(rng.integers(6, 30)), seed=1)
                writer.append(trajectory.__class__(**{**trajectory.__dict__, "token_ids": trajectory.token_ids % 64}))
                if writer.buffered == 3:  # shards of 3 records
                    writer.flush()

    straight = _run(log_dir, tmp_path / "ckpt_a", tmp_path / "a", 2 * K, 0)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _run(log_dir, tmp_path / "ckpt_b", tmp_path / "b", 2 * K, K)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _run(log_dir, tmp_path / "ckpt_b", tmp_path / "b", 2 * K, 0)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) > 5
    for name in a.files:
        np.testing.assert_allclose(b[name], a[name], atol=1e-6, err_msg=name)
    consumed_a, consumed_b = _consumed(tmp_path / "a"), _consumed(tmp_path / "b")
    assert consumed_b == consumed_a  # same records, same order, none twice
    assert len(set(consumed_b)) == len(consumed_b) == 2 * K * 2 * 2
