"""The rollout side's held-out evaluations (server 0): their schedule (`eval_due`) and the thread that runs
them on the live generator (`HeldoutEvaluator`), beside the rollouts, so the trainer never waits for one.

Whoever applies a version to the generator (the trainer loop's publisher in one process, the weight follower
in a rollout server) sends the evaluator the version when it is due; the thread alone keeps its queue. The
generator goes on taking new versions while an evaluation runs: a report says how many were applied during
it (`eval/versions_applied_during`; 0 = every sample from the evaluated version). When evaluations fall
behind, the thread takes the newest version asked for and skips the older ones. Each result is written as
files (`eval_results.py`), which the trainer records at the evaluated version's step.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from areal_jax.config import ExperimentConfig
from areal_jax.data.datasets import PromptRecord
from areal_jax.inference.generator import Generator
from areal_jax.progress import heartbeat
from areal_jax.rollout.evaluation import evaluate
from areal_jax.rollout.workflow import RolloutWorkflow
from areal_jax.seeds import stream_seed
from areal_jax.system.eval_results import is_evaluated, write_evaluation

logger = logging.getLogger(__name__)

THREAD_NAME = "areal-heldout-eval"
_STOP = None


def eval_due(cfg: ExperimentConfig, version: int) -> bool:
    """Whether version `version` is evaluated on the held-out split: every `eval.every_steps` versions (the
    starting version 0 included) and the last step's."""
    every = cfg.eval.every_steps
    return bool(every) and (version % every == 0 or version >= cfg.train_steps)


class HeldoutEvaluator(threading.Thread):
    """Evaluates the versions it is sent on the held-out split (see the module docstring)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        generator: Generator,
        workflow: RolloutWorkflow,
        heldout: Sequence[PromptRecord],
    ):
        super().__init__(name=THREAD_NAME, daemon=True)
        self.cfg, self.generator, self.workflow = cfg, generator, workflow
        self.prompts = list(heldout[: cfg.eval.max_prompts or None])
        self.directory = cfg.layout.eval_dir
        self.requests: queue.Queue[int | threading.Event | None] = queue.Queue()

    def submit_if_due(self, version: int) -> None:
        """Evaluate `version` when the schedule says so and it was not evaluated before (a resumed run's
        starting version may have been)."""
        if eval_due(self.cfg, version) and not is_evaluated(self.directory, version):
            self.requests.put(version)

    def finish(self) -> None:
        """Returns once every version sent before is evaluated (or skipped)."""
        if not self.is_alive():
            return
        done = threading.Event()
        self.requests.put(done)
        done.wait()

    def close(self) -> None:
        """End the thread once the evaluation it is running is written; versions still waiting are not
        evaluated (the trainer waited for those it records: `finish`, or the summary files)."""
        if self.is_alive():
            self.requests.put(_STOP)
            self.join()

    def run(self) -> None:
        while True:
            request = self.requests.get()
            pending = [request]
            while not self.requests.empty():  # fallen behind: the newest version only
                pending.append(self.requests.get_nowait())
            versions = [r for r in pending if isinstance(r, int)]
            closing = _STOP in pending
            for skipped in versions if closing else versions[:-1]:
                reason = "the rollout side is closing" if closing else "evaluations fall behind"
                logger.warning("held-out evaluation of version %d skipped: %s", skipped, reason)
            if versions and not closing:
                self._evaluate(versions[-1])
            for r in pending:
                if isinstance(r, threading.Event):
                    r.set()
            if closing:
                return

    def _evaluate(self, version: int) -> None:
        generator = self.generator
        emitted = generator.stats.emitted_tokens
        status = lambda: f"{generator.stats.emitted_tokens - emitted} tokens generated"  # noqa: E731
        title = f"held-out evaluation at version {version} ({len(self.prompts)} prompts)"
        try:
            with heartbeat(title, status):
                seed = stream_seed(self.cfg.seed, "eval")
                report = evaluate(generator, self.workflow, self.prompts, self.cfg.eval, seed)
            applied = generator.version - version
            thread = threading.current_thread().name
            write_evaluation(self.directory, report, version, applied_during=applied, thread=thread)
        except Exception:  # a failing reward also fails the rollouts, whose budget stops the run if it must
            logger.exception("held-out evaluation at version %d failed; training goes on", version)
            return
        logger.info(
            "held-out pass@1 at version %d: %.3f (%d prompts, %d newer versions applied during it)",
            version,
            report.overall.pass_at_1,
            len(self.prompts),
            applied,
        )
