"""The trainer loop of every training run, in one process or several: take a batch, train a step, publish
the version, record the step, checkpoint; until `StopControl` says stop.

The loop runs on every trainer process. Process 0 reads the rollout log through the Grain pipeline (or,
with several processes, hands each batch to the others: `SharedBatches`) and alone writes the records,
among them the rollout side's held-out evaluations once they are finished (`eval_results.py`), each at the
step of the version it evaluated; the loop never runs one. Every process takes part in the step, the
publish and each checkpoint (all collective). A checkpoint holds the arrays and the `RunState`, which
process 0 decides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from areal_jax import storage
from areal_jax.config import ExperimentConfig
from areal_jax.data.trajectory import Trajectory
from areal_jax.multiprocess import TrainerProcesses
from areal_jax.profiling import ProfileWindow
from areal_jax.progress import heartbeat
from areal_jax.reporting.metric_keys import BATCH_WAIT
from areal_jax.system.eval_results import FinishedEvaluations
from areal_jax.system.run_state import RunState
from areal_jax.system.step_report import StepRecords, reward_stats
from areal_jax.system.stop_control import RunFailed, StopControl
from areal_jax.trainer.checkpoint import CheckpointError, TrainCheckpointer
from areal_jax.trainer.trainer import Trainer
from areal_jax.weights.base import WeightPublisher

logger = logging.getLogger(__name__)

PUBLISH_SECONDS = "weights/publish_blocking_seconds"


class Rollouts(Protocol):
    """The rollout side as the trainer loop sees it: in this process (`jobs/train.py`) or rollout server
    processes (`jobs/trainer_role.py`)."""

    done: Any  # `is_set()` once every rollout has been written (a finite dataset ran out)

    def serving(self, trainer: Trainer, stops: StopControl) -> contextlib.AbstractContextManager[WeightPublisher]:
        """Rollouts run inside this context from the trainer's current version; the publisher it gives
        carries each new version to them."""
        ...

    def stop(self) -> None: ...
    def failure(self) -> BaseException | None: ...
    def stats(self) -> dict[str, float]: ...
    def next_group_id(self) -> int: ...
    def generation_tokens(self) -> int: ...
    def interruptions(self) -> int: ...

    def evaluations(self) -> storage.Location:
        """Where the rollout side writes its held-out evaluations (`eval_results.py`)."""
        ...

    def finish_evaluations(self, version: int) -> None:
        """Returns once the rollout side has written its evaluations up to `version` (the last step's), or
        gave up on them."""
        ...


@dataclasses.dataclass
class RewardTrace:
    first: float = float("nan")
    last: float = float("nan")
    trained: int = 0

    def add(self, reward: float, trajectories: int) -> None:
        if np.isnan(self.first):
            self.first = reward
        self.last = reward
        self.trained += trajectories


class TrainingLoop:
    """See the module docstring. `take` returns the next batch or None to stop (the data ran out, or a stop
    was requested); `pipeline_state` is process 0's pipeline position (None on the others); `records` is
    process 0's."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        trainer: Trainer,
        state: RunState,
        checkpointer: TrainCheckpointer,
        stops: StopControl,
        processes: TrainerProcesses,
        rollouts: Rollouts,
        publisher: WeightPublisher,
        take: Callable[[int], list[Trajectory] | None],
        pipeline_state: Callable[[], Any] | None,
        records: StepRecords | None,
        stream_prompts: int,
    ):
        self.cfg, self.trainer, self.state, self.checkpointer = cfg, trainer, state, checkpointer
        self.stops, self.processes, self.rollouts, self.publisher = stops, processes, rollouts, publisher
        self.take, self.pipeline_state, self.records = take, pipeline_state, records
        self.stream_prompts = stream_prompts
        self.evaluations = (
            FinishedEvaluations(rollouts.evaluations(), records.reporter.evaluated_steps())
            if records is not None
            else None
        )

    def run(self, profile: ProfileWindow) -> RewardTrace:
        trainer, stops = self.trainer, self.stops
        trace = RewardTrace()
        first = True
        while stops.go_on(trainer.version):
            waiting = time.perf_counter()
            with self._first_batch_heartbeat(first):
                batch = self.take(trainer.version + 1)
            if batch is None:
                break
            first = False
            waited = time.perf_counter() - waiting
            version_before = trainer.version
            profile.before_step(version_before + 1)
            stats = trainer.step(batch)
            published = time.perf_counter()
            self.publisher.publish(trainer.params, trainer.version)
            stats[PUBLISH_SECONDS] = time.perf_counter() - published
            profile.after_step(trainer.version)
            stats.update(reward_stats(batch, version_before))
            stats[BATCH_WAIT] = waited
            self.state.version = trainer.version
            self.state.consume(batch)
            if self.records is not None:
                stats["data/epoch"] = self.rollouts.next_group_id() / self.stream_prompts
                self.records.add_run_stats(stats, self.rollouts.stats(), self._pipeline_state())
                self.records.write(trainer.version, stats, batch)
                self.record_evaluations()
            trace.add(stats["rollout/reward_mean"], len(batch))
            stops.count_skipped(stats["train/skipped_updates"])
            self._save(due_only=trainer.version < self.cfg.train_steps)  # the last step, always
        if stops.agreed():
            logger.info("stopping after step %d on %s", trainer.version, stops.describe())
            self._save(due_only=False)
        elif self.processes.primary and self.rollouts.failure() is None:
            self.rollouts.finish_evaluations(trainer.version)
            self.record_evaluations()
        return trace

    def record_evaluations(self) -> None:
        """Process 0: the held-out evaluations finished since the last call, each at its version's step."""
        if self.evaluations is None or self.records is None:
            return
        for version, scalars in self.evaluations.take():
            self.records.reporter.log_evaluation(version, scalars)

    def _first_batch_heartbeat(self, first: bool) -> contextlib.AbstractContextManager[None]:
        """While the first batch of this process's run is awaited: what the rollout side has made so far."""
        if not first:
            return contextlib.nullcontext()
        groups = self.cfg.rollout.staleness.batch_prompts
        rollouts = self.rollouts
        return heartbeat(
            f"waiting for the first batch ({groups} groups)",
            lambda: f"{rollouts.generation_tokens()} tokens generated in this process",
        )

    def _pipeline_state(self) -> Any:
        return self.pipeline_state() if self.pipeline_state is not None else None

    def _save(self, *, due_only: bool) -> None:
        """A checkpoint of the current version when due (`train_checkpoint.every_steps`: the same answer on
        every process), or now unless it exists or the rollouts failed (process 0 decides: every process
        takes part in a save, or none does)."""
        version = self.trainer.version
        arrays = {"params": self.trainer.params, "opt_state": self.trainer.opt_state}
        try:
            if due_only:
                self.checkpointer.maybe_save(version, arrays, self._metadata)
            elif self.processes.share(self.checkpointer.latest_step() != version and self.rollouts.failure() is None):
                self.checkpointer.save(version, arrays, self._metadata(), wait=True)
        except CheckpointError as err:  # non-finite weights: the newest checkpoint stays the last good one
            raise RunFailed(str(err)) from err

    def _metadata(self) -> dict[str, Any]:
        """The run state at this checkpoint, process 0's on every process."""
        if self.processes.primary:
            self.state.pipeline = self._pipeline_state()
        return self.processes.share(self.state.metadata() if self.processes.primary else None)
