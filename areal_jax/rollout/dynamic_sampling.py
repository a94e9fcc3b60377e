"""DAPO's dynamic sampling (Yu et al. 2025, Sec. 3.2): a group whose samples all earned the same reward has
zero group-normalised advantage, so it adds no gradient; it is kept out of training and another prompt is
admitted in its place.

The rule runs on the rollout side, once per finished group. A dropped group is still written to the rollout
log, each sample marked `NOT_TRAINED` (the pipeline skips it; a resumed rollout side neither issues its id
again nor counts it), and the staleness manager counts it rejected, not accepted: the bound
`accepted + running <= (eta + v + 1) * B` counts only groups the trainer will consume, so the freed place
admits the replacement. A policy for which every group is uniform (a task far too hard or too easy) would
generate forever; after `max_dropped_in_a_row` dropped groups in a row the rollouts stop with an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from areal_jax.configuration import Config, option
from areal_jax.data.trajectory import NOT_TRAINED, Trajectory
from areal_jax.rollout.failures import RolloutFailure

UNIFORM_REWARD = "uniform_reward"


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig(Config):
    """DAPO dynamic sampling: groups whose rewards are all equal are replaced by new prompts."""

    enabled: bool = option(
        False, doc="drop each group whose samples' rewards are all equal and admit another prompt in its place"
    )
    max_dropped_in_a_row: int = option(
        256, ge=1, doc="stop the rollouts after this many dropped groups in a row (no group the trainer can use)"
    )


def is_uniform(group: Sequence[Trajectory]) -> bool:
    """Whether every sample of `group` earned the same reward (its group-normalised advantages are all 0)."""
    return len({float(t.reward) for t in group}) <= 1


def marked_untrained(group: Sequence[Trajectory], reason: str = UNIFORM_REWARD) -> list[Trajectory]:
    """`group`'s samples marked as logged but not trained (`Trajectory.trains` is False)."""
    return [dataclasses.replace(t, metadata={**t.metadata, NOT_TRAINED: reason}) for t in group]


class DynamicSampler:
    """Decides per finished group (one owner: the rollout controller's thread) and counts the drops."""

    def __init__(self, config: DynamicSamplingConfig):
        self.config = config
        self.dropped = 0
        self.in_a_row = 0

    def drops(self, group: Sequence[Trajectory]) -> bool:
        """Whether `group` is kept out of training; counts it."""
        if not self.config.enabled or not is_uniform(group):
            self.in_a_row = 0
            return False
        self.dropped += 1
        self.in_a_row += 1
        return True

    def exhausted(self) -> RolloutFailure | None:
        """The error to stop the rollouts with once `max_dropped_in_a_row` groups in a row were dropped."""
        if self.in_a_row < self.config.max_dropped_in_a_row:
            return None
        return RolloutFailure(
            f"rollout.dynamic_sampling dropped {self.in_a_row} groups in a row: every one's samples earned the "
            "same reward, so none can train (the task is too hard or too easy for this policy); raise "
            "rollout.workflow.n_samples, change the data, or set rollout.dynamic_sampling.enabled=false"
        )
