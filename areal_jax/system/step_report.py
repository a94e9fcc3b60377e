"""What process 0 records of each training step besides the trainer's own statistics: the batch's rewards
and staleness, the rollout side's and the pipeline's counters, the sampler/trainer log-prob monitor, the
step's warnings, and the trained-groups record; the reporter (`reporting.py`) writes and shows the line."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

import numpy as np

from areal_jax.config import ExperimentConfig
from areal_jax.data.pipeline import pipeline_stats, staleness_of
from areal_jax.data.trajectory import Trajectory
from areal_jax.reporting.run_reporter import RunReporter

logger = logging.getLogger(__name__)


def reward_stats(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    """The batch's rewards, correctness, staleness against `version` (the one it trains), lengths, truncations."""
    rewards = np.array([t.reward for t in trajectories])
    correct = np.array([t.reward_components.get("correct", 0.0) for t in trajectories])
    staleness = np.array([staleness_of(t, version) for t in trajectories])
    lengths = np.array([t.length - t.prompt_length for t in trajectories])
    truncated = np.array([bool(t.metadata.get("truncated", False)) for t in trajectories])
    return {
        "rollout/truncated_share": float(truncated.mean()),
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/correct_mean": float(correct.mean()),
        "rollout/staleness_mean": float(staleness.mean()),
        "rollout/staleness_max": float(staleness.max()),
        "rollout/response_length_mean": float(lengths.mean()),
    }


def monitor_logprobs(cfg: ExperimentConfig, stats: dict[str, float]) -> None:
    """Sampler vs trainer log-probs on the tokens the trainer's current version sampled (staleness 0): the
    same weights on both sides, so any gap is numerics (dtype, kernels, masking). Adds `monitor/...`."""
    if not cfg.trainer.ppo.needs_prox_pass or stats.get("prox/skipped"):
        # no trainer log-prob pass (this step): the proximal log-probs are the sampler's own, nothing to compare
        return
    tokens = stats.get("staleness/0/n_tokens", 0.0)
    if not tokens:
        return  # every token came from an older version (eta > 0 at steady state)
    gap, kl = stats["staleness/0/logp_abs_diff"], stats["staleness/0/approx_kl"]
    stats.update({"monitor/onpolicy_tokens": tokens, "monitor/logp_abs_diff": gap, "monitor/kl": kl})
    limit = cfg.trainer.logprob_mismatch_warning
    if gap > limit:
        logger.warning(
            "sampler and trainer log-probs differ by %.3g on average (max %.3g, KL %.3g) on %d tokens "
            "of the current version, above trainer.logprob_mismatch_warning=%g: check compute dtypes",
            gap,
            stats["staleness/0/logp_abs_diff_max"],
            kl,
            int(tokens),
            limit,
        )


class StepRecords:
    """Process 0's records of the steps: the reporter's line, trained_groups.jsonl, the warnings."""

    def __init__(self, cfg: ExperimentConfig, reporter: RunReporter, started: float):
        self.cfg, self.reporter, self.started = cfg, reporter, started
        self.trained_groups = contextlib.ExitStack()
        self.groups_file = self.trained_groups.enter_context(cfg.layout.trained_groups.open("a"))
        self.warned_at: dict[str, int] = {}  # warning -> the step it was last logged at

    def add_run_stats(self, stats: dict[str, float], rollout_stats: dict[str, float], pipeline_state: Any) -> None:
        """The rollout side's counters, the pipeline's, and the clocks."""
        stats.update(rollout_stats)
        for key, value in pipeline_stats(pipeline_state).items():
            if isinstance(value, dict):  # samples kept/dropped per staleness
                stats.update({f"pipeline/{key}/{k}": float(v) for k, v in value.items()})
            else:
                stats[f"pipeline/{key}"] = float(value)
        stats["time/wall"] = time.perf_counter() - self.started
        stats["time/unix"] = time.time()  # the clock of the rollout log's append times and the servers' status files
        stats["time/process_cpu"] = time.process_time()  # CPU seconds of all its threads: its share of its cores

    def write(self, version: int, stats: dict[str, float], batch: list[Trajectory]) -> None:
        monitor_logprobs(self.cfg, stats)
        self.reporter.log(version, stats)
        groups = sorted({(t.group_id, t.prompt_id) for t in batch})
        self.groups_file.write(json.dumps({"version": version, "groups": groups}) + "\n")
        self.groups_file.flush()
        self._warn_truncation(version, stats["rollout/truncated_share"])
        self._warn_rejection(version, stats.get("correction/seq/rejected_frac", 0.0))

    def _due(self, warning: str, version: int, value: float) -> bool:
        """Whether `warning` (its value above one half) is logged at this step: at most once every 50 steps."""
        last = self.warned_at.get(warning)
        if value <= 0.5 or (last is not None and version - last < 50):
            return False
        self.warned_at[warning] = version
        return True

    def _warn_rejection(self, version: int, rejected: float) -> None:
        if not self._due("rejection", version, rejected):
            return
        logger.warning(
            "trainer.ppo.rollout_correction left %.0f%% of this step's sequences out of the loss (masked or "
            "rejected); what is left is a biased sample, and the optimizer still takes full-size steps on it. "
            "Widen its bounds (is_high/is_low, rs_high/rs_low) or lower rollout.staleness.max_head_offpolicyness "
            "(docs/objectives.md, 'Where each correction belongs')",
            100 * rejected,
        )

    def _warn_truncation(self, version: int, truncated: float) -> None:
        if not self._due("truncation", version, truncated):
            return
        sampling = self.cfg.rollout.workflow
        logger.warning(
            "%.0f%% of this step's samples hit a length limit (rollout.workflow.sampling.max_new_tokens=%d, "
            "rollout.engine.max_length=%d); they are handled by rollout.workflow.truncation=%r",
            100 * truncated,
            sampling.sampling.max_new_tokens,
            self.cfg.rollout.engine.max_length,
            sampling.truncation,
        )

    def close(self, outputs: list[str]) -> None:
        self.trained_groups.close()
        self.reporter.close(outputs)
