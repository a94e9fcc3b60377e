"""Asynchronous RL in one JAX program: the rollout side and the trainer side at once, assembled from config.

Construction (`areal_jax.system.assembly`): tokenizer, meshes (devices split inference_share:trainer_share;
on one device both share it), policy (an HF checkpoint or a random init), reward, workflow, prompts. The
rollout side (`RolloutController` -> workflow -> `Generator`) runs in background threads and appends every
finished group to the durable rollout log. The trainer side reads the log through the Grain pipeline, runs
PPO steps, and publishes each new version in-process: a device-to-device copy onto the inference shardings,
`Generator.update_params` (interrupting in-flight generation or draining first, by config) and
`StalenessManager.set_version`, which admits more rollouts. With eta = 0 the same wiring is synchronous RL.

Prompts. Group g is always given prompt g of the shuffled, repeated training stream (`TaskStream`), so a
run's prompt order is fixed by its seed. A checkpoint records the pipeline's log position, the next group
id and the groups admitted but not yet consumed by the trainer. `resume=True` moves the log's unread
shards aside (they came from the lost part of the run), re-issues those groups first with the same ids and
prompts, then continues: every prompt is trained once, in the uninterrupted run's order of group ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax import storage
from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError, to_dict
from areal_jax.data.datasets import PromptRecord
from areal_jax.data.pipeline import build_pipeline, open_group_ids, pipeline_stats, set_aside_unread, staleness_of
from areal_jax.data.rollout_log import GroupLogSink, RolloutLogWriter, new_writer_id
from areal_jax.data.tasks import TaskStream
from areal_jax.data.trajectory import Trajectory
from areal_jax.evaluation import evaluate
from areal_jax.inference.engine import Engine
from areal_jax.inference.generator import Generator
from areal_jax.models.decoder import Decoder
from areal_jax.models.init import abstract_like
from areal_jax.multiprocess import TrainerProcesses
from areal_jax.planning.memory import check_memory
from areal_jax.profiling import ProfileWindow
from areal_jax.progress import heartbeat
from areal_jax.rollout.controller import RolloutController
from areal_jax.rollout.rewards import Reward
from areal_jax.rollout.staleness import StalenessManager
from areal_jax.rollout.workflow import RolloutWorkflow
from areal_jax.run_layout import PROFILE_DIR
from areal_jax.system import resources
from areal_jax.system.assembly import (
    build_meshes,
    build_prompts,
    build_tokenizer,
    build_workflow,
    export_policy,
    policy_config,
)
from areal_jax.system.reporting import BATCH_WAIT, QUEUE, RunReporter
from areal_jax.system.run_dir import check_run_dir, start_run_dir
from areal_jax.system.run_mirror import mirroring, pull_records, reset_local_copy
from areal_jax.system.starting_policy import load_policy
from areal_jax.system.trainer_processes import SharedBatches
from areal_jax.trainer.checkpoint import CheckpointError, TrainCheckpointer, nonfinite_leaves
from areal_jax.trainer.trainer import Trainer
from areal_jax.weights.base import abstract_target
from areal_jax.weights.in_process import InProcessPublisher, unaliased_for

logger = logging.getLogger(__name__)


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


def _reward_stats(trajectories: list[Trajectory], version: int) -> dict[str, float]:
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


@dataclasses.dataclass
class GroupLedger:
    """Which group ids the trainer has consumed, and which admitted ones it has not (owned by the trainer
    loop). A checkpoint stores `outstanding`: the groups a resumed run must issue again."""

    consumed: set[int] = dataclasses.field(default_factory=set)
    consumed_count: int = 0  # over the whole run, resumes included
    reissued: tuple[int, ...] = ()
    first_new_id: int = 0

    def consume(self, trajectories: Iterable[Trajectory]) -> None:
        groups = {t.group_id for t in trajectories}
        self.consumed.update(groups)
        self.consumed_count += len(groups)

    def outstanding(self, next_group_id: int, still_in_pipeline: set[int]) -> list[int]:
        """Admitted ids (the re-issued ones, then first_new_id..next_group_id) neither consumed nor held
        as an incomplete group by the pipeline."""
        admitted = [*self.reissued, *range(self.first_new_id, next_group_id)]
        return [g for g in admitted if g not in self.consumed and g not in still_in_pipeline]


def _truncate_jsonl(path: Path, version: int, key: str) -> None:
    """Keep the lines of steps up to `version` (a resumed run writes the later ones again)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get(key, 0) <= version]
    path.write_text("".join(line + "\n" for line in kept))


