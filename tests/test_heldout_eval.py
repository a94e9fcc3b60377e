"""Held-out evaluations during training: the rollout side's evaluation thread (its schedule, skipping when it
falls behind, never re-evaluating a finished version), the files that carry results to the trainer, and the
reporter writing them into metrics.jsonl and TensorBoard at the evaluated version's step, however late they
finish, once each across a resume. The whole run in both shapes: tests/test_readme_commands.py (the main
job and the one-minute job through `areal-jax train`, one process; its `launch local` twin, separate processes)."""

from __future__ import annotations

import threading
import types

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal_jax.config import load_experiment
from areal_jax.inference.sampling import SamplingParams
from areal_jax.jsonl import read_jsonl
from areal_jax.reporting.metric_keys import is_evaluation
from areal_jax.reporting.plots import run_series
from areal_jax.reporting.run_reporter import RunReporter, tensorboard_tag
from areal_jax.rollout.evaluation import EvalReport, EvalSample
from areal_jax.system import heldout_evaluator
from areal_jax.system.eval_results import (
    APPLIED_DURING,
    FinishedEvaluations,
    drop_evaluations_after,
    evaluated_versions,
    is_evaluated,
    write_evaluation,
)
from areal_jax.system.heldout_evaluator import THREAD_NAME, HeldoutEvaluator, eval_due
from areal_jax.system_config import ReportConfig

QUIET = ReportConfig(live="never", plots=False)


def _report(version: int, correct: bool = True) -> EvalReport:
    sample = EvalSample(0, "p0", "heldout", 0, "1+1", "2", float(correct), {}, correct, 1, "stop", False)
    return EvalReport.from_samples([sample], SamplingParams(temperature=0.0), 0.1, version)


def _cfg(tmp_path, every: int = 2, steps: int = 6):
    overrides = [f"output_dir={tmp_path}", "name=run", f"eval.every_steps={every}", f"train_steps={steps}"]
    return load_experiment("configs/train_cpu.yaml", overrides)


def _step_stats(step: int) -> dict[str, float]:
    return {"train/version": float(step), "rollout/reward_mean": 0.1 * step, "time/wall": float(step)}


def test_schedule_is_every_n_versions_from_zero_and_the_last(tmp_path):
    cfg = _cfg(tmp_path, every=4, steps=6)
    assert [v for v in range(8) if eval_due(cfg, v)] == [0, 4, 6, 7]
    assert not any(eval_due(_cfg(tmp_path, every=0), v) for v in range(8))


def test_a_summary_is_the_last_file_written_and_picked_up_once(tmp_path):
    directory = tmp_path / "eval"
    write_evaluation(directory, _report(2), 2, applied_during=1, thread="t")
    assert sorted(p.name for p in (directory / "step-2").iterdir()) == ["eval.json", "eval.md", "summary.json"]
    (directory / "step-4").mkdir()  # an evaluation still running: no summary yet
    finished = FinishedEvaluations(directory, recorded=[0])
    (version, scalars), *rest = finished.take()
    assert version == 2 and not rest
    assert scalars["eval/pass@1"] == 1.0 and scalars[APPLIED_DURING] == 1.0
    assert finished.take() == []  # recorded
    write_evaluation(directory, _report(4, correct=False), 4, applied_during=0, thread="t")
    assert [(v, s["eval/pass@1"]) for v, s in finished.take()] == [(4, 0.0)]
    drop_evaluations_after(directory, 2)
    assert evaluated_versions(directory) == [2] and is_evaluated(directory, 2) and not is_evaluated(directory, 4)


class _Generator:
    """What the evaluator reads of a generator: its version and its counters."""

    def __init__(self, version: int):
        self.version = version
        self.stats = types.SimpleNamespace(emitted_tokens=0)


def test_the_evaluator_thread_runs_due_versions_newest_first_when_behind(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, every=2, steps=6)
    generator = _Generator(version=0)
    release = threading.Event()
    ran: list[tuple[int, str]] = []

    def fake_evaluate(gen, workflow, prompts, config, seed):
        ran.append((gen.version, threading.current_thread().name))
        release.wait(10)
        return _report(gen.version)

    monkeypatch.setattr(heldout_evaluator, "evaluate", fake_evaluate)
    evaluator = HeldoutEvaluator(cfg, generator, workflow=None, heldout=["p"] * 3)  # type: ignore[arg-type]
    evaluator.start()
    evaluator.submit_if_due(0)
    while not ran:  # version 0 is being evaluated; versions 1..4 arrive meanwhile
        threading.Event().wait(0.01)
    for version in (1, 2, 3, 4):
        generator.version = version
        evaluator.submit_if_due(version)  # 2 and 4 are due; 2 is skipped: evaluations fall behind
    release.set()
    evaluator.finish()
    assert evaluated_versions(cfg.layout.eval_dir) == [0, 4]
    assert {thread for _, thread in ran} == {THREAD_NAME}
    summaries = FinishedEvaluations(cfg.layout.eval_dir, recorded=[]).take()
    assert [(v, s[APPLIED_DURING]) for v, s in summaries] == [(0, 4.0), (4, 0.0)]
    evaluator.submit_if_due(4)  # finished before (a resumed run's starting version): not again
    evaluator.close()
    assert len(ran) == 2 and not evaluator.is_alive()


def test_reporter_writes_late_evaluations_at_their_steps_once_across_a_resume(tmp_path):
    with RunReporter(QUIET, tmp_path, total_steps=6) as reporter:
        for step in (1, 2, 3):
            reporter.log(step, _step_stats(step))
        reporter.log_evaluation(0, {"eval/pass@1": 0.25})  # the starting policy's, finished after step 3
        reporter.log_evaluation(2, {"eval/pass@1": 0.5})
        reporter.log(4, _step_stats(4))
        assert reporter.heldout == 0.5 and reporter.evaluated_steps() == {0, 2}
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(m["train/version"], is_evaluation(m)) for m in lines] == [
        (1, False),
        (2, False),
        (3, False),
        (0, True),
        (2, True),
        (4, False),
    ]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {p.step: p.value for p in events.Scalars(tensorboard_tag("eval/pass@1"))} == {0: 0.25, 2: 0.5}

    series = run_series(reporter.history)
    assert list(series["step"]) == [0, 1, 2, 3, 4]
    np.testing.assert_equal(series["eval/pass@1"], [0.25, np.nan, 0.5, np.nan, np.nan])

    # resumed from the checkpoint of step 2: the evaluations up to it stay recorded, later lines go
    with RunReporter(QUIET, tmp_path, total_steps=6, start_step=2) as resumed:
        assert resumed.evaluated_steps() == {0, 2} and resumed.heldout == 0.5
        finished = FinishedEvaluations(tmp_path / "eval", resumed.evaluated_steps())
        write_evaluation(tmp_path / "eval", _report(2), 2, applied_during=0, thread="t")  # again: not recorded
        assert finished.take() == []
    assert [m["train/version"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 0, 2]
