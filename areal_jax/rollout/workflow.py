"""Rollout workflows: one task item in, the n `Trajectory` records of its group out, token in / token out.

`RLVRWorkflow` (single turn) renders the prompt with the tokenizer's chat template, asks the generator for
n samples in one request (one shared prefill), scores each completion with a reward function on an
executor (never on the generator's thread or the event loop) and builds one trajectory per sample.

`MultiTurnWorkflow` alternates model turns and an `Environment`'s replies up to `max_turns`. The model's
tokens are never re-tokenized: the next turn's prompt is the exact concatenation of the tokens so far,
the model's output ids and the reply's ids. The reply's ids are what the chat template writes after an
assistant message's content (the end of the model's turn, less any part of it the model already produced,
then the user turn and the generation prompt), rendered as text and encoded once (`turns.py`). They
enter the sequence with loss mask 0, behaviour log-prob 0 and version -1, like the prompt. The episode is
one trajectory whose reward is the last step's reward times `turn_discount ** (turns - 1)`.

Reward functions and environment steps run on an `Executor` (a thread pool of `reward_workers` by
default; a process pool works when they and the task items pickle).

A sample that did not end on a stop condition (finish reason "length", or "abort") is truncated and is
handled by `truncation`: "keep" (as is), "mask" (loss mask all 0, reward kept for statistics) or
"penalize" (reward set to `truncation_penalty`; the raw reward stays in `metadata["raw_reward"]`).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import functools
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar

import numpy as np

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.generator import Generator
from areal_jax.inference.requests import GenerationResult
from areal_jax.inference.sampling import SamplingParams
from areal_jax.inference.seeds import mix_seed
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.agent_config import AgentConfig
from areal_jax.rollout.environments import Environment, EnvStep, Message, RewardFn
from areal_jax.rollout.turns import TurnRenderer

R = TypeVar("R")
Truncation = Literal["mask", "penalize", "keep"]


@dataclasses.dataclass(frozen=True)
class WorkflowConfig(Config):
    """How one prompt becomes the trajectories of its group: single-turn RLVR, or multi-turn episodes."""

    kind: Literal["single_turn", "multi_turn", "agent", "external"] = option(
        "single_turn",
        doc="'single_turn' (RLVR: one answer per sample), 'multi_turn' (the environment replies), 'agent' (the "
        "user's agent through the OpenAI-compatible proxy: `agent`, docs/agents.md) or 'external' (agents in "
        "other processes pull the tasks from the proxy, GET /v1/tasks/next, and post their rewards)",
    )
    n_samples: int = option(4, ge=1, doc="samples per prompt: the group size")
    sampling: SamplingParams = option(default_factory=SamplingParams, doc="how every model turn is sampled")
    system_prompt: str = option("", doc="a system message before each prompt's user turn; empty = none")
    stop_at_tokenizer_stops: bool = option(True, doc="add the tokenizer's stop ids (eos) to sampling.stop_token_ids")
    truncation: Truncation = option(
        "keep",
        doc="samples that hit a length limit: 'keep' as is; 'mask' loss mask all 0 (reward kept for stats); "
        "'penalize' reward set to truncation_penalty",
    )
    truncation_penalty: float = option(0.0, doc="reward of a truncated sample under truncation='penalize'")
    reward_workers: int = option(4, ge=1, le=1024, doc="threads of the reward executor made when none is given")
    max_turns: int = option(3, ge=1, doc="multi_turn: model turns per episode at most")
    turn_discount: float = option(
        1.0, gt=0, le=1, doc="multi_turn: the episode's reward is multiplied by this per extra turn"
    )
    agent: AgentConfig = option(default_factory=AgentConfig, doc="agent: the user's agent and the proxy")

    def validate(self) -> None:
        if not math.isfinite(self.truncation_penalty):
            raise ConfigError("truncation_penalty", f"value {self.truncation_penalty!r} is not a finite number")
        if self.kind == "agent" and not self.agent.function:
            raise ConfigError("agent.function", "is empty; kind 'agent' needs the agent as 'package.module:function'")


class TaskItem(Protocol):
    """What a workflow reads of a task (a `PromptRecord` fits); reward functions may read more."""

    @property
    def id(self) -> str: ...

    @property
    def prompt(self) -> str: ...


@dataclasses.dataclass
class _Tokens:
    """The segments of one sample's sequence, concatenated once into the trajectory's per-token arrays."""

    ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)
    versions: list[np.ndarray] = dataclasses.field(default_factory=list)
    model: list[np.ndarray] = dataclasses.field(default_factory=list)
    length: int = 0
    routing: list[np.ndarray] | None = dataclasses.field(default_factory=list)  # None once a turn has none
    routed: int = 0  # tokens `routing` covers

    def add_context(self, ids: Sequence[int]) -> None:
        """Prompt or environment tokens: not sampled by the policy."""
        n = len(ids)
        self._add(np.asarray(ids, np.int32), np.zeros(n, np.float32), np.full(n, -1, np.int32), False)

    def add_model(self, result: GenerationResult) -> None:
        logprobs = np.asarray(result.output_logprobs, np.float32)
        versions = np.asarray(result.output_versions, np.int32)
        # the turn's routing covers its prompt (every token so far) and its output: keep the new part, so earlier
        # outputs keep the routing of the weights that sampled them
        end = self.length + len(result.output_ids)
        if self.routing is not None and result.routing is not None and len(result.routing) == end:
            self.routing.append(result.routing[self.routed :])
            self.routed = end
        else:
            self.routing = None
        self._add(np.asarray(result.output_ids, np.int32), logprobs, versions, True)

    def _add(self, ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, model: bool) -> None:
        self.ids.append(ids)
        self.logprobs.append(logprobs)
        self.versions.append(versions)
        self.model.append(np.full(len(ids), model, np.bool_))
        self.length += len(ids)

    def token_ids(self) -> np.ndarray:
        return np.concatenate(self.ids)

    def trajectory(self, train: bool, **fields: Any) -> Trajectory:
        mask = np.concatenate(self.model) if train else np.zeros(self.length, np.bool_)
        routed = self.routing and self.routed == self.length
        return Trajectory(
            token_ids=self.token_ids(),
            behav_logprobs=np.concatenate(self.logprobs),
            versions=np.concatenate(self.versions),
            loss_mask=mask,
            routing=np.concatenate(self.routing) if routed and self.routing else None,
            **fields,
        )


def _timed_call(fn: Callable[..., R], *args: Any) -> tuple[R, float]:
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def _checked_reward(value: Any, where: str) -> tuple[float, dict[str, float]]:
    """(reward, components) from a reward function's return value, refusing anything else and non-finite rewards."""
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping)):
        raise ValueError(f"{where}: reward function returned {value!r}; expected (reward, components dict)")
    reward = float(value[0])
    if not math.isfinite(reward):
        raise ValueError(f"{where}: reward {value[0]!r} is not a finite number")
    return reward, {str(k): float(v) for k, v in value[1].items()}