def run_async(
    cfg: ExperimentConfig,
    resume: bool = False,
    stop_event: threading.Event | None = None,
    overwrite: bool = False,
) -> RunSummary:
    """Train up to `cfg.train_steps` steps of asynchronous RL on the configured prompts and reward. A new
    run needs a run directory without an earlier run (or `overwrite`); `resume` continues the newest
    checkpoint. Ends early when a finite dataset (`dataset.epochs`) has been used up."""
    inference_mesh, trainer_mesh = build_meshes(cfg)

    def rollouts(training: _TrainingRun) -> RolloutSide:
        return InProcessRollouts(
            cfg, training.model, training.workflow, training.stream, inference_mesh, training.ledger, training.metadata
        )

    return train(
        cfg,
        trainer_mesh,
        rollouts,
        resume=resume,
        overwrite=overwrite,
        stop_event=stop_event,
        inference_mesh=inference_mesh,
    )


def train(
    cfg: ExperimentConfig,
    trainer_mesh: Mesh,
    rollouts: Callable[[_TrainingRun], RolloutSide],
    *,
    resume: bool = False,
    overwrite: bool = False,
    stop_event: threading.Event | None = None,
    inference_mesh: Mesh | None = None,
) -> RunSummary:
    """The trainer side of a run on `trainer_mesh`, fed by the rollout side `rollouts` builds (in this
    process, or rollout server processes): run directory, policy, prompts, trainer, checkpoints, loop.

    With several trainer processes (`jax.distributed`, `trainer_mesh` over all their devices) every process
    calls this; process 0 starts the run directory, reads the log and decides (`trainer_processes`)."""
    started = time.perf_counter()
    processes = TrainerProcesses()
    checkpoints = cfg.layout.checkpoints
    latest = TrainCheckpointer.latest_in(checkpoints) if resume else None
    plan = check_run_dir(cfg, resume, overwrite, latest)  # every process: the same refusals
    processes.barrier("areal-run-dir-checked")  # before process 0 changes what the others check
    processes.on_primary(lambda: start_run_dir(cfg, plan))
    with _records_mirror(cfg, resume, processes) as mirror:
        before_save = mirror.sync if mirror is not None else None  # records up to a checkpoint before it
        return _train(
            cfg,
            trainer_mesh,
            inference_mesh,
            rollouts,
            checkpoints,
            before_save,
            processes,
            resume,
            stop_event,
            started,
        )


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


def _train(
    cfg: ExperimentConfig,
    trainer_mesh: Mesh,
    inference_mesh: Mesh | None,
    rollouts: Callable[[_TrainingRun], RolloutSide],
    checkpoints: str,
    before_save: Callable[[], None] | None,
    processes: TrainerProcesses,
    resume: bool,
    stop_event: threading.Event | None,
    started: float,
) -> RunSummary:
    _check_several_processes(cfg, processes)
    tokenizer = build_tokenizer(cfg)
    check_memory(cfg, policy_config(cfg, tokenizer), trainer_mesh, inference_mesh)  # before anything is loaded
    model = load_policy(cfg, trainer_mesh, tokenizer)
    with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
        train_prompts, heldout = build_prompts(cfg, workflow)
        stream = TaskStream(train_prompts, cfg.seed, cfg.dataset.shuffle, cfg.dataset.epochs)
        kl = cfg.trainer.ppo.kl_coef > 0 or cfg.trainer.advantage.kl_reward_coef > 0
        trainer = Trainer(
            model,
            cfg.trainer,
            trainer_mesh,
            temperature=cfg.rollout.workflow.sampling.temperature,
            reference_params=nnx.state(model) if kl else None,  # the starting policy (also on --resume)
        )
        model = abstract_like(model)  # the trainer holds its own copy: the loaded arrays are freed
        checkpointer = TrainCheckpointer(checkpoints, cfg.train_checkpoint, before_save=before_save)
        checkpointer.install_signal_handlers()
        try:
            training = _TrainingRun(cfg, model, trainer, checkpointer, stream, heldout, workflow, stop_event, processes)
            if resume:
                training.restore()
            return training.run(rollouts(training), started)
        finally:
            checkpointer.close()


