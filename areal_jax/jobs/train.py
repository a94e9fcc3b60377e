"""`areal-jax train`: asynchronous RL in one JAX program, and the trainer side every training run shares.

`run_async`: the rollout side (`system/rollout_side.py`, server 0 of 1: engine and generator on the
inference mesh, the controller's threads, the rollout log) and the trainer (on the trainer mesh) at once.
Each new version goes to the rollout side in-process: a device-to-device copy onto the engine's shardings,
swapped into the generator between two decode steps (interrupting in-flight samples, or draining first,
by `rollout.interrupt`), then admission follows it. With eta = 0 the same wiring is synchronous RL.

`train`: the trainer side on `trainer_mesh`, fed by the rollout side its caller makes (this process's, or
rollout server processes': `jobs/trainer_role.py`): run directory, policy, trainer, the resume, the
`TrainingLoop` (`system/training_loop.py`), the final export.

Prompts. Group g is always prompt g of the shuffled, repeated training stream (`TaskStream`), so a run's
prompt order is fixed by its seed. A resume restores the newest good checkpoint (`RunState`: the version
and the pipeline's position in the log), sets the log's unread shards aside (they came from the lost part
of the run), and the rollout side issues the groups missing from the log again before new ones: every
prompt is trained once, in the uninterrupted run's order of group ids.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from areal_jax import storage
from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError, to_dict
from areal_jax.data.datasets import PromptRecord
from areal_jax.data.pipeline import build_pipeline
from areal_jax.data.tasks import TaskStream
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.engine import Engine
from areal_jax.jobs.sft import cached_warm_start
from areal_jax.jobs.starting_policy import load_policy
from areal_jax.models.decoder import Decoder
from areal_jax.models.init import abstract_like
from areal_jax.multiprocess import TrainerProcesses
from areal_jax.planning.memory import check_memory
from areal_jax.profiling import ProfileWindow
from areal_jax.reporting.run_reporter import RunReporter
from areal_jax.rollout.rewards import Reward
from areal_jax.rollout.workflow import RolloutWorkflow
from areal_jax.run_layout import EVAL_DIR, PROFILE_DIR
from areal_jax.system import resources
from areal_jax.system.assembly import (
    build_meshes,
    build_prompts,
    build_task_stream,
    build_tokenizer,
    build_workflow,
    export_policy,
    policy_config,
)
from areal_jax.system.eval_results import drop_evaluations_after
from areal_jax.system.rollout_side import RolloutSide, open_rollout_side
from areal_jax.system.run_dir import check_run_dir, start_run_dir
from areal_jax.system.run_mirror import mirroring, pull_records, reset_local_copy
from areal_jax.system.run_state import RunState, continue_log, restore
from areal_jax.system.step_report import StepRecords
from areal_jax.system.stop_control import RunFailed, StopControl
from areal_jax.system.trainer_processes import SharedBatches
from areal_jax.system.training_loop import Rollouts, TrainingLoop
from areal_jax.trainer.checkpoint import TrainCheckpointer, nonfinite_leaves
from areal_jax.trainer.trainer import Trainer
from areal_jax.weights.in_process import InProcessPublisher

logger = logging.getLogger(__name__)

__all__ = ["RunFailed", "RunSummary", "run_async", "train"]


@dataclasses.dataclass
class RunSummary:
    steps: int
    version: int
    trajectories_trained: int
    mean_reward_first: float
    mean_reward_last: float
    wall_seconds: float
    generation_tokens: int
    interruptions: int
    metrics_file: str
    final_hf_checkpoint: str | None  # None when stopped by a signal (resumable, nothing final)
    stopped_by_signal: bool = False


def run_async(cfg: ExperimentConfig, resume: bool = False, overwrite: bool = False) -> RunSummary:
    """Train up to `cfg.train_steps` steps of asynchronous RL on the configured prompts and reward. A new
    run needs a run directory without an earlier run (or `overwrite`); `resume` continues the newest
    checkpoint. Ends early when a finite dataset (`dataset.epochs`) has been used up."""
    inference_mesh, trainer_mesh = build_meshes(cfg)
    rollouts = lambda run: InProcessRollouts(cfg, run, inference_mesh)  # noqa: E731
    return train(cfg, trainer_mesh, rollouts, resume=resume, overwrite=overwrite, inference_mesh=inference_mesh)


@dataclasses.dataclass
class TrainingRun:
    """What the trainer side built, for the rollout side its caller makes."""

    model: Decoder  # abstract: the trainer holds the arrays
    workflow: RolloutWorkflow
    stream: TaskStream
    heldout: list[PromptRecord]
    processes: TrainerProcesses


def train(
    cfg: ExperimentConfig,
    trainer_mesh: Mesh,
    rollouts: Callable[[TrainingRun], Rollouts],
    *,
    resume: bool = False,
    overwrite: bool = False,
    inference_mesh: Mesh | None = None,
) -> RunSummary:
    """The trainer side of a run on `trainer_mesh` (see the module docstring). With several trainer
    processes (`jax.distributed`, `trainer_mesh` over all their devices) every process calls this; process 0
    starts the run directory, reads the log and decides (`trainer_processes`)."""
    started = time.perf_counter()
    processes = TrainerProcesses()
    latest = TrainCheckpointer.latest_in(cfg.layout.checkpoints) if resume else None
    plan = check_run_dir(cfg, resume, overwrite, latest)  # every process: the same refusals
    processes.barrier("areal-run-dir-checked")  # before process 0 changes what the others check
    processes.on_primary(lambda: start_run_dir(cfg, plan))
    _check_several_processes(cfg, processes)
    tokenizer = build_tokenizer(cfg)
    check_memory(cfg, policy_config(cfg, tokenizer), trainer_mesh, inference_mesh)  # before anything is loaded
    stops = StopControl(processes, cfg.train_steps, cfg.trainer.max_skipped_steps, cfg.trainer.ppo_minibatches)
    with (
        _records_mirror(cfg, resume, processes) as mirror,
        Reward(cfg.reward) as reward,
        build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow,
        stops.watching_signals(),
    ):
        model = load_policy(cfg, trainer_mesh, tokenizer)
        train_prompts, heldout = build_prompts(cfg, workflow)
        stream = build_task_stream(cfg, train_prompts)
        trainer = Trainer(
            model,
            cfg.trainer.replace(packing=cfg.packing_on(trainer_mesh.devices.flat[0].platform)),
            trainer_mesh,
            temperature=cfg.rollout.workflow.sampling.temperature,
            max_new_tokens=cfg.rollout.workflow.sampling.max_new_tokens,
            reference_params=nnx.state(model) if cfg.trainer.uses_reference else None,  # the starting policy
            seed=cfg.seed,  # LoRA dropout's masks
        )
        model = abstract_like(model)  # the trainer holds its own copy: the loaded arrays are freed
        before_save = mirror.sync if mirror is not None else None  # records up to a checkpoint before it
        checkpointer = TrainCheckpointer(cfg.layout.checkpoints, cfg.train_checkpoint, before_save=before_save)
        try:
            state = RunState()
            if resume:
                state, step = restore(checkpointer, trainer)
                processes.on_primary(lambda: continue_log(cfg, state, step))
                processes.on_primary(lambda: _drop_evaluations_after(cfg, step))
            side = rollouts(TrainingRun(model, workflow, stream, heldout, processes))
            return _run(cfg, trainer, state, checkpointer, stops, processes, side, len(stream), started)
        finally:
            checkpointer.close()


def _run(
    cfg: ExperimentConfig,
    trainer: Trainer,
    state: RunState,
    checkpointer: TrainCheckpointer,
    stops: StopControl,
    processes: TrainerProcesses,
    rollouts: Rollouts,
    stream_prompts: int,
    started: float,
) -> RunSummary:
    stops.failed = lambda: rollouts.failure() is not None
    first_version = trainer.version
    records: StepRecords | None = None
    profile_dir = cfg.layout.profile
    if processes.primary:
        hparams = to_dict(cfg)
        reporter = RunReporter(cfg.report, cfg.run_dir, cfg.train_steps, start_step=trainer.version, hparams=hparams)
        records = StepRecords(cfg, reporter, started)
    else:
        profile_dir = profile_dir / f"process-{processes.index}"
    profile = ProfileWindow(cfg.profile, profile_dir)
    final: list[str] = []
    try:
        with rollouts.serving(trainer, stops) as publisher:
            resources.record_mesh(cfg.run_location, f"trainer-{processes.index}", trainer.train_step.mesh)
            batches = _PipelineBatches(cfg, trainer, state, stops, rollouts) if processes.primary else None
            shared = None
            if processes.count > 1:
                take_shared = batches.take if batches is not None else None
                shared = SharedBatches(processes, take_shared, lambda: stops.signalled, stops.peer)
            loop = TrainingLoop(
                cfg, trainer, state, checkpointer, stops, processes, rollouts, publisher,
                shared.next if shared is not None else (lambda _step: batches.take()),  # type: ignore[union-attr]
                batches.state if batches is not None else None, records, stream_prompts,
            )  # fmt: skip
            try:
                rewards = loop.run(profile)
            finally:
                profile.close()
                stops.ended.set()  # a pipeline still waiting for data gives up
                rollouts.stop()
                if shared is not None:
                    shared.close()
                checkpointer.wait()
        loop.record_evaluations()  # those the rollout side finished as it closed
        final_dir = _finish(cfg, trainer, stops, processes, rollouts)
        final = [f"final policy (HF): {final_dir}"] if final_dir else []
        return RunSummary(
            steps=trainer.version - first_version,
            version=trainer.version,
            trajectories_trained=rewards.trained,
            mean_reward_first=rewards.first,
            mean_reward_last=rewards.last,
            wall_seconds=round(time.perf_counter() - started, 2),
            generation_tokens=rollouts.generation_tokens(),
            interruptions=rollouts.interruptions(),
            metrics_file=str(cfg.layout.metrics),
            final_hf_checkpoint=final_dir,
            stopped_by_signal=stops.stopped_by_request,
        )
    finally:
        if records is not None:
            records.close([*_outputs(cfg), *final])  # also after a failure


class _PipelineBatches:
    """Process 0's batches from the rollout log (the Grain pipeline, at the restored position on a resume),
    and the pipeline's position as of the last batch handed out for training: what a checkpoint records."""

    def __init__(
        self, cfg: ExperimentConfig, trainer: Trainer, state: RunState, stops: StopControl, rollouts: Rollouts
    ):
        self.cfg, self.stops = cfg, stops
        pipeline = build_pipeline(
            cfg.layout.rollout_log,
            cfg.pipeline_config(),
            trainer_version=lambda: trainer.version,
            stop_event=stops,
            writers_done=rollouts.done,
        )
        self.batches = iter(pipeline)
        if state.pipeline is not None:
            self.batches.set_state(state.pipeline)
        self._state = copy.deepcopy(self.batches.get_state())

    def state(self) -> Any:
        return self._state

    def take(self) -> list[Trajectory] | None:
        """The next batch to train, or None to stop: the data ran out, or the pipeline ended on a stop (an
        incomplete batch then stays out of the recorded position: the resumed run reads or generates it)."""
        batch = next(self.batches, None)
        if batch is None:
            if not self.stops.requested():
                logger.info("the prompts are used up (dataset.epochs=%s)", self.cfg.dataset.epochs)
            return None
        groups = len({t.group_id for t in batch})
        if groups < self.cfg.rollout.staleness.batch_prompts and self.stops.requested():
            logger.info("stopping: %d group(s) of an incomplete batch are left to the resumed run", groups)
            return None
        self._state = copy.deepcopy(self.batches.get_state())
        return batch


