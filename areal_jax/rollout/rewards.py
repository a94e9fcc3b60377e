"""The reward of a run, chosen by config: the embedded arithmetic check, the running-sums check, math-verify,
the code sandbox, or a user function named `package.module:function`.

A user reward function has the signature every workflow calls:

    def my_reward(completion_text: str, task: PromptRecord) -> tuple[float, dict[str, float]]:
        return reward, {"correct": ...}   # components are logged; "correct" feeds the correct-rate metric

It runs on the workflow's reward threads (several calls at once), so it must be thread-safe; it may be
slow. `task` carries `id`, `prompt`, `answer`, `tests`, `source` and `metadata` from the dataset row.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.rewards.code import CodeRewardConfig
from areal_jax.rewards.math import MathRewardConfig
from areal_jax.rewards.synthetic import arithmetic_reward, chain_sum_reward
from areal_jax.rollout.environments import (
    DEFAULT_RETRY_MESSAGE,
    CodeFeedbackEnvironment,
    CodeRewardFn,
    Environment,
    MathRetryEnvironment,
    MathRewardFn,
    RewardFn,
    SyntheticRewardFn,
)

BUILTIN_REWARDS = ("arithmetic", "chain_sums", "math", "code")
_USER_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclasses.dataclass(frozen=True)
class RewardConfig(Config):
    """Which reward scores a completion."""

    kind: str = option(
        "arithmetic",
        doc="'arithmetic' (the embedded task), 'chain_sums' (the running-sums task: the whole worked chain must "
        "match), 'math' (math-verify on `answer`), 'code' (sandboxed `tests`), or a user function "
        "'package.module:function' called as fn(completion_text, task) -> (reward, components)",
    )
    format_bonus: float = option(
        0.0,
        ge=0,
        lt=1,
        doc="arithmetic: reward of a wrong answer that is still an integer; chain_sums: of a wrong chain with "
        "the right number of partial sums",
    )
    math: MathRewardConfig = option(default_factory=MathRewardConfig, doc="math-verify workers and limits")
    code: CodeRewardConfig = option(default_factory=CodeRewardConfig, doc="the code sandbox's limits")
    retry_message: str = option(DEFAULT_RETRY_MESSAGE, doc="multi-turn (all but code): the reply to a wrong answer")

    def validate(self) -> None:
        if self.kind not in BUILTIN_REWARDS and not _USER_FUNCTION.match(self.kind):
            raise ConfigError(
                "kind", f"got {self.kind!r}; allowed: {', '.join(BUILTIN_REWARDS)} or 'package.module:function'"
            )
        if not self.retry_message:
            raise ConfigError("retry_message", "is empty; a retry turn needs a user message")

    @property
    def needs(self) -> str:
        """The task field the reward reads ('answer' or 'tests'; '' for a user function)."""
        return {"code": "tests", "math": "answer", "arithmetic": "answer", "chain_sums": "answer"}.get(self.kind, "")


def import_user_function(spec: str, key: str) -> Callable:
    """The callable named by 'package.module:function' (config key `key`), with an error naming what is missing."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(key, f"cannot import module {module_name!r}: {err}") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ConfigError(key, f"{module_name!r} has no function {attribute!r}")
    return fn


def import_reward_function(spec: str) -> RewardFn:
    """The reward function named by 'package.module:function' (`reward.kind`)."""
    return import_user_function(spec, "reward.kind")


class Reward:
    """The reward function of a run, the environment of its multi-turn episodes, and the workers behind
    them (closed with `close()` or `with`)."""

    def __init__(self, config: RewardConfig):
        self.config = config
        self._closers: list[Callable[[], None]] = []
        self.fn: RewardFn
        self._code_verifier = None
        if config.kind == "arithmetic":
            self.fn = SyntheticRewardFn(arithmetic_reward, config.format_bonus)
        elif config.kind == "chain_sums":
            self.fn = SyntheticRewardFn(chain_sum_reward, config.format_bonus)
        elif config.kind == "math":
            from areal_jax.rewards.math import MathVerifier

            verifier = MathVerifier(config.math)
            self._closers.append(verifier.close)
            self.fn = MathRewardFn(verifier)
        elif config.kind == "code":
            from areal_jax.rewards.code import CodeVerifier

            self._code_verifier = CodeVerifier(config.code)
            self._closers.append(self._code_verifier.close)
            self.fn = CodeRewardFn(self._code_verifier)
        else:
            self.fn = import_reward_function(config.kind)

    def environment(self) -> Environment:
        """Multi-turn: code feedback on the first failing test for code, else retry while wrong."""
        if self._code_verifier is not None:
            return CodeFeedbackEnvironment(self._code_verifier)
        return MathRetryEnvironment(self.fn, self.config.retry_message)

    def close(self) -> None:
        for close in self._closers:
            close()
        self._closers.clear()

    def __enter__(self) -> Reward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
