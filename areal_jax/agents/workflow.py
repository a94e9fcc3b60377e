"""`rollout.workflow.kind: agent`: the user's agent, `async def run(client, task) -> float | None`, runs each
episode against the proxy with an `openai.AsyncOpenAI` client whose base URL is the episode's session. The
agent runs on the proxy's event loop; its client reaches the proxy in the process (`agent.transport: local`)
or over HTTP.

One task item gives a group of `n_samples` episodes run concurrently. An episode's trajectory is the sequence
the proxy recorded for it (the exact ids, behaviour log-probs and versions of every turn); its reward is the
agent's return value, or, when that is None, `reward.kind`'s function of the last turn's text. An episode
recorded as several sequences (the template rule 'split', branches) trains the sequence that ended last
under `agent.extra_sequences: train_last` (the others are counted in its metadata), every sequence under 'all'
(the episode's reward on each, one advantage per episode: `Trajectory.num_sequences`), or fails under 'fail'.
An agent that raises, times out or makes no request fails its group, which counts against
`rollout.failures`; its requests still generating are aborted, and other groups go on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import openai

from areal_jax.agents.admission import EpisodeAdmission
from areal_jax.agents.local_transport import LocalTransport
from areal_jax.agents.server import AgentProxy
from areal_jax.agents.sessions import TokenSequence
from areal_jax.configuration import ConfigError
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.generator import Generator
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.environments import RewardFn
from areal_jax.rollout.rewards import import_user_function
from areal_jax.rollout.workflow import RolloutWorkflow, TaskItem, WorkflowConfig, gather_episodes

Agent = Callable[[openai.AsyncOpenAI, Any], Awaitable[float | None]]


def import_agent(spec: str) -> Agent:
    """The coroutine function named by 'package.module:function'."""
    fn = import_user_function(spec, "rollout.workflow.agent.function")
    if not asyncio.iscoroutinefunction(fn):
        raise ConfigError(
            "rollout.workflow.agent.function", f"{spec!r} is not an async function run(client, task) -> float | None"
        )
    return fn


class AgentWorkflow(RolloutWorkflow):
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
        super().__init__(config, tokenizer, executor)
        self.reward_fn = reward_fn
        self._proxy: AgentProxy | None = None
        self._owns_proxy = False
        self._source: AgentWorkflow | None = None  # a resampled copy's original, whose proxy it uses
        # per proxy loop, touched on that loop only (the agents run there)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = (
            weakref.WeakKeyDictionary()
        )

    @contextlib.contextmanager
    def serving(
        self, generator: Generator, admission: EpisodeAdmission | None = None, port: int | None = None
    ) -> Iterator[AgentProxy]:
        """The proxy on `generator` while the context lasts (the rollout side starts it so)."""
        with AgentProxy(
            generator, self.tokenizer, self.config.agent, self.sampling, admission=admission, port=port
        ) as proxy:
            self._proxy = proxy
            try:
                yield proxy
            finally:
                self._proxy = None

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
        if not sequences:
            raise ValueError(f"{where}: the agent returned {value!r} without asking the model anything")
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
        timings = {"agent": agent_s, "reward": reward_s, "total": time.perf_counter() - start}
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
                raise ValueError(f"{where}: the agent returned {value!r}; expected a finite number or None")
            return float(value), {}, 0.0
        text = self.tokenizer.decode(seq.produced, skip_special_tokens=True)
        scored, seconds = await self._offload(self.reward_fn, text, task)
        if not (isinstance(scored, tuple) and len(scored) == 2 and isinstance(scored[1], dict)):
            raise ValueError(f"{where}: reward function returned {scored!r}; expected (reward, components dict)")
        if not math.isfinite(float(scored[0])):
            raise ValueError(f"{where}: reward {scored[0]!r} is not a finite number")
        return float(scored[0]), {str(k): float(v) for k, v in scored[1].items()}, seconds
