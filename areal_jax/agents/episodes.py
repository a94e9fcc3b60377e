"""What the workflows of the proxy share (`kind: agent`, `kind: external`): the proxy served on the rollout
side's generator, and an episode's trajectories from the sequences the proxy recorded for it.

An episode's trajectory is a sequence the proxy recorded (the exact ids, behaviour log-probs and versions of
every turn); its reward is the agent's (its return value, or the outside client's), or, when that is None,
`reward.kind`'s function of the last turn's text. An episode recorded as several sequences (the template rule
'split', branches) trains the sequence that ended last under `agent.extra_sequences: train_last` (the others
are counted in its metadata), every sequence under 'all' (the episode's reward on each, one advantage per
episode: `Trajectory.num_sequences`), or fails under 'fail'.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

from areal_jax.agents.admission import EpisodeAdmission
from areal_jax.agents.server import AgentProxy
from areal_jax.agents.sessions import TokenSequence
from areal_jax.agents.task_board import TaskBoard
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.generator import Generator
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.environments import RewardFn
from areal_jax.rollout.workflow import RolloutWorkflow, TaskItem, WorkflowConfig


class ProxyWorkflow(RolloutWorkflow):
    """A workflow whose episodes run through the proxy (see the module docstring)."""

    def __init__(
        self,
        config: WorkflowConfig,
        tokenizer: Tokenizer,
        reward_fn: RewardFn,
        executor: concurrent.futures.Executor | None = None,
    ):
        super().__init__(config, tokenizer, executor)
        self.reward_fn = reward_fn
        self._proxy: AgentProxy | None = None

    def task_board(self) -> TaskBoard | None:
        """The tasks the proxy hands out to outside agents (none here)."""
        return None

    @contextlib.contextmanager
    def serving(
        self, generator: Generator, admission: EpisodeAdmission | None = None, port: int | None = None
    ) -> Iterator[AgentProxy]:
        """The proxy on `generator` while the context lasts (the rollout side starts it so)."""
        with AgentProxy(
            generator,
            self.tokenizer,
            self.config.agent,
            self.sampling,
            admission=admission,
            port=port,
            tasks=self.task_board(),
        ) as proxy:
            self._proxy = proxy
            try:
                yield proxy
            finally:
                self._proxy = None

    async def episode_trajectories(
        self,
        value: Any,
        sequences: list[TokenSequence],
        task: TaskItem,
        group_id: int,
        index: int,
        timings: dict[str, float],
        start: float,
    ) -> list[Trajectory]:
        """An episode's trajectories: its last sequence's, or (`extra_sequences: all`) one per sequence;
        `value` its reward (None: score the last turn), `timings` its own, `start` when it started."""
        where = f"prompt {task.id!r} sample {index}"
        if not sequences:
            raise ValueError(f"{where}: the episode ended ({value!r}) without asking the model anything")
        extra = self.config.agent.extra_sequences
        if len(sequences) > 1 and extra == "fail":
            raise ValueError(
                f"{where}: the episode was recorded as {len(sequences)} sequences (rollout.workflow.agent."
                "extra_sequences='fail')"
            )
        last = sequences[-1]
        raw, components, reward_s = await self._reward(value, last, task, where)
        reward, train, meta = self._outcome(last.finish_reason, raw)  # the episode's end decides for all
        trained = sequences if extra == "all" else [last]
        timings = {**timings, "reward": reward_s, "total": time.perf_counter() - start}
        untrained = sum(len(s.ids) for s in sequences) - sum(len(s.ids) for s in trained)
        return [
            seq.trajectory(
                reward,
                train,
                prompt_id=task.id,
                group_id=group_id,
                sample_index=index,
                sequence_index=k,
                num_sequences=len(trained),
                reward_components=components,
                timings=timings,
                metadata={
                    **meta,
                    "num_interruptions": seq.interruptions,
                    "num_turns": seq.turns,
                    "template_divergences": seq.divergences,
                    "sequences": len(sequences),
                    "untrained_sequence_tokens": untrained,
                },
            )
            for k, seq in enumerate(trained)
        ]

    async def _reward(
        self, value: Any, seq: TokenSequence, task: TaskItem, where: str
    ) -> tuple[float, dict[str, float], float]:
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{where}: the episode's reward is {value!r}; expected a finite number or None")
            return float(value), {}, 0.0
        text = self.tokenizer.decode(seq.produced, skip_special_tokens=True)
        scored, seconds = await self._offload(self.reward_fn, text, task)
        if not (isinstance(scored, tuple) and len(scored) == 2 and isinstance(scored[1], dict)):
            raise ValueError(f"{where}: reward function returned {scored!r}; expected (reward, components dict)")
        if not math.isfinite(float(scored[0])):
            raise ValueError(f"{where}: reward {scored[0]!r} is not a finite number")
        return float(scored[0]), {str(k): float(v) for k, v in scored[1].items()}, seconds
