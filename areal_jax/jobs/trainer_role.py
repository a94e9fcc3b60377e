"""`areal-jax trainer`: the trainer of a run whose rollout servers are other processes (`areal-jax rollout`).

The trainer owns the run directory: it creates it (or resumes it), publishes every version into
`<run>/weights` through Orbax (saved asynchronously; a version becomes visible by one rename once written,
so a server never reads a half-written one), reads `<run>/rollout_log` through the same Grain pipeline as
the one-process run, and checkpoints the same way. The servers' status files give its rollout metrics;
a server's failure marker stops it (`RunFailed`); at the end it writes the stop marker the servers wait for.

On `--resume` the weight versions newer than the restored step (made by the lost part of the run) are
deleted before the restored version is published again, so a server never serves weights the trainer does
not have; the log's unread shards are set aside as in the one-process run, and the servers issue those
groups again when they start (`cluster.resume_point`).

Several trainer processes (`distributed.enabled`): one global mesh over all their devices; process 0 reads
the log and decides each batch and when to stop (`trainer_processes`), and alone writes the control files
and the run's reports; every process takes part in publishing each weight version and in each checkpoint
(Orbax's saves are collective).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import orbax.checkpoint as ocp

from areal_jax import storage
from areal_jax.config import ExperimentConfig
from areal_jax.inference.requests import GeneratorStats
from areal_jax.jobs.train import RunSummary, train
from areal_jax.multiprocess import TrainerProcesses
from areal_jax.reporting.metric_keys import QUEUE
from areal_jax.run_layout import EVAL_DIR
from areal_jax.sharding import make_mesh
from areal_jax.system.cluster import ControlFiles, initialize_distributed, sum_statuses, weight_path_stats
from areal_jax.system.eval_results import is_evaluated
from areal_jax.system.heldout_evaluator import eval_due
from areal_jax.system.stop_control import StopControl
from areal_jax.system.weight_paths import open_publisher
from areal_jax.trainer.trainer import Trainer
from areal_jax.weights.base import WeightPublisher, checkpoint_location

logger = logging.getLogger(__name__)

_GENERATOR_COUNTERS = tuple(field.name for field in dataclasses.fields(GeneratorStats))


class RemoteFailure(RuntimeError):
    """A rollout server spent its failure budget (its marker file's message)."""


class RemoteRollouts:
    """The rollout side as rollout server processes, seen through the run directory."""

    def __init__(self, cfg: ExperimentConfig, processes: TrainerProcesses):
        self.cfg = cfg
        self.processes = processes  # process 0 alone writes the control files
        self.control = ControlFiles(cfg.run_location, cfg.cluster.rollout_servers)
        self.done = _AllDone(self.control)

    @contextlib.contextmanager
    def serving(self, trainer: Trainer, stops: StopControl) -> Iterator[WeightPublisher]:
        """Versions newer than the trainer's removed (a resumed trainer's lost future), its version published
        (the servers start from it), the ready marker written; then each version goes through the path."""
        primary = self.processes.primary
        if primary:
            self.control.clear()
            self.control.reset_floors(trainer.version)
        _drop_versions_after(self.cfg.layout.weights, trainer.version)  # Orbax: every process takes part
        self.processes.barrier("areal-weights-trimmed")
        publisher = open_publisher(self.cfg)
        try:
            if publisher.latest_version() != trainer.version:
                publisher.publish(trainer.params, trainer.version)
            publisher.wait()  # the servers start from this version
            if primary:
                self.control.trainer_ready(trainer.version)
            yield publisher
        finally:
            publisher.close()

    def stop(self) -> None:
        if self.processes.primary:
            self.control.request_stop("the trainer stopped")

    def failure(self) -> BaseException | None:
        messages = self.control.failures()
        return RemoteFailure("; ".join(messages)) if messages else None

    def failed(self) -> bool:
        return bool(self.control.failures())

    def stats(self) -> dict[str, float]:
        statuses = self.control.statuses()
        stats = {f"generator/{k}": v for k, v in sum_statuses(statuses, _GENERATOR_COUNTERS).items()}
        stats["rollout/failed_total"] = sum_statuses(statuses, ("failed",))["failed"]
        stats[QUEUE] = sum_statuses(statuses, ("queue",))["queue"]
        stats["rollout/servers_reporting"] = float(len(statuses))
        stats.update(weight_path_stats(statuses))
        return stats

    def next_group_id(self) -> int:
        statuses = self.control.statuses()
        return max((int(s.get("next_group_id", 0)) for s in statuses), default=0)

    def generation_tokens(self) -> int:
        return int(sum_statuses(self.control.statuses(), ("emitted_tokens",))["emitted_tokens"])

    def interruptions(self) -> int:
        return int(sum_statuses(self.control.statuses(), ("interruptions",))["interruptions"])

    def evaluations(self) -> str:
        return storage.join(self.cfg.run_location, EVAL_DIR)  # server 0's, uploaded there on a gs:// run

    def finish_evaluations(self, version: int) -> None:
        """Waits for server 0's evaluation of the last version when it is due: at most
        `cluster.start_timeout_s`, less when server 0 fails or ends first."""
        if not (eval_due(self.cfg, version) and self.cfg.dataset.heldout):
            return
        deadline = time.monotonic() + self.cfg.cluster.start_timeout_s
        while True:
            ended = storage.exists(self.control.done_path(0))  # it wrote its evaluations before it ended
            if is_evaluated(self.evaluations(), version):
                return
            if ended or self.failed() or time.monotonic() > deadline:
                logger.warning("the held-out evaluation of version %d did not arrive; it is not recorded", version)
                return
            time.sleep(self.cfg.cluster.weights_poll_s)


class _AllDone:
    """`is_set()` once every server has written its done marker (its prompts ran out)."""

    def __init__(self, control: ControlFiles):
        self.control = control

    def is_set(self) -> bool:
        return self.control.all_done()


def _drop_versions_after(store: Any, version: int) -> None:
    """Delete weight versions newer than `version` (a resumed trainer's lost future)."""
    if not storage.is_dir(store):
        return
    options = ocp.CheckpointManagerOptions(create=False)
    with ocp.CheckpointManager(checkpoint_location(store), options=options) as manager:
        for step in manager.all_steps():
            if step > version:
                logger.warning("deleting weight version %d: newer than the restored step %d", step, version)
                manager.delete(step)


def run_trainer(cfg: ExperimentConfig, resume: bool = False, overwrite: bool = False) -> RunSummary:
    """Train `cfg.train_steps` steps on what the rollout servers write (see the module docstring)."""
    initialize_distributed(cfg.distributed)
    if TrainerProcesses().primary:
        ControlFiles(cfg.run_location, cfg.cluster.rollout_servers).trainer_starting()
    mesh = make_mesh(cfg.mesh)  # every device of every trainer process
    return train(
        cfg,
        mesh,
        lambda training: RemoteRollouts(cfg, training.processes),
        resume=resume,
        overwrite=overwrite,
    )
