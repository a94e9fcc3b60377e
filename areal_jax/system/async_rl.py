"""Asynchronous RL in one JAX program: the rollout side and the trainer side at once.

Devices are split into an inference mesh and a trainer mesh (inference_share:trainer_share; on one
device both share it). The rollout side (`RolloutController` -> workflows -> `Generator`) runs in
background threads and appends every finished group to the durable rollout log. The trainer side reads
the log through the Grain pipeline, runs PPO steps, and publishes each new version in-process: a
device-to-device copy onto the inference shardings, `Generator.update_params` (interrupting in-flight
generation or draining first, by config) and `StalenessManager.set_version`, which admits more rollouts.
With eta = 0 the same wiring is synchronous RL (the baseline). Training checkpoints (every N steps and on
SIGTERM/SIGINT) hold params, optimizer state, version, the pipeline position and the rollout counters;
`resume=True` continues from the newest one.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError, to_yaml
from areal_jax.data.datasets import PromptRecord
from areal_jax.data.pipeline import PipelineConfig, build_pipeline, pipeline_stats
from areal_jax.data.rollout_log import RolloutLogWriter
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.engine import Engine
from areal_jax.inference.generator import Generator
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.init import create_decoder
from areal_jax.models.tokenizer import load_tokenizer
from areal_jax.profiling import ProfileWindow
from areal_jax.rewards.synthetic import make_problems
from areal_jax.rollout.controller import RolloutController
from areal_jax.rollout.environments import ArithmeticRewardFn, arithmetic_prompt_record
from areal_jax.rollout.staleness import StalenessManager
from areal_jax.rollout.workflow import RLVRWorkflow
from areal_jax.sharding import copy_to, make_mesh, split_devices, state_shardings
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


def arithmetic_tasks(cfg: ExperimentConfig, first_group_id: int) -> Iterator[PromptRecord]:
    """An endless, reproducible stream of arithmetic prompts; group g always gets the same problem."""
    pool = [arithmetic_prompt_record(p) for p in make_problems(cfg.rollout.task, 4096, cfg.seed)]
    for group_id in itertools.count(first_group_id):
        yield pool[group_id % len(pool)]


def _meshes(cfg: ExperimentConfig) -> tuple[Mesh, Mesh]:
    inference, trainer = split_devices(jax.devices(), cfg.rollout.inference_share, cfg.rollout.trainer_share)
    # each side takes the configured mesh shape, with its -1 axis absorbing that side's devices
    return make_mesh(cfg.mesh, inference), make_mesh(cfg.mesh, trainer)


def _initial_model(cfg: ExperimentConfig, trainer_mesh: Mesh) -> Decoder:
    if cfg.hf_checkpoint is None:
        return create_decoder(cfg.model, cfg.seed, trainer_mesh)
    _, model = load_hf_checkpoint(
        cfg.hf_checkpoint,
        mesh=trainer_mesh,
        compute_dtype=cfg.model.compute_dtype,
        remat=cfg.model.remat,
        logprob_chunk=cfg.model.logprob_chunk,
    )
    return model


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


def run_async(
    cfg: ExperimentConfig,
    resume: bool = False,
    stop_event: threading.Event | None = None,
    overwrite: bool = False,
) -> RunSummary:
    """Train `cfg.train_steps` steps of asynchronous RL on the embedded arithmetic task. A new run needs
    a run directory without an earlier run (or `overwrite`); `resume` continues the newest checkpoint."""
    started = time.perf_counter()
    run_dir = cfg.run_dir
    latest = TrainCheckpointer.latest_in(run_dir / "checkpoints") if resume else None
    prepare_run_dir(run_dir, resume, overwrite, latest)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.hf_checkpoint is None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size", f"value {cfg.model.vocab_size} is below the tokenizer's {tokenizer.vocab_size}"
        )
    inference_mesh, trainer_mesh = _meshes(cfg)
    model = _initial_model(cfg, trainer_mesh)
    trainer = Trainer(model, cfg.trainer, trainer_mesh)
    checkpointer = TrainCheckpointer(run_dir / "checkpoints", cfg.train_checkpoint)
    checkpointer.install_signal_handlers()
    metadata: dict[str, Any] = {}
    if resume and checkpointer.latest_step() is not None:
        restored = checkpointer.restore(abstract_target({"params": trainer.params, "opt_state": trainer.opt_state}))
        trainer.params, trainer.opt_state = restored.state["params"], restored.state["opt_state"]
        metadata = restored.metadata
        trainer.version = int(metadata["version"])
        logger.info("resumed from step %d (version %d)", restored.step, trainer.version)

    engine = Engine(model, cfg.rollout.engine, inference_mesh)
    inference_params = copy_to(trainer.params, state_shardings(trainer.params, inference_mesh))
    params = engine.load_params(inference_params, trainer.version)
    engine.warmup(params)
    staleness = StalenessManager(cfg.rollout.staleness, version=trainer.version)
    if metadata:
        staleness.restore(int(metadata["accepted"]), int(metadata["rejected"]), trainer.version)
    log_dir = run_dir / "rollout_log"
    writer = RolloutLogWriter(
        log_dir, writer_id=f"rollout{jax.process_index()}-{int(time.time())}", config=cfg.rollout.log
    )
    writer_lock = threading.Lock()

    def sink(trajectories: list[Trajectory]) -> None:
        with writer_lock:
            for trajectory in trajectories:
                writer.append(trajectory)
            writer.flush()  # one shard per group keeps the trainer's latency low at demo scale

    pipeline_cfg = PipelineConfig(
        group_size=cfg.rollout.workflow.n_samples,
        groups_per_batch=cfg.rollout.staleness.batch_prompts,
        max_staleness=cfg.rollout.max_staleness,
        prefetch_batches=0,
    )
    pipeline_stop = stop_event or threading.Event()
    batches = iter(
        build_pipeline(log_dir, pipeline_cfg, trainer_version=lambda: trainer.version, stop_event=pipeline_stop)
    )
    if metadata:
        batches.set_state(metadata["pipeline"])

    metrics_path = run_dir / "metrics.jsonl"
    profile = ProfileWindow(cfg.profile, run_dir / "profile")
    first_reward = last_reward = float("nan")
    trained = 0
    workflow = RLVRWorkflow(cfg.rollout.workflow, tokenizer, ArithmeticRewardFn(cfg.rollout.task.format_bonus))
    with Generator(engine, params, detokenize=tokenizer.decode, seed=cfg.seed) as generator, workflow:
        trainer.publish = InProcessPublisher(generator, staleness, cfg.rollout.interrupt)
        first_group = int(metadata.get("next_group_id", 0))
        controller = RolloutController(
            generator, workflow, arithmetic_tasks(cfg, first_group), staleness, sink, first_group_id=first_group
        ).start()
        try:
            with metrics_path.open("a") as metrics:
                while trainer.version < cfg.train_steps and not checkpointer.stop_requested:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    version_before = trainer.version
                    profile.before_step(version_before + 1)
                    stats = trainer.step(batch)
                    profile.after_step(trainer.version)
                    stats.update(_reward_stats(batch, version_before))
                    stats.update({f"generator/{k}": float(v) for k, v in dataclasses.asdict(generator.stats).items()})
                    counters = pipeline_stats(batches.get_state())
                    stats.update({f"pipeline/{k}": float(v) for k, v in counters.items() if isinstance(v, int)})
                    stats["time/wall"] = time.perf_counter() - started
                    metrics.write(json.dumps(stats) + "\n")
                    metrics.flush()
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
                    snapshot = staleness.snapshot()
                    checkpointer.maybe_save(
                        trainer.version,
                        {"params": trainer.params, "opt_state": trainer.opt_state},
                        lambda snapshot=snapshot: {
                            "version": trainer.version,
                            "pipeline": batches.get_state(),
                            "accepted": snapshot.accepted,
                            "rejected": snapshot.rejected,
                            "next_group_id": controller.next_group_id,
                        },
                    )
        finally:
            profile.close()
            pipeline_stop.set()
            controller.stop()
            checkpointer.wait()
            with writer_lock:
                writer.close()
        generation_tokens, interruptions = generator.stats.emitted_tokens, generator.stats.interruptions
    checkpointer.close()
    final_dir = save_hf_checkpoint(model.config, nnx.merge(trainer.graphdef, trainer.params), run_dir / "hf_final")
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


def load_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