def _finish(
    cfg: ExperimentConfig, trainer: Trainer, stops: StopControl, processes: TrainerProcesses, rollouts: Rollouts
) -> str | None:
    """After the loop: the failure that stopped it, or the final export (not after a stop request)."""
    failure = rollouts.failure()
    if (message := processes.share(None if failure is None else str(failure))) is not None:
        raise RunFailed(message) from failure
    if stops.stopped_by_request:
        logger.warning("stopped by a signal at step %d; continue with --resume", trainer.version)
        return None
    if bad := nonfinite_leaves(trainer.params):
        raise RunFailed(f"the policy at step {trainer.version} has non-finite {bad[:3]}; nothing exported")
    final = nnx.merge(trainer.graphdef, trainer.policy_state())
    base = cfg.hf_checkpoint or (cached_warm_start(cfg) if cfg.warm_start.steps else None)  # a LoRA adapter's
    return str(export_policy(cfg, final, cfg.layout.hf_final, base=base))  # every process gathers


def _drop_evaluations_after(cfg: ExperimentConfig, step: int) -> None:
    """A resumed run's held-out evaluations of versions after its checkpoint: they are made again."""
    drop_evaluations_after(cfg.layout.eval_dir, step)
    if storage.is_remote(cfg.run_location):  # where rollout server processes' evaluations arrive
        drop_evaluations_after(storage.join(cfg.run_location, EVAL_DIR), step)


