"""The README's main job (configs/chain_sums_cpu.yaml: a supervised warm start, then asynchronous RL on
the embedded running-sums task) for a handful of steps: the live display, the TensorBoard event file,
metrics.jsonl and the plots are written and agree on the values of the last step."""

from __future__ import annotations

import json
import math
import re

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal_jax.config import load_experiment
from areal_jax.jobs.train import run_async
from areal_jax.reporting.run_reporter import tensorboard_tag

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 4
SMALL = [
    f"train_steps={STEPS}",
    "warm_start.steps=4",
    "warm_start.heldout_examples=8",
    "dataset.heldout=8",
    "rollout.staleness.batch_prompts=2",
    "rollout.workflow.n_samples=2",
    "rollout.engine.max_slots=8",
    "rollout.engine.max_prefill_batch=2",  # 3 row buckets fewer to compile at warm-up
    "rollout.staleness.max_head_offpolicyness=2",
    "rollout.staleness.max_concurrent=8",
    "trainer.packing.token_budget=512",
    "trainer.packing.rows=4",
    f"train_checkpoint.every_steps={STEPS}",
    f"eval.every_steps={STEPS}",
    "report.live=always",
]


def test_default_task_display_tensorboard_metrics_and_plots_agree(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the display's width: one line per row of labels
    cfg = load_experiment("configs/chain_sums_cpu.yaml", [*SMALL, f"output_dir={tmp_path}"])
    summary = run_async(cfg)
    captured = capsys.readouterr()
    run_dir = cfg.run_dir
    assert summary.version == STEPS

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/version"] for m in metrics] == list(range(1, STEPS + 1))
    last = metrics[-1]
    assert "eval_before/pass@1" in metrics[0] and "eval/pass@1" in last

    # the display's last frame (rich prints it when the live display stops) shows the last step's values
    display = captured.err
    assert f"step {STEPS}/{STEPS}" in display
    for label, key, spec in (
        ("reward", "rollout/reward_mean", ".3f"),
        ("correct", "rollout/correct_mean", ".3f"),
        ("held-out pass@1", "eval/pass@1", ".3f"),
        ("interruptions", "generator/interruptions", ".0f"),
    ):
        shown = re.search(rf"{re.escape(label)}\s+(\S+)", display)
        assert shown is not None, f"{label!r} missing from the display:\n{display}"
        assert shown.group(1) == format(last[key], spec), (label, shown.group(1), last[key])
    staleness = re.search(r"staleness mean/max\s+(\S+) / (\S+)", display)
    expected = (format(last["rollout/staleness_mean"], ".2f"), format(last["rollout/staleness_max"], ".0f"))
    assert staleness is not None and staleness.groups() == expected

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("rollout/reward_mean", "rollout/correct_mean", "rollout/staleness_mean", "train/loss", "eval/pass@1"):
        points = {p.step: p.value for p in events.Scalars(tensorboard_tag(key))}
        assert tensorboard_tag(key) in tags and sorted(points)[-1] == STEPS
        assert math.isclose(points[STEPS], last[key], rel_tol=1e-6, abs_tol=1e-6), key

    plots = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert plots == ["reward.png", "staleness.png", "throughput.png"]
    assert all((run_dir / "plots" / name).read_bytes()[:8] == PNG_MAGIC for name in plots)
    assert "plots:" in captured.out and str(run_dir / "metrics.jsonl") in captured.out  # the closing summary
