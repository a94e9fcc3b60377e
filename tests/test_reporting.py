"""RunReporter: metrics.jsonl, TensorBoard, the live display and the plots agree on every step's values;
train.log receives the run's log records; a resumed run continues the files."""

import io
import json
import logging
import subprocess
import sys
import types

import numpy as np
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal_jax.configuration import ConfigError
from areal_jax.reporting.run_reporter import RunReporter, tensorboard_tag
from areal_jax.system_config import ReportConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _stats(step: int, wall_start: float = 0.0, shift: float = 0.0) -> dict[str, float]:
    """A step's stats as the trainer loop passes them (wall time and generator counters of one process)."""
    stats = {
        "rollout/reward_mean": 0.1 * step + shift,
        "rollout/correct_mean": 0.05 * step,
        "rollout/staleness_mean": 0.25 * step,
        "rollout/staleness_max": float(step % 3),
        "train/loss": 1.0 / step,
        "train/throughput": 1000.0 + 10 * step,
        "train/version": float(step),
        "train/step_time": 0.5,
        "generator/emitted_tokens": 300.0 * (step - wall_start / 2),
        "generator/interruptions": float(2 * step),
        "generator/queue": float(step % 4),
        "time/wall": 2.0 * step - wall_start,
        "pipeline/kept_by_staleness/0": 8.0 * step,
        "pipeline/kept_by_staleness/1": 3.0 * step,
    }
    if step % 5 == 0:
        stats["eval/pass@1"] = 0.125 + shift
    return stats


def _scalars(tensorboard_dir) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    scalars = {}
    for tag in events.Tags()["scalars"]:
        points = events.Scalars(tag)
        steps = [p.step for p in points]
        assert len(steps) == len(set(steps)), f"{tag}: a step shown twice: {steps}"
        scalars[tag] = {p.step: p.value for p in points}
    return scalars


def _metrics(run_dir) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _render(renderable) -> str:
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_outputs_agree_on_the_last_step(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO)
    console_handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(console_handler)
    live_console = Console(record=True, width=160, file=io.StringIO())
    run_dir = tmp_path / "run"
    try:
        reporter = RunReporter(ReportConfig(live="always"), run_dir, total_steps=10, console=live_console)
        assert console_handler not in root.handlers  # the display owns the terminal; records go to train.log
        for step in range(1, 6):
            reporter.log(step, _stats(step))
        logging.getLogger("areal_jax.test").warning("a warning during the run")
        assert "a warning during the run" in (run_dir / "train.log").read_text()
        table = _render(reporter.renderable())
        reporter.close(["checkpoints: run/checkpoints (step 5)", "hf_final: run/hf_final"])
        assert console_handler in root.handlers
    finally:
        root.removeHandler(console_handler)

    last = _stats(5)
    assert _metrics(run_dir)[-1] == last
    scalars = _scalars(run_dir / "tensorboard")
    assert tensorboard_tag("eval/pass@1") == "eval/pass_1"
    assert set(scalars) == {tensorboard_tag(key) for key in last}
    for key, value in last.items():
        points = scalars[tensorboard_tag(key)]
        assert sorted(points) == ([5] if key == "eval/pass@1" else [1, 2, 3, 4, 5])
        assert points[5] == pytest.approx(value, rel=1e-6), key

    shown = reporter.display_values
    expected = {
        "step": "5/10",
        "reward": f"{last['rollout/reward_mean']:.3f}",
        "correct": f"{last['rollout/correct_mean']:.3f}",
        "held-out pass@1": f"{last['eval/pass@1']:.3f}",
        "staleness mean/max": f"{last['rollout/staleness_mean']:.2f} / {last['rollout/staleness_max']:.0f}",
        "generation tok/s": f"{300 / 2:,.0f}",  # 300 tokens more over 2 s more
        "training tok/s": f"{last['train/throughput']:,.0f}",
        "queue": f"{last['generator/queue']:.0f}",
        "interruptions": f"{last['generator/interruptions']:.0f}",
    }
    assert {k: shown[k] for k in expected} == expected
    final_display = live_console.export_text()
    for label, text in expected.items():
        assert f"{label} {text}" in " ".join(table.split()), label
        assert f"{label} {text}" in " ".join(final_display.split()), label

    series = reporter.plot_data
    assert series["step"][-1] == 5
    for key in ("rollout/reward_mean", "rollout/correct_mean", "eval/pass@1", "train/throughput"):
        assert series[key][-1] == pytest.approx(last[key])
    assert series["generation_tokens_per_s"][-1] == pytest.approx(150.0)
    assert dict(zip(series["staleness"], series["kept"], strict=True)) == {0: 40.0, 1: 15.0}
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["reward.png", "staleness.png", "throughput.png"]
    for path in reporter.plots:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, path

    log = (run_dir / "train.log").read_text()
    assert "step 5/10 reward 0.500" in log and "a warning during the run" in log
    logging.getLogger("areal_jax.test").warning("after the run")
    assert "after the run" not in (run_dir / "train.log").read_text()  # the handler left with close()

    summary = capsys.readouterr().out
    for name in ("metrics.jsonl", "tensorboard", "train.log", "reward.png", "staleness.png", "throughput.png"):
        assert str(run_dir / name) in summary or name in summary, name
    assert "checkpoints: run/checkpoints (step 5)" in summary and "hf_final: run/hf_final" in summary


