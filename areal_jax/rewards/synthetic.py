"""The embedded default task: integer arithmetic with a verifiable answer, for CPU-sized runs.

Prompts look like "12+7" (rendered by the char tokenizer's template as "Q: 12+7\\nA: "); the answer is
the decimal result. A completion is correct when its text before the first end-of-sequence, stripped
of spaces, equals the answer.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import ClassVar, Literal

from areal_jax.configuration import Config, ConfigError, option

_INTEGER = re.compile(r"-?[0-9]+")


@dataclasses.dataclass(frozen=True)
class ArithmeticTaskConfig(Config):
    """Which problems the synthetic task draws."""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {"format_bonus": "it was read nowhere; reward.format_bonus is the setting"}

    min_operand: int = option(0, ge=0, doc="smallest operand")
    max_operand: int = option(9, ge=0, doc="largest operand")
    operators: str = option("+-", doc="operators to draw from, a subset of '+-*'")
    num_terms: int = option(2, ge=2, le=4, doc="operands per problem")

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


# ------------------------------------------------------------------------------------- running sums

_CHAIN = re.compile(r"-?[0-9]+(,-?[0-9]+)*")


@dataclasses.dataclass(frozen=True)
class ChainSumTaskConfig(Config):
    """The running-sums task: "7+5+3+8" is answered with the worked chain "12,15,23" (each partial sum,
    the last one the result). Answers grow with the number of terms; `max_terms` is the difficulty knob."""

    min_terms: int = option(2, ge=2, doc="fewest terms of a problem (answer: min_terms - 1 partial sums)")
    max_terms: int = option(5, ge=2, le=12, doc="most terms of a problem: the difficulty knob (longer chains)")
    max_operand: int = option(9, ge=1, le=99, doc="terms are drawn from 0..max_operand")
    problems: int = option(20000, ge=2, doc="distinct problems drawn (training and held-out together)")

    def validate(self) -> None:
        if self.max_terms < self.min_terms:
            raise ConfigError("max_terms", f"value {self.max_terms} must be >= min_terms={self.min_terms}")
        if self.problems > self.distinct_problems:
            raise ConfigError(
                "problems",
                f"value {self.problems} exceeds the {self.distinct_problems} distinct problems of "
                f"{self.min_terms}..{self.max_terms} terms in 0..{self.max_operand}; raise max_terms or max_operand",
            )

    @property
    def distinct_problems(self) -> int:
        return sum((self.max_operand + 1) ** n for n in range(self.min_terms, self.max_terms + 1))


def worked_answer(terms: list[int]) -> str:
    """The running sums after each addition, comma-separated: [7, 5, 3] -> "12,15"."""
    sums, total = [], terms[0]
    for term in terms[1:]:
        total += term
        sums.append(str(total))
    return ",".join(sums)


def make_chain_problems(cfg: ChainSumTaskConfig, seed: int) -> list[ArithmeticProblem]:
    """`cfg.problems` distinct reproducible problems; each number of terms is equally likely until its
    problems run out (two-term problems are few: 100 with one-digit terms)."""
    rng = random.Random(seed)
    counts = list(range(cfg.min_terms, cfg.max_terms + 1))
    capacity = {n: (cfg.max_operand + 1) ** n for n in counts}
    seen: set[str] = set()
    drawn = dict.fromkeys(counts, 0)
    problems: list[ArithmeticProblem] = []
    while len(problems) < cfg.problems:
        n = rng.choice([n for n in counts if drawn[n] < capacity[n]])
        terms = [rng.randint(0, cfg.max_operand) for _ in range(n)]
        question = "+".join(map(str, terms))
        if question in seen:
            continue
        seen.add(question)
        drawn[n] += 1
        problems.append(ArithmeticProblem(len(problems), question, worked_answer(terms)))
    return problems


def chain_sum_reward(completion_text: str, answer: str, format_bonus: float = 0.0) -> float:
    """1.0 when the completion is exactly the worked chain (every partial sum right); `format_bonus` when
    it is a chain of as many integers that is wrong somewhere; else 0.0."""
    stated = completion_text.replace(" ", "").strip()
    if stated == answer:
        return 1.0
    well_formed = _CHAIN.fullmatch(stated) is not None and stated.count(",") == answer.count(",")
    return format_bonus if well_formed else 0.0