def _check_several_processes(cfg: ExperimentConfig, processes: TrainerProcesses) -> None:
    """Refuse what several trainer processes cannot do: train the warm start (each would train its own)."""
    if processes.count == 1 or cfg.hf_checkpoint is not None or not cfg.warm_start.steps:
        return
    from areal_jax.sft import cached_warm_start  # it assembles itself from this package

    if cached_warm_start(cfg) is None:
        raise ConfigError(
            "warm_start.steps",
            f"is {cfg.warm_start.steps} and the run has no warm start yet; a trainer over {processes.count} "
            "processes does not train one: run `areal-jax sft` with the same config first",
        )


class RunFailed(RuntimeError):
    """The run cannot go on (rollouts keep failing, every update is skipped); the message says why."""


class _StopWhen:
    """An `is_set()` that is true once any of its events is, for the pipeline's stop check: a signal
    (the checkpointer's flag), a failed rollout side, or the caller's stop event."""

    def __init__(self, *checks: Callable[[], bool]):
        self.checks = checks

    def is_set(self) -> bool:
        return any(check() for check in self.checks)


class RolloutSide(Protocol):
    """What the trainer loop needs from the rollout side, in this process or in rollout server processes."""

    done: Any  # `is_set()` once every rollout has been written (a finite dataset ran out)

    def serving(self, trainer: Trainer, on_failure: Callable[[], None]) -> contextlib.AbstractContextManager[Any]:
        """Rollouts run (and `trainer.publish` reaches them) inside this context."""
        ...

    def stop(self) -> None: ...
    def failed(self) -> bool: ...
    def failure(self) -> BaseException | None: ...
    def step_stats(self) -> dict[str, float]: ...
    def next_group_id(self) -> int: ...
    def rejected(self) -> int: ...
    def generation_tokens(self) -> int: ...
    def interruptions(self) -> int: ...
    def local_generator(self) -> Generator | None: ...