def test_resume_continues_metrics_and_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    quiet = ReportConfig(live="never", plots=False)
    with RunReporter(quiet, run_dir, total_steps=7) as first:
        for step in range(1, 6):
            first.log(step, _stats(step))
    with RunReporter(quiet, run_dir, total_steps=7, start_step=5) as second:  # checkpoint at step 5
        for step in (6, 7):
            second.log(step, _stats(step, wall_start=10.0))
    # The second process stopped after step 7 with its newest checkpoint at step 6: step 7 is trained again.
    third = RunReporter(ReportConfig(live="never"), run_dir, total_steps=7, start_step=6)
    third.log(7, _stats(7, wall_start=12.0, shift=1.0))
    third.close()

    metrics = _metrics(run_dir)
    assert [m["train/version"] for m in metrics] == [1, 2, 3, 4, 5, 6, 7]
    assert metrics[-1] == _stats(7, wall_start=12.0, shift=1.0)
    rewards = _scalars(run_dir / "tensorboard")["rollout/reward_mean"]
    assert sorted(rewards) == [1, 2, 3, 4, 5, 6, 7]
    assert rewards[7] == pytest.approx(1.7) and rewards[6] == pytest.approx(0.6)
    assert len(list((run_dir / "tensorboard").iterdir())) == 3  # one event file per process
    assert np.all(np.diff(third.plot_data["wall"]) > 0)  # one time axis across the three processes
    assert third.plot_data["rollout/reward_mean"][-1] == pytest.approx(1.7)


def test_wandb_is_optional_and_logs_every_step(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ConfigError, match=r"report\.wandb_project.*pip install wandb"):
        RunReporter(ReportConfig(wandb_project="p"), tmp_path / "a", total_steps=1)
    assert not (tmp_path / "a").exists()

    calls = []

    class FakeRun:
        url = "https://wandb.example/run"

        def log(self, stats, step=None):
            calls.append(("log", step, stats.get("rollout/reward_mean", stats.get("eval/step"))))

        def define_metric(self, name, step_metric=None):
            calls.append(("define_metric", name, step_metric))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs["project"], kwargs["id"], kwargs["resume"], kwargs["config"]))
        return FakeRun()

    fake = types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: "abc123"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = ReportConfig(wandb_project="p", live="never", plots=False)
    with RunReporter(config, tmp_path / "b", total_steps=2, hparams={"seed": 1}) as reporter:
        reporter.log(1, _stats(1))
    fake.util.generate_id = lambda: "other"
    with RunReporter(config, tmp_path / "b", total_steps=2, start_step=1) as reporter:  # resumed: the same W&B run
        reporter.log(2, _stats(2))
        reporter.log_evaluation(0, {"eval/pass@1": 0.5})  # a late evaluation: on its own axis, `eval/step`
    metrics = [("define_metric", "eval/step", None), ("define_metric", "eval/*", "eval/step")]
    assert calls == [
        ("init", "p", "abc123", "allow", {"seed": 1}),
        *metrics,
        ("log", 1, pytest.approx(0.1)),
        ("finish",),
        ("init", "p", "abc123", "allow", {}),
        *metrics,
        ("log", 2, pytest.approx(0.2)),
        ("log", None, 0),
        ("finish",),
    ]


def test_report_config_refuses_an_unknown_live_mode():
    with pytest.raises(ConfigError, match="live"):
        ReportConfig(live="sometimes")


def test_before_the_first_step_the_live_display_shows_what_the_start_is_doing(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    console = Console(record=True, width=160, file=io.StringIO())
    reporter = RunReporter(ReportConfig(live="always", plots=False), tmp_path / "run", total_steps=3, console=console)
    try:
        logging.getLogger("areal_jax.inference.engine").info("engine warm-up: compiling 27 programs, tasks: 3/15")
        shown = _render(reporter.renderable())
    finally:
        reporter.close([])
    assert "waiting for the first step (engine warm-up: compiling 27 programs, tasks: 3/15)" in shown


def test_step_records_warn_of_heavy_rejection_and_truncation_at_most_every_50_steps(tmp_path, caplog):
    from areal_jax.config import load_experiment
    from areal_jax.system.step_report import StepRecords

    overrides = [f"output_dir={tmp_path}", "report.live=never", "report.plots=false"]
    cfg = load_experiment("configs/train_cpu.yaml", overrides)
    cfg.run_dir.mkdir(parents=True)
    records = StepRecords(cfg, RunReporter(cfg.report, cfg.run_dir, 200), started=0.0)
    steps = [(1, 0.9, 0.0), (2, 0.9, 0.0), (51, 0.4, 0.0), (52, 0.9, 0.8), (53, 0.9, 0.8), (102, 0.6, 0.0)]
    with caplog.at_level(logging.WARNING, logger="areal_jax.system.step_report"):
        for version, rejected, truncated in steps:
            stats = {"train/version": float(version), "rollout/truncated_share": truncated}
            stats["correction/seq/rejected_frac"] = rejected
            records.write(version, stats, batch=[])
    records.close([])
    rejection = [r.message for r in caplog.records if "rollout_correction left" in r.message]
    truncation = [r.message for r in caplog.records if "hit a length limit" in r.message]
    # logged when above one half, then not again for 50 steps; each warning keeps its own clock
    assert [m.split("%")[0].split()[-1] for m in rejection] == ["90", "90", "60"], rejection
    assert len(truncation) == 1 and truncation[0].startswith("80%"), truncation


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports torch whenever it is installed (it is, for the parity tests): 5-7 s of every
    `areal-jax` process's start-up and 2-3 s of its exit, for tensors a run never hands it."""
    script = (
        "import sys\n"
        "from areal_jax.reporting.run_reporter import RunReporter\n"
        "from areal_jax.system_config import ReportConfig\n"
        "with RunReporter(ReportConfig(live='never', plots=False), sys.argv[1], total_steps=1) as r:\n"
        "    r.log(1, {'train/loss': 0.5})\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars(tensorboard_tag("train/loss"))] == [0.5]
