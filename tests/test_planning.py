"""`areal-jax plan`: the step-time model against its formula restated in NumPy, calibration read from run
directories in the real format (config.yaml, metrics.jsonl, control/resources-<role>.json) against numbers
computed by hand, and the refusals of bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.configuration import to_yaml
from areal_jax.planning.architecture import on_platform
from areal_jax.planning.calibration import CalibrationError, read_calibration
from areal_jax.planning.layouts import tiled_elements
from areal_jax.planning.memory import plan_for_shapes
from areal_jax.planning.plan import make_plan
from areal_jax.planning.step_model import Measured, Workload, every_split, fastest, predict, side_rate

CONFIG = "configs/train_cpu.yaml"
OVERRIDES = ["rollout.staleness.batch_prompts=8", "rollout.workflow.n_samples=8"]


@pytest.mark.parametrize("eta", [0, 3])
def test_every_split_matches_the_formula(eta):
    measured = Measured(gen={1: 400.0}, train={1: 900.0}, overhead_s=0.2, handoff_s=0.3)
    work = Workload(samples=64, gen_tokens_per_sample=24, train_tokens_per_sample=33, eta=eta)
    rows = every_split(work, 8, measured)
    d_gen = np.arange(1, 8)
    gen = 64 * 24 / (400 * d_gen)
    train = 64 * 33 / (900 * (8 - d_gen))
    expected = gen + 0.3 + train + 0.2 if eta == 0 else np.maximum(gen, train + 0.2)
    np.testing.assert_allclose([r.step_s for r in rows], expected)
    np.testing.assert_allclose([r.gen_s for r in rows], gen)
    np.testing.assert_allclose([r.train_s for r in rows], train)
    assert [r.train_units for r in rows] == list(8 - d_gen)
    best = fastest(rows)
    assert best.gen_units == d_gen[np.argmin(expected)] == 4  # neither end: the sides balance in the middle
    if eta:
        assert [r.bottleneck for r in rows] == ["generation"] * 4 + ["training"] * 3


def test_colocated_takes_turns_on_every_unit():
    measured = Measured(gen={2: 1000.0}, train={2: 500.0}, overhead_s=0.1, handoff_s=0.05)
    for eta, handoff in ((0, 0.05), (2, 0.0)):
        work = Workload(samples=10, gen_tokens_per_sample=20, train_tokens_per_sample=30, eta=eta)
        row = predict(measured, work, 4, 4, colocated=True)  # 4 units: twice the measured 2, linearly
        assert row.step_s == pytest.approx(200 / 2000 + 300 / 1000 + 0.1 + handoff)
        assert row.label == "colocated on 4"


def test_side_rate_interpolates_between_measured_counts_and_scales_linearly_outside():
    assert side_rate({2: 100.0}, 2) == 100.0
    assert side_rate({2: 100.0}, 6) == pytest.approx(300.0)
    assert side_rate({2: 100.0}, 1) == pytest.approx(50.0)
    measured = {1: 100.0, 4: 160.0, 8: 200.0}  # sublinear, as measured
    assert side_rate(measured, 2) == pytest.approx(120.0)
    assert side_rate(measured, 6) == pytest.approx(180.0)
    assert side_rate(measured, 16) == pytest.approx(400.0)


def _write_run(
    run_dir: Path, *, eta: int = 0, trainer_cores=(0,), rollout_cores=(1,), steps: int = 8, keys_missing=()
) -> None:
    """A finished run's files in the real format: 2 s steps of 1.2 s training, 0.5 s batch wait and 0.3 s
    host work (step 5 compiled: 9 s), 64 samples of 33 tokens (24 generated), the generator at 15360 tok/s."""
    cfg = load_experiment(
        CONFIG, [*OVERRIDES, f"rollout.staleness.max_head_offpolicyness={eta}", f"output_dir={run_dir.parent}"]
    )
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    lines, wall = [], 10.0
    for step in range(1, steps + 1):
        train = 9.0 if step == 5 else 1.2
        wall += train + 0.5 + 0.3
        line = {
            "train/version": float(step),
            "time/wall": wall,
            "train/step_time": train,
            "time/batch_wait": 0.5,
            "batch/tokens": 2112.0,
            "batch/sequences": 64.0,
            "rollout/response_length_mean": 24.0,
            "generator/emitted_tokens": 1536.0 * step,
            "generator/busy_seconds": 0.1 * step,
        }
        lines.append({k: v for k, v in line.items() if k not in keys_missing})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    control = run_dir / "control"
    control.mkdir()
    for role, cores in (("trainer-0", trainer_cores), ("rollout-0", rollout_cores)):
        record = {"host": "h", "pid": 1, "platform": "cpu", "device_kind": "cpu", "devices": [0], "cores": list(cores)}
        (control / f"resources-{role}.json").write_text(json.dumps(record))


def test_calibration_reads_a_split_run(tmp_path):
    _write_run(tmp_path / "split")
    c = read_calibration(tmp_path / "split", skip=2)
    assert (c.unit, c.gen_units, c.train_units, c.colocated, c.eta) == ("cores", 1, 1, False, 0)
    assert c.steps == 6 and c.samples_per_step == 64
    assert c.gen_tokens_per_s == pytest.approx(1536 / 0.1)
    assert c.train_tokens_per_s == pytest.approx(2112 / 1.2)  # the median step: the compiling one left out
    assert c.overhead_s == pytest.approx(0.3)
    assert c.handoff_s == pytest.approx(0.5 - 64 * 24 / 15360)
    assert c.step_s == pytest.approx(2.0)
    assert (c.gen_tokens_per_sample, c.train_tokens_per_sample) == (24, 33)


def test_calibration_reads_a_run_on_a_bucket_as_on_a_disk(tmp_path, gcs):
    from areal_jax import storage
    from tests.gcs_emulator import BUCKET

    _write_run(tmp_path / "split")
    remote = f"gs://{BUCKET}/{tmp_path.name}/split"
    storage.upload_tree(tmp_path / "split", remote)
    local, bucket = read_calibration(tmp_path / "split", skip=2), read_calibration(remote, skip=2)
    assert dataclasses.replace(bucket, run_dir=local.run_dir) == local
    with pytest.raises(CalibrationError, match="not a directory"):
        read_calibration(f"gs://{BUCKET}/{tmp_path.name}/nothing")


def test_calibration_counts_every_process_of_a_rollout_server(tmp_path):
    """A rollout server over two hosts records one file per process (`rollout-0`, `rollout-0.1`): both count."""
    _write_run(tmp_path / "two-hosts", rollout_cores=(1,))
    record = {"host": "h2", "pid": 2, "platform": "cpu", "device_kind": "cpu", "devices": [0], "cores": [1]}
    (tmp_path / "two-hosts" / "control" / "resources-rollout-0.1.json").write_text(json.dumps(record))
    c = read_calibration(tmp_path / "two-hosts", skip=2)
    assert (c.gen_units, c.train_units, c.colocated) == (2, 1, False)  # core 1 of host h and of host h2


def test_calibration_takes_the_asked_quantile_of_the_steps(tmp_path):
    _write_run(tmp_path / "split")
    slowest = read_calibration(tmp_path / "split", skip=2, quantile=1.0)
    assert slowest.train_tokens_per_s == pytest.approx(2112 / 9.0)  # the step that compiled
    assert slowest.step_s == pytest.approx(9.8)
    with pytest.raises(ValueError, match="quantile 0 is not in"):
        read_calibration(tmp_path / "split", quantile=0)


def test_calibration_of_a_colocated_run(tmp_path):
    _write_run(tmp_path / "colocated", trainer_cores=(0, 1), rollout_cores=(0, 1))
    c = read_calibration(tmp_path / "colocated", skip=2)
    assert (c.gen_units, c.train_units, c.colocated) == (2, 2, True)
    _write_run(tmp_path / "overlapping", eta=2, trainer_cores=(0, 1), rollout_cores=(0, 1))
    with pytest.raises(CalibrationError, match="shared their cores with eta 2"):
        read_calibration(tmp_path / "overlapping")


def test_bad_calibration_directories_are_refused(tmp_path):
    with pytest.raises(CalibrationError, match="is not a directory"):
        read_calibration(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match=r"no config\.yaml"):
        read_calibration(tmp_path / "empty")
    _write_run(tmp_path / "short", steps=4)
    with pytest.raises(CalibrationError, match="has 4 steps; a calibration needs at least 5"):
        read_calibration(tmp_path / "short")
    _write_run(tmp_path / "old", keys_missing=("time/batch_wait", "generator/busy_seconds"))
    with pytest.raises(CalibrationError, match="lacks time/batch_wait, generator/busy_seconds"):
        read_calibration(tmp_path / "old")
    _write_run(tmp_path / "unrecorded")
    (tmp_path / "unrecorded" / "control" / "resources-rollout-0.json").unlink()
    with pytest.raises(CalibrationError, match="no record of the resources of rollout-0"):
        read_calibration(tmp_path / "unrecorded")
    _write_run(tmp_path / "stopped")
    (tmp_path / "stopped" / "metrics.jsonl").unlink()
    with pytest.raises(CalibrationError, match=r"no metrics\.jsonl"):
        read_calibration(tmp_path / "stopped")


def test_plan_uses_each_topology_and_recommends_the_fastest(tmp_path):
    _write_run(tmp_path / "split")
    _write_run(tmp_path / "colocated", trainer_cores=(0, 1), rollout_cores=(0, 1))
    calibrations = [read_calibration(tmp_path / name, skip=2) for name in ("split", "colocated")]
    cfg = load_experiment(CONFIG, OVERRIDES)
    plan = make_plan(cfg, calibrations, devices=4, eta=2, batch_prompts=16)
    assert [row.label for row in plan.rows] == ["1 : 3", "2 : 2", "3 : 1", "colocated on 4"]
    work = Workload(128, 24, 33, eta=2)
    split = Measured({1: 1536 / 0.1}, {1: 2112 / 1.2}, overhead_s=0.3, handoff_s=0.5 - 0.1)
    assert plan.rows[1].step_s == pytest.approx(predict(split, work, 2, 2).step_s)
    lines = plan.lines()
    assert any("no split run with eta >= 1 measured" in line for line in lines)
    best = fastest(plan.rows)
    assert lines[-1] == f"recommended: {best.gen_units} inference : {best.train_units} training, " + (
        f"predicted step {best.step_s:.2f} s"
    )
    other_model = load_experiment(CONFIG, [*OVERRIDES, "model.num_layers=3"])
    with pytest.raises(CalibrationError, match="trained another model"):
        make_plan(other_model, calibrations, devices=4)


def test_the_plan_command(tmp_path, capsys):
    _write_run(tmp_path / "split")
    args = ["plan", CONFIG, *OVERRIDES, "--calibration", str(tmp_path / "split"), "--devices", "3"]
    assert main([*args, "--skip-steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("recommended: ") and "inference : " in out[-1]
    assert main(["plan", CONFIG, "--calibration", str(tmp_path / "none"), "--devices", "2"]) == 2
    assert "areal-jax plan: calibration: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", CONFIG, "--calibration", str(tmp_path / "split"), "--devices", "1"])
    assert exit_info.value.code == 2
    assert "a split needs at least 2" in capsys.readouterr().err


def test_tpu_tiles_pad_the_dims_that_pad_least():
    """TPU's 8 x 128 tiles on the two dims that pad least (the layouts XLA:TPU gave these shapes' arguments in
    `areal-jax compile`'s HLO); other platforms store arrays exact."""
    assert tiled_elements((512, 32), "tpu") == 512 * 32  # {0,1:T(8,128)}: the vocab in the lanes
    assert tiled_elements((16, 2, 32, 32), "tpu") == 16 * 2 * 32 * 128  # a cache segment of head dim 32: 4x
    assert tiled_elements((24, 896, 2, 9, 64), "tpu") == 24 * 896 * 2 * 9 * 64  # 896 lanes, 64 sublanes
    assert tiled_elements((16,), "tpu") == 128 and tiled_elements((16, 2), "tpu") == 2 * 128  # T(128), T(2,128)
    assert tiled_elements((16, 2, 32, 32), "cpu") == 16 * 2 * 32 * 32


