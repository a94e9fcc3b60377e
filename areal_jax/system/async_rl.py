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

import dataclasses
import json
import logging
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from areal_jax.config import ExperimentConfig
from areal_jax.configuration import to_yaml
from areal_jax.data.datasets import PromptRecord
from areal_jax.data.pipeline import build_pipeline, open_group_ids, pipeline_stats, set_aside_unread
from areal_jax.data.rollout_log import RolloutLogWriter
from areal_jax.data.tasks import TaskStream
from areal_jax.data.trajectory import Trajectory
from areal_jax.evaluation import evaluate
from areal_jax.inference.engine import Engine
from areal_jax.inference.generator import Generator
from areal_jax.models.decoder import Decoder
from areal_jax.profiling import ProfileWindow
from areal_jax.rollout.controller import RolloutController
from areal_jax.rollout.rewards import Reward
from areal_jax.rollout.staleness import StalenessManager
from areal_jax.rollout.workflow import RolloutWorkflow
from areal_jax.sharding import copy_to, state_shardings
from areal_jax.system.assembly import (
    build_meshes,
    build_prompts,
    build_tokenizer,
    build_workflow,
    export_policy,
    load_policy,
)
from areal_jax.trainer.checkpoint import TrainCheckpointer
from areal_jax.trainer.trainer import Trainer
from areal_jax.weights.base import abstract_target

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
    final_hf_checkpoint: str


class InProcessPublisher:
    """Trainer -> generator weights within one program: copy onto the inference shardings, swap them in,
    and tell the staleness manager the new version."""

    def __init__(self, generator: Generator, staleness: StalenessManager, interrupt: bool):
        self.generator = generator
        self.staleness = staleness
        self.interrupt = interrupt
        self.shardings = generator.engine.param_shardings or jax.tree.map(lambda x: x.sharding, generator.params.state)

    def __call__(self, params: nnx.State, version: int) -> None:
        started = time.perf_counter()
        copied = copy_to(params, self.shardings)
        self.generator.update_params(copied, version, interrupt=self.interrupt).result()
        self.staleness.set_version(version)
        logger.debug("published v%d in %.3f s", version, time.perf_counter() - started)


