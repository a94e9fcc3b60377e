"""The rollout side: one rollout server's engine, generator, controller threads and rollout-log writer, built
by one function (`open_rollout_side`) for both shapes of a run. The one-process run (`areal-jax train`) is
server 0 of 1 and hands it each version in-process; `areal-jax rollout` is server i of N and hands it the
versions its weight follower loads. Everything else is written here once:

- where it goes on: from the group ids in the rollout log (`cluster.resume_point`): its ids below the
  highest written one that are missing (in flight when a process died, or set aside by a trainer resume)
  are issued again first, then new ids; the staleness count starts from its groups in the log;
- its rollout-log writer id (`new_writer_id(server)`);
- applying a version (`weight_versions.apply_version`: the generator first, then admission);
- the held-out evaluations (server 0, `heldout_evaluator.py`): its own thread evaluates the starting version
  when it is due and was not evaluated before, then every version applied that `eval.every_steps` divides,
  and the last step's; the results go to the trainer as files (`eval_results.py`).
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
from areal_jax.reporting.metric_keys import QUEUE
from areal_jax.rollout.controller import RolloutController
from areal_jax.rollout.staleness import StalenessManager
from areal_jax.rollout.weight_versions import apply_version
from areal_jax.rollout.workflow import RolloutWorkflow
from areal_jax.seeds import stream_seed
from areal_jax.system.cluster import ResumePoint, resume_point, server_group_ids
from areal_jax.system.heldout_evaluator import HeldoutEvaluator

logger = logging.getLogger(__name__)


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
        evaluator: HeldoutEvaluator | None,
    ):
        self.cfg, self.server, self.point = cfg, server, point
        self.generator, self.staleness, self.controller = generator, staleness, controller
        self.evaluator = evaluator

    def apply(self, params: Any, version: int) -> None:
        """Swap `params` in as `version`; returns once the generator decodes with them and admission follows
        (its held-out evaluation, when due, runs on the evaluator's thread)."""
        apply_version(self.generator, self.staleness, params, version, interrupt=self.cfg.rollout.interrupt)
        if self.evaluator is not None:
            self.evaluator.submit_if_due(version)

    def finish_evaluations(self) -> None:
        """Returns once the evaluations of the versions applied so far are written."""
        if self.evaluator is not None:
            self.evaluator.finish()

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
    admits_from: int = 0,
    on_failure: Callable[[], None] | None = None,
) -> Iterator[RolloutSide]:
    """Server `server` of `servers` generating from `params` (version `version`, on `engine`'s shardings)
    until the context ends, admitting at `admits_from` or a later version (a restarted server's earlier
    floor, `StalenessManager`); `on_failure` is called once its rollouts spent their failure budget."""
    loaded = engine.load_params(params, version)
    del params  # the engine has its copy: a reference here would pin the first version for the whole run
    engine.warmup(loaded)
    log_dir = cfg.layout.rollout_log
    logged = logged_groups(log_dir)
    point = resume_point(logged, server, servers, untrained=[g for g, trains in logged.items() if not trains])
    staleness = StalenessManager(
        cfg.rollout.staleness, version, server=server, servers=servers, admits_from=admits_from
    )
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
    evaluator = None
    if server == 0 and heldout and cfg.eval.every_steps:
        evaluator = HeldoutEvaluator(cfg, generator, workflow, heldout)
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
            if evaluator is not None:
                evaluator.start()
                evaluator.submit_if_due(version)  # the starting version: a new run's, or a resumed one's
            try:
                yield RolloutSide(cfg, server, point, generator, staleness, controller, evaluator)
            finally:
                controller.stop()
                if evaluator is not None:
                    evaluator.close()  # after the one it is running: a signal's stop does not wait for more
    finally:
        sink.close()