def _request_sampling(sampling: SamplingParams, *entropy: int) -> SamplingParams:
    """`sampling` with a seed derived from its own and `entropy` (group, sample, turn); unseeded stays so."""
    if sampling.seed is None:
        return sampling
    return sampling.replace(seed=mix_seed(sampling.seed, *entropy))


class RolloutWorkflow(abc.ABC):
    """Turns one task item into the trajectories of its group; owns the executor its slow calls run on."""

    def __init__(
        self, config: WorkflowConfig, tokenizer: Tokenizer, executor: concurrent.futures.Executor | None = None
    ):
        self.config = config
        self.tokenizer = tokenizer
        self._owns_executor = executor is None
        self.executor = executor or concurrent.futures.ThreadPoolExecutor(
            config.reward_workers, thread_name_prefix="areal-reward"
        )
        sampling = config.sampling
        if config.stop_at_tokenizer_stops:
            stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *tokenizer.stop_token_ids)))
            sampling = sampling.replace(stop_token_ids=stops)
        self.sampling = sampling

    @abc.abstractmethod
    async def run(self, generator: Generator, task: TaskItem, group_id: int) -> list[Trajectory]:
        """The `n_samples` trajectories of `task`, all with `group_id`, in sample order."""

    def render_prompt(self, task: TaskItem) -> list[int]:
        """The task's prompt as one user turn of the chat template, ending with the generation prompt."""
        return list(self.tokenizer.apply_chat_template(self.first_messages(task), add_generation_prompt=True))

    def first_messages(self, task: TaskItem) -> list[Message]:
        """The conversation before the model's first turn: the system prompt (if any) and the task's prompt."""
        system: list[Message] = [{"role": "system", "content": self.config.system_prompt}]
        return [*(system if self.config.system_prompt else []), {"role": "user", "content": task.prompt}]

    def resampled(self, config: WorkflowConfig) -> RolloutWorkflow:
        """A copy running `config` (another `n_samples`, `sampling` or truncation rule: the held-out
        evaluation's) with this workflow's tokenizer, reward or environment and executor."""
        raise TypeError(f"a {type(self).__name__} cannot be re-sampled")

    def close(self) -> None:
        """Shut down the executor if this workflow made it."""
        if self._owns_executor:
            self.executor.shutdown(wait=True)

    def __enter__(self) -> RolloutWorkflow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _offload(self, fn: Callable[..., R], *args: Any) -> tuple[R, float]:
        """`fn(*args)` on the executor, with its duration in seconds."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(_timed_call, fn, *args))

    def _outcome(self, finish_reason: str, reward: float) -> tuple[float, bool, dict[str, Any]]:
        """(reward, whether the sample trains, metadata) after the truncation rule."""
        truncated = finish_reason != "stop"
        meta: dict[str, Any] = {"finish_reason": finish_reason, "truncated": truncated}
        if not truncated or self.config.truncation == "keep":
            return reward, True, meta
        if self.config.truncation == "mask":
            return reward, False, meta
        return self.config.truncation_penalty, True, {**meta, "raw_reward": reward}


async def gather_episodes(episodes: Iterable[Awaitable[R]]) -> list[R]:
    """The episodes' results, run concurrently; when one fails the others are cancelled (their requests
    aborted), not left running."""
    tasks = [asyncio.ensure_future(episode) for episode in episodes]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _check_group_id(group_id: int) -> None:
    if group_id < 0:
        raise ValueError(f"group_id must be >= 0, got {group_id}")


async def _generate(
    generator: Generator,
    task: TaskItem,
    prompt_ids: Sequence[int] | np.ndarray,
    sampling: SamplingParams,
    n: int,
    request_id: str,
) -> list[GenerationResult]:
    """The generator's n results (a cancelled caller aborts the request); a refused request names the task."""
    try:
        return await generator.generate(prompt_ids, sampling, n, request_id)
    except ValueError as err:
        raise ValueError(f"prompt {task.id!r}: {err}") from err