def _reward_stats(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    rewards = np.array([t.reward for t in trajectories])
    correct = np.array([t.reward_components.get("correct", 0.0) for t in trajectories])
    staleness = np.array([version - t.oldest_version() for t in trajectories])
    lengths = np.array([t.length - t.prompt_length for t in trajectories])
    return {
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


class RunDirectoryError(Exception):
    """The run directory does not fit the request (a new run over an old one, a resume with nothing to
    resume); raised before any work is done."""


def _previous_run(run_dir: Path) -> str | None:
    """What an earlier run left in `run_dir` (None when nothing)."""
    found = [name for name in ("checkpoints", "rollout_log", "metrics.jsonl", "hf_final") if (run_dir / name).exists()]
    return ", ".join(found) or None


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool, latest_checkpoint: int | None) -> None:
    """A new run needs an empty run directory (an old rollout log would feed the new trainer, old
    checkpoints would clash with new ones): refuse, or with `overwrite` delete the old run first.
    A resume needs a checkpoint."""
    if resume and overwrite:
        raise RunDirectoryError("--resume and --overwrite exclude each other")
    previous = _previous_run(run_dir)
    if resume:
        if latest_checkpoint is None:
            raise RunDirectoryError(
                f"nothing to resume: no training checkpoint in {run_dir / 'checkpoints'}"
                + (f" (found: {previous}); start over with --overwrite" if previous else "")
            )
        return
    if previous is None:
        return
    if not overwrite:
        raise RunDirectoryError(
            f"{run_dir} holds an earlier run ({previous}); continue it with --resume, start over with "
            "--overwrite (deletes it), or pick another name=... / output_dir=..."
        )
    logger.warning("--overwrite: deleting the earlier run in %s (%s)", run_dir, previous)
    shutil.rmtree(run_dir)


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
    started = time.perf_counter()
    run_dir = cfg.run_dir
    latest = TrainCheckpointer.latest_in(run_dir / "checkpoints") if resume else None
    prepare_run_dir(run_dir, resume, overwrite, latest)
    tokenizer = build_tokenizer(cfg)
    inference_mesh, trainer_mesh = build_meshes(cfg)
    model = load_policy(cfg, trainer_mesh, tokenizer)
    with Reward(cfg.reward) as reward, build_workflow(cfg.rollout.workflow, tokenizer, reward) as workflow:
        train_prompts, heldout = build_prompts(cfg, workflow)
        stream = TaskStream(train_prompts, cfg.seed, cfg.dataset.shuffle, cfg.dataset.epochs)
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        trainer = Trainer(model, cfg.trainer, trainer_mesh, temperature=cfg.rollout.workflow.sampling.temperature)
        checkpointer = TrainCheckpointer(run_dir / "checkpoints", cfg.train_checkpoint)
        checkpointer.install_signal_handlers()
        try:
            return _train(
                cfg,
                resume,
                stop_event,
                started,
                model,
                trainer,
                checkpointer,
                stream,
                heldout,
                workflow,
                inference_mesh,
            )
        finally:
            checkpointer.close()


def _train(
    cfg: ExperimentConfig,
    resume: bool,
    stop_event: threading.Event | None,
    started: float,
    model: Decoder,
    trainer: Trainer,
    checkpointer: TrainCheckpointer,
    stream: TaskStream,
    heldout: list[PromptRecord],
    workflow: RolloutWorkflow,
    inference_mesh: Any,
) -> RunSummary:
    run_dir = cfg.run_dir
    log_dir = run_dir / "rollout_log"
    metrics_path = run_dir / "metrics.jsonl"
    groups_path = run_dir / "trained_groups.jsonl"  # which prompts each step trained on
    metadata: dict[str, Any] = {}
    ledger = GroupLedger()
    if resume:
        restored = checkpointer.restore(abstract_target({"params": trainer.params, "opt_state": trainer.opt_state}))
        trainer.params, trainer.opt_state = restored.state["params"], restored.state["opt_state"]
        metadata = restored.metadata
        trainer.version = int(metadata["version"])
        aside = set_aside_unread(log_dir, metadata["pipeline"], run_dir / f"rollout_log_unused/resume-{restored.step}")
        ledger.reissued = tuple(g for g in metadata["outstanding"] if g not in aside.unread_group_ids)
        ledger.first_new_id = int(metadata["next_group_id"])
        ledger.consumed_count = int(metadata["consumed_groups"])
        _truncate_jsonl(metrics_path, trainer.version, "train/version")
        _truncate_jsonl(groups_path, trainer.version, "version")
        logger.info(
            "resumed from step %d (version %d): %d unread log records set aside, %d groups re-issued",
            restored.step,
            trainer.version,
            aside.records,
            len(ledger.reissued),
        )

    engine = Engine(model, cfg.rollout.engine, inference_mesh)
    inference_params = copy_to(trainer.params, state_shardings(trainer.params, inference_mesh))
    params = engine.load_params(inference_params, trainer.version)
    engine.warmup(params)
    staleness = StalenessManager(cfg.rollout.staleness, version=trainer.version)
    if metadata:
        staleness.restore(int(metadata["consumed_groups"]), int(metadata["rejected"]), trainer.version)
    writer = RolloutLogWriter(
        log_dir, writer_id=f"rollout{jax.process_index()}-{int(time.time())}", config=cfg.rollout.log
    )
    writer_lock = threading.Lock()

    def sink(trajectories: list[Trajectory]) -> None:
        with writer_lock:
            for trajectory in trajectories:
                writer.append(trajectory)
            writer.flush()  # one shard per group: the trainer sees each group as soon as it is done

    pipeline_stop = stop_event or threading.Event()
    rollouts_done = threading.Event()
    batches = iter(
        build_pipeline(
            log_dir,
            cfg.pipeline_config().replace(prefetch_batches=0),  # the checkpointed position is what was trained
            trainer_version=lambda: trainer.version,
            stop_event=pipeline_stop,
            writers_done=rollouts_done,
        )
    )
    if metadata:
        batches.set_state(metadata["pipeline"])

    profile = ProfileWindow(cfg.profile, run_dir / "profile")
    first_reward = last_reward = float("nan")
    trained = 0
    with Generator(engine, params, detokenize=workflow.tokenizer.decode, seed=cfg.seed) as generator:
        trainer.publish = InProcessPublisher(generator, staleness, cfg.rollout.interrupt)
        controller = RolloutController(
            generator, workflow, stream.groups(ledger.first_new_id, ledger.reissued), staleness, sink
        ).start()
        exhausted_watch = threading.Thread(
            target=lambda: (controller.exhausted.wait(), rollouts_done.set()), daemon=True, name="areal-exhausted"
        )
        exhausted_watch.start()

        def metadata_now() -> dict[str, Any]:
            return _checkpoint_metadata(trainer, batches, staleness, controller, ledger)

        try:
            with metrics_path.open("a") as metrics, groups_path.open("a") as trained_groups:
                while trainer.version < cfg.train_steps and not checkpointer.stop_requested:
                    batch = next(batches, None)
                    if batch is None:
                        logger.info("the prompts are used up (dataset.epochs=%s)", cfg.dataset.epochs)
                        break
                    ledger.consume(batch)
                    version_before = trainer.version
                    profile.before_step(version_before + 1)
                    stats = trainer.step(batch)
                    profile.after_step(trainer.version)
                    stats.update(_reward_stats(batch, version_before))
                    stats.update({f"generator/{k}": float(v) for k, v in dataclasses.asdict(generator.stats).items()})
                    counters = pipeline_stats(batches.get_state())
                    stats.update({f"pipeline/{k}": float(v) for k, v in counters.items() if isinstance(v, int)})
                    stats["data/epoch"] = controller.next_group_id / stream.prompts_per_epoch
                    if _eval_due(cfg, trainer.version) and heldout:
                        report = evaluate(
                            generator, workflow, heldout[: cfg.eval.max_prompts or None], cfg.eval, cfg.seed
                        )
                        report.write(run_dir / "eval" / f"step-{trainer.version}")
                        stats.update(report.scalars())
                    stats["time/wall"] = time.perf_counter() - started
                    metrics.write(json.dumps(stats) + "\n")
                    metrics.flush()
                    groups = sorted({(t.group_id, t.prompt_id) for t in batch})
                    trained_groups.write(json.dumps({"version": trainer.version, "groups": groups}) + "\n")
                    trained_groups.flush()
                    trained += len(batch)
                    if np.isnan(first_reward):
                        first_reward = stats["rollout/reward_mean"]
                    last_reward = stats["rollout/reward_mean"]
                    logger.info(
                        "v%d reward %.3f correct %.3f staleness %.2f loss %.4f %.0f tok/s",
                        trainer.version,
                        stats["rollout/reward_mean"],
                        stats["rollout/correct_mean"],
                        stats["rollout/staleness_mean"],
                        stats["train/loss"],
                        stats["train/throughput"],
                    )
                    arrays = {"params": trainer.params, "opt_state": trainer.opt_state}
                    checkpointer.maybe_save(trainer.version, arrays, metadata_now)
                    if trainer.version >= cfg.train_steps and checkpointer.latest_step() != trainer.version:
                        checkpointer.save(trainer.version, arrays, metadata_now())  # the last step, always
        finally:
            profile.close()
            pipeline_stop.set()
            controller.stop()
            checkpointer.wait()
            with writer_lock:
                writer.close()
        generation_tokens, interruptions = generator.stats.emitted_tokens, generator.stats.interruptions
    final_dir = export_policy(cfg, nnx.merge(trainer.graphdef, trainer.params), run_dir / "hf_final")
    return RunSummary(
        steps=trainer.version - int(metadata.get("version", 0)),
        version=trainer.version,
        trajectories_trained=trained,
        mean_reward_first=first_reward,
        mean_reward_last=last_reward,
        wall_seconds=round(time.perf_counter() - started, 2),
        generation_tokens=generation_tokens,
        interruptions=interruptions,
        metrics_file=str(metrics_path),
        final_hf_checkpoint=str(final_dir),
    )


def _eval_due(cfg: ExperimentConfig, version: int) -> bool:
    """Held-out evaluation every `eval.every_steps` steps and after the last one."""
    every = cfg.eval.every_steps
    return bool(every) and (version % every == 0 or version >= cfg.train_steps)


def _checkpoint_metadata(
    trainer: Trainer,
    batches: Any,
    staleness: StalenessManager,
    controller: RolloutController,
    ledger: GroupLedger,
) -> dict[str, Any]:
    """What a resume needs besides the arrays: the version, the pipeline position, the groups consumed
    (the staleness bound counts them as accepted), the next group id and the outstanding groups."""
    state = batches.get_state()
    next_group_id = controller.next_group_id
    return {
        "version": trainer.version,
        "pipeline": state,
        "consumed_groups": ledger.consumed_count,
        "rejected": staleness.snapshot().rejected,
        "next_group_id": max(next_group_id, ledger.first_new_id),
        "outstanding": ledger.outstanding(next_group_id, open_group_ids(state)),
    }


def load_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
