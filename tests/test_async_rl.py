"""The whole system in one process: rollouts and training overlap within the staleness bound, weights
flow back with versions, checkpoints resume, and the final export loads."""

import numpy as np
import pytest

from areal_jax.config import load_experiment
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.system.async_rl import load_metrics, run_async

FAST = [
    "train_steps=4",
    "rollout.staleness.batch_prompts=2",
    "rollout.workflow.n_samples=2",
    "rollout.engine.max_slots=8",
    "trainer.packing.token_budget=256",
    "trainer.packing.rows=4",
    "train_checkpoint.every_steps=2",
]


@pytest.mark.parametrize("eta", [0, 2])
def test_async_training_runs_within_staleness_and_resumes(tmp_path, eta):
    overrides = [*FAST, f"output_dir={tmp_path}", f"rollout.staleness.max_head_offpolicyness={eta}"]
    cfg = load_experiment("configs/train_cpu.yaml", overrides)
    summary = run_async(cfg)
    assert summary.version == 4 and summary.steps == 4
    metrics = load_metrics(summary.metrics_file)
    assert [m["train/version"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["rollout/staleness_max"] <= eta for m in metrics)
    assert all(np.isfinite(m["train/loss"]) for m in metrics)
    if eta == 0:
        assert summary.interruptions == 0  # synchronous: nothing is in flight when weights change
    model_cfg, _ = load_hf_checkpoint(summary.final_hf_checkpoint)
    assert model_cfg.vocab_size == cfg.model.vocab_size

    resumed = run_async(cfg.replace(train_steps=6), resume=True)
    assert resumed.version == 6 and resumed.steps == 2
    metrics = load_metrics(resumed.metrics_file)
    assert [m["train/version"] for m in metrics] == [1, 2, 3, 4, 5, 6]