class InProcessRollouts:
    """The rollout side inside the trainer's program: engine and generator on the inference mesh, the
    controller's threads, the in-process weight publisher."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        model: Decoder,
        workflow: RolloutWorkflow,
        stream: TaskStream,
        inference_mesh: Any,
        ledger: GroupLedger,
        metadata: dict[str, Any],
    ):
        self.cfg, self.model, self.workflow, self.stream = cfg, model, workflow, stream
        self.inference_mesh, self.ledger, self.metadata = inference_mesh, ledger, metadata
        self.done = threading.Event()
        self.controller: RolloutController | None = None
        self.generator: Generator | None = None

    @contextlib.contextmanager
    def serving(self, trainer: Trainer, on_failure: Callable[[], None]) -> Iterator[None]:
        cfg = self.cfg
        engine = Engine(self.model, cfg.rollout.engine, self.inference_mesh)
        params = engine.load_params(unaliased_for(engine, trainer.params), trainer.version)
        engine.warmup(params)
        resources.record_mesh(cfg.run_location, "rollout-0", self.inference_mesh)
        self.staleness = StalenessManager(cfg.rollout.staleness, version=trainer.version)
        if self.metadata:
            self.staleness.restore(self.ledger.consumed_count, int(self.metadata["rejected"]), trainer.version)
        writer = RolloutLogWriter(
            cfg.layout.rollout_log, writer_id=new_writer_id(jax.process_index()), config=cfg.rollout.log
        )
        self.sink = GroupLogSink(writer)
        generator = Generator(engine, params, detokenize=self.workflow.tokenizer.decode, seed=cfg.seed)
        del params  # the generator owns the weights: a local here would pin version 0 for the whole run
        try:
            with generator:
                trainer.publish = InProcessPublisher(generator, self.staleness, cfg.rollout.interrupt)
                self.generator = generator
                self.controller = RolloutController(
                    generator,
                    self.workflow,
                    self.stream.groups(self.ledger.first_new_id, self.ledger.reissued),
                    self.staleness,
                    self.sink,
                    failures=cfg.rollout.failures,
                    on_failure=on_failure,
                ).start()
                controller = self.controller
                threading.Thread(
                    target=lambda: (controller.exhausted.wait(), self.done.set()), daemon=True, name="areal-exhausted"
                ).start()
                yield
        finally:
            self.sink.close()

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()

    def failure(self) -> BaseException | None:
        return None if self.controller is None else self.controller.failure

    def failed(self) -> bool:
        return self.failure() is not None

    def step_stats(self) -> dict[str, float]:
        assert self.generator is not None and self.controller is not None
        stats = {f"generator/{k}": float(v) for k, v in dataclasses.asdict(self.generator.stats).items()}
        stats[QUEUE] = float(self.generator.num_in_flight())  # requests submitted and not yet answered
        stats["rollout/failed_total"] = float(self.controller.stats.failed)
        return stats

    def next_group_id(self) -> int:
        return 0 if self.controller is None else self.controller.next_group_id

    def rejected(self) -> int:
        return self.staleness.snapshot().rejected

    def generation_tokens(self) -> int:
        return 0 if self.generator is None else self.generator.stats.emitted_tokens

    def interruptions(self) -> int:
        return 0 if self.generator is None else self.generator.stats.interruptions

    def local_generator(self) -> Generator | None:
        return self.generator


class _TrainingRun:
    """The trainer loop of `run_async` and the pieces it drives (one object so the loop stays short)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        model: Decoder,
        trainer: Trainer,
        checkpointer: TrainCheckpointer,
        stream: TaskStream,
        heldout: list[PromptRecord],
        workflow: RolloutWorkflow,
        stop_event: threading.Event | None,
        processes: TrainerProcesses,
    ):
        self.cfg = cfg
        self.processes = processes
        self.model = model
        self.trainer = trainer
        self.checkpointer = checkpointer
        self.stream = stream
        self.heldout = heldout
        self.workflow = workflow
        self.run_dir = cfg.run_dir
        self.log_dir = cfg.layout.rollout_log
        self.metrics_path = cfg.layout.metrics
        self.groups_path = cfg.layout.trained_groups
        self.metadata: dict[str, Any] = {}
        self.ledger = GroupLedger()
        self.pipeline_stop = stop_event or threading.Event()
        self.peer_stop = threading.Event()  # another trainer process has a stop request (several processes)
        self.batches: Any = None  # process 0's pipeline iterator
        self.shared: SharedBatches | None = None  # the batches of several processes
        self.reporter: RunReporter | None = None  # process 0's
        self.skipped_in_a_row = 0
        self.truncation_warned_at: int | None = None
        self.before: dict[str, float] = {}  # the held-out evaluation of the starting policy (a new run)

    def restore(self) -> None:
        """Continue the newest checkpoint: arrays, version, prompt ledger; the log's unread rest set aside."""
        trainer = self.trainer
        restored = self.checkpointer.restore(
            abstract_target({"params": trainer.params, "opt_state": trainer.opt_state})
        )
        trainer.params, trainer.opt_state = restored.state["params"], restored.state["opt_state"]
        self.metadata = metadata = restored.metadata
        trainer.version = int(metadata["version"])
        self.ledger.first_new_id = int(metadata["next_group_id"])
        self.ledger.consumed_count = int(metadata["consumed_groups"])
        self.processes.on_primary(lambda: self._continue_log(restored.step))
        for step, reason in restored.rejected:
            logger.warning("checkpoint %d was not used: %s", step, reason)

    def _continue_log(self, step: int) -> None:
        """On a resume, process 0: set the log's unread rest aside (the servers issue those groups again) and
        drop the trained-groups lines after the checkpoint (metrics.jsonl: the reporter's)."""
        metadata, version = self.metadata, self.trainer.version
        unused = storage.join(self.cfg.layout.rollout_log_unused, f"resume-{step}")
        aside = set_aside_unread(self.log_dir, metadata["pipeline"], unused)
        self.ledger.reissued = tuple(g for g in metadata["outstanding"] if g not in aside.unread_group_ids)
        _truncate_jsonl(self.groups_path, version, "version")
        logger.info(
            "resumed from step %d (version %d): %d unread log records set aside, %d groups re-issued",
            step,
            version,
            aside.records,
            len(self.ledger.reissued),
        )

    def run(self, rollouts: RolloutSide, started: float) -> RunSummary:
        self.rollouts = rollouts
        processes = self.processes
        if processes.count > 1:
            take = self._take_batch if processes.primary else None
            self.shared = SharedBatches(processes, take, lambda: self.checkpointer.stop_requested, self.peer_stop)
        profile_dir = self.cfg.layout.profile
        if processes.primary:
            self.batches = self._open_pipeline()
            self.reporter = RunReporter(
                self.cfg.report,
                self.run_dir,
                self.cfg.train_steps,
                start_step=self.trainer.version,
                hparams=to_dict(self.cfg),
            )
        else:
            profile_dir = profile_dir / f"process-{processes.index}"
        profile = ProfileWindow(self.cfg.profile, profile_dir)
        try:
            with rollouts.serving(self.trainer, on_failure=self.pipeline_stop.set):
                resources.record_mesh(self.cfg.run_location, f"trainer-{processes.index}", self.trainer.train_step.mesh)
                try:
                    if self.cfg.eval.every_steps and self.heldout and not self.metadata:
                        self.before = self._evaluate(0, prefix="eval_before")
                    rewards = self._loop(profile, started)
                finally:
                    profile.close()
                    self.pipeline_stop.set()
                    rollouts.stop()
                    if self.shared is not None:
                        self.shared.close()
                    self.checkpointer.wait()
            return self._finish(rewards, started)
        finally:
            if self.reporter is not None:
                self.reporter.close(self._outputs())  # after a failure (a no-op once closed)

    def _open_pipeline(self) -> Any:
        """The trainer's iterator over the rollout log, at the restored position on a resume."""
        batches = iter(
            build_pipeline(
                self.log_dir,
                self.cfg.pipeline_config().replace(prefetch_batches=0),  # the checkpointed position = what trained
                trainer_version=lambda: self.trainer.version,
                stop_event=_StopWhen(
                    self.pipeline_stop.is_set,
                    lambda: self.checkpointer.stop_requested,
                    self.rollouts.failed,
                    self.peer_stop.is_set,
                ),
                writers_done=self.rollouts.done,
            )
        )
        if self.metadata:
            batches.set_state(self.metadata["pipeline"])
        return batches

    def _finish(self, rewards: _RewardTrace, started: float) -> RunSummary:
        """After the loop: the failure that stopped it, or the final export (not after a signal), and the summary."""
        cfg, trainer = self.cfg, self.trainer
        failure = self.rollouts.failure()
        if (message := self.processes.share(None if failure is None else str(failure))) is not None:
            raise RunFailed(message) from failure
        signalled = self._stop_agreed()
        final_dir = None
        if signalled:
            logger.warning("stopped by a signal at step %d; continue with --resume", trainer.version)
        else:
            final = nnx.merge(trainer.graphdef, trainer.params)
            if bad := nonfinite_leaves(trainer.params):
                raise RunFailed(f"the policy at step {trainer.version} has non-finite {bad[:3]}; nothing exported")
            final_dir = str(export_policy(cfg, final, cfg.layout.hf_final))  # every process gathers
        if self.reporter is not None:
            self.reporter.close([*self._outputs(), *([f"final policy (HF): {final_dir}"] if final_dir else [])])
        return RunSummary(
            steps=trainer.version - int(self.metadata.get("version", 0)),
            version=trainer.version,
            trajectories_trained=rewards.trained,
            mean_reward_first=rewards.first,
            mean_reward_last=rewards.last,
            wall_seconds=round(time.perf_counter() - started, 2),
            generation_tokens=self.rollouts.generation_tokens(),
            interruptions=self.rollouts.interruptions(),
            metrics_file=str(self.metrics_path),
            final_hf_checkpoint=final_dir,
            stopped_by_signal=signalled,
        )

    def _loop(self, profile: ProfileWindow, started: float) -> _RewardTrace:
        cfg, trainer = self.cfg, self.trainer
        trace = _RewardTrace()
        primary = self.processes.primary
        first_version = trainer.version
        with self.groups_path.open("a") if primary else contextlib.nullcontext() as trained_groups:
            while trainer.version < cfg.train_steps and not self._stop_agreed():
                waiting = time.perf_counter()
                with self._first_batch_heartbeat(trainer.version == first_version):
                    batch = self._take_batch() if self.shared is None else self.shared.next(trainer.version + 1)
                if batch is None:
                    break
                waited = time.perf_counter() - waiting
                self.ledger.consume(batch)
                version_before = trainer.version
                profile.before_step(version_before + 1)
                stats = trainer.step(batch)
                profile.after_step(trainer.version)
                stats.update(_reward_stats(batch, version_before))
                stats[BATCH_WAIT] = waited
                if primary:
                    stats.update(self._step_stats(started))
                    self._monitor_logprobs(stats)
                    self._report(stats, batch, trained_groups)
                trace.add(stats["rollout/reward_mean"], len(batch))
                self._check_updates(stats)
                arrays = {"params": trainer.params, "opt_state": trainer.opt_state}
                try:
                    self.checkpointer.maybe_save(trainer.version, arrays, self._checkpoint_metadata)
                except CheckpointError as err:  # non-finite weights: the newest checkpoint stays the last good one
                    raise RunFailed(str(err)) from err
                if trainer.version >= cfg.train_steps:
                    self._save_now()  # the last step, always
        if self._stop_agreed():
            self._save_now()
        return trace

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

    def _take_batch(self) -> list[Trajectory] | None:
        """Process 0: the next batch to train from the pipeline, or None to stop (the data ran out, or the
        pipeline ended on a stop)."""
        batch = next(self.batches, None)
        if batch is None:
            if not self._stopping():
                logger.info("the prompts are used up (dataset.epochs=%s)", self.cfg.dataset.epochs)
            return None
        groups = len({t.group_id for t in batch})
        if groups < self.cfg.rollout.staleness.batch_prompts and self._stopping():
            # the pipeline ended on the stop, not on the data: these groups stay unconsumed, so the
            # checkpoint lists them as outstanding and a resumed run generates and trains them
            logger.info("stopping: %d group(s) of an incomplete batch are left to the resumed run", groups)
            return None
        return batch

    def _report(self, stats: dict[str, float], batch: list[Trajectory], trained_groups: Any) -> None:
        """Process 0: the step's metrics, its trained groups and its warnings."""
        assert self.reporter is not None
        self.reporter.log(self.trainer.version, stats)
        groups = sorted({(t.group_id, t.prompt_id) for t in batch})
        trained_groups.write(json.dumps({"version": self.trainer.version, "groups": groups}) + "\n")
        trained_groups.flush()
        self._log_step(stats)

    def _stop_agreed(self) -> bool:
        """Whether any trainer process has a stop request (a signal): the same answer on every process."""
        return self.processes.any(self.checkpointer.stop_requested)

    def _stopping(self) -> bool:
        return (
            self.checkpointer.stop_requested
            or self.pipeline_stop.is_set()
            or self.peer_stop.is_set()
            or self.rollouts.failed()
        )

    def _save_now(self) -> None:
        due = self.checkpointer.latest_step() != self.trainer.version and not self.rollouts.failed()
        if self.processes.share(due):  # process 0 decides: every process takes part in the save, or none does
            arrays = {"params": self.trainer.params, "opt_state": self.trainer.opt_state}
            self.checkpointer.save(self.trainer.version, arrays, self._checkpoint_metadata(), wait=True)

    def _step_stats(self, started: float) -> dict[str, float]:
        """Process 0: the step's statistics besides the trainer's and the batch's rewards."""
        stats = self.rollouts.step_stats()
        counters = pipeline_stats(self.batches.get_state())
        for key, value in counters.items():
            if isinstance(value, dict):  # samples kept/dropped per staleness
                stats.update({f"pipeline/{key}/{k}": float(v) for k, v in value.items()})
            else:
                stats[f"pipeline/{key}"] = float(value)
        stats["data/epoch"] = self.rollouts.next_group_id() / self.stream.prompts_per_epoch
        version = self.trainer.version
        if _eval_due(self.cfg, version) and self.heldout:
            stats.update(self._evaluate(version))
        stats.update(self.before)  # the starting policy's held-out scores, on the first line of the run
        self.before = {}
        stats["time/wall"] = time.perf_counter() - started
        stats["time/unix"] = time.time()  # the clock of the rollout log's append times and the servers' status files
        stats["time/process_cpu"] = time.process_time()  # CPU seconds of all its threads: its share of its cores
        return stats

    def _evaluate(self, version: int, prefix: str = "eval") -> dict[str, float]:
        """The held-out split on the live generator at its current version, written to eval/step-<version>."""
        prompts = self.heldout[: self.cfg.eval.max_prompts or None]
        generator = self.rollouts.local_generator()
        if generator is None:  # rollout servers in other processes: server 0 evaluates
            return {}
        emitted = generator.stats.emitted_tokens
        status = lambda: f"{generator.stats.emitted_tokens - emitted} tokens generated"  # noqa: E731
        try:
            with heartbeat(f"held-out evaluation at step {version} ({len(prompts)} prompts)", status):
                report = evaluate(generator, self.workflow, prompts, self.cfg.eval, self.cfg.seed)
        except Exception:  # a failing reward also fails the rollouts, whose budget stops the run if it must
            logger.exception("held-out evaluation at step %d failed; training goes on", version)
            return {}
        report.write(self.cfg.layout.eval_dir / f"step-{version}")
        logger.info("held-out pass@1 at step %d: %.3f (%d prompts)", version, report.overall.pass_at_1, len(prompts))
        return report.scalars(prefix)

    def _outputs(self) -> list[str]:
        """The run's outputs besides the reporter's, for its closing summary."""
        location = self.cfg.run_location
        lines = [f"checkpoints: {storage.join(location, 'checkpoints')}", f"trained prompts: {self.groups_path}"]
        if self.cfg.layout.eval_dir.is_dir():
            lines.append(f"held-out evaluations: {self.run_dir / 'eval'}")
        if storage.is_remote(location):
            lines.append(f"records: {self.run_dir}, uploaded to {location}")
        return lines

    def _log_step(self, stats: dict[str, float]) -> None:
        """The warnings of a step (the reporter logs its line)."""
        truncated = stats["rollout/truncated_share"]
        if truncated > 0.5 and (
            self.truncation_warned_at is None or self.trainer.version - self.truncation_warned_at >= 50
        ):
            self.truncation_warned_at = self.trainer.version
            logger.warning(
                "%.0f%% of this step's samples hit a length limit (rollout.workflow.sampling.max_new_tokens=%d, "
                "rollout.engine.max_length=%d); they are handled by rollout.workflow.truncation=%r",
                100 * truncated,
                self.cfg.rollout.workflow.sampling.max_new_tokens,
                self.cfg.rollout.engine.max_length,
                self.cfg.rollout.workflow.truncation,
            )

    def _monitor_logprobs(self, stats: dict[str, float]) -> None:
        """Sampler vs trainer log-probs on the tokens the trainer's current version sampled (staleness 0):
        the same weights on both sides, so any gap is numerics (dtype, kernels, masking)."""
        if not self.cfg.trainer.ppo.needs_prox_pass:
            return  # no trainer log-prob pass: the proximal log-probs are the sampler's own, nothing to compare
        tokens = stats.get("staleness/0/n_tokens", 0.0)
        if not tokens:
            return  # every token came from an older version (eta > 0 at steady state)
        gap, kl = stats["staleness/0/logp_abs_diff"], stats["staleness/0/approx_kl"]
        stats.update({"monitor/onpolicy_tokens": tokens, "monitor/logp_abs_diff": gap, "monitor/kl": kl})
        limit = self.cfg.trainer.logprob_mismatch_warning
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

    def _check_updates(self, stats: dict[str, float]) -> None:
        """Stop a run whose every update is skipped (non-finite loss or gradient) step after step."""
        if stats["train/skipped_updates"] < self.cfg.trainer.ppo_minibatches:
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        limit = self.cfg.trainer.max_skipped_steps
        if self.skipped_in_a_row >= limit:
            raise RunFailed(
                f"every update of the last {limit} steps was skipped (non-finite loss or gradient; "
                f"trainer.max_skipped_steps={limit}); the newest checkpoint holds the last finite policy"
            )

    def _checkpoint_metadata(self) -> dict[str, Any]:
        """What a resume needs besides the arrays: the version, the pipeline position, the groups consumed
        (the staleness bound counts them as accepted), the next group id and the outstanding groups.
        Process 0's, on every process."""
        return self.processes.share(self._own_checkpoint_metadata() if self.processes.primary else None)

    def _own_checkpoint_metadata(self) -> dict[str, Any]:
        state = self.batches.get_state()
        next_group_id = self.rollouts.next_group_id()
        return {
            "version": self.trainer.version,
            "pipeline": state,
            "consumed_groups": self.ledger.consumed_count,
            "rejected": self.rollouts.rejected(),
            "next_group_id": max(next_group_id, self.ledger.first_new_id),
            "outstanding": self.ledger.outstanding(next_group_id, open_group_ids(state)),
        }


@dataclasses.dataclass
class _RewardTrace:
    first: float = float("nan")
    last: float = float("nan")
    trained: int = 0

    def add(self, reward: float, trajectories: int) -> None:
        if np.isnan(self.first):
            self.first = reward
        self.last = reward
        self.trained += trajectories


def _eval_due(cfg: ExperimentConfig, version: int) -> bool:
    """Held-out evaluation every `eval.every_steps` steps and after the last one."""
    every = cfg.eval.every_steps
    return bool(every) and (version % every == 0 or version >= cfg.train_steps)


def load_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
