"""The embedded default task: integer arithmetic with a verifiable answer, for CPU-sized runs.

Prompts look like "12+7" (rendered by the char tokenizer's template as "Q: 12+7\\nA: "); the answer is
the decimal result. A completion is correct when its text before the first end-of-sequence, stripped
of spaces, equals the answer.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Literal

from areal_jax.configuration import Config, ConfigError, option

_INTEGER = re.compile(r"-?[0-9]+")


@dataclasses.dataclass(frozen=True)
class ArithmeticTaskConfig(Config):
    """Which problems the synthetic task draws."""

    min_operand: int = option(0, ge=0, doc="smallest operand")
    max_operand: int = option(9, ge=0, doc="largest operand")
    operators: str = option("+-", doc="operators to draw from, a subset of '+-*'")
    num_terms: int = option(2, ge=2, le=4, doc="operands per problem")
    format_bonus: float = option(0.0, ge=0, lt=1, doc="reward for a wrong answer that is still an integer")

    def validate(self) -> None:
        if self.max_operand < self.min_operand:
            raise ConfigError("max_operand", f"value {self.max_operand} must be >= min_operand={self.min_operand}")
        bad = sorted(set(self.operators) - set("+-*"))
        if not self.operators or bad:
            raise ConfigError("operators", f"value {self.operators!r} must be a non-empty subset of '+-*'")


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    prompt_id: int
    question: str
    answer: str


def make_problems(cfg: ArithmeticTaskConfig, count: int, seed: int) -> list[ArithmeticProblem]:
    """`count` reproducible problems."""
    rng = random.Random(seed)
    problems = []
    for index in range(count):
        terms = [str(rng.randint(cfg.min_operand, cfg.max_operand)) for _ in range(cfg.num_terms)]
        ops = [rng.choice(cfg.operators) for _ in range(cfg.num_terms - 1)]
        question = terms[0] + "".join(op + term for op, term in zip(ops, terms[1:], strict=True))
        problems.append(ArithmeticProblem(index, question, str(_evaluate(terms, ops))))
    return problems


def _evaluate(terms: list[str], ops: list[str]) -> int:
    """Evaluate with the usual precedence (* before + and -), without eval()."""
    values = [int(terms[0])]
    pending: list[Literal["+", "-"]] = []
    for op, term in zip(ops, terms[1:], strict=True):
        if op == "*":
            values[-1] *= int(term)
        else:
            pending.append(op)  # type: ignore[arg-type]
            values.append(int(term))
    total = values[0]
    for op, value in zip(pending, values[1:], strict=True):
        total = total + value if op == "+" else total - value
    return total


def arithmetic_reward(completion_text: str, answer: str, format_bonus: float = 0.0) -> float:
    """1.0 when the completion states exactly the answer; `format_bonus` when it is some other integer
    (a shaping term that gives a small model a signal before it can add); else 0.0."""
    stated = completion_text.replace(" ", "").strip()
    if stated == answer:
        return 1.0
    return format_bonus if _INTEGER.fullmatch(stated) else 0.0
