"""The task side of rollout workflows: reward functions behind one signature, and multi-turn environments.

A reward function is `reward_fn(completion_text, task) -> (reward, components)`; it may be slow and
synchronous (workflows call it on an executor, never on the generator's thread or the event loop).
Adapters give that shape to the embedded tasks' checks, `MathVerifier` and `CodeVerifier`.

An `Environment` answers each model turn of a multi-turn episode with an `EnvStep`: the text of the next
user turn (None ends the episode), the episode's reward if it ended now, and whether it is done.
`MathRetryEnvironment` asks again while the answer is wrong; `CodeFeedbackEnvironment` replies with the
code reward's verdict on the first failing test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_jax.data.datasets import PromptRecord
from areal_jax.rewards.synthetic import ArithmeticProblem

if TYPE_CHECKING:
    from areal_jax.rewards.code import CodeResult, CodeVerifier
    from areal_jax.rewards.math import MathVerifier

RewardFn = Callable[[str, Any], tuple[float, dict[str, float]]]
Message = Mapping[str, str]

DEFAULT_RETRY_MESSAGE = "Your answer is incorrect. Try again."


# ---------------------------------------------------------------------------------------------- rewards


def arithmetic_prompt_record(problem: ArithmeticProblem) -> PromptRecord:
    """The arithmetic task's problem as a `PromptRecord` (id "arith-<n>", answer the decimal result)."""
    return PromptRecord(
        id=f"arith-{problem.prompt_id}",
        prompt=problem.question,
        answer=problem.answer,
        tests=None,
        source="arithmetic",
        metadata={},
    )


def _answer_of(task: Any) -> str:
    answer = getattr(task, "answer", None)
    if not isinstance(answer, str):
        raise ValueError(f"task {getattr(task, 'id', task)!r} has answer {answer!r}; this reward needs a string")
    return answer


@dataclasses.dataclass(frozen=True)
class SyntheticRewardFn:
    """An embedded task's check (`rewards.synthetic.arithmetic_reward` or `chain_sum_reward`:
    `check(completion, answer, format_bonus)` is 1 when right, `format_bonus` when wrong but well formed, 0
    otherwise) as a reward function: the reward is the check with `format_bonus`; components `correct` (the
    check without a bonus) and `format` (1 when well formed)."""

    check: Callable[[str, str, float], float]
    format_bonus: float = 0.0

    def __call__(self, completion: str, task: Any) -> tuple[float, dict[str, float]]:
        answer = _answer_of(task)
        return self.check(completion, answer, self.format_bonus), {
            "correct": self.check(completion, answer, 0.0),
            "format": self.check(completion, answer, 1.0),
        }


class MathRewardFn:
    """`MathVerifier` as a reward function: reward = `correct`, components `correct` and `format`."""

    def __init__(self, verifier: MathVerifier):
        self.verifier = verifier

    def __call__(self, completion: str, task: Any) -> tuple[float, dict[str, float]]:
        result = self.verifier.score(completion, _answer_of(task))
        return result.correct, result.components()


def _code_result(verifier: CodeVerifier, completion: str, task: Any) -> CodeResult:
    tests = getattr(task, "tests", None)
    if tests is None:
        raise ValueError(f"task {getattr(task, 'id', task)!r} has no tests; a code reward needs them")
    metadata = getattr(task, "metadata", None) or {}
    return verifier.score_response(completion, tests, metadata.get("fn_name"))


class CodeRewardFn:
    """`CodeVerifier` as a reward function on `task.tests` (and `task.metadata["fn_name"]`): 1 iff all pass."""

    def __init__(self, verifier: CodeVerifier):
        self.verifier = verifier

    def __call__(self, completion: str, task: Any) -> tuple[float, dict[str, float]]:
        result = _code_result(self.verifier, completion, task)
        return result.reward, result.components()


# ---------------------------------------------------------------------------------------------- environments


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one model turn."""

    reply: str | None  # the next user turn; None ends the episode
    reward: float  # the episode's reward if it ends after this turn
    done: bool
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """Judges a model turn. `history` is the conversation before it (user/assistant messages, as text)."""

    def step(self, task: Any, history: Sequence[Message], completion: str) -> EnvStep: ...


class MathRetryEnvironment:
    """Done when the reward reaches `solved_at`; otherwise replies `retry_message` and the episode goes on."""

    def __init__(self, reward_fn: RewardFn, retry_message: str = DEFAULT_RETRY_MESSAGE, solved_at: float = 1.0):
        if not retry_message:
            raise ValueError("retry_message is empty; the next turn needs a user message")
        self.reward_fn = reward_fn
        self.retry_message = retry_message
        self.solved_at = solved_at

    def step(self, task: Any, history: Sequence[Message], completion: str) -> EnvStep:
        reward, components = self.reward_fn(completion, task)
        if reward >= self.solved_at:
            return EnvStep(None, reward, True, components)
        return EnvStep(self.retry_message, reward, False, components)


class CodeFeedbackEnvironment:
    """Done when every test passes; otherwise replies with the verdict and detail of the first failing test."""

    def __init__(self, verifier: CodeVerifier, max_detail_chars: int = 300):
        if max_detail_chars < 0:
            raise ValueError(f"max_detail_chars must be >= 0, got {max_detail_chars}")
        self.verifier = verifier
        self.max_detail_chars = max_detail_chars

    def step(self, task: Any, history: Sequence[Message], completion: str) -> EnvStep:
        result = _code_result(self.verifier, completion, task)
        components = result.components()
        if result.reward >= 1.0:
            return EnvStep(None, result.reward, True, components)
        return EnvStep(self.feedback(result), result.reward, False, components)

    def feedback(self, result: CodeResult) -> str:
        """The reply to a solution that did not pass."""
        if not result.cases:
            return "No code block found. Answer with the whole solution in a ```python code block."
        index, case = next((i, c) for i, c in enumerate(result.cases) if c.verdict != "passed")
        detail = case.detail.strip()[: self.max_detail_chars]
        where = f"test {index + 1} of {len(result.cases)}"
        return f"Your code failed {where}: {case.verdict}" + (f" ({detail})" if detail else "") + ". Fix it."
