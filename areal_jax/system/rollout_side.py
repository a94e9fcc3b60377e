"""The rollout side: one rollout server's engine, generator, controller threads and rollout-log writer, built
by one function (`open_rollout_side`) for both shapes of a run. The one-process run (`areal-jax train`) is
server 0 of 1 and hands it each version in-process; `areal-jax rollout` is server i of N and hands it the
versions its weight follower loads. Everything else is written here once:

- where it goes on: from the group ids in the rollout log (`cluster.resume_point`): its ids below the
  highest written one that are missing (in flight when a process died, or set aside by a trainer resume)
  are issued again first, then new ids; the staleness count starts from its groups in the log;
- its rollout-log writer id (`new_writer_id(server)`);
- applying a version (`weight_versions.apply_version`: the generator first, then admission);
- the held-out evaluation schedule (server 0): the starting version of a new run, then every version
  that `eval.every_steps` divides, and the last step's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from areal_jax.agents.serving import workflow_serving
from areal_jax.config import ExperimentConfig
from areal_jax.data.datasets import PromptRecord
from areal_jax.data.rollout_log import GroupLogSink, RolloutLogWriter, new_writer_id
from areal_jax.data.rollout_log_reader import logged_groups
from areal_jax.data.tasks import TaskStream
from areal_jax.inference.generator import Generator
from areal_jax.inference.serving_engine import ServingEngine
from areal_jax.progress import heartbeat
from areal_jax.reporting.metric_keys import QUEUE
from areal_jax.rollout.controller import RolloutController
from areal_jax.rollout.evaluation import evaluate
from areal_jax.rollout.staleness import StalenessManager
from areal_jax.rollout.weight_versions import apply_version
from areal_jax.rollout.workflow import RolloutWorkflow
from areal_jax.seeds import stream_seed
from areal_jax.system.cluster import ResumePoint, resume_point, server_group_ids

logger = logging.getLogger(__name__)


def eval_due(cfg: ExperimentConfig, version: int) -> bool:
    """Whether version `version` is evaluated on the held-out split: every `eval.every_steps` versions (the
    starting version 0 included) and the last step's."""
    every = cfg.eval.every_steps
    return bool(every) and (version % every == 0 or version >= cfg.train_steps)


class RolloutSide:
    """A running rollout side (see the module docstring); made by `open_rollout_side`."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        server: int,
        point: ResumePoint,
        generator: Generator,
        staleness: StalenessManager,
        controller: RolloutController,
        workflow: RolloutWorkflow,
        heldout: Sequence[PromptRecord],
    ):
        self.cfg, self.server, self.point = cfg, server, point
        self.generator, self.staleness, self.controller = generator, staleness, controller
        self.workflow, self.heldout = workflow, heldout

    def apply(self, params: Any, version: int) -> None:
        """Swap `params` in as `version`; returns once the generator decodes with them and admission follows."""
        apply_version(self.generator, self.staleness, params, version, interrupt=self.cfg.rollout.interrupt)

    def evaluate_if_due(self, version: int) -> dict[str, float]:
        """Server 0, when `eval_due`: the held-out split on the live generator at `version`, written to
        `eval/step-<version>`; its scalars (`eval/...`, `eval_before/...` for version 0). Else, or when the
        evaluation fails (training goes on), nothing."""
        if self.server != 0 or not self.heldout or not eval_due(self.cfg, version):
            return {}
        prompts = list(self.heldout[: self.cfg.eval.max_prompts or None])
        generator = self.generator
        emitted = generator.stats.emitted_tokens
        status = lambda: f"{generator.stats.emitted_tokens - emitted} tokens generated"  # noqa: E731
        try:
            with heartbeat(f"held-out evaluation at version {version} ({len(prompts)} prompts)", status):
                report = evaluate(generator, self.workflow, prompts, self.cfg.eval, stream_seed(self.cfg.seed, "eval"))
        except Exception:  # a failing reward also fails the rollouts, whose budget stops the run if it must
            logger.exception("held-out evaluation at version %d failed; training goes on", version)
            return {}
        report.write(self.cfg.layout.eval_dir / f"step-{version}")
        logger.info("held-out pass@1 at version %d: %.3f (%d prompts)", version, report.overall.pass_at_1, len(prompts))
        return report.scalars("eval_before" if version == 0 else "eval")

    @property
    def failure(self) -> BaseException | None:
        """The controller's failure once its failing rollouts spent `rollout.failures`."""
        return self.controller.failure

    @property
    def exhausted(self) -> Any:
        """Set once every group of the prompt stream has ended (a finite dataset ran out)."""
        return self.controller.exhausted

    def stats(self) -> dict[str, float]:
        """The generator's counters, its queue and the failed rollouts, for the trainer's metrics."""
        stats = {f"generator/{k}": float(v) for k, v in dataclasses.asdict(self.generator.stats).items()}
        stats[QUEUE] = float(self.generator.num_in_flight())  # requests submitted and not yet answered
        stats["rollout/failed_total"] = float(self.controller.stats.failed)
        stats["rollout/untrained_groups_total"] = float(self.controller.stats.dropped)  # dynamic sampling
        return stats

    @property
    def next_group_id(self) -> int:
        return max(self.controller.next_group_id, self.point.next_group_id)

    @property
    def groups_written(self) -> int:
        """Its groups in the log that train (not dropped by dynamic sampling): before it started and since."""
        return self.point.written + self.controller.stats.accepted


@contextlib.contextmanager
def open_rollout_side(
    cfg: ExperimentConfig,
    engine: ServingEngine,
    params: Any,
    version: int,
    workflow: RolloutWorkflow,
    stream: TaskStream,
    heldout: Sequence[PromptRecord],
    *,
    server: int = 0,
    servers: int = 1,
    on_failure: Callable[[], None] | None = None,
) -> Iterator[RolloutSide]:
    """Server `server` of `servers` generating from `params` (version `version`, on `engine`'s shardings)
    until the context ends; `on_failure` is called once its rollouts spent their failure budget."""
    loaded = engine.load_params(params, version)
    del params  # the engine has its copy: a reference here would pin the first version for the whole run
    engine.warmup(loaded)
    log_dir = cfg.layout.rollout_log
    logged = logged_groups(log_dir)
    point = resume_point(logged, server, servers, untrained=[g for g, trains in logged.items() if not trains])
    staleness = StalenessManager(cfg.rollout.staleness, version, server=server, servers=servers)
    staleness.restore(point.written, 0, version)
    logger.info(
        "rollout server %d of %d at weights v%d: %d groups written before, %d re-issued, next id %d",
        server,
        servers,
        version,
        point.written,
        len(point.reissue),
        point.next_group_id,
    )
    tasks = ((g, stream.task_for(g)) for g in server_group_ids(point, servers, len(stream)))
    sink = GroupLogSink(RolloutLogWriter(log_dir, writer_id=new_writer_id(server), config=cfg.rollout.log))
    seed = stream_seed(cfg.seed, "generator", server)
    generator = Generator(engine, loaded, detokenize=workflow.tokenizer.decode, seed=seed)
    del loaded  # the generator owns the weights
    try:
        with generator, workflow_serving(workflow, generator, staleness, server):
            controller = RolloutController(
                generator,
                workflow,
                tasks,
                staleness,
                sink,
                failures=cfg.rollout.failures,
                on_failure=on_failure,
                dynamic_sampling=cfg.rollout.dynamic_sampling,
            ).start()
            try:
                yield RolloutSide(cfg, server, point, generator, staleness, controller, workflow, heldout)
            finally:
                controller.stop()
    finally:
        sink.close()
