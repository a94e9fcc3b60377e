"""Math reward: answer extraction, an equivalence table judged by math-verify, and a killed pathological call."""

from __future__ import annotations

import gc
import os
import time

import psutil
import pytest

from areal_jax.configuration import ConfigError
from areal_jax.rewards.math import (
    CallTimeout,
    KillablePool,
    MathRewardConfig,
    MathVerifier,
    extract_answer,
    last_boxed,
)

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def verifier():
    # a generous clock: on a loaded 2-core machine one sympy comparison has passed 1.5 s (a `timeout` verdict
    # where an answer was expected); the timeout itself is tested with TIMEOUT_S below
    with MathVerifier(MathRewardConfig(timeout_s=15.0, num_workers=2)) as v:
        yield v


# (gold, predicted answer, equivalent?)
EQUIVALENCE_TABLE = [
    # fractions and decimals
    ("\\frac{1}{2}", "0.5", True),
    ("\\frac12", "1/2", True),
    ("\\dfrac{3}{4}", "\\tfrac{3}{4}", True),
    ("3/4", "0.75", True),
    ("-\\frac{1}{2}", "\\frac{-1}{2}", True),
    ("1.5", "\\frac{3}{2}", True),
    ("12", "12.0", True),
    ("\\frac{1}{3}", "0.33", False),
    ("\\frac{2}{3}", "\\frac{3}{2}", False),
    # radicals
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
    ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("\\sqrt[3]{8}", "2", True),
    ("5\\sqrt{2}", "\\sqrt{50}", True),
    ("\\sqrt{2}", "\\sqrt{3}", False),
    # intervals and sets
    ("[1,2)", "[1, 2)", True),
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("(1, \\infty)", "(1,\\infty)", True),
    ("(1,2)", "[1,2]", False),
    ("[0, 1]", "[0, 2]", False),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    # units, percent, degrees, money, thousands separators
    ("5\\text{ cm}", "5", True),
    ("30^\\circ", "30", True),
    ("\\$5", "5", True),
    ("5 \\text{ dollars}", "5", True),
    ("1,000", "1000", True),
    ("15,000", "15000", True),
    ("7", "-7", False),
    # expressions, equations, tuples
    ("x^2+2x+1", "(x+1)^2", True),
    ("x=3", "3", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\pi/2)", True),
    ("\\pi", "3.14159265358979", True),
    ("2", "3", False),
    ("x^2", "x^3", False),
    # \boxed inside the answer and multiple choice
    ("\\boxed{3}", "3", True),
    ("\\text{(B)}", "B", True),
    ("\\text{(B)}", "C", False),
]


def test_equivalence_table(verifier):
    responses = [(f"Working... so the result is \\boxed{{{pred}}}.", gold) for gold, pred, _ in EQUIVALENCE_TABLE]
    rewards = verifier.score_batch(responses)
    wrong = [
        (gold, pred, expected, r)
        for (gold, pred, expected), r in zip(EQUIVALENCE_TABLE, rewards, strict=True)
        if r.correct != float(expected) or r.status != "ok"
    ]
    assert not wrong
    assert len(EQUIVALENCE_TABLE) >= 30
    assert all(r.format == 1.0 for r in rewards)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\left\\{ x \\mid x > \\frac{1}{2} \\right\\}}", "\\left\\{ x \\mid x > \\frac{1}{2} \\right\\}"),
        ("early \\boxed{7} and a truncated \\boxed{\\frac{1", "7"),
        ("$\\boxed 5$", "5"),
        ("\\fbox{9}", "9"),
        ("\\boxed{}", None),
        ("no box here", None),
    ],
)
def test_last_boxed_handles_nesting(text, answer):
    assert last_boxed(text) == answer


def test_extraction_is_linear_on_hostile_text():
    hostile = ["\\boxed{" * 30_000, "\\boxed " * 30_000, "The answer is " + ". " * 50_000 + "x", "1," * 50_000]
    # this thread's CPU time, not wall time: the other test worker's load must not count, nor threads an earlier
    # test of this worker left running (its process time once grew 2.2 s here), nor a garbage collection of what
    # earlier tests left (2.4 s of this thread's time in one full run: collected first, then held off); a
    # quadratic scan of these texts takes minutes either way
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        for text in hostile:
            extract_answer(text)
        spent = time.thread_time() - start
    finally:
        gc.enable()
    assert spent < 2.0


def test_fallback_extractors():
    assert extract_answer("So the answer is $\\frac{3}{4}$.") == ("\\frac{3}{4}", "answer_is")
    assert extract_answer("We get 12 apples, then 1,250 more") == ("1250", "last_number")
    assert extract_answer("The answer is 4.", fallbacks=()) == (None, "none")
    assert extract_answer("Nothing numeric.") == (None, "none")


def test_components_for_fallback_empty_and_garbage(verifier):
    fallback = verifier.score("The answer is 29.", "29")
    assert (fallback.correct, fallback.format, fallback.source) == (1.0, 0.0, "answer_is")
    empty = verifier.score("", "29")
    assert (empty.correct, empty.format, empty.status) == (0.0, 0.0, "no_answer")
    garbage = verifier.score("\\boxed{)(*&^%$#@!}", "29")
    assert (garbage.correct, garbage.format) == (0.0, 0.0)
    wrong = verifier.score("\\boxed{30}", "29")
    assert (wrong.correct, wrong.format) == (0.0, 1.0)
    assert wrong.components() == {"correct": 0.0, "format": 1.0}
    long = verifier.score("\\boxed{" + "1+" * 2000 + "1}", "29")
    assert (long.correct, long.status) == (0.0, "too_long")


def test_fallback_may_count_as_format():
    cfg = MathRewardConfig(timeout_s=TIMEOUT_S, num_workers=1, fallback_counts_as_format=True)
    with MathVerifier(cfg) as v:
        assert v.score("the answer is 29", "29").components() == {"correct": 1.0, "format": 1.0}


def test_pathological_answer_times_out_without_hanging():
    with MathVerifier(MathRewardConfig(timeout_s=TIMEOUT_S, num_workers=2)) as verifier:
        verifier.score("\\boxed{1}", "1")  # the workers have started (their start has its own limit)
        start = time.monotonic()
        result = verifier.score("\\boxed{9^{9^{9^{9}}}}", "1")
        elapsed = time.monotonic() - start
        assert result.status == "timeout" and result.correct == 0.0
        assert elapsed < TIMEOUT_S + 3.0
        # the killed worker was replaced: the pool keeps answering
        assert verifier.score("\\boxed{2}", "2").correct == 1.0
        assert verifier.score_batch([("\\boxed{3}", "3")] * 4) == [verifier.score("\\boxed{3}", "3")] * 4


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_killable_pool_kills_and_replaces_the_worker():
    with KillablePool(1, start_method="forkserver") as pool:
        first = pool.call(_pid, timeout_s=30)
        with pytest.raises(CallTimeout):
            pool.call(_sleep, 60.0, timeout_s=0.5)
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
        second = pool.call(_pid, timeout_s=30)
        assert second != first
        assert pool.call(_sleep, 0.0, timeout_s=30) == 0.0
    assert not psutil.pid_exists(second) or psutil.Process(second).status() == psutil.STATUS_ZOMBIE


def _pid() -> int:
    return os.getpid()


def test_config_refusals():
    with pytest.raises(ConfigError, match="timeout_s"):
        MathRewardConfig(timeout_s=0)
    with pytest.raises(ConfigError, match="fallbacks"):
        MathRewardConfig(fallbacks=("last_number", "last_number"))