class RLVRWorkflow(RolloutWorkflow):
    """Single turn: n samples of one prompt, each scored by `reward_fn(completion_text, task)`."""

    def __init__(
        self,
        config: WorkflowConfig,
        tokenizer: Tokenizer,
        reward_fn: RewardFn,
        executor: concurrent.futures.Executor | None = None,
    ):
        if not callable(reward_fn):
            raise TypeError(f"reward_fn {reward_fn!r} is not callable; expected fn(completion_text, task)")
        super().__init__(config, tokenizer, executor)
        self.reward_fn = reward_fn

    def resampled(self, config: WorkflowConfig) -> RLVRWorkflow:
        return RLVRWorkflow(config, self.tokenizer, self.reward_fn, self.executor)

    async def run(self, generator: Generator, task: TaskItem, group_id: int) -> list[Trajectory]:
        _check_group_id(group_id)
        start = time.perf_counter()
        prompt_ids = self.render_prompt(task)
        sampling = _request_sampling(self.sampling, group_id)
        results = await _generate(
            generator, task, prompt_ids, sampling, self.config.n_samples, f"{task.id}:g{group_id}"
        )
        texts = [self.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in results]
        scored = await asyncio.gather(*(self._offload(self.reward_fn, text, task) for text in texts))
        trajectories = []
        for result, (value, reward_s) in zip(results, scored, strict=True):
            where = f"prompt {task.id!r} sample {result.sample_index}"
            raw, components = _checked_reward(value, where)
            reward, train, meta = self._outcome(result.finish_reason, raw)
            tokens = _Tokens()
            tokens.add_context(prompt_ids)
            tokens.add_model(result)
            trajectories.append(
                tokens.trajectory(
                    train,
                    prompt_length=len(prompt_ids),
                    reward=reward,
                    prompt_id=task.id,
                    group_id=group_id,
                    sample_index=result.sample_index,
                    reward_components=components,
                    timings={
                        "queued_to_first_token": result.timings["queued_to_first_token"],
                        "generate": result.timings["total"],
                        "reward": reward_s,
                        "total": time.perf_counter() - start,
                    },
                    metadata={**meta, "num_interruptions": result.num_interruptions, "num_turns": 1},
                )
            )
        return trajectories


