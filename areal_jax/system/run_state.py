"""`RunState`: what a training checkpoint holds besides the arrays, and the one thing a resume restores.

- `version`: the policy version (trainer steps published);
- `pipeline`: the Grain pipeline's position in the rollout log (what the trainer has read, incomplete
  groups included), so a resumed pipeline reads on from exactly there;
- `consumed_groups`: the groups trained so far, over the whole run.

Where the rollout side goes on is not in it: the rollout log is that record (`rollout_side.py`). A resume
therefore first makes the log end where the checkpoint's pipeline is (`continue_log`: the shards it had not
started are set aside, their groups are generated again) and cuts the trained-groups record back to the
checkpoint's step; metrics.jsonl is cut back by the reporter.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from areal_jax import storage
from areal_jax.config import ExperimentConfig
from areal_jax.data.pipeline import set_aside_unread
from areal_jax.data.trajectory import Trajectory
from areal_jax.jsonl import keep_upto
from areal_jax.trainer.checkpoint import TrainCheckpointer
from areal_jax.trainer.trainer import Trainer
from areal_jax.weights.base import abstract_target

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunState:
    version: int = 0
    pipeline: dict[str, Any] | None = None
    consumed_groups: int = 0
    resumed: bool = False  # restored from a checkpoint (not a new run)

    def consume(self, batch: Iterable[Trajectory]) -> None:
        self.consumed_groups += len({t.group_id for t in batch})

    def metadata(self) -> dict[str, Any]:
        """The checkpoint's JSON metadata."""
        return {"version": self.version, "pipeline": self.pipeline, "consumed_groups": self.consumed_groups}

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> RunState:
        return cls(int(metadata["version"]), metadata["pipeline"], int(metadata["consumed_groups"]), resumed=True)


def restore(checkpointer: TrainCheckpointer, trainer: Trainer) -> tuple[RunState, int]:
    """The newest good checkpoint into `trainer` (arrays and version); its run state and step."""
    restored = checkpointer.restore(abstract_target({"params": trainer.params, "opt_state": trainer.opt_state}))
    trainer.params, trainer.opt_state = restored.state["params"], restored.state["opt_state"]
    state = RunState.from_metadata(restored.metadata)
    trainer.version = state.version
    for step, reason in restored.rejected:
        logger.warning("checkpoint %d was not used: %s", step, reason)
    return state, restored.step


def continue_log(cfg: ExperimentConfig, state: RunState, step: int) -> None:
    """On a resume, process 0, before any rollout side starts: the log's shards the checkpoint's pipeline had
    not started set aside (into rollout_log_unused/resume-<step>), the trained-groups lines after it dropped."""
    assert state.pipeline is not None
    unused = storage.join(cfg.layout.rollout_log_unused, f"resume-{step}")
    aside = set_aside_unread(cfg.layout.rollout_log, state.pipeline, unused)
    keep_upto(cfg.layout.trained_groups, state.version, "version")
    logger.info(
        "resumed from step %d (version %d): %d unread log records set aside; their groups are generated again",
        step,
        state.version,
        aside.records,
    )
