"""The keys of a run's per-step stats that the reporter reads, named once, and the generation rate between two
steps' stats."""

from __future__ import annotations

from collections.abc import Mapping

STEP_KEY = "train/version"  # a metrics line's step
REWARD = "rollout/reward_mean"
CORRECT = "rollout/correct_mean"
HELDOUT = "eval/pass@1"
EVAL_PREFIX = "eval/"  # a held-out evaluation's scalars; its line has these and STEP_KEY only
STALENESS_MEAN = "rollout/staleness_mean"
STALENESS_MAX = "rollout/staleness_max"
TRAIN_TOKENS_PER_S = "train/throughput"
EMITTED = "generator/emitted_tokens"
INTERRUPTIONS = "generator/interruptions"
QUEUE = "generator/queue"
WALL = "time/wall"
BATCH_WAIT = "time/batch_wait"  # seconds the trainer waited for the step's batch (the rollout side's share)
KEPT_BY_STALENESS = "pipeline/kept_by_staleness/"


def generation_rate(previous: Mapping[str, float] | None, stats: Mapping[str, float]) -> float | None:
    """Generated tokens per second over the last step: the growth of `generator/emitted_tokens` over that of
    `time/wall`; at the first step of a process (the counters restarted) the process's own average."""
    if EMITTED not in stats or WALL not in stats:
        return None
    emitted, wall = stats[EMITTED], stats[WALL]
    if previous is not None and EMITTED in previous and WALL in previous:
        d_emitted, d_wall = emitted - previous[EMITTED], wall - previous[WALL]
        if d_emitted >= 0 and d_wall > 0:
            return d_emitted / d_wall
    return emitted / wall if wall > 0 else None


def is_evaluation(stats: Mapping[str, float]) -> bool:
    """Whether a metrics line is a held-out evaluation's (written when it finished, at its version's step)
    rather than a training step's."""
    return all(key == STEP_KEY or key.startswith(EVAL_PREFIX) for key in stats)