class MultiTurnWorkflow(RolloutWorkflow):
    """Model turn, environment reply, model turn, ... up to `max_turns`; one trajectory per episode."""

    def __init__(
        self,
        config: WorkflowConfig,
        tokenizer: Tokenizer,
        env: Environment,
        executor: concurrent.futures.Executor | None = None,
    ):
        if not isinstance(env, Environment):
            raise TypeError(f"env {env!r} has no step(task, history, completion) method")
        super().__init__(config, tokenizer, executor)
        self.env = env
        self.renderer = TurnRenderer(tokenizer)

    def resampled(self, config: WorkflowConfig) -> MultiTurnWorkflow:
        return MultiTurnWorkflow(config, self.tokenizer, self.env, self.executor)

    async def run(self, generator: Generator, task: TaskItem, group_id: int) -> list[Trajectory]:
        _check_group_id(group_id)
        start = time.perf_counter()
        prompt_ids = self.render_prompt(task)
        # each episode asks for its own first turn (the generator prefills the shared prompt once), so an
        # episode's second turn does not wait for the group's slowest first turn
        return await gather_episodes(
            self._episode(generator, task, group_id, prompt_ids, index, start) for index in range(self.config.n_samples)
        )

    async def _episode(
        self, generator: Generator, task: TaskItem, group_id: int, prompt_ids: list[int], index: int, start: float
    ) -> Trajectory:
        cfg = self.config
        engine_config = generator.engine.config
        sampling = _request_sampling(self.sampling, group_id, index, 1)
        request_id = f"{task.id}:g{group_id}:s{index}:t1"
        (result,) = await _generate(generator, task, prompt_ids, sampling, 1, request_id)
        tokens = _Tokens()
        tokens.add_context(prompt_ids)
        history: list[Message] = self.first_messages(task)
        turn, interruptions, generate_s, env_s = 1, 0, 0.0, 0.0
        first_token_s = result.timings["queued_to_first_token"]
        while True:
            tokens.add_model(result)
            interruptions += result.num_interruptions
            generate_s += result.timings["total"]
            completion = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
            step, seconds = await self._offload(self.env.step, task, tuple(history), completion)
            env_s += seconds
            step = _checked_step(step, f"prompt {task.id!r} sample {index} turn {turn}")
            history.append({"role": "assistant", "content": completion})
            end = _end_reason(result.finish_reason, step, turn, cfg.max_turns)
            reply_ids: list[int] = []
            if end is None:
                reply_ids = self.renderer.reply_ids(step.reply or "", result.output_ids)
                if not engine_config.fits_prompt(tokens.length + len(reply_ids)):
                    end = "context_full"
            if end is not None:
                break
            tokens.add_context(reply_ids)
            history.append({"role": "user", "content": step.reply or ""})
            turn += 1
            sampling = _request_sampling(self.sampling, group_id, index, turn)
            request_id = f"{task.id}:g{group_id}:s{index}:t{turn}"
            (result,) = await _generate(generator, task, tokens.token_ids(), sampling, 1, request_id)
        raw = step.reward * cfg.turn_discount ** (turn - 1)
        reward, train, meta = self._outcome(result.finish_reason, raw)
        return tokens.trajectory(
            train,
            prompt_length=len(prompt_ids),
            reward=reward,
            prompt_id=task.id,
            group_id=group_id,
            sample_index=index,
            reward_components={str(k): float(v) for k, v in step.components.items()},
            timings={
                "queued_to_first_token": first_token_s,
                "generate": generate_s,
                "env": env_s,
                "total": time.perf_counter() - start,
            },
            metadata={
                **meta,
                "num_interruptions": interruptions,
                "num_turns": turn,
                "end_reason": end,
                "env_reward": step.reward,
            },
        )


def _checked_step(step: Any, where: str) -> EnvStep:
    if not isinstance(step, EnvStep):
        raise ValueError(f"{where}: environment returned {step!r}; expected an EnvStep")
    if not math.isfinite(step.reward):
        raise ValueError(f"{where}: environment reward {step.reward!r} is not a finite number")
    return step


def _end_reason(finish_reason: str, step: EnvStep, turn: int, max_turns: int) -> str | None:
    """Why the episode ends after this turn (None: it goes on)."""
    if finish_reason == "length":
        return "truncated"
    if finish_reason != "stop":
        return "aborted"
    if step.done or step.reply is None:
        return "done"
    if turn >= max_turns:
        return "max_turns"
    return None
