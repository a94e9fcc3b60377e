"""The whole system in one process: rollouts and training overlap within the staleness bound, weights
flow back with versions, checkpoints resume, and the final export loads."""

import numpy as np
import pytest

from areal_jax.config import load_experiment
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.system.async_rl import load_metrics, run_async
from areal_jax.trainer.checkpoint import TrainCheckpointer

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
    if eta:
        overrides += ["profile.start_step=2", "profile.num_steps=1"]  # a trace of step 2, both sides running
        overrides += ["model.vocab_size=64"]  # embedding rows past the 27-symbol tokenizer are never sampled
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
    assert TrainCheckpointer.latest_in(cfg.run_dir / "checkpoints") == 4
    assert len(list((cfg.run_dir / "profile").rglob("*.xplane.pb"))) == (1 if eta else 0)

    if eta == 0:
        return  # resuming is the same code at any eta (and tests/test_resume_prompts.py kills the real process)
    resumed = run_async(cfg.replace(train_steps=6), resume=True)
    assert resumed.version == 6 and resumed.steps == 2
    metrics = load_metrics(resumed.metrics_file)
    assert [m["train/version"] for m in metrics] == [1, 2, 3, 4, 5, 6]


def test_latest_checkpoint_is_read_without_creating_anything(tmp_path):
    assert TrainCheckpointer.latest_in(tmp_path / "none") is None
    assert not (tmp_path / "none").exists()
