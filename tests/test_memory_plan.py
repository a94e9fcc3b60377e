"""The memory plan: its terms follow the config, it refuses what cannot fit naming keys, and on two
vocabulary-heavy configs it is within 25% of the peak RSS of a real `areal-jax train` process (through its first
step, where that peak is)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.planning.memory import GIB, plan_memory
from areal_jax.sharding import MeshConfig, make_mesh
from tests.xla_flags import xla_flags

BASE = "configs/train_cpu.yaml"
# Models whose state (params, Adam, gradients: ~5x the params) dwarfs the process's runtime, compiled fast
# (2 layers): most parameters are the embedding and the untied head.
HEAVY = [
    "model.vocab_size=160000",
    "model.hidden_size=384",
    "model.intermediate_size=512",
    "model.num_heads=4",
    "model.num_kv_heads=2",
]
RUN = ["train_steps=1", "eval.every_steps=0", "dataset.heldout=0", "report.plots=false", "report.live=never"]
# one prefill row bucket, not three: the run's time is mostly compiles, its peak the train step's
RUN += ["rollout.engine.max_prefill_batch=1"]
# The plan counts the largest micro-batch the packing can produce (8 rows x 128); a one-step run of short answers
# packs smaller ones unless every micro-batch is padded to that shape.
LARGEST_MICROBATCH = ["trainer.packing.min_row_length=128", "trainer.packing.min_rows=8"]


def _single_device_plan(overrides: list[str]):
    cfg = load_experiment(BASE, overrides)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    return cfg, plan_memory(cfg, cfg.model, mesh, mesh)


def _items(plan) -> dict[str, int]:
    return {item.name.split(" (")[0]: item.bytes for side in plan.sides for item in side.items}


def test_terms_follow_the_config():
    _, plan = _single_device_plan(HEAVY)
    items = _items(plan)
    params = load_experiment(BASE, HEAVY).model.num_params() * 4
    assert items["params"] == params and items["Adam moments"] == 2 * params
    assert items["engine weights"] == params  # compute_dtype auto is float32 on CPU: the params as they are
    _, bf16 = _single_device_plan([*HEAVY, "model.compute_dtype=bfloat16"])
    assert _items(bf16)["engine weights"] == params // 2  # the engine's serving copy
    assert _items(bf16)["f32 copies of bf16 weights"] == params  # XLA:CPU converts them at every call
    _, longer = _single_device_plan([*HEAVY, "rollout.engine.max_length=64", "model.max_position_embeddings=64"])
    assert _items(longer)["KV cache"] == 2 * items["KV cache"]
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4])
    cfg = load_experiment(BASE, HEAVY)
    four = plan_memory(cfg, cfg.model, mesh, None)
    assert _items(four)["params"] == params // 4 and len(four.sides) == 1


def test_a_run_that_cannot_fit_is_refused_naming_keys(capsys):
    too_big = [*HEAVY, "model.vocab_size=4000000", "model.hidden_size=1024"]
    _, plan = _single_device_plan(too_big)
    with pytest.raises(ConfigError, match=r"model\.param_dtype") as err:
        plan.check(24 * GIB)
    assert "GiB of host memory" in str(err.value) and "plan --memory" in str(err.value)
    assert main(["plan", "--memory", BASE, *too_big]) == 2
    assert "the run needs about" in capsys.readouterr().err
    assert main(["train", BASE, *too_big, "output_dir=/nonexistent-never-written"]) == 2  # before anything loads


# The run's peak is its first train step (with the tests' configs: 4.08 GiB in the step, then 3.1-3.3 GiB while it
# checkpoints 1.5 GB and exports, sampled at 4 Hz on 2026-12-04), so the measured process is killed once the step is
# logged: the checkpoint, the export and the shutdown after it (~10 s a run, ~20 s beside the suite) measure nothing.
_PEAK_OF_FIRST_STEP = (
    "import resource, subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[1:], stderr=subprocess.PIPE, text=True)\n"
    "tail = []\n"
    "for line in child.stderr:\n"
    "    tail = [*tail[-60:], line]\n"
    "    if 'trainer: step 1: loss' in line:\n"
    "        child.kill()\n"
    "        break\n"
    "code = child.wait()\n"
    "stepped = 'trainer: step 1: loss' in tail[-1] if tail else False\n"
    "sys.stderr.write(''.join(tail))\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, int(stepped), code)\n"
)


def _measured_peak_rss(tmp_path, overrides: list[str]) -> int:
    """Peak RSS (bytes) of an `areal-jax train` process through its first train step, from the kernel's
    accounting of the finished (killed) child."""
    command = [sys.executable, "-m", "areal_jax.cli", "train", BASE, *overrides, f"output_dir={tmp_path}"]
    # one CPU device, as the plan is made for, and XLA:CPU's own fusion emitters, as on a user's machine (the
    # suite's classic ones fuse less, a lower peak); LLVM's level does not move buffers
    env = {**os.environ, "XLA_FLAGS": xla_flags(1, classic_emitters=False)}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_FIRST_STEP, *command], capture_output=True, text=True, timeout=600, env=env
    )
    peak, stepped, code = out.stdout.strip().splitlines()[-1].split()
    assert stepped == "1", f"the run ended (exit {code}) before its first step:\n{out.stderr[-3000:]}"
    return int(peak)


@pytest.mark.parametrize(
    "extra",
    [
        # a mini-batch of 8 sequences in 8 rows always packs into one micro-batch: planned and run without an
        # accumulator (the plan counts one for the worst packing of a bigger batch, which a one-step run may not meet)
        ["model.remat=none", "rollout.staleness.batch_prompts=1"],
        ["model.remat=full", "model.hidden_size=512", "model.vocab_size=120000"],
    ],
    ids=["160k-vocab-384-wide", "120k-vocab-512-wide-remat"],
)
def test_plan_is_within_25_percent_of_the_measured_peak(tmp_path, extra):
    overrides = [*HEAVY, *RUN, *LARGEST_MICROBATCH, *extra, "compilation_cache_dir=null"]
    cfg = load_experiment(BASE, overrides)
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    planned = plan_memory(cfg, cfg.model, mesh, mesh).host_total
    measured = _measured_peak_rss(tmp_path, overrides)
    print(json.dumps({"planned_gib": planned / GIB, "measured_gib": measured / GIB}))
    assert abs(planned - measured) <= 0.25 * measured, (planned / GIB, measured / GIB)
