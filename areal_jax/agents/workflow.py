"""`rollout.workflow.kind: agent`: the user's agent, `async def run(client, task) -> float | None`, runs each
episode against the proxy with an `openai.AsyncOpenAI` client whose base URL is the episode's session. The
agent runs on the proxy's event loop; its client reaches the proxy in the process (`agent.transport: local`)
or over HTTP.

One task item gives a group of `n_samples` episodes run concurrently; their trajectories and rewards as
`episodes.py` makes them, the reward the agent's return value (None: `reward.kind` scores the last turn). An
agent that raises, times out or makes no request fails its group, which counts against `rollout.failures`; its
requests still generating are aborted, and other groups go on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import openai

from areal_jax.agents.episodes import ProxyWorkflow
from areal_jax.agents.local_transport import LocalTransport
from areal_jax.agents.server import AgentProxy
from areal_jax.configuration import ConfigError
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.generator import Generator
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.environments import RewardFn
from areal_jax.rollout.rewards import import_user_function
from areal_jax.rollout.workflow import TaskItem, WorkflowConfig, gather_episodes

Agent = Callable[[openai.AsyncOpenAI, Any], Awaitable[float | None]]


def import_agent(spec: str) -> Agent:
    """The coroutine function named by 'package.module:function'."""
    fn = import_user_function(spec, "rollout.workflow.agent.function")
    if not asyncio.iscoroutinefunction(fn):
        raise ConfigError(
            "rollout.workflow.agent.function", f"{spec!r} is not an async function run(client, task) -> float | None"
        )
    return fn


class AgentWorkflow(ProxyWorkflow):
    """Episodes of the user's agent through the proxy (see the module docstring)."""

    def __init__(
        self,
        config: WorkflowConfig,
        tokenizer: Tokenizer,
        reward_fn: RewardFn,
        executor: concurrent.futures.Executor | None = None,
    ):
        if not config.agent.function:
            raise ConfigError(
                "rollout.workflow.agent.function", "is empty; kind 'agent' needs 'package.module:function'"
            )
        self.agent = import_agent(config.agent.function)
        super().__init__(config, tokenizer, reward_fn, executor)
        self._owns_proxy = False
        self._source: AgentWorkflow | None = None  # a resampled copy's original, whose proxy it uses
        # per proxy loop, touched on that loop only (the agents run there)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = (
            weakref.WeakKeyDictionary()
        )

    def resampled(self, config: WorkflowConfig) -> AgentWorkflow:
        """A copy running `config` (the held-out evaluation's) on this workflow's proxy: its episodes' turns
        start from its own sampling (`AgentProxy.run_episode`)."""
        if config.agent.extra_sequences == "all":  # an evaluation scores each episode once
            config = config.replace(agent=config.agent.replace(extra_sequences="train_last"))
        copy = AgentWorkflow(config, self.tokenizer, self.reward_fn, self.executor)
        copy._source = self
        return copy

    def proxy_for(self, generator: Generator) -> AgentProxy:
        """The serving proxy; one of this workflow's own (closed with it) when none serves (`areal-jax eval`)."""
        if self._source is not None:
            return self._source.proxy_for(generator)
        if self._proxy is None:
            self._proxy = AgentProxy(generator, self.tokenizer, self.config.agent, self.sampling).start()
            self._owns_proxy = True
        if self._proxy.generator is not generator:
            raise ValueError("the agent proxy serves another generator than the one this rollout was given")
        return self._proxy

    def _client(self, proxy: AgentProxy, timeout: float) -> openai.AsyncOpenAI:
        """The client of `proxy`'s loop, the running one (making one costs ~40 ms; each episode gets a copy with
        its own base URL); its transport is `agent.transport`."""
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            http = None
            if self.config.agent.transport == "local":
                http = openai.DefaultAsyncHttpxClient(transport=LocalTransport(proxy), timeout=timeout)
            self._clients[loop] = openai.AsyncOpenAI(
                base_url="http://unused", api_key="areal", max_retries=0, timeout=timeout, http_client=http
            )
        return self._clients[loop]

    def close(self) -> None:
        if self._owns_proxy and self._proxy is not None:
            self._proxy.close()
            self._proxy, self._owns_proxy = None, False
        super().close()

    async def run(self, generator: Generator, task: TaskItem, group_id: int) -> list[Trajectory]:
        if group_id < 0:
            raise ValueError(f"group_id must be >= 0, got {group_id}")
        proxy = self.proxy_for(generator)
        episodes = await gather_episodes(self._episode(proxy, task, group_id, i) for i in range(self.config.n_samples))
        return [t for episode in episodes for t in episode]

    async def _episode(self, proxy: AgentProxy, task: TaskItem, group_id: int, index: int) -> list[Trajectory]:
        """The episode's trajectories: its last sequence's, or (`extra_sequences: all`) one per sequence."""
        start = time.perf_counter()
        where = f"prompt {task.id!r} sample {index}"
        timeout = self.config.agent.episode_timeout_s

        async def agent(base_url: str) -> Any:  # on the proxy's loop
            client = self._client(proxy, timeout).with_options(base_url=base_url)
            return await asyncio.wait_for(self.agent(client, task), timeout)

        try:
            value, sequences = await proxy.run_episode(f"g{group_id}-s{index}", agent, self.sampling)
        except TimeoutError:
            raise TimeoutError(
                f"{where}: the agent ran past rollout.workflow.agent.episode_timeout_s={timeout}"
            ) from None
        agent_s = time.perf_counter() - start
        return await self.episode_trajectories(value, sequences, task, group_id, index, {"agent": agent_s}, start)
