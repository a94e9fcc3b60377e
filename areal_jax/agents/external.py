"""`rollout.workflow.kind: external`: the rollout side runs no agents of its own; agents in other processes
pull the run's tasks from the proxy (`GET /v1/tasks/next`), run each as an episode (a session of the proxy,
any OpenAI-compatible client) and end it with their reward (`task_board.py`, docs/agents.md).

The rollout controller admits each group (the staleness bound, the task stream's order and group ids) and
runs it here: the group is posted to the proxy's task board and its trajectories are made once its
`n_samples` episodes have ended, as the agent workflow makes them (`episodes.py`). A group that fails (an
episode not ended within `agent.episode_timeout_s`, an episode that asked the model nothing) raises
`ReissueGroup`: the controller counts it against `rollout.failures` and hands its task out again under the
same group id, its open episodes closed, so no group is trained twice and none is lost.
"""

from __future__ import annotations

import asyncio
import time

from areal_jax.agents.episodes import ProxyWorkflow
from areal_jax.agents.server import AgentProxy
from areal_jax.agents.task_board import EpisodeEnd, TaskBoard
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.generator import Generator
from areal_jax.rollout.failures import ReissueGroup
from areal_jax.rollout.workflow import TaskItem


class ExternalWorkflow(ProxyWorkflow):
    """A group's episodes come from outside agents (see the module docstring)."""

    def task_board(self) -> TaskBoard:
        return TaskBoard(self.config.agent.episode_timeout_s)

    def _serving_proxy(self, generator: Generator) -> AgentProxy:
        proxy = self._proxy
        if proxy is None:
            raise RuntimeError("kind 'external' runs only while the rollout side serves the proxy (serving())")
        if proxy.generator is not generator:
            raise ValueError("the agent proxy serves another generator than the one this rollout was given")
        return proxy

    async def run(self, generator: Generator, task: TaskItem, group_id: int) -> list[Trajectory]:
        if group_id < 0:
            raise ValueError(f"group_id must be >= 0, got {group_id}")
        proxy = self._serving_proxy(generator)
        start = time.perf_counter()
        messages = [dict(m) for m in self.first_messages(task)]
        done = await proxy.post_group(group_id, task, messages, self.config.n_samples)
        try:
            ends: list[EpisodeEnd] = await asyncio.wrap_future(done)
            episodes = [
                await self.episode_trajectories(
                    end.reward, end.sequences, task, group_id, end.index, {"agent": end.seconds}, start
                )
                for end in ends
            ]
        except asyncio.CancelledError:
            raise
        except Exception as err:
            raise ReissueGroup(f"group {group_id} (task {task.id!r}) is handed out again: {err}") from err
        finally:
            await asyncio.shield(proxy.withdraw_group(group_id))
        return [t for episode in episodes for t in episode]
