"""The whole system in one process: rollouts and training overlap within the staleness bound, weights
flow back with versions, checkpoints resume, and the final export loads."""

import gc
import os
import weakref

import jax
import numpy as np
import pytest

from areal_jax.config import load_experiment
from areal_jax.jobs.train import run_async
from areal_jax.jsonl import read_jsonl
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.planning.calibration import read_calibration
from areal_jax.system.rollout_side import RolloutSide
from areal_jax.system.step_report import monitor_logprobs
from areal_jax.trainer.checkpoint import TrainCheckpointer
from tests.short_runs import SHORT_TRAIN_CPU

FAST = [
    *SHORT_TRAIN_CPU,
    "train_steps=4",
    "rollout.staleness.batch_prompts=2",
    "rollout.workflow.n_samples=2",
    "train_checkpoint.every_steps=2",
    "eval.every_steps=0",  # no held-out evaluation (200 prompts, twice): tests/test_readme_commands.py covers it
]


@pytest.mark.parametrize("eta", [0, 2])
def test_async_training_runs_within_staleness_and_resumes(tmp_path, monkeypatch, eta):
    freed = _record_whether_each_publish_frees_the_served_version(monkeypatch)
    overrides = [*FAST, f"output_dir={tmp_path}", f"rollout.staleness.max_head_offpolicyness={eta}"]
    if eta == 0:
        overrides += ["trainer.ppo.kl_coef=0.05"]  # KL to the starting policy, which the run keeps frozen
        # every step is on-policy, where auto skips the proximal pass but on the monitor's steps: here all
        overrides += ["trainer.logprob_monitor_every=1"]
    if eta:
        overrides += ["profile.start_step=2", "profile.num_steps=1"]  # a trace of step 2, both sides running
        overrides += ["model.vocab_size=64"]  # embedding rows past the 27-symbol tokenizer are never sampled
    cfg = load_experiment("configs/train_cpu.yaml", overrides)
    summary = run_async(cfg)
    assert summary.version == 4 and summary.steps == 4
    metrics = read_jsonl(summary.metrics_file)
    assert [m["train/version"] for m in metrics] == [1, 2, 3, 4]
    assert freed == [True] * 4  # no version outlives its successor (at 0.5B one engine copy is 1.7 GiB)
    assert all(m["rollout/staleness_max"] <= eta for m in metrics)
    assert all(np.isfinite(m["train/loss"]) for m in metrics)
    if eta == 0:
        assert summary.interruptions == 0  # synchronous: nothing is in flight when weights change
        assert abs(metrics[0]["kl/kl_mean"]) < 1e-6 < metrics[-1]["kl/kl_mean"]  # drifts from the frozen start
        # every token is on-policy: the sampler's and the trainer's log-probs agree (fp32)
        assert all(m["monitor/onpolicy_tokens"] == m["ppo/n_tokens"] for m in metrics)
        assert all(m["monitor/logp_abs_diff"] < 1e-4 and abs(m["monitor/kl"]) < 1e-6 for m in metrics)
    model_cfg, _ = load_hf_checkpoint(summary.final_hf_checkpoint)
    assert model_cfg.vocab_size == cfg.model.vocab_size
    assert TrainCheckpointer.latest_in(cfg.run_dir / "checkpoints") == 4
    assert len(list((cfg.run_dir / "profile").rglob("*.xplane.pb"))) == (1 if eta else 0)

    if eta == 0:
        # the run is a calibration of `areal-jax plan`: both sides took turns on this process's cores
        calibration = read_calibration(cfg.run_dir, skip=1)
        cores = len(os.sched_getaffinity(0))
        assert calibration.colocated and (calibration.gen_units, calibration.train_units) == (cores, cores)
        assert calibration.gen_tokens_per_s > 0 and calibration.train_tokens_per_s > 0
        return  # resuming is the same code at any eta (and tests/test_resume_prompts.py kills the real process)
    resumed = run_async(cfg.replace(train_steps=6), resume=True)
    assert resumed.version == 6 and resumed.steps == 2
    metrics = read_jsonl(resumed.metrics_file)
    assert [m["train/version"] for m in metrics] == [1, 2, 3, 4, 5, 6]


def _record_whether_each_publish_frees_the_served_version(monkeypatch) -> list[bool]:
    """Per version applied to the rollout side: whether every engine array of the version served before it was
    freed once the generator used the new one (nothing, e.g. a local of the set-up, keeps an old version alive)."""
    freed: list[bool] = []
    apply = RolloutSide.apply

    def spy(self, params, version):
        served = self.generator.params
        refs = [weakref.ref(leaf) for leaf in jax.tree.leaves((served.state, served.layers))]
        del served
        apply(self, params, version)
        gc.collect()
        freed.append(all(ref() is None for ref in refs))

    monkeypatch.setattr(RolloutSide, "apply", spy)
    return freed


def test_latest_checkpoint_is_read_without_creating_anything(tmp_path):
    assert TrainCheckpointer.latest_in(tmp_path / "none") is None
    assert not (tmp_path / "none").exists()


def test_logprob_monitor_reports_on_policy_tokens_and_warns_above_the_threshold(caplog):
    cfg = load_experiment("configs/train_cpu.yaml", ["trainer.logprob_mismatch_warning=0.01"])
    stale_only = {"staleness/0/n_tokens": 0.0}
    monitor_logprobs(cfg, stale_only)
    assert "monitor/logp_abs_diff" not in stale_only  # no token of the current version: nothing to compare
    stats = {
        "staleness/0/n_tokens": 12.0,
        "staleness/0/logp_abs_diff": 0.03,
        "staleness/0/logp_abs_diff_max": 0.2,
        "staleness/0/approx_kl": 0.001,
    }
    monitor_logprobs(cfg, stats)
    assert (stats["monitor/onpolicy_tokens"], stats["monitor/logp_abs_diff"], stats["monitor/kl"]) == (12, 0.03, 0.001)
    assert "differ by 0.03 on average (max 0.2" in caplog.text and "logprob_mismatch_warning=0.01" in caplog.text