def _outputs(cfg: ExperimentConfig) -> list[str]:
    """The run's outputs besides the reporter's, for its closing summary."""
    location = cfg.run_location
    lines = [f"checkpoints: {cfg.layout.checkpoints}", f"trained prompts: {cfg.layout.trained_groups}"]
    if cfg.layout.eval_dir.is_dir():
        lines.append(f"held-out evaluations: {cfg.layout.eval_dir}")
    if storage.is_remote(location):
        lines.append(f"records: {cfg.run_dir}, uploaded to {location}")
    return lines


def _records_mirror(cfg: ExperimentConfig, resume: bool, processes: TrainerProcesses) -> Any:
    """On a gs:// run: process 0's local copy of the records, emptied (a new run) or filled from the bucket
    (a resume), uploaded while the run goes on; the other processes upload their profiles only."""
    if storage.is_remote(cfg.run_location):
        if processes.primary:
            if resume:
                pull_records(cfg.run_location, cfg.run_dir)
            else:
                reset_local_copy(cfg.run_dir)
        # processes on process 0's host share its local copy: none writes there while it is emptied
        processes.barrier("areal-local-copy-ready")
    return mirroring(cfg) if processes.primary else mirroring(cfg, only=frozenset({PROFILE_DIR}))


def _check_several_processes(cfg: ExperimentConfig, processes: TrainerProcesses) -> None:
    """Refuse what several trainer processes cannot do: train the warm start (each would train its own)."""
    if processes.count == 1 or cfg.hf_checkpoint is not None or not cfg.warm_start.steps:
        return
    from areal_jax.jobs.sft import cached_warm_start  # the sft job assembles itself from the system layer

    if cached_warm_start(cfg) is None:
        raise ConfigError(
            "warm_start.steps",
            f"is {cfg.warm_start.steps} and the run has no warm start yet; a trainer over {processes.count} "
            "processes does not train one: run `areal-jax sft` with the same config first",
        )


