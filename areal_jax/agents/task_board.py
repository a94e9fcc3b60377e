"""The tasks of `rollout.workflow.kind: external`, handed out to agents that run in other processes.

The rollout controller admits a group (the staleness bound) and the external workflow posts it here: its
task and `n_samples` sample slots. `GET /v1/tasks/next` claims the oldest group's next slot as an episode (a
session of the proxy); none to claim is a 429. An episode ends with its reward, or none (then `reward.kind`
scores its last turn). When a group's `n_samples` episodes have ended, its `done` future gets their ends in
sample order. An episode handed out and not ended within `timeout_s` fails its group (`EpisodeTimedOut` in
`done`): its workflow withdraws it (closing its open sessions) and the controller hands its task out again.

Owned by the proxy's event-loop thread: every method runs there; `done` is a thread-safe future that the
rollout controller's loop awaits.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import secrets
from collections.abc import Mapping
from typing import Any

from areal_jax.agents.messages import RequestError
from areal_jax.agents.sessions import TokenSequence
from areal_jax.rollout.workflow import TaskItem


class EpisodeTimedOut(TimeoutError):
    """An episode of the group was handed out and not ended in time (its client died or hangs)."""


@dataclasses.dataclass(frozen=True)
class EpisodeEnd:
    """What an ended episode hands its group: its recorded sequences and the client's reward (None: score it)."""

    index: int
    sequences: list[TokenSequence]
    reward: float | None
    seconds: float  # from hand-out to end


@dataclasses.dataclass
class Claim:
    """A handed-out episode: its group's slot `index`, its session, its deadline timer and reward so far."""

    group: PostedGroup
    index: int
    session_id: str
    started: float
    timer: asyncio.TimerHandle | None = None
    reward: float | None = None


@dataclasses.dataclass
class PostedGroup:
    group_id: int
    task: TaskItem
    messages: list[dict[str, Any]]
    n: int
    done: concurrent.futures.Future[list[EpisodeEnd]]
    unclaimed: collections.deque[int]
    claims: dict[str, Claim] = dataclasses.field(default_factory=dict)  # episodes in flight, by session id
    ended: dict[int, EpisodeEnd] = dataclasses.field(default_factory=dict)


class TaskBoard:
    """The groups posted and their episodes (see the module docstring)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._groups: dict[int, PostedGroup] = {}  # in posting order: the oldest group's slots go first
        self._claims: dict[str, Claim] = {}

    def post(self, group_id: int, task: TaskItem, messages: list[dict[str, Any]], n: int) -> PostedGroup:
        if group_id in self._groups:
            raise ValueError(f"group {group_id} is posted already")
        done: concurrent.futures.Future[list[EpisodeEnd]] = concurrent.futures.Future()
        group = PostedGroup(group_id, task, messages, n, done, collections.deque(range(n)))
        self._groups[group_id] = group
        return group

    def claim(self) -> Claim | None:
        """The oldest group's next slot as an episode with a new session id; None when no slot is free."""
        group = next((g for g in self._groups.values() if g.unclaimed), None)
        if group is None:
            return None
        loop = asyncio.get_running_loop()
        index = group.unclaimed.popleft()
        session_id = f"g{group.group_id}-s{index}-{secrets.token_hex(6)}"  # a new id per hand-out
        claim = Claim(group, index, session_id, loop.time())
        claim.timer = loop.call_later(self.timeout_s, self._expire, claim)
        group.claims[session_id] = self._claims[session_id] = claim
        return claim

    def claim_of(self, session_id: str) -> Claim | None:
        return self._claims.get(session_id)

    def end(self, claim: Claim, sequences: list[TokenSequence], reward: float | None) -> float | None:
        """The episode ended (its session closed) with `reward`, else the one set before (None: none); its group
        completes with its last episode. Returns the episode's reward."""
        self._drop(claim)
        group = claim.group
        seconds = asyncio.get_running_loop().time() - claim.started
        reward = reward if reward is not None else claim.reward
        group.ended[claim.index] = EpisodeEnd(claim.index, sequences, reward, seconds)
        if len(group.ended) == group.n:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # its workflow was cancelled
                group.done.set_result([group.ended[i] for i in range(group.n)])
        return reward

    def withdraw(self, group_id: int) -> list[str]:
        """Take a group off the board (completed, failed or cancelled): the sessions of its episodes still in
        flight, for the proxy to close."""
        group = self._groups.pop(group_id, None)
        if group is None:
            return []
        open_sessions = list(group.claims)
        for claim in list(group.claims.values()):
            self._drop(claim)
        if not group.done.done():
            group.done.cancel()
        return open_sessions

    def _drop(self, claim: Claim) -> None:
        if claim.timer is not None:
            claim.timer.cancel()
        claim.group.claims.pop(claim.session_id, None)
        self._claims.pop(claim.session_id, None)

    def _expire(self, claim: Claim) -> None:
        group = claim.group
        if claim.session_id not in self._claims:
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # done, or its workflow was cancelled
            group.done.set_exception(
                EpisodeTimedOut(
                    f"group {group.group_id} (task {group.task.id!r}): episode {claim.session_id!r} (sample "
                    f"{claim.index}) did not end within rollout.workflow.agent.episode_timeout_s={self.timeout_s}"
                )
            )


def task_json(claim: Claim, base_url: str, timeout_s: float) -> dict[str, Any]:
    """The answer of `GET /v1/tasks/next`: the task, its group and sample, and the episode's session."""
    group, task = claim.group, claim.group.task
    return {
        "task_id": task.id,
        "prompt": task.prompt,
        "messages": group.messages,
        "answer": getattr(task, "answer", None),
        "metadata": dict(getattr(task, "metadata", None) or {}),
        "group_id": group.group_id,
        "sample_index": claim.index,
        "n_samples": group.n,
        "session_id": claim.session_id,
        "base_url": base_url,
        "end_url": base_url.removesuffix("/v1") + "/end",
        "timeout_s": timeout_s,
    }


def reward_of(body: Any, required: bool) -> float | None:
    """The `reward` of an end or set-reward body: a finite number, or (when not `required`) absent."""
    if not isinstance(body, Mapping):
        raise RequestError(f"the request body must be a JSON object, got {body!r}")
    reward = body.get("reward")
    if reward is None and not required:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise RequestError(f"reward: expected a finite number, got {reward!r}")
    return float(reward)


def rl_session_id(body: Any, header: str | None, authorization: str | None, path: str | None) -> str | None:
    """The session an `/rl/...` request names: its path, else the X-Session-Id header, else the body's
    `session_id`, else AReaL's form, the session's key as the bearer token."""
    if path or header:
        return path or header
    if isinstance(body, Mapping) and isinstance(body.get("session_id"), str):
        return body["session_id"]
    if authorization and authorization.startswith("Bearer "):
        return authorization.removeprefix("Bearer ").strip() or None
    return None