def test_tpu_plan_counts_gradient_buffers_and_one_engine_program_at_a_time():
    """On TPU: one gradient-sized buffer for one micro-batch (clipped in place), three for several (accumulator,
    micro-batch gradient, clipped output); the engine's larger of prefill and decode step, not their sum; no
    flat overhead line; the CPU plan unchanged."""
    tiny = ["model.hidden_size=128", "model.intermediate_size=320", "model.num_layers=2", "model.vocab_size=512"]
    shape = {"data": 1, "fsdp": 4, "tensor": 1}

    def lines(overrides: list[str], platform: str) -> dict[str, dict[str, int]]:
        cfg = load_experiment(CONFIG, [*tiny, "model.max_position_embeddings=128", *overrides])
        plan = plan_for_shapes(cfg, on_platform(cfg.model, platform), platform, shape, shape)
        return {side.side: {item.name.split(" (")[0]: item.bytes for item in side.items} for side in plan.sides}

    one = lines(["trainer.packing.rows=8", "rollout.staleness.batch_prompts=1"], "tpu")
    several = lines(["trainer.packing.rows=8", "rollout.staleness.batch_prompts=8"], "tpu")
    assert one["trainer"]["gradients"] * 3 == several["trainer"]["gradients"] == 3 * one["trainer"]["Adam moments"] // 2
    assert "compiled code" in one["trainer"] and not any(name.startswith("XLA") for name in one["trainer"])
    engine = one["inference"]
    assert ("prefill temporaries" in engine) != ("decode logits and sampling" in engine)
    cpu = lines(["trainer.packing.rows=8", "rollout.staleness.batch_prompts=1"], "cpu")
    assert "XLA temporaries and transient copies" in cpu["trainer"] and "compiled code" not in cpu["trainer"]
    assert {"prefill temporaries", "decode logits and sampling"} <= set(cpu["inference"])