class InProcessRollouts:
    """The rollout side inside the trainer's program (server 0 of 1) on the inference mesh."""

    def __init__(self, cfg: ExperimentConfig, run: TrainingRun, inference_mesh: Mesh):
        self.cfg, self.run, self.inference_mesh = cfg, run, inference_mesh
        self.done = threading.Event()
        self.side: RolloutSide | None = None

    @contextlib.contextmanager
    def serving(self, trainer: Trainer, stops: StopControl) -> Iterator[InProcessPublisher]:
        cfg, run = self.cfg, self.run
        engine = Engine(run.model, cfg.rollout.engine, self.inference_mesh)
        resources.record_mesh(cfg.run_location, "rollout-0", self.inference_mesh)
        with open_rollout_side(
            cfg,
            engine,
            trainer.policy_state(),  # the whole policy once; LoRA versions: adapters alone
            trainer.version,
            run.workflow,
            run.stream,
            run.heldout,
        ) as side:
            self.side = side
            self.done = side.exhausted
            yield InProcessPublisher(side.apply)

    def stop(self) -> None:
        if self.side is not None:
            self.side.controller.stop()

    def failure(self) -> BaseException | None:
        return None if self.side is None else self.side.failure

    def stats(self) -> dict[str, float]:
        return {} if self.side is None else self.side.stats()

    def next_group_id(self) -> int:
        return 0 if self.side is None else self.side.next_group_id

    def generation_tokens(self) -> int:
        return 0 if self.side is None else self.side.generator.stats.emitted_tokens

    def interruptions(self) -> int:
        return 0 if self.side is None else self.side.generator.stats.interruptions

    def evaluations(self) -> Path:
        return self.cfg.layout.eval_dir

    def finish_evaluations(self, version: int) -> None:
        if self.side is not None:
            self.side.finish_evaluations()
