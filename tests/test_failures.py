"""Failures stop the run with an error that names the cause, instead of retrying forever."""

from __future__ import annotations

import time

import pytest

from areal_jax.config import load_experiment
from areal_jax.jobs.train import run_async
from areal_jax.rollout.failures import FailureBudget, FailureBudgetConfig
from areal_jax.system.stop_control import RunFailed
from tests.short_runs import SHORT_TRAIN_CPU

FAST = [*SHORT_TRAIN_CPU, "train_steps=4", "eval.every_steps=0"]


def always_raises(completion: str, task: object) -> tuple[float, dict[str, float]]:
    raise ValueError(f"this reward cannot score {completion!r}")


def test_budget_trips_on_consecutive_failures_and_on_the_recent_share():
    budget = FailureBudget(FailureBudgetConfig(max_consecutive=3, window=10, max_failed_share=0.5))
    assert budget.failed_with(KeyError("a"), "task 1") is None
    budget.succeeded()
    assert budget.failed_with(KeyError("b"), "task 2") is None and budget.failed_with(KeyError("c"), "task 3") is None
    stop = budget.failed_with(KeyError("d"), "task 4")
    assert stop is not None and "3 rollouts in a row failed" in str(stop)
    assert "the first failure was task 1: " in str(stop) and "KeyError: 'a'" in str(stop)

    shared = FailureBudget(FailureBudgetConfig(max_consecutive=100, window=10, max_failed_share=0.5))
    outcomes = [False, True] * 5  # 5 of 10 failed: not more than half
    for failed in outcomes:
        assert (shared.failed_with(OSError("x"), "t") if failed else shared.succeeded()) is None
    stop = shared.failed_with(OSError("x"), "t")  # the window now holds 6 failures of 10
    assert stop is not None and "6 of the last 10 rollouts failed" in str(stop)


def test_a_reward_that_always_raises_stops_the_run_within_the_budget(tmp_path):
    cfg = load_experiment(
        "configs/train_cpu.yaml",
        [
            *FAST,
            f"output_dir={tmp_path}",
            "reward.kind=tests.test_failures:always_raises",
            "rollout.failures.max_consecutive=6",
        ],
    )
    started = time.perf_counter()
    with pytest.raises(RunFailed) as info:
        run_async(cfg)
    message = str(info.value)
    assert "rollouts in a row failed (rollout.failures.max_consecutive=6)" in message
    assert "ValueError: this reward cannot score" in message  # the first failure's traceback
    assert time.perf_counter() - started < 120
    assert not (cfg.run_dir / "hf_final").exists()  # nothing exported as if finished