def test_the_30b_mixture_fits_a_v5p_64_by_its_all_to_all_dispatch(capsys):
    """Qwen3-30B-A3B's TPU recipe: megablox resolves the dispatch to the all-to-all, whose rows a chip holds are its
    own 32,768 tokens x top-8 (one round's received rows at a time), not its expert group's 16 x that; the plan
    fits it on v5p-64 (XLA:TPU compiled one such layer's forward and gradient in 8.5 GiB of temporaries against the
    all-gather's 76.3: docs/moe.md)."""
    # no checkpoint here: the shapes come from its config.json kept in configs/sizing/Qwen3-30B-A3B
    args = ["plan", "--memory", "configs/recipes/qwen3_30b_a3b_deepscaler_tpu.yaml", "--topology", "v5p-64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    trainer = out.split("trainer:")[1].split("inference:")[0]
    activations = float(trainer.split("activations (32768 tokens, remat full)")[1].split("GiB")[0])
    total = float(trainer.split("total")[1].split("GiB")[0])
    assert 15 < activations < 30 and 50 < total < 87.4, trainer  # 87.4 GiB usable of a v5p chip's 95.74


def test_the_30b_mixture_is_refused_on_gpus_for_its_all_gather_dispatch(capsys):
    """On GPUs (ragged_dot: the all-gather dispatch, XLA's partitioning) each trainer device gathers its expert
    group's 16 x 32,768 tokens to dispatch them, which XLA:TPU's compiler measured at 160.93 GB a chip for the
    same rows; the plan counts it and refuses the run (docs/moe.md)."""
    config, hardware = (
        "configs/sizing/qwen3_30b_a3b_deepscaler_gpu.yaml",
        ["--devices", "32", "--device-memory-gib", "80"],
    )
    args = ["plan", "--memory", config, *hardware]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "trainer.packing.token_budget" in err and "largest: activations (32768 tokens, remat full)" in err
    needed = float(err.split("the run needs about ")[1].split(" GiB")[0])
    assert 140 < needed < 175, needed  # the rollout side alone would fit
